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
from ..backends.host_memory import address_limit, out_of_memory
from ..comm.launch import Interrupt
from ..formats.hellaswag import read_eval
from ..formats.llmc import check_finite, write_model
from ..formats.tokenizer import Tokenizer
from ..log import open_log
from ..model.optim import AdamWConfig, lr_at
from ..model.shape import mfu
from ..parallel.pipeline.plan import stage_shares
from ..parallel.runner import Abandoned
from ..precision import is_narrow
from ..session import load_model
from . import checkpoint, rundir
from .evaluate import evaluate as hellaswag
from .loader import DataLoader
from .outlier import UpdateGate
from .sample import generate


def open_tokenizer(path, shape, log):
    """The tokenizer when it matches the model's vocab; else None (samples print as ids)."""
    if not path:
        return None
    tok = Tokenizer(path)
    if tok.vocab_size != shape.V:
        log(f"note: {path} has {tok.vocab_size} tokens, the model {shape.V}; samples print ids")
        return None
    return tok


def train(sess):
    """The `train` command over a Session holding its validated TrainConfig: llm.c's loop,
    each step validated, sampled, trained, logged and checkpointed as the flags say."""
    config, t = sess.config, None
    # read here, not kept by the config: validate read them only to check them
    examples = read_eval(config.hellaswag_file) if config.hellaswag else ()
    rundir.make_parents(config, sess.transport.rank)
    # -sl/-sg: the update waits on the step's loss and norm (an eager step)
    settings = sess.step_settings(
        batch=config.batch, seq=config.seq, recompute=config.recompute,
        adamw=AdamWConfig(lr=config.lr, weight_decay=config.weight_decay,
                          grad_clip=config.grad_clip),
        graphs=config.graphs, trace=bool(config.trace), micro_steps=config.micro_steps,
        gated=bool(config.skip_loss or config.skip_norm))
    lock = rundir.claim(config, sess.transport, rundir.need_bytes(
        sess.shape, is_narrow(settings.dtype), config))
    try:
        t = Trainer(sess, settings, examples)
        for step in range(t.start, t.config.steps + 1):
            last = step == t.config.steps
            t.evaluate(step, last)
            t.sample(step, last)
            if t.stopped:  # (a signal during validation or sampling)
                t.interrupt(step)
            if last:
                break
            t.train_step(step)
        t.finish()
    except BaseException as e:
        if t is None or t.logf is None:  # failed before its first step: no empty -o left
            rundir.unmake(config, sess.transport, lock)
        if t is not None and isinstance(e, Exception):
            raise t.kept(e)  # (e itself, or its line with what was written)
        raise
    finally:
        if t:
            t.close()


class Diverged(CupyGPTError):
    """The loss or the weights are no longer finite: the error names the last good
    checkpoint, and nothing of the diverged weights is written."""


# batches read between two looks for a stop signal: a look is a collective over the ranks,
# so not one a batch
READ_BETWEEN_STOPS = 4096


class Trainer:
    """A training run's state: the runner, the data, the RNG, the log and the newest
    checkpoint; each part of a step is a method."""

    def __init__(self, sess, settings, examples):
        self.examples = examples  # -h 1: HellaSwag's, read at the run's start
        self.sess, self.log, self.config = sess, sess.log, sess.config
        self.transport = sess.transport
        config, shape = self.config, sess.shape
        self.gate = UpdateGate(sess.transport, config.skip_loss, config.skip_norm)
        self.run = sess.runner(shape, None, settings)
        self.train_data = DataLoader(config.train_pattern, config.batch, config.seq, shape.V,
                                     "train_pattern", shuffle=config.shuffle, seed=config.seed)
        self.val_data = (DataLoader(config.val_pattern, config.batch, config.seq, shape.V,
                                    "val_pattern") if config.val_pattern else None)
        self.val_batches = config.val_batches
        if self.val_data and config.val_every and config.val_batches > self.val_data.batches:
            # more would read the same batches again: the same mean, only slower
            self.val_batches = self.val_data.batches
            self.log(f"note: -m {config.val_batches}: the val shard(s) hold "
                     f"{self.val_batches} batches of B*T = {config.batch * config.seq} tokens; "
                     f"validating on those {self.val_batches}")
        self.tok = open_tokenizer(config.tokenizer, shape, self.log)
        self.rng, self.start = np.random.default_rng(config.seed), 0
        if config.resume:  # the parameters and optimizer state from the checkpoint
            self.resume(checkpoint.restore(self.run, config.resume))
        else:  # after the runner's memory check; a mapped file is unmapped once loaded
            params = load_model(config.init, config.seed)[1]
            check_finite(config.init, params)
            self.run.load_state_dict(params)
        self.describe()
        if self.transport.rank == 0:
            checkpoint.clean_litter(config.out)
        # the log is opened by its first line: a run failing before it leaves none
        self.logf, self.broken = None, []
        self.sampling = config.gen_tokens and config.sample_every
        if self.sampling and config.seq < 2:
            self.log(f"note: -t {config.seq} leaves no room after the start token: no samples")
            self.sampling = False
        elif self.sampling and config.gen_tokens > config.seq - 1:
            self.log(f"note: -g {config.gen_tokens}: -t {config.seq} leaves room for "
                     f"{config.seq - 1} tokens after the start token; generating {config.seq - 1}")
        self.ckpt, self.stop = config.resume, Interrupt()
        self.stopped = False
        # the step whose weights the parameters hold (None while an update is under way);
        # agreed: an error now is every rank's (a batch none could read), so all can write
        self.trained, self.agreed, self.writing = self.start, self.transport.size == 1, False
        self.written = self.start  # the step whose weights the run wrote last

    def resume(self, meta):
        """The checkpoint's step, data position and RNG; refused (and renamed .nan, as the
        NaN rule does) when its weights are not finite."""
        config = self.config
        if self.transport.any(not self.run.params_finite()):
            out, name = os.path.split(os.path.normpath(config.resume))
            good = (checkpoint.demote(self.transport, out, config.resume)
                    if checkpoint.NAME.match(name) else None)
            raise CupyGPTError(
                f"{os.path.join(config.resume, 'model.bin')}: holds non-finite weights (NaN "
                f"or inf)" + (f"; renamed {config.resume}.nan. Last good checkpoint: "
                              f"{good or 'none'}" if checkpoint.NAME.match(name) else ""))
        self.start = meta["step"]
        if self.start == config.steps:
            self.log(f"note: the checkpoint is at step {self.start}, -n {config.steps}: no step "
                     f"to train; its model is written as the run's")
        self.train_data.set_state(meta["train_loader"])
        if self.train_data.shuffle != config.shuffle:
            self.log("note: --[no-]shuffle: this run continues the checkpoint's data order")
        if self.train_data.seed != config.seed:
            self.log(f"note: --seed {config.seed}: this run continues the checkpoint's data "
                     f"order and samples (its seed {self.train_data.seed})")
        self.rng.bit_generator.state = meta["rng"]
        self.gate = UpdateGate(self.transport, config.skip_loss, config.skip_norm,
                               meta.get("outliers"))
        was = meta.get("train_files")
        if was and was != [os.path.realpath(f) for f in self.train_data.files]:
            self.log(f"note: the checkpoint's run read other train shards (-i: "
                     f"{', '.join(was)}); its data position is taken in these, so this run "
                     f"does not continue that one's data")

    def describe(self):
        config, counts, d = self.config, self.run.plan.counts, self.train_data
        order = f"(shuffled, seed {d.seed})" if d.shuffle else "(in order)"
        shares = ", ".join(f"{100 * x:.0f}%" for x in stage_shares(self.sess.shape, config.seq,
                                                                  counts))
        self.sess.describe(self.sess.shape, self.run, [
            ("init", config.resume or config.init), ("B, T", f"{config.batch}, {config.seq}"),
            ("tokens per step", f"{config.total_batch} ({config.micro_steps} micro-step(s))"),
            ("lr schedule", config.lr_schedule + ("" if config.lr_schedule == "constant" else
                                                f", warm-up {config.warmup}")),
            ("dtype", config.dtype + (" (fp32 master weights and AdamW state)"
                                    if is_narrow(self.run.settings.dtype) else "")),
            ("recompute", f"{config.recompute}" + (
                f" (rank 0 keeps {self.run.recompute_saves() / 2**20:.1f} MiB less)"
                if config.recompute else "")),
            ("grad clip", f"global norm {config.grad_clip:g}" if config.grad_clip else "off"),
            ("micro_batches", config.pipeline.micro_batches),
            ("schedule", config.pipeline.schedule),
            ("stages (layers)", f"{','.join(map(str, counts))} (cost {shares})"),
            ("train shards", f"{len(self.train_data.files)} " + order), ("start step", self.start)])

    def record(self, rec):
        """A line of the log (rank 0's), on disk at once. A log that cannot be written is
        reported and dropped; the run goes on (finish says so after writing the model)."""
        if self.transport.rank != 0 or self.logf is False:
            return
        whole = None  # the log's size before this record: a record cut short is cut off
        try:
            if self.logf is None:
                self.logf = open_log(self.config.log_file, self.start, self.log)
            whole = os.fstat(self.logf.fileno()).st_size
            self.logf.write(json.dumps(rec) + "\n")
            self.logf.flush()
        except (OSError, CupyGPTError) as e:
            why = f"the log {self.config.log_file} ({getattr(e, 'strerror', None) or e})"
            self.log(f"warning: cannot write {why}; training goes on without it")
            self.broken.append(why)
            with contextlib.suppress(OSError):
                self.logf and self.logf.close()
            if whole is not None:  # (the disk filled mid-record: its whole lines are kept)
                with contextlib.suppress(OSError):
                    os.truncate(self.config.log_file, whole)
            with contextlib.suppress(OSError):  # (else a rerun is refused: "exists; add
                if os.path.getsize(self.config.log_file) == 0:  # --overwrite")
                    os.unlink(self.config.log_file)
            self.logf = False

    def evaluate(self, step, last):
        """Val loss and (-h 1) HellaSwag accuracy, in one line and one log record: every
        val_every steps and at the end (HellaSwag at the end also with -v 0)."""
        config, rec, said = self.config, {"step": step}, []
        if not ((config.val_every and step % config.val_every == 0) or last):
            return
        if self.val_data and config.val_every:
            self.val_data.reset()
            losses = []
            while len(losses) < self.val_batches and not self.stopping():
                losses.append(self.run.eval_loss(*self.read(self.val_data.next_batch)))
            if self.stopped:  # (a part of the batches is no val loss)
                return
            rec["val_loss"] = float(np.mean(losses))
            said.append(f"val loss {rec['val_loss']:.6f}")
        if config.hellaswag:
            acc = hellaswag(self.run, self.examples, config.batch, config.seq,
                            self.stopping)
            if self.stopped:
                return
            rec["hellaswag_acc"] = acc[0]
            said.append(f"hellaswag acc {rec['hellaswag_acc']:.4f}")
        if said:
            self.log(", ".join(said))
            self.record(rec)

    def sample(self, step, last):
        if self.sampling and ((step > 0 and step % self.config.sample_every == 0) or last):
            eot = self.tok.eot if self.tok else 0
            ids = generate(self.run, [eot], self.config.gen_tokens, eot, self.rng,
                           stop=self.stopping)
            if self.stopped:
                return
            text = self.tok.decode(ids[1:]) if self.tok else " ".join(map(str, ids[1:]))
            self.log(f"generating:\n---\n{text}\n---")

    def batches(self):
        """The step's batches (gradient accumulation's, one after another); with -a 1 the
        first batch every time (the loader stays put, so a resume reads it again)."""
        data, n = self.train_data, self.config.micro_steps
        if self.config.overfit:
            at = data.state()
            x, y = self.read(data.next_batch)
            data.set_state(at)
            return np.concatenate([x] * n), np.concatenate([y] * n)
        read, failed = [], None
        for i in range(n):  # (millions of batches take seconds: a signal is heard between)
            if i and i % READ_BETWEEN_STOPS == 0 and self.stopping():
                raise Abandoned(f"the step stopped while reading its {n} batches")
            if failed is None:  # (a rank that failed still joins the stop looks above)
                try:
                    read.append(data.next_batch())
                except CupyGPTError as e:
                    failed = e
        self.agree(failed)
        return (np.concatenate(a) for a in zip(*read))

    def read(self, next_batch):
        """next_batch()'s batch, a failure to read it agreed over the ranks (agree)."""
        try:
            batch, failed = next_batch(), None
        except CupyGPTError as e:
            batch, failed = None, e
        self.agree(failed)
        return batch

    def agree(self, failed):
        """Collective: raises on every rank when any could not read its batch (each reads
        the whole batch, so all usually fail alike), before the step's own collectives: the
        ranks stop together and can still write the weights they hold."""
        if self.transport.any(failed is not None):
            self.agreed = True
            raise failed or CupyGPTError("another rank could not read this batch (its line "
                                         "says why)")

    def train_step(self, step):
        config, transport = self.config, self.transport
        at = self.train_data.state()
        lr = lr_at(step, config.lr, config.warmup, config.steps, config.final_lr_frac,
                   config.lr_schedule)
        updates = self.run.opt.t
        try:  # with several batches a step, a signal is heard between them
            x, y = self.before_step(step + 1, *self.batches())
            t0 = time.perf_counter()
            loss = self.run.step(x, y, lr, self.gate.keep if self.run.settings.gated else None,
                                 stop=self.stopping if config.micro_steps > 1 else None)
        except Abandoned:  # (this step's batches are read again by a resume)
            self.train_data.set_state(at)
            self.interrupt(step)
        except Exception:
            if self.run.opt.t != updates:  # the update began: the weights are no step's
                self.trained = None
            raise
        self.trained = step + 1
        self.sess.be.synchronize()
        dt = time.perf_counter() - t0
        if not math.isfinite(loss):
            self.stop_on_nan(step, loss)
        norm = self.run.grad_norm()
        u = mfu(self.sess.be, self.sess.shape, config.seq, config.dtype, config.total_batch, dt,
                transport.size)
        skipped = self.run.settings.gated and self.gate.skipped
        rec = dict(step=step + 1, train_loss=loss, norm=norm, lr=lr, ms=dt * 1e3,
                   tok_s=config.total_batch / dt, mem_bytes=self.sess.be.memory_in_use(),
                   **({"mfu": u} if u else {}), **({"skipped": skipped} if skipped else {}))
        self.log(f"step {step + 1:4d}/{config.steps}: train loss {loss:.6f} norm {norm:.4f} "
                 f"lr {lr:.2e} ({dt * 1e3:.2f} ms, {rec['tok_s']:.0f} tok/s"
                 + (f", MFU {100 * u:.1f}%" if u else "") + ")"
                 + (f" update skipped ({skipped})" if skipped else ""))
        if skipped:  # each rank's own decision, so a log shows they agree
            self.log(f"rank {transport.rank}: step {step + 1}'s update skipped ({skipped})",
                     every_rank=True)
        self.record(rec)
        if config.checkpoint_every and (step + 1) % config.checkpoint_every == 0:
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
        self.stopped = self.stopped or self.stop.stopping(self.transport)
        return self.stopped

    def interrupt(self, step):
        """A signal's stop after `step`: its checkpoint when checkpointing, else its model
        (none when this run has trained no step), then exit 128 + the signal, every rank."""
        config = self.config
        if step == self.start:
            said = "; nothing trained in this run, nothing written"
        elif config.checkpoint_every:
            if not (self.ckpt or "").endswith(f"ckpt_{step:08d}"):
                self.save(step)
            said = f"; resume from {config.out}"
        else:
            said = (f"; wrote {self.write_model()} of step {step} (no checkpoints: "
                    f"--checkpoint-every 0, so it cannot be resumed exactly)")
        self.log(f"interrupted after step {step}{said}")
        raise SystemExit(self.stop.code(self.transport))

    def kept(self, e):
        """An error that ends the run after a step of it finished: that step's weights are
        written as a signal's stop writes them, so no step trained is lost, and e's line
        says so, or why they could not be (another exception: logged, e kept)."""
        step, config = self.trained, self.config
        if step == self.start or isinstance(e, (Abandoned, Diverged)):
            return e  # (nothing trained in this run, or NaN)
        if self.writing:  # (the failure was that write: not tried again; the last whole one)
            last = (f"{self.ckpt} holds step {self.written}: resume from it"
                    if config.checkpoint_every and self.ckpt else
                    f"this run's steps {self.start + 1}..{step} were not written")
            if out_of_memory(e):
                return CupyGPTError(
                    f"out of memory while writing step {step}'s weights;"
                    f"{address_limit() or ''} free memory (lower -b or -t, or recompute "
                    f"activations, -r 2, to leave more room for the write); {last}")
            if not (config.checkpoint_every and self.ckpt):
                return e
            note = f"; {last}"
        elif step == self.written:  # (its checkpoint, or the run's end wrote it and said so)
            note = (f"; {self.ckpt} holds step {step}: resume from it"
                    if config.checkpoint_every else "")
        elif step is None or not self.agreed:
            why = ("the update was under way: the weights are no step's" if step is None else
                   "the other ranks were mid-step and cannot join in writing them")
            note = f"; this run's steps were not written ({why}); " + (
                f"last checkpoint: {self.ckpt}" if self.ckpt else "it wrote no checkpoint")
        else:
            try:
                if config.checkpoint_every:
                    self.save(step)
                    note = f"; wrote checkpoint {self.ckpt} of step {step}: resume from it"
                else:
                    note = (f"; wrote {self.write_model()} of step {step} (no checkpoints: "
                            f"it cannot be resumed exactly)")
            except Exception as again:  # (the disk, or memory, failing again)
                note = f"; step {step}'s weights could not be written either ({again})"
        if isinstance(e, CupyGPTError):
            return CupyGPTError(e.args[0] + note, e.option, e.value)
        if out_of_memory(e):
            return CupyGPTError(
                f"out of memory while training, though {self.sess.be.memory_name} had room "
                f"for the run at its start (another process took some since, or a temporary "
                f"outgrew the plan): lower -b or -t, or recompute activations (-r 2)" + note)
        if note:
            self.log(note[2:3].upper() + note[3:], every_rank=True)
        return e

    def stop_on_nan(self, step, loss):
        if step == self.start:  # before any update of this run: its weights' forward
            raise Diverged(
                f"step {step + 1}: train loss is {loss} with the weights this run started "
                f"from ({self.config.resume or self.config.init}), before any update: their "
                f"forward is not finite (a model whose weights, though finite, overflow "
                f"float32); give another model (-l cannot help)")
        ckpt = self.ckpt
        if ckpt and ckpt.endswith(f"ckpt_{step:08d}") and ckpt != self.config.resume:
            # its parameters gave this loss
            ckpt = self.ckpt = checkpoint.demote(self.transport, self.config.out, ckpt)
        raise Diverged(
            f"step {step + 1}: train loss is {loss} (computed on rank "
            f"{self.run.plan.loss_rank}, the last stage); stopping. " + (
                f"Last good checkpoint: {ckpt}; lower the learning rate and resume from it"
                if ckpt else "No checkpoint yet; lower -l"))

    def save(self, step):
        if self.transport.any(not self.run.params_finite()):
            raise Diverged(f"step {step}: parameters are no longer finite; not writing a "
                               f"checkpoint. Last good checkpoint: {self.ckpt or 'none'}; "
                               f"lower the learning rate")
        self.writing = True  # (a write that fails is not tried again by kept)
        self.ckpt = checkpoint.save(self.run, self.transport, self.config.out, step,
                                    {"train_loader": self.train_data.state(),
                                     "train_files": [os.path.realpath(f)
                                                     for f in self.train_data.files],
                                     "rng": self.rng.bit_generator.state,
                                     "outliers": self.gate.state(),
                                     "total_batch": self.config.total_batch}, self.config.keep,
                                    self.config.checkpoint_major)
        self.writing, self.written = False, step
        self.log(f"checkpoint {self.ckpt}")

    def close(self):
        self.stop.restore()
        if self.logf:
            with contextlib.suppress(OSError):  # (a failed write has said why)
                self.logf.close()

    def write_model(self):
        """Collective: the whole model to OUT/model.bin (rank 0 writes); returns its path."""
        self.writing = True
        full = self.run.state_dict(optimizer=False)
        path = os.path.join(self.config.out, "model.bin")
        if self.transport.rank == 0:
            write_model(path, self.sess.shape, full["params"],
                        bf16=is_narrow(self.run.settings.dtype))
        self.writing, self.written = False, self.trained
        return path

    def finish(self):
        """The last checkpoint (unless the loop wrote it), the model, then the trace: a
        debug output that cannot be written never costs the model, and is named."""
        config = self.config
        if config.checkpoint_every and (self.ckpt is None
                                      or not self.ckpt.endswith(f"{config.steps:08d}")):
            self.save(config.steps)
        path = self.write_model()
        self.log(f"wrote {path}")
        if config.trace:
            try:
                self.run.write_trace(config.trace)
                self.log(f"wrote trace {config.trace}")
            except (OSError, CupyGPTError) as e:  # (rank 0's write; the gather is done)
                why = getattr(e, "strerror", None) or e
                self.broken.append(f"the trace {config.trace} ({why})")
        broken = self.transport.bcast(self.broken if self.transport.rank == 0 else None)
        if broken:
            raise CupyGPTError(f"could not write {' and '.join(broken)}; the model was "
                               f"written: {path}")
        if self.stopping():  # a signal during the last writes, which it let finish
            self.log("interrupted after the last step; everything was written")
            raise SystemExit(self.stop.code(self.transport))
