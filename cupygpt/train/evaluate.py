"""HellaSwag in llm.c's eval file format (magic 20240522) and its scoring.

The file: a header of 256 int32 (magic, version 1, examples, longest example's bytes), then
per example a uint16 stream: 65535, the example's bytes, its index, its label, the number
of completions (4), the context's length and tokens, then each completion's length and
tokens. Scoring as llm.c's: each completion is a row, context then completion; its loss is
the mean cross-entropy over the completion's tokens; the lowest loss (the first on a tie)
is the model's choice. A batch holds B // 4 examples, 4 rows each.
"""
import time

import numpy as np

from .. import CupyGPTError
from ..formats.hellaswag import COMPLETIONS, read_eval
from ..formats.llmc import check_finite, read_model



def batch(examples, B, T):
    """(x, y, mask) int32 (B, T), bool (B, T) of up to B // 4 examples: row 4 i + c is
    example i's context and completion c; the mask marks the positions whose target is a
    completion token (from the context's last token on). Unused rows are zeros."""
    x, y, mask = (np.zeros((B, T), np.int32) for _ in range(3))
    for i, e in enumerate(examples):
        for c, end in enumerate(e.endings):
            row, r, k = np.concatenate([e.context, end]), 4 * i + c, len(e.context)
            x[r, :len(row)], y[r, :len(row) - 1] = row, row[1:]
            mask[r, k - 1:len(row) - 1] = 1
    return x, y, mask.astype(bool)


def completion_losses(losses, mask, n):
    """(n, 4): each of n examples' completions' mean loss over its masked positions."""
    rows = (losses * mask).sum(1) / np.maximum(mask.sum(1), 1)
    return rows[:4 * n].reshape(n, COMPLETIONS)


def evaluate(run, examples, B, T, stop=None):
    """Collective: (accuracy, (n, 4) completion losses) of the examples through the runner's
    forward (run.position_losses, on every rank alike), B // 4 examples a batch; None when
    stop() (collective, asked before each batch) says to stop."""
    per = B // COMPLETIONS
    scores = []
    for i in range(0, len(examples), per):
        if stop and stop():
            return None
        part = examples[i:i + per]
        x, y, mask = batch(part, B, T)
        scores.append(completion_losses(run.position_losses(x, y), mask, len(part)))
    scores = np.concatenate(scores)
    labels = np.array([e.label for e in examples])
    return float(np.mean(scores.argmin(1) == labels)), scores


def eval_command(sess):
    """The `eval` command over a Session holding its validated EvalConfig: the report
    (accuracy, each example's completion losses), the same on every rank."""
    c = sess.config
    examples = read_eval(c.hellaswag)  # (validate read them only to check them)
    shape, params = read_model(c.model, mmap=True)
    check_finite(c.model, params)
    run = sess.runner(shape, params, sess.step_settings(batch=c.batch, seq=c.seq))
    t0 = time.perf_counter()
    acc, losses = evaluate(run, examples, c.batch, c.seq)
    bad = int((~np.isfinite(losses)).any(1).sum())
    if bad:  # (argmin over NaN picks completion 0: a score of label 0's share)
        raise CupyGPTError(f"{c.model}: its losses are not finite on {bad} of {len(examples)} "
                           f"examples (weights that, though finite, overflow float32 in its "
                           f"forward); it cannot be scored")
    return {"model": c.model, "hellaswag": c.hellaswag, "examples": len(examples),
            "correct": int(round(acc * len(examples))), "accuracy": acc,
            "B": c.batch, "T": c.seq, "dtype": c.dtype, "ranks": sess.mesh.size,
            "seconds": time.perf_counter() - t0, "losses": losses.tolist()}
