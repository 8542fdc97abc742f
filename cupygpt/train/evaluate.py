"""HellaSwag scored as llm.c scores it, over llm.c's eval file (formats/hellaswag.py).

The file: a header of 256 int32 (magic, version 1, examples, longest example's bytes), then
per example a uint16 stream: 65535, the example's bytes, its index, its label, the number
of completions (4), the context's length and tokens, then each completion's length and
tokens. Scoring as llm.c's: each completion is a row, context then completion; its loss is
the mean cross-entropy over the completion's tokens; the lowest loss (the first on a tie)
is the model's choice. A batch holds B // 4 examples, 4 rows each.
"""

import numpy as np

from ..formats.hellaswag import COMPLETIONS


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
