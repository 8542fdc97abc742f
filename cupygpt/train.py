"""llm.c's training loop: val every -v steps, sample every -s, a step line per step; plus
checkpoints and exact resume, a JSON-lines log, and clean stops (NaN, Ctrl-C)."""
import contextlib
import json
import math
import os
import signal
import time

import numpy as np

from . import CupyGPTError
from . import checkpoint
from .data import DataLoader
from .files import atomic_write, write_model
from .optim import AdamWConfig, lr_at
from .parallel.pipeline.plan import stage_shares
from .sample import generate
from .session import load_model
from .tokenizer import Tokenizer


def open_tokenizer(path, cfg, log):
    """The tokenizer when it matches the model's vocab; else None (samples print as ids)."""
    if not path:
        return None
    tok = Tokenizer(path)
    if tok.vocab_size != cfg.V:
        log(f"note: {path} has {tok.vocab_size} tokens, the model {cfg.V}; samples print ids")
        return None
    return tok


def injected_fault():
    """Tests make one rank fail mid-run with CUPYGPT_FAULT=raise:STEP:RANK."""
    spec = os.environ.get("CUPYGPT_FAULT", "")
    return tuple(int(x) for x in spec.split(":")[1:]) if spec.startswith("raise:") else None


def open_log(path, start):
    """The log, open to append: a fresh run starts it; a resume keeps what came before its
    first step (a run that went on past its checkpoint logged steps the resume repeats:
    train records up to `start`, val records before it, since step `start` validates)."""
    if not start:
        return open(path, "w")
    keep = []
    if os.path.exists(path):
        with open(path, encoding="utf-8", errors="replace") as f:
            for line in f:
                try:
                    rec = json.loads(line)
                    step = rec["step"] + ("val_loss" in rec)
                except (ValueError, TypeError, KeyError):
                    continue  # (a line cut short by a kill)
                if isinstance(step, int) and step <= start:
                    keep.append(line if line.endswith("\n") else line + "\n")
    with atomic_write(path) as f:
        f.write("".join(keep).encode())
    return open(path, "a")


class Interrupt:
    """Ctrl-C sets a flag; the loop stops at the next step boundary, on every rank."""

    def __init__(self):
        self.hit = False
        self.old = signal.signal(signal.SIGINT, self.handle)

    def handle(self, *_):
        self.hit = True

    def restore(self):
        signal.signal(signal.SIGINT, self.old)


def train(sess):
    """The `train` command over a Session holding its validated TrainConfig."""
    log, tr, o = sess.log, sess.tr, sess.config
    cfg, params = (sess.shape, None) if o.resume else load_model(o.init, o.seed)
    run = sess.runner(cfg, params, batch=o.batch, seq=o.seq,
                      adamw=AdamWConfig(lr=o.lr, weight_decay=o.weight_decay),
                      graphs=o.graphs and not o.trace)  # a trace marks each action: eager
    if o.trace:
        run.start_trace()
    del params  # a model file is mapped: unmapped now, its pages leave the resident set
    train_data = DataLoader(o.train_pattern, o.batch, o.seq, cfg.V, "train_pattern")
    val_data = (DataLoader(o.val_pattern, o.batch, o.seq, cfg.V, "val_pattern")
                if o.val_pattern else None)
    tok = open_tokenizer(o.tokenizer, cfg, log)
    rng, start = np.random.default_rng(o.seed), 0
    if o.resume:  # the parameters and optimizer state from the rank files
        meta = checkpoint.restore(run, o.resume)
        start = meta["step"]
        train_data.set_state(meta["train_loader"])
        rng.bit_generator.state = meta["rng"]
    sess.describe(cfg, run, [("init", o.resume or o.init), ("B, T", f"{o.batch}, {o.seq}"),
                             ("micro_batches", o.pipeline.micro_batches),
                             ("schedule", o.pipeline.schedule),
                             ("stages (layers)", ",".join(map(str, run.plan.counts)) + " (cost " +
                              ", ".join(f"{100 * x:.0f}%" for x in
                                        stage_shares(cfg, o.seq, run.plan.counts)) + ")"),
                             ("train shards", len(train_data.files)),
                             ("start step", start)])
    if tr.rank == 0:
        checkpoint.clean_litter(o.out)
    logf = open_log(o.log_file, start) if tr.rank == 0 else None
    sampling = o.gen_tokens and o.sample_every
    if sampling and o.seq < 2:
        log(f"note: -t {o.seq} leaves no room after the start token: no samples")
        sampling = False
    ckpt, stop, fault = o.resume, Interrupt(), injected_fault()

    def record(rec):  # a line of the log (rank 0's), on disk at once
        if logf:
            try:
                logf.write(json.dumps(rec) + "\n")
                logf.flush()
            except OSError as e:
                raise CupyGPTError(f"{o.log_file}: cannot write the log ({e.strerror}); free "
                                   f"some space, or give --log-file elsewhere") from None

    def save(step):
        nonlocal ckpt
        if tr.any(not run.params_finite()):
            raise CupyGPTError(f"step {step}: parameters are no longer finite; not writing a "
                               f"checkpoint. Last good checkpoint: {ckpt or 'none'}; lower the learning rate")
        ckpt = checkpoint.save(run, tr, o.out, step, {"train_loader": train_data.state(),
                                                  "rng": rng.bit_generator.state}, o.keep)
        log(f"checkpoint {ckpt}")

    try:
        for step in range(start, o.steps + 1):
            last = step == o.steps
            if val_data and o.val_every and (step % o.val_every == 0 or last):
                val_data.reset()
                vl = float(np.mean([run.eval_loss(*val_data.next_batch())
                                    for _ in range(o.val_batches)]))
                log(f"val loss {vl:.6f}")
                record({"step": step, "val_loss": vl})
            if sampling and ((step > 0 and step % o.sample_every == 0) or last):
                eot = tok.eot if tok else 0
                ids = generate(run, [eot], o.gen_tokens, eot, rng)
                text = tok.decode(ids[1:]) if tok else " ".join(map(str, ids[1:]))
                log(f"generating:\n---\n{text}\n---")
            if last:
                break
            x, y = train_data.next_batch()
            lr = lr_at(step, o.lr, o.warmup, o.steps, o.final_lr_frac)
            t0 = time.perf_counter()
            loss = run.step(x, y, lr)
            sess.be.synchronize()
            dt = time.perf_counter() - t0
            if fault == (step + 1, tr.rank):
                raise RuntimeError(f"injected fault on rank {tr.rank} at step {step + 1}")
            if not math.isfinite(loss):
                if ckpt and ckpt.endswith(f"ckpt_{step:08d}") and ckpt != o.resume:
                    ckpt = checkpoint.demote(tr, o.out, ckpt)  # its parameters gave this loss
                raise CupyGPTError(
                    f"step {step + 1}: train loss is {loss} (computed on rank {run.plan.loss_rank}, "
                    f"the last stage); stopping. " + (
                        f"Last good checkpoint: {ckpt}; lower the learning rate and resume from it"
                        if ckpt else "No checkpoint yet; lower -l"))
            rec = dict(step=step + 1, train_loss=loss, lr=lr, ms=dt * 1e3,
                       tok_s=o.batch * o.seq / dt, mem_bytes=sess.be.memory_in_use())
            log(f"step {step + 1:4d}/{o.steps}: train loss {loss:.6f} lr {lr:.2e} "
                f"({dt * 1e3:.2f} ms, {rec['tok_s']:.0f} tok/s)")
            record(rec)
            interrupted = tr.any(stop.hit)
            if o.checkpoint_every and ((step + 1) % o.checkpoint_every == 0 or interrupted):
                save(step + 1)
            if interrupted:
                log(f"interrupted after step {step + 1}" +
                    (f"; resume from {o.out}" if ckpt else ""))
                raise SystemExit(130)
    finally:
        stop.restore()
        if logf:
            with contextlib.suppress(OSError):  # (a failed write has said why)
                logf.close()
    if o.checkpoint_every and (ckpt is None or not ckpt.endswith(f"{o.steps:08d}")):
        save(o.steps)
    if o.trace:
        run.write_trace(o.trace)
        log(f"wrote trace {o.trace}")
    full = run.state_dict(optimizer=False)
    if tr.rank == 0:
        path = os.path.join(o.out, "model.bin")
        write_model(path, cfg, full["params"])
        log(f"wrote {path}")
