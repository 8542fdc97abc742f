"""What every command sets up, in order: the backend, the command's config validated
against it (before anything is allocated), this rank's place in the grid, the transport,
the device; then the runner and the run's table."""
import os
from dataclasses import replace

from . import CupyGPTError
from .backends import FusedAttentionUnsupported, get_backend
from .comm import make_transport
from .comm.launch import disagreement, host_names, launched_ranks, world_rank
from .config.fields import values
from .config.sections import attention_path
from .formats.llmc import is_model_file, read_model
from .log import Log
from .model.initialize import init_params
from .model.shape import preset
from .parallel.mesh import Mesh
from .parallel.runner import Runner
from .parallel.settings import StepSettings
from .precision import DTYPES


def load_model(spec, seed):
    """-e: an llm.c model file (fp32 or bf16), or a preset name for a fresh model."""
    if is_model_file(spec):
        return read_model(spec, mmap=True)
    shape = preset(spec)
    return shape, init_params(shape, seed)


class Session:
    """Backend + grid place + transport for this rank; `config` is the command's, validated
    and resolved, and `shape` the model's GPT2Config."""

    def __init__(self, config, tf32_default):
        self.be, self.backend_note = get_backend(config.device.backend)
        world = launched_ranks()
        self.config, self.shape = config.validate(self.be, world)
        # the same flags resolve alike only on alike machines (a rank seeing a GPU takes
        # the GPU's defaults): ranks that would run different steps stop here, together
        found = disagreement({"backend in use": repr(self.be.name),
                              **dict(values(self.config, contents=False))})
        if found:
            raise CupyGPTError(f"the ranks' settings differ once each resolved its defaults "
                               f"on its own machine ({found[0]}: {found[1]}); give every rank "
                               f"the same kind of machine, or the setting itself")
        dev = self.config.device
        g = self.config.grid
        self.mesh = Mesh(rank=world_rank(), pp=g.pp, dp=g.dp, tp=g.tp, hosts=host_names())
        self.transport = make_transport(dev.transport, self.be, self.mesh, dev.peer_timeout)
        # after the transport, which may pick the GPU first: both ask the mesh
        self.be.configure(tf32=tf32_default if dev.tf32 is None else dev.tf32,
                          device_of=self.mesh.device, ranks_here=self.mesh.local_size)
        self.log = Log(self.mesh.rank, self.mesh.size)

    def step_settings(self, *, batch, seq, dtype=None, adamw=None, graphs=False, recompute=0,
                      trace=False, micro_steps=1, gated=False):
        """The StepSettings of a runner of this command: the given ones, dtype (a --dtype
        name; None: the command's) as its NumPy type, the pipeline and grid the config's."""
        p, g = self.config.pipeline, self.config.grid
        return StepSettings(batch=batch, seq=seq, dtype=DTYPES[dtype or self.config.dtype],
                            adamw=adamw, recompute=recompute, micro_batches=p.micro_batches,
                            schedule=p.schedule, virtual=p.virtual_stages, counts=p.counts,
                            zero=bool(g.zero), overlap=g.overlap, graphs=graphs,
                            trace=trace, micro_steps=micro_steps, gated=gated)

    def runner(self, shape, params, settings, attention=None):
        """This rank's Runner of settings (step_settings'); params: the whole model's host
        parameters (None: a resume fills the stages); attention: --attention's choice
        (None: the command's), taken before the memory plan (it builds cuDNN's graphs and
        counts their workspace) and said in `attention` (the run table's words). A shape
        cuDNN's own checks refuse (met there, before anything big is allocated) sends auto
        to the own kernels, saying why, and is --attention cudnn's one-line refusal."""
        asked = attention or self.config.device.attention
        kind, self.attention = attention_path(asked, self.be, settings.dtype, shape)

        def make(kind):
            return Runner(shape=shape, be=self.be, transport=self.transport, mesh=self.mesh,
                          settings=replace(settings, attention=kind))
        try:
            run = make(kind)
        except FusedAttentionUnsupported as e:
            if asked != "auto":
                raise CupyGPTError(f"{e}; else use --attention auto (cuDNN where it can "
                                   f"run, the own kernels elsewhere) or own", "attention",
                                   asked) from None
            self.attention = f"own flash kernels (auto: {e})"
            run = make("own")
        if params is not None:
            run.load_state_dict(params)
        return run

    def describe(self, shape, run, extra=()):
        """llm.c-style header: the config, then this rank's memory, one line per rank."""
        m, g = self.mesh, self.config.grid
        rows = [*self.be.device_info().items(), ("transport", self.transport.name),
                ("ranks", f"{m.size} = dp {m.dp} x tp {m.tp} x pp {m.pp}"), *m.describe(),
                ("dp gradient sum", "-" if m.dp == 1 else "overlapped, per layer" +
                 (" (zero 1)" if g.zero else "") if run.overlap else
                 ("reduce-scatter (zero 1)" if g.zero else "after backward")),
                ("step", "a CUDA graph, replayed from step 2" if run.graphs else "eager"),
                ("attention", self.attention),
                ("max_seq_len", shape.maxT), ("vocab_size", shape.V),
                ("padded_vocab_size", shape.Vp), ("num_layers", shape.L), ("num_heads", shape.NH),
                ("channels", shape.C), ("num_parameters", shape.num_parameters()), *extra]
        bar = "+" + "-" * 25 + "+" + "-" * 52 + "+"
        self.log("\n".join([self.backend_note, bar] +
                           [f"| {k:<23} | {str(v):<50} |" for k, v in rows] + [bar]))
        mem = ", ".join(f"{k} {v / 2**20:.1f} MiB" for k, v in run.memory.items() if v)
        self.log(f"rank {m.rank} = stage {m.stage} replica {m.replica} shard {m.shard} "
                 f"(pid {os.getpid()}) on {m.host} as its rank {m.local_rank}, "
                 f"{self.be.device_name()}: layers {run.layers()}: {mem}", every_rank=True)
