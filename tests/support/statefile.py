"""Writes llm.c's debug-state format (the package only reads it): fixtures and tests."""
import numpy as np

from cupygpt.formats.llmc import STATE_MAGIC, make_header
from cupygpt.paths import atomic_write


def write_state(path, x, y, logits, loss, grads):
    B, T = x.shape
    with atomic_write(path) as f:
        f.write(make_header(STATE_MAGIC, 2, B, T).tobytes())
        for a, dt in ((x, np.int32), (y, np.int32), (logits, np.float32),
                      (np.array([loss]), np.float32), (grads, np.float32)):
            f.write(np.ascontiguousarray(a, dtype=dt).tobytes())


def make_state64(model, d, B, T, seed=3):
    """A debug state and its 10 AdamW losses for the model file, made by the single process
    in float64 (the reference for shapes no llm.c-made file has): d/state.bin and
    d/expected.json. Returns (model, state, expected) paths."""
    import json

    from cupygpt.backends.numpy.backend import NumpyBackend
    be = NumpyBackend()
    from cupygpt.comm.local import Local
    from cupygpt.formats.llmc import read_model
    from cupygpt.model.optim import AdamWConfig
    from cupygpt.parallel.mesh import Mesh
    from cupygpt.parallel.runner import Runner
    from cupygpt.parallel.settings import StepSettings
    cfg, params = read_model(model)
    run = Runner(shape=cfg, be=be, transport=Local(), mesh=Mesh(),
                 settings=StepSettings(batch=B, seq=T, dtype=np.float64,
                                       adamw=AdamWConfig(lr=1e-4, weight_decay=0.01)))
    run.load_state_dict(params)
    xy = np.random.default_rng(seed).integers(0, cfg.V, (B, T + 1)).astype(np.int32)
    x, y = xy[:, :-1], xy[:, 1:]
    logits = []
    run.eval_loss(x, y, lambda rows, v0, lg: logits.append(lg.copy()))
    losses = [run.gradients(x, y)]
    write_state(d / "state.bin", x, y, logits[0], losses[0], run.stages[0].grads)
    run.update()
    losses += [run.step(x, y) for _ in range(9)]
    (d / "expected.json").write_text(json.dumps({"losses": losses}))
    return model, d / "state.bin", d / "expected.json"
