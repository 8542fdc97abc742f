"""GPU pipelines: cuda + nvshmem (2 PEs on one GPU, or one per GPU) and cuda + nccl
(one GPU per rank) against the single-GPU path. Skipped without a GPU and nvshmem4py."""
import importlib.util
import json
import re

import pytest

from conftest import cli, fixture, gpu_available, mpiexec

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not gpu_available(), reason="needs a CUDA GPU and CuPy"),
              pytest.mark.skipif(importlib.util.find_spec("nvshmem") is None,
                                 reason="needs nvshmem4py (pip install -e '.[cuda13]')"),
              pytest.mark.skipif(mpiexec() is None, reason="needs mpiexec")]


def n_gpus():
    import cupy as cp
    return cp.cuda.runtime.getDeviceCount()


def verify(ranks, *extra):
    res = cli("verify", "--model", fixture("odd_model.bin"), "--state",
              fixture("odd_debug_state.bin"), "--expected", fixture("odd_expected.json"),
              "--backend", "cuda", "--json", *extra, ranks=ranks, timeout=600)
    return res, json.loads(res.stdout.strip().splitlines()[-1]) if res.stdout.strip() else None


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b"])
@pytest.mark.parametrize("ranks,micro", [(2, 1), (2, 3), (3, 3)])
def test_nvshmem_verify(schedule, ranks, micro):
    res, r = verify(ranks, "--transport", "nvshmem", "--schedule", schedule,
                    "--micro-batches", micro)
    assert res.returncode == 0 and r["ok"] and r["ranks"] == ranks, res.stdout + res.stderr


def losses(text):
    return [float(x) for x in re.findall(r"train loss (\d+\.\d+)", text)]


@pytest.mark.parametrize("transport", ["nvshmem", "nccl"])
def test_pipelined_train_equals_single_gpu(tmp_path, transport):
    if transport == "nccl" and n_gpus() < 2:
        pytest.skip("nccl needs one GPU per rank; this machine has one")
    args = ["train", "--backend", "cuda", "--no-tf32", "-b", "4", "-t", "128", "-n", "6",
            "-v", "0", "-g", "0"]
    single = cli(*args, "-o", tmp_path / "a")
    piped = cli(*args, "--transport", transport, "-o", tmp_path / "b", ranks=2, timeout=600)
    assert single.returncode == 0 and piped.returncode == 0, piped.stdout + piped.stderr
    assert losses(piped.stdout) == pytest.approx(losses(single.stdout), rel=1e-5)


def test_nccl_refused_with_two_ranks_on_one_gpu():
    if n_gpus() >= 2:
        pytest.skip("more than one GPU: nccl is allowed")
    res = cli("train", "--backend", "cuda", "--transport", "nccl", "-n", "1", ranks=2, timeout=120)
    assert res.returncode != 0 and "--transport nccl: 2 ranks but 1 GPU(s)" in res.stderr
