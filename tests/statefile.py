"""Writes llm.c's debug-state format (the package only reads it): fixtures and tests."""
import numpy as np

from cupygpt.files import STATE_MAGIC, atomic_write, make_header


def write_state(path, x, y, logits, loss, grads):
    B, T = x.shape
    with atomic_write(path) as f:
        f.write(make_header(STATE_MAGIC, 2, B, T).tobytes())
        for a, dt in ((x, np.int32), (y, np.int32), (logits, np.float32),
                      (np.array([loss]), np.float32), (grads, np.float32)):
            f.write(np.ascontiguousarray(a, dtype=dt).tobytes())
