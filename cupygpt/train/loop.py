"""llm.c's training loop: val every -v steps, sample every -s, a step line per step; plus
checkpoints and exact resume, a JSON-lines log, and clean stops (NaN, a signal between
any two batches). One module, the training loop told as one story (llm.c's main), so it
runs past the size a file is otherwise held to."""
import contextlib
import json
import math
import os
import time

import numpy as np

from .. import CupyGPTError
from . import checkpoint, rundir
from ..model.shape import mfu
from ..comm.launch import Interrupt
from .loader import DataLoader
from ..formats.hellaswag import read_eval
from ..formats.llmc import check_finite, write_model
from .evaluate import evaluate as hellaswag
from ..log import open_log
from ..model.optim import AdamWConfig, lr_at
from .outlier import UpdateGate
from ..parallel.pipeline.plan import stage_shares
from ..parallel.runner import Abandoned
from ..precision import is_narrow
from .sample import generate
from ..session import load_model
from ..formats.tokenizer import Tokenizer


def open_tokenizer(path, cfg, log):
    """The tokenizer when it matches the model's vocab; else None (samples print as ids)."""
    if not path:
        return None
    tok = Tokenizer(path)
    if tok.vocab_size != cfg.V:
        log(f"note: {path} has {tok.vocab_size} tokens, the model {cfg.V}; samples print ids")
        return None
    return tok


def train(sess):
    """The `train` command over a Session holding its validated TrainConfig: llm.c's loop,
    each step validated, sampled, trained, logged and checkpointed as the flags say."""
    opts, t = sess.config, None
    # read here, not kept by the config: validate read them only to check them
    examples = read_eval(opts.hellaswag_file) if opts.hellaswag else ()
    rundir.make_parents(opts)
    # -sl/-sg: the update waits on the step's loss and norm (an eager step)
    settings = sess.step_settings(
        batch=opts.batch, seq=opts.seq, recompute=opts.recompute,
        adamw=AdamWConfig(lr=opts.lr, weight_decay=opts.weight_decay, grad_clip=opts.grad_clip),
        graphs=opts.graphs, trace=bool(opts.trace), micro_steps=opts.micro_steps,
        gated=bool(opts.skip_loss or opts.skip_norm))
    lock = rundir.claim(opts, sess.tr, rundir.need_bytes(
        sess.shape, is_narrow(settings.dtype), opts))
    try:
        t = Trainer(sess, settings, examples)
        for step in range(t.start, t.opts.steps + 1):
            last = step == t.opts.steps
            t.evaluate(step, last)
            t.sample(step, last)
            if t.stopped:  # (a signal during validation or sampling)
                t.interrupt(step)
            if last:
                break
            t.train_step(step)
        t.finish()
    except BaseException:
        if t is None or t.logf is None:  # failed before its first step: no empty -o left
            rundir.unmake(opts, sess.tr, lock)
        raise
    finally:
        if t:
            t.close()


class Trainer:
    """A training run's state: the runner, the data, the RNG, the log and the newest
    checkpoint; each part of a step is a method."""

    def __init__(self, sess, settings, examples):
        self.examples = examples  # -h 1: HellaSwag's, read at the run's start
        self.sess, self.log, self.tr, self.opts = sess, sess.log, sess.tr, sess.config
        opts, shape = self.opts, sess.shape
        self.gate = UpdateGate(sess.tr, opts.skip_loss, opts.skip_norm)
        self.run = sess.runner(shape, None, settings)
        self.train_data = DataLoader(opts.train_pattern, opts.batch, opts.seq, shape.V,
                                     "train_pattern", shuffle=opts.shuffle, seed=opts.seed)
        self.val_data = (DataLoader(opts.val_pattern, opts.batch, opts.seq, shape.V,
                                    "val_pattern") if opts.val_pattern else None)
        self.val_batches = opts.val_batches
        if self.val_data and opts.val_every and opts.val_batches > self.val_data.batches:
            # more would read the same batches again: the same mean, only slower
            self.val_batches = self.val_data.batches
            self.log(f"note: -m {opts.val_batches}: the val shard(s) hold "
                     f"{self.val_batches} batches of B*T = {opts.batch * opts.seq} tokens; "
                     f"validating on those {self.val_batches}")
        self.tok = open_tokenizer(opts.tokenizer, shape, self.log)
        self.rng, self.start = np.random.default_rng(opts.seed), 0
        if opts.resume:  # the parameters and optimizer state from the checkpoint
            self.resume(checkpoint.restore(self.run, opts.resume))
        else:  # after the runner's memory check; a mapped file is unmapped once loaded
            params = load_model(opts.init, opts.seed)[1]
            check_finite(opts.init, params)
            self.run.load_state_dict(params)
        self.describe()
        if self.tr.rank == 0:
            checkpoint.clean_litter(opts.out)
        # the log is opened by its first line: a run failing before it leaves none
        self.logf, self.broken = None, []
        self.sampling = opts.gen_tokens and opts.sample_every
        if self.sampling and opts.seq < 2:
            self.log(f"note: -t {opts.seq} leaves no room after the start token: no samples")
            self.sampling = False
        elif self.sampling and opts.gen_tokens > opts.seq - 1:
            self.log(f"note: -g {opts.gen_tokens}: -t {opts.seq} leaves room for "
                     f"{opts.seq - 1} tokens after the start token; generating {opts.seq - 1}")
        self.ckpt, self.stop = opts.resume, Interrupt()
        self.stopped = False

    def resume(self, meta):
        """The checkpoint's step, data position and RNG; refused (and renamed .nan, as the
        NaN rule does) when its weights are not finite."""
        opts = self.opts
        if self.tr.any(not self.run.params_finite()):
            out, name = os.path.split(os.path.normpath(opts.resume))
            good = (checkpoint.demote(self.tr, out, opts.resume)
                    if checkpoint.NAME.match(name) else None)
            raise CupyGPTError(
                f"{os.path.join(opts.resume, 'model.bin')}: holds non-finite weights (NaN "
                f"or inf)" + (f"; renamed {opts.resume}.nan. Last good checkpoint: "
                              f"{good or 'none'}" if checkpoint.NAME.match(name) else ""))
        self.start = meta["step"]
        self.train_data.set_state(meta["train_loader"])
        if self.train_data.shuffle != opts.shuffle:
            self.log("note: --[no-]shuffle: this run continues the checkpoint's data order")
        self.rng.bit_generator.state = meta["rng"]
        self.gate = UpdateGate(self.tr, opts.skip_loss, opts.skip_norm, meta.get("outliers"))
        was = meta.get("train_files")
        if was and was != [os.path.realpath(f) for f in self.train_data.files]:
            self.log(f"note: the checkpoint's run read other train shards (-i: "
                     f"{', '.join(was)}); its data position is taken in these, so this run "
                     f"does not continue that one's data")

    def describe(self):
        opts, counts, d = self.opts, self.run.plan.counts, self.train_data
        order = f"(shuffled, seed {d.seed})" if d.shuffle else "(in order)"
        shares = ", ".join(f"{100 * x:.0f}%" for x in stage_shares(self.sess.shape, opts.seq,
                                                                  counts))
        self.sess.describe(self.sess.shape, self.run, [
            ("init", opts.resume or opts.init), ("B, T", f"{opts.batch}, {opts.seq}"),
            ("tokens per step", f"{opts.total_batch} ({opts.micro_steps} micro-step(s))"),
            ("lr schedule", opts.lr_schedule + ("" if opts.lr_schedule == "constant" else
                                                f", warm-up {opts.warmup}")),
            ("dtype", opts.dtype + (" (fp32 master weights and AdamW state)"
                                    if is_narrow(self.run.settings.dtype) else "")),
            ("recompute", f"{opts.recompute}" + (
                f" (rank 0 keeps {self.run.recompute_saves() / 2**20:.1f} MiB less)"
                if opts.recompute else "")),
            ("grad clip", f"global norm {opts.grad_clip:g}" if opts.grad_clip else "off"),
            ("micro_batches", opts.pipeline.micro_batches), ("schedule", opts.pipeline.schedule),
            ("stages (layers)", f"{','.join(map(str, counts))} (cost {shares})"),
            ("train shards", f"{len(self.train_data.files)} " + order), ("start step", self.start)])

    def record(self, rec):
        """A line of the log (rank 0's), on disk at once. A log that cannot be written is
        reported and dropped; the run goes on (finish says so after writing the model)."""
        if self.tr.rank != 0 or self.logf is False:
            return
        try:
            if self.logf is None:
                self.logf = open_log(self.opts.log_file, self.start)
            self.logf.write(json.dumps(rec) + "\n")
            self.logf.flush()
        except (OSError, CupyGPTError) as e:
            why = f"the log {self.opts.log_file} ({getattr(e, 'strerror', None) or e})"
            self.log(f"warning: cannot write {why}; training goes on without it")
            self.broken.append(why)
            with contextlib.suppress(OSError):
                self.logf and self.logf.close()
            self.logf = False

    def evaluate(self, step, last):
        """Val loss and (-h 1) HellaSwag accuracy, in one line and one log record: every
        val_every steps and at the end (HellaSwag at the end also with -v 0)."""
        opts, rec, said = self.opts, {"step": step}, []
        if not ((opts.val_every and step % opts.val_every == 0) or last):
            return
        if self.val_data and opts.val_every:
            self.val_data.reset()
            losses = []
            while len(losses) < self.val_batches and not self.stopping():
                losses.append(self.run.eval_loss(*self.val_data.next_batch()))
            if self.stopped:  # (a part of the batches is no val loss)
                return
            rec["val_loss"] = float(np.mean(losses))
            said.append(f"val loss {rec['val_loss']:.6f}")
        if opts.hellaswag:
            acc = hellaswag(self.run, self.examples, opts.batch, opts.seq,
                            self.stopping)
            if self.stopped:
                return
            rec["hellaswag_acc"] = acc[0]
            said.append(f"hellaswag acc {rec['hellaswag_acc']:.4f}")
        if said:
            self.log(", ".join(said))
            self.record(rec)

    def sample(self, step, last):
        if self.sampling and ((step > 0 and step % self.opts.sample_every == 0) or last):
            eot = self.tok.eot if self.tok else 0
            ids = generate(self.run, [eot], self.opts.gen_tokens, eot, self.rng,
                           stop=self.stopping)
            if self.stopped:
                return
            text = self.tok.decode(ids[1:]) if self.tok else " ".join(map(str, ids[1:]))
            self.log(f"generating:\n---\n{text}\n---")

    def batches(self):
        """The step's batches (gradient accumulation's, one after another); with -a 1 the
        first batch every time (the loader stays put, so a resume reads it again)."""
        data, n = self.train_data, self.opts.micro_steps
        if self.opts.overfit:
            at = data.state()
            x, y = data.next_batch()
            data.set_state(at)
            return np.concatenate([x] * n), np.concatenate([y] * n)
        return (np.concatenate(a) for a in zip(*(data.next_batch() for _ in range(n))))

    def train_step(self, step):
        opts, tr = self.opts, self.tr
        at = self.train_data.state()
        x, y = self.before_step(step + 1, *self.batches())
        lr = lr_at(step, opts.lr, opts.warmup, opts.steps, opts.final_lr_frac,
                   opts.lr_schedule)
        t0 = time.perf_counter()
        try:  # with several batches a step, a signal is heard between them
            loss = self.run.step(x, y, lr, self.gate.keep if self.run.settings.gated else None,
                                 stop=self.stopping if opts.micro_steps > 1 else None)
        except Abandoned:  # (this step's batches are read again by a resume)
            self.train_data.set_state(at)
            self.interrupt(step)
        self.sess.be.synchronize()
        dt = time.perf_counter() - t0
        if not math.isfinite(loss):
            self.stop_on_nan(step, loss)
        norm = self.run.grad_norm()
        u = mfu(self.sess.be, self.sess.shape, opts.seq, opts.dtype, opts.total_batch, dt,
                tr.size)
        skipped = self.run.settings.gated and self.gate.skipped
        rec = dict(step=step + 1, train_loss=loss, norm=norm, lr=lr, ms=dt * 1e3,
                   tok_s=opts.total_batch / dt, mem_bytes=self.sess.be.memory_in_use(),
                   **({"mfu": u} if u else {}), **({"skipped": skipped} if skipped else {}))
        self.log(f"step {step + 1:4d}/{opts.steps}: train loss {loss:.6f} norm {norm:.4f} "
                 f"lr {lr:.2e} ({dt * 1e3:.2f} ms, {rec['tok_s']:.0f} tok/s"
                 + (f", MFU {100 * u:.1f}%" if u else "") + ")"
                 + (f" update skipped ({skipped})" if skipped else ""))
        if skipped:  # each rank's own decision, so a log shows they agree
            self.log(f"rank {tr.rank}: step {step + 1}'s update skipped ({skipped})",
                     every_rank=True)
        self.record(rec)
        if opts.checkpoint_every and (step + 1) % opts.checkpoint_every == 0:
            self.save(step + 1)
        if self.stopping():
            self.interrupt(step + 1)

    def before_step(self, step, x, y):
        """The batch step trains on. A seam for the tests, which replace it to make a rank
        fail mid-run or a step's loss spike (tests/support/faulty_cli.py)."""
        return x, y

    def stopping(self):
        """Collective, at each step's end and between the batches of validation, HellaSwag
        and sampling: whether a rank has been signalled (then, stopped, for good)."""
        self.stopped = self.stopped or self.stop.stopping(self.tr)
        return self.stopped

    def interrupt(self, step):
        """A signal's stop after `step`: its checkpoint when checkpointing, else its model
        (none when this run has trained no step), then exit 128 + the signal, every rank."""
        opts = self.opts
        if step == self.start:
            said = "; nothing trained in this run, nothing written"
        elif opts.checkpoint_every:
            if not (self.ckpt or "").endswith(f"ckpt_{step:08d}"):
                self.save(step)
            said = f"; resume from {opts.out}"
        else:
            said = (f"; wrote {self.write_model()} of step {step} (no checkpoints: "
                    f"--checkpoint-every 0, so it cannot be resumed exactly)")
        self.log(f"interrupted after step {step}{said}")
        raise SystemExit(self.stop.code(self.tr))

    def stop_on_nan(self, step, loss):
        ckpt = self.ckpt
        if ckpt and ckpt.endswith(f"ckpt_{step:08d}") and ckpt != self.opts.resume:
            # its parameters gave this loss
            ckpt = self.ckpt = checkpoint.demote(self.tr, self.opts.out, ckpt)
        raise CupyGPTError(
            f"step {step + 1}: train loss is {loss} (computed on rank "
            f"{self.run.plan.loss_rank}, the last stage); stopping. " + (
                f"Last good checkpoint: {ckpt}; lower the learning rate and resume from it"
                if ckpt else "No checkpoint yet; lower -l"))

    def save(self, step):
        if self.tr.any(not self.run.params_finite()):
            raise CupyGPTError(f"step {step}: parameters are no longer finite; not writing a "
                               f"checkpoint. Last good checkpoint: {self.ckpt or 'none'}; "
                               f"lower the learning rate")
        self.ckpt = checkpoint.save(self.run, self.tr, self.opts.out, step,
                                    {"train_loader": self.train_data.state(),
                                     "train_files": [os.path.realpath(f)
                                                     for f in self.train_data.files],
                                     "rng": self.rng.bit_generator.state,
                                     "outliers": self.gate.state(),
                                     "total_batch": self.opts.total_batch}, self.opts.keep,
                                    self.opts.checkpoint_major)
        self.log(f"checkpoint {self.ckpt}")

    def close(self):
        self.stop.restore()
        if self.logf:
            with contextlib.suppress(OSError):  # (a failed write has said why)
                self.logf.close()

    def write_model(self):
        """Collective: the whole model to OUT/model.bin (rank 0 writes); returns its path."""
        full = self.run.state_dict(optimizer=False)
        path = os.path.join(self.opts.out, "model.bin")
        if self.tr.rank == 0:
            write_model(path, self.sess.shape, full["params"],
                        bf16=is_narrow(self.run.settings.dtype))
        return path

    def finish(self):
        """The last checkpoint (unless the loop wrote it), the model, then the trace: a
        debug output that cannot be written never costs the model, and is named."""
        opts = self.opts
        if opts.checkpoint_every and (self.ckpt is None
                                      or not self.ckpt.endswith(f"{opts.steps:08d}")):
            self.save(opts.steps)
        path = self.write_model()
        self.log(f"wrote {path}")
        if opts.trace:
            try:
                self.run.write_trace(opts.trace)
                self.log(f"wrote trace {opts.trace}")
            except (OSError, CupyGPTError) as e:  # (rank 0's write; the gather is done)
                self.broken.append(f"the trace {opts.trace} ({getattr(e, 'strerror', None) or e})")
        broken = self.tr.bcast(self.broken if self.tr.rank == 0 else None)
        if broken:
            raise CupyGPTError(f"could not write {' and '.join(broken)}; the model was "
                               f"written: {path}")
        if self.stopping():  # a signal during the last writes, which it let finish
            self.log("interrupted after the last step; everything was written")
            raise SystemExit(self.stop.code(self.tr))
