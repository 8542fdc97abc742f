"""What every command sets up: backend, transport, model, runner, and the run's table."""
import os

import numpy as np

from . import CupyGPTError
from .backends import get_backend
from .config import preset
from .files import read_model
from .log import Log
from .model import init_params
from .pipeline.runner import Runner
from .pipeline.transport import make_transport


def load_model(spec, seed):
    """-e: an llm.c model file (fp32 or bf16), or a preset name for a fresh model."""
    if os.path.exists(spec) or os.sep in spec or spec.endswith(".bin"):
        return read_model(spec, mmap=True)
    cfg = preset(spec)
    return cfg, init_params(cfg, seed)


class Session:
    """Backend + transport + runner for this rank, from the command's options."""

    def __init__(self, backend="auto", transport="auto", peer_timeout=300.0, tf32=None):
        self.be, why = get_backend(backend)
        self.tr = make_transport(transport, self.be, peer_timeout)
        if self.be.name == "cuda":  # after the transport: rank r takes GPU r % count
            self.be.configure(tf32=tf32, device=self.tr.rank)
        self.log = Log(self.tr.rank, self.tr.size)
        self.backend_note = why

    def runner(self, cfg, params, B, T, micro_batches=1, schedule="1f1b", split=None,
               dtype=np.float32, adamw=None, graphs=False):
        if B <= 0 or T <= 0:
            raise CupyGPTError(f"-b {B} -t {T}: batch size and sequence length must be positive")
        if T > cfg.maxT:
            raise CupyGPTError(f"-t {T}: longer than the model's maxT={cfg.maxT}; lower -t")
        run = Runner(cfg, self.be, self.tr, B, T, micro_batches, schedule, split, dtype, adamw,
                     graphs)
        if params is not None:  # None: a resume fills the stage from its checkpoint
            run.stage.load(params)
        return run

    def describe(self, cfg, run, extra=()):
        """llm.c-style header: the config, then this rank's memory, one line per rank."""
        rows = [("backend", self.be.name), ("transport", self.tr.name), ("ranks", self.tr.size),
                ("max_seq_len", cfg.maxT), ("vocab_size", cfg.V), ("padded_vocab_size", cfg.Vp),
                ("num_layers", cfg.L), ("num_heads", cfg.NH), ("channels", cfg.C),
                ("num_parameters", cfg.num_parameters()), *extra]
        bar = "+" + "-" * 25 + "+" + "-" * 52 + "+"
        self.log("\n".join([self.backend_note, bar] +
                           [f"| {k:<23} | {str(v):<50} |" for k, v in rows] + [bar]))
        st = run.stage
        mem = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in st.memory_bytes().items())
        opt = f", optimizer {2 * st.params.nbytes / 2**20:.1f} MiB" if run.opt else ""
        self.log(f"stage {self.tr.rank} (pid {os.getpid()}): layers {st.l0}..{st.l1 - 1}"
                 f"{' +embedding' if st.embed else ''}{' +head' if st.head else ''}: {mem}{opt}",
                 every_rank=True)
