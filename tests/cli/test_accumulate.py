"""llm.c's mainline flags: gradient accumulation (-d) and the lr schedules (-k)."""
import math

import numpy as np
import pytest
from harness import cli, losses

from cupygpt.backends.numpy.backend import NumpyBackend
from cupygpt.comm.local import Local
from cupygpt.model.initialize import init_params
from cupygpt.model.optim import LR_SCHEDULES, lr_at
from cupygpt.model.shape import preset
from cupygpt.parallel.mesh import Mesh
from cupygpt.parallel.runner import Runner
from cupygpt.parallel.settings import StepSettings

numpy_backend = NumpyBackend()


def test_lr_schedules_are_llmcs():
    lr, warm, n, q = 1e-3, 10, 100, 0.1
    at = {k: [lr_at(s, lr, warm, n, q, k) for s in range(n + 1)] for k in LR_SCHEDULES}
    for k in ("cosine", "linear", "wsd"):
        assert at[k][:warm] == [lr * (s + 1) / warm for s in range(warm)], k  # warm-up
        assert at[k][n] == pytest.approx(lr * q), k                 # down to -q at the end
        after = at[k][warm:]
        assert all(a >= b for a, b in zip(after, after[1:])), k     # never rises again
    assert at["constant"] == [lr] * (n + 1)                           # no warm-up, as llm.c
    assert at["linear"][55] == pytest.approx((lr + lr * q) / 2)       # half way, a line
    assert at["cosine"][55] == pytest.approx((lr + lr * q) / 2)       # and a symmetric cosine
    assert at["cosine"][30] > at["linear"][30]                        # which starts slower
    assert set(at["wsd"][warm:80]) == {lr} and at["wsd"][81] < lr     # hold, then the last 20%
    assert at["wsd"][90] == pytest.approx(lr * q + (1 - math.sqrt(0.5)) * (lr - lr * q))


def train(out, *flags, ranks=None):
    res = cli("train", "-e", "tiny", "-t", "32", "-n", "3", "-v", "0", "-g", "0", "-u", "1",
              "-l", "3e-3", "--no-shuffle", "-o", out, *flags, ranks=ranks)
    assert res.returncode == 0, res.stderr
    return losses(res.stdout)


def test_four_micro_steps_give_the_gradient_of_four_times_the_batch():
    """Four batches of 2 rows adding into one gradient equal one batch of 8 rows (up to the
    order of the sums: 1e-6 in fp32), the loss too."""
    shape = preset("tiny")
    xy = np.random.default_rng(0).integers(0, shape.V, (8, 33)).astype(np.int32)
    out = {}
    for rows in (2, 8):
        run = Runner(shape=shape, be=numpy_backend, transport=Local(), mesh=Mesh(),
                     settings=StepSettings(batch=rows, seq=32))
        run.load_state_dict(init_params(shape, 1))
        loss = run.gradients(xy[:, :-1], xy[:, 1:])
        out[rows] = loss, run.stages[0].grads.copy()
    assert out[2][0] == pytest.approx(out[8][0], rel=1e-6)
    assert np.abs(out[2][1] - out[8][1]).max() <= 1e-6 * np.abs(out[8][1]).max()


@pytest.mark.parametrize("ranks,grid", [(None, []), (2, ["--dp", "2"]),
                                        (2, ["--pp", "2", "--micro-batches", "2"])])
def test_accumulating_runs_track_the_big_batch(tmp_path, ranks, grid):
    """-d 4 B T: the same rows as one batch of 4 B (the sequential loader reads them in
    the same order; the shuffled one moves B x T batches), so the same losses up to the
    order of the sums, alone and on grids."""
    rows = 4 if grid[:1] == ["--dp"] else 2  # (dp 2: 2 rows a replica)
    big_losses = train(tmp_path / "big", "-b", str(4 * rows))
    acc_losses = train(tmp_path / "acc", "-b", str(rows), "-d", str(4 * rows * 32), *grid,
                          ranks=ranks)
    assert acc_losses == pytest.approx(big_losses, rel=1e-6, abs=0)


def test_accumulation_is_said_and_bad_values_refused(tmp_path):
    res = cli("train", "-e", "tiny", "-b", "2", "-t", "32", "-d", "100", "-o", tmp_path)
    assert res.returncode == 1
    assert res.stderr.strip() == ("error: -d 100: tokens per step must be a multiple of B x T "
                                  "= 64 (each micro-step a batch)")
    res = cli("train", "-e", "tiny", "-b", "2", "-t", "32", "-k", "step", "-o", tmp_path)
    assert res.returncode == 2 and "'step' is not one of" in res.stderr
    res = cli("train", "-e", "tiny", "-b", "2", "-t", "32", "-d", "128", "-n", "1", "-v", "0",
              "-g", "0", "-k", "wsd", "-o", tmp_path)
    assert res.returncode == 0, res.stderr
    assert "| tokens per step         | 128 (2 micro-step(s))" in res.stdout
    assert "| lr schedule             | wsd, warm-up 10" in res.stdout
