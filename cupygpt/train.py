"""llm.c's training loop: val every -v steps, sample every -s, a step line per step."""
import os
import time

import numpy as np

from .data import DataLoader
from .files import write_model
from .optim import AdamWConfig, lr_at
from .sample import generate
from .session import load_model
from .tokenizer import Tokenizer


def open_tokenizer(path, cfg, log):
    """The tokenizer when it matches the model's vocab; else None (samples print as ids)."""
    if not path or not os.path.exists(path):
        return None
    tok = Tokenizer(path)
    if tok.vocab_size != cfg.V:
        log(f"note: {path} has {tok.vocab_size} tokens, the model {cfg.V}; samples print ids")
        return None
    return tok


def train(sess, o):
    log, tr = sess.log, sess.tr
    cfg, params = load_model(o.init, o.seed)
    run = sess.runner(cfg, params, o.batch, o.seq, o.micro_batches, o.schedule, o.split,
                      adamw=AdamWConfig(lr=o.lr, weight_decay=o.weight_decay))
    train_data = DataLoader(o.train_pattern, o.batch, o.seq, cfg.V, "-i")
    val_data = DataLoader(o.val_pattern, o.batch, o.seq, cfg.V, "-j") if o.val_pattern else None
    tok = open_tokenizer(o.tokenizer, cfg, log)
    sess.describe(cfg, run, [("init", o.init), ("B, T", f"{o.batch}, {o.seq}"),
                             ("micro_batches", o.micro_batches), ("schedule", o.schedule),
                             ("stages (layers)", ",".join(map(str, run.counts))),
                             ("train shards", len(train_data.files))])
    rng = np.random.default_rng(o.seed)
    losses = []
    for step in range(o.steps + 1):
        last = step == o.steps
        if val_data and o.val_every and (step % o.val_every == 0 or last):
            val_data.reset()
            vl = np.mean([run.eval_loss(*val_data.next_batch()) for _ in range(o.val_batches)])
            log(f"val loss {vl:.6f}")
        if o.gen_tokens and o.sample_every and ((step > 0 and step % o.sample_every == 0) or last):
            eot = tok.eot if tok else 0
            ids = generate(run, [eot], o.gen_tokens, eot, rng)
            text = tok.decode(ids[1:]) if tok else " ".join(map(str, ids[1:]))
            log(f"generating:\n---\n{text}\n---")
        if last:
            break
        x, y = train_data.next_batch()
        t0 = time.perf_counter()
        lr = lr_at(step, o.lr, o.warmup, o.steps, o.final_lr_frac)
        loss = run.train_step(x, y, lr)
        sess.be.synchronize()
        dt = time.perf_counter() - t0
        losses.append(loss)
        log(f"step {step + 1:4d}/{o.steps}: train loss {loss:.6f} lr {lr:.2e} ({dt * 1e3:.2f} ms, "
            f"{o.batch * o.seq / dt:.0f} tok/s)", rank=0)
    full = run.gather_params()
    if tr.rank == 0:
        path = os.path.join(o.out, "model.bin")
        write_model(path, cfg, full)
        log(f"wrote {path}")
    return losses
