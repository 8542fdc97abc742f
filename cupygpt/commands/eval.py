"""The `eval` command: HellaSwag accuracy of an llm.c model file, scored as llm.c does
(train/evaluate.py scores; this reads the files and runs it over the session's ranks)."""
import time

import numpy as np

from .. import CupyGPTError
from ..formats.hellaswag import read_eval
from ..formats.llmc import check_finite, read_model
from ..train.evaluate import evaluate


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
