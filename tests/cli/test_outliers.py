"""-sl/-sg (llm.c's outlier detector): a loss spike injected through the train loop's seam
for the tests (support/faulty_cli.py: one step's targets all the vocab's last token) is
skipped on every rank of a grid, leaving the parameters as they were; the detectors' window
survives a resume."""
import json
import os

import numpy as np
import pytest
from harness import DEVICES, ROOT, cli, device_env, mpiexec

SPIKE = 130  # the window (128 values) is full from step 129


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    from cupygpt.formats.llmc import read_shard, write_model, write_shard
    from cupygpt.model.initialize import init_params
    from cupygpt.model.shape import GPT2Config
    d = tmp_path_factory.mktemp("outliers")
    cfg = GPT2Config(maxT=32, V=301, Vp=320, L=4, NH=6, C=48)
    write_model(d / "model.bin", cfg, init_params(cfg, 7))
    toks = read_shard(os.path.join(ROOT, "cupygpt", "data", "tiny_shakespeare_val.bin"))
    write_shard(d / "train.bin", toks[:20000] % cfg.V)
    return d


def train(made, out, steps, *extra, ranks=None, spike=True, device=None):
    res = cli("train", "-e", made / "model.bin", "-i", made / "train.bin", "-j", "", "-b", "4",
              "-t", "16", "-n", steps, "-g", "0", "-l", "3e-3", "-k", "constant", "-o", out,
              "--backend", "cuda" if device else "numpy", *extra, ranks=ranks,
              env=device_env(device), fault=f"targets:{SPIKE}" if spike else None)
    assert res.returncode == 0, res.stdout + res.stderr
    return res


def model(out):
    return open(out / "model.bin", "rb").read()


@pytest.mark.mpi
@pytest.mark.skipif(mpiexec() is None and not os.environ.get("CI"),
                    reason="needs mpiexec (pip install mpich)")
def test_a_spike_is_skipped_on_every_rank_of_a_grid(made, tmp_path):
    grid = ["--dp", "2", "--tp", "2", "--pp", "2"]
    res = train(made, tmp_path / "a", SPIKE, "-sl", "3", *grid, ranks=8)
    before = train(made, tmp_path / "b", SPIKE - 1, *grid, ranks=8, spike=False)
    said = [ln for ln in res.stdout.splitlines() if f"step {SPIKE}'s update skipped" in ln]
    assert sorted(ln.split("]")[0] for ln in said) == [f"[pe{r}" for r in range(8)], res.stdout
    assert all("(loss z " in ln for ln in said)  # each rank's own detector said so
    assert model(tmp_path / "a") == model(tmp_path / "b"), before.stdout[-500:]
    last = json.loads(open(tmp_path / "a" / "log.jsonl").read().splitlines()[-1])
    assert last["step"] == SPIKE and last["skipped"].startswith("loss z ")
    assert last["train_loss"] > 2 + json.loads(open(tmp_path / "b" / "log.jsonl")
                                               .read().splitlines()[-1])["train_loss"]


def test_a_norm_spike_alone_is_skipped(made, tmp_path):
    """-sg alone: the spike's gradient norm is the outlier; the update is skipped."""
    res = train(made, tmp_path / "a", SPIKE, "-sg", "3")
    train(made, tmp_path / "b", SPIKE - 1, spike=False)
    said = [ln for ln in res.stdout.splitlines() if f"step {SPIKE}'s update skipped" in ln]
    assert len(said) == 1 and "(norm z " in said[0], res.stdout[-2000:]
    assert model(tmp_path / "a") == model(tmp_path / "b")
    last = json.loads(open(tmp_path / "a" / "log.jsonl").read().splitlines()[-1])
    assert last["step"] == SPIKE and last["skipped"].startswith("norm z ")


def test_the_window_is_checkpointed(made, tmp_path):
    """Resumed at step 128, the run skips step 130 as the uninterrupted run does (a fresh
    window would have no z-score until step 256) and ends with the same parameters (the
    lr is constant, so runs of other lengths share their steps)."""
    full = train(made, tmp_path / "full", SPIKE + 2, "-sg", "3", "-sl", "3")
    assert f"step {SPIKE}'s update skipped" in full.stdout
    train(made, tmp_path / "cut", 128, "-sg", "3", "-sl", "3", "--checkpoint-every", "128")
    res = train(made, tmp_path / "cut", SPIKE + 2, "-sg", "3", "-sl", "3",
                "--checkpoint-every", "128", "--resume", tmp_path / "cut")
    assert f"step {SPIKE}'s update skipped" in res.stdout
    assert model(tmp_path / "cut") == model(tmp_path / "full")
    no_skip = train(made, tmp_path / "plain", SPIKE + 2)
    assert "skipped" not in no_skip.stdout and model(tmp_path / "plain") != model(tmp_path / "full")


@pytest.mark.parametrize("device", DEVICES)
def test_a_spike_is_skipped_on_cuda(made, tmp_path, device):
    """The CUDA backend (cudasim, or the GPU), whose other steps replay a CUDA graph: the
    parameters after the spike are those of the checkpoint before it. The window is filled
    on NumPy (a checkpoint holds it), the last steps run on the device."""
    train(made, tmp_path, SPIKE - 3, "-sl", "3", "--checkpoint-every", SPIKE - 3, "--dtype",
          "bf16", spike=False)  # (the device's default)
    train(made, tmp_path, SPIKE, "-sl", "3", "--checkpoint-every", SPIKE - 1, "--resume",
          tmp_path, device=device)
    assert model(tmp_path) == model(tmp_path / f"ckpt_{SPIKE - 1:08d}")
    last = json.loads(open(tmp_path / "log.jsonl").read().splitlines()[-1])
    assert last["step"] == SPIKE and last["skipped"].startswith("loss z ")


def test_a_non_finite_value_is_an_outlier_that_stays_out_of_the_window():
    """(llm.c's running sums would turn NaN for good, and no later step could be judged.)"""
    from cupygpt.train.outlier import WINDOW, OutlierDetector
    d = OutlierDetector()
    for i in range(WINDOW):
        d.update(1.0 + (i % 2))
    before = d.state()
    assert d.update(float("inf")) == float("inf") and d.update(float("nan")) == float("inf")
    assert d.state() == before
    window = np.array([2.0] + [1.0 + (i % 2) for i in range(1, WINDOW)])  # 2.0 replaced the first
    assert d.update(2.0) == pytest.approx((2.0 - window.mean()) / window.std(), rel=1e-12)
