"""Real multi-process pipelines on the CPU (NumPy + mpi transport) under mpiexec."""
import os

import numpy as np
import pytest
from harness import FILES, cli, fixture, losses, mpiexec
from test_verify import verify_numpy

# CI installs mpich, so there a missing mpiexec is a failure, not a skip.
pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(mpiexec() is None and not os.environ.get("CI"),
                                 reason="needs mpiexec (pip install mpich)")]


# With one micro-batch gpipe and 1f1b are the same actions (test_schedule.py), so gpipe
# runs only with several.
ONE_AND_MANY = [(1, "1f1b"), *((m, s) for m in (2, 4) for s in ("gpipe", "1f1b"))]


@pytest.mark.parametrize("micro,schedule", ONE_AND_MANY)
def test_two_stage_verify(schedule, micro):
    res, r = verify_numpy(FILES[0], "--schedule", schedule, "--micro-batches", micro, ranks=2)
    assert res.returncode == 0 and r["ok"] and r["ranks"] == 2, res.stdout + res.stderr
    assert all(s["ok"] for s in r["steps"])


@pytest.mark.parametrize("micro,schedule", [(1, "1f1b"), (3, "gpipe"), (3, "1f1b")])
def test_three_stage_verify(schedule, micro):
    res, r = verify_numpy(FILES[1], "--schedule", schedule, "--micro-batches", micro, ranks=3)
    assert res.returncode == 0 and r["ok"] and r["ranks"] == 3, res.stdout + res.stderr


TRAIN = ["train", "-b", "4", "-t", "32", "-n", "4", "-v", "2", "-m", "2", "-g", "8"]


@pytest.fixture(scope="module")
def single_run(tmp_path_factory):
    """The single-process run every pipeline is compared with (the same for each)."""
    out = tmp_path_factory.mktemp("single")
    res = cli(*TRAIN, "-o", out)
    assert res.returncode == 0, res.stderr
    return res, out


# 1f1b with one and several micro-batches, gpipe with several (with one it is 1f1b's
# schedule), and four stages of one layer each
@pytest.mark.parametrize("ranks,extra", [(2, []),
                                         (3, ["--schedule", "gpipe", "--micro-batches", "2"]),
                                         (4, ["--split", "1,1,1,1", "--micro-batches", "4"])])
def test_pipelined_train_equals_single_process(tmp_path, single_run, ranks, extra):
    single, single_out = single_run
    piped = cli(*TRAIN, *extra, "-o", tmp_path / "b", ranks=ranks)
    assert piped.returncode == 0, piped.stderr
    a, b = losses(single.stdout), losses(piped.stdout)
    assert len(a) == len(b) == 4
    assert b == pytest.approx(a, rel=1e-5, abs=1e-6)
    assert piped.stdout.count("train loss") == 4, "step lines are printed once, not per rank"
    va, vb = losses(single.stdout, "val loss"), losses(piped.stdout, "val loss")
    assert len(va) == len(vb) == 3 and vb == pytest.approx(va, rel=1e-5)
    assert piped.stdout.count("generating:") == 1, "the pipeline samples, one rank prints"
    assert "[pe1] rank 1 = stage 1" in piped.stdout
    from cupygpt.formats.llmc import read_model
    cfg_a, pa = read_model(single_out / "model.bin")
    cfg_b, pb = read_model(tmp_path / "b" / "model.bin")
    # AdamW divides by sqrt(v): where a gradient is ~0, summation-order noise becomes a
    # visible fraction of one step (lr 1e-3), so weights agree to 1% of a step, not to rtol.
    # (pytest.approx's tolerance, |a - b| <= max(1e-4 |b|, 1e-5), computed by NumPy: approx
    # compares 7M parameters one by one in Python, ~25 s.)
    assert cfg_a == cfg_b and pa.shape == pb.shape
    off = ~(np.abs(pa - pb) <= np.maximum(1e-4 * np.abs(pb), 1e-5))  # NaN is off too
    assert not off.any(), f"{off.sum()} of {off.size} parameters differ, e.g. at " \
                          f"{np.flatnonzero(off)[:5]}: {pa[off][:5]} vs {pb[off][:5]}"


@pytest.mark.parametrize("ranks,extra,expect", [
    (3, [], "3 pipeline stages but the model has 2 layers"),
    (2, ["--split", "2,1"], "--split 2,1: counts must be positive and sum to the model's 2"),
    (2, ["--split", "2"], "--split 2: 1 stages but 2 ranks"),
    (2, ["--transport", "nvshmem"],
     "--transport nvshmem: the numpy backend's arrays travel by mpi only"),
])
def test_bad_pipelines_are_refused(ranks, extra, expect):
    res = cli("verify", "--model", fixture("tiny_model.bin"), "--state",
              fixture("tiny_debug_state.bin"), "--backend", "numpy", *extra, ranks=ranks,
              timeout=60)
    assert res.returncode != 0
    assert expect in res.stderr and "Traceback" not in res.stderr


def test_pipelined_sampling_streams_the_same_text_with_and_without_the_kv_cache(tmp_path):
    made = cli("train", "-e", "tiny", "-n", "0", "-v", "0", "-g", "0", "-o", tmp_path)
    assert made.returncode == 0, made.stderr  # a fresh tiny GPT-2: 4 layers, GPT-2's vocab
    args = ["sample", "--model", tmp_path / "model.bin", "--prompt", "Hello",
            "--max-new-tokens", "10", "--seed", "5"]
    texts = []
    for ranks, cache in ((None, "--kv-cache"), (2, "--kv-cache"), (2, "--no-kv-cache")):
        res = cli(*args, cache, ranks=ranks)
        assert res.returncode == 0, res.stderr
        texts.append(res.stdout)
    assert texts[0].startswith("Hello") and len(texts[0]) > len("Hello\n")
    assert texts[1] == texts[0] and texts[2] == texts[0], texts  # no rank tag inside the text
