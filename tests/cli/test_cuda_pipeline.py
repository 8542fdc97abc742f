"""Pipelines of CUDA stages against the single-device path: nvshmem (2 PEs on one GPU, or
one per GPU), nccl (one GPU per rank) and mpi. Each runs on cudasim (CPU processes, with
cudasim's NVSHMEM over shared memory) and on a real GPU where there is one."""
import importlib.util
import json

import pytest
from harness import DEVICES, FILES, cli, cudasim_missing, device_env, losses, mpiexec, run_verify

SIM, GPU = DEVICES
pytestmark = pytest.mark.skipif(mpiexec() is None, reason="needs mpiexec")
NVSHMEM_DEVICES = [SIM, pytest.param("gpu", marks=[
    *GPU.marks, pytest.mark.skipif(importlib.util.find_spec("nvshmem") is None,
                                   reason="needs nvshmem4py (pip install -e '.[cuda13]')")])]


def n_gpus(device):
    if device == "sim":
        return 1
    import cupy as cp
    return cp.cuda.runtime.getDeviceCount()


def verify(device, ranks, *extra):
    return run_verify(FILES[1], "--backend", "cuda", *extra, ranks=ranks, env=device_env(device))


# with one micro-batch gpipe is 1f1b's schedule (test_schedule.py): it runs with several
@pytest.mark.parametrize("device", NVSHMEM_DEVICES)
@pytest.mark.parametrize("ranks,micro,schedule", [(2, 1, "1f1b"), (2, 3, "gpipe"), (2, 3, "1f1b"),
                                                  (3, 3, "gpipe"), (3, 3, "1f1b")])
def test_nvshmem_verify(device, schedule, ranks, micro):
    res, r = verify(device, ranks, "--transport", "nvshmem", "--schedule", schedule,
                    "--micro-batches", micro)
    assert res.returncode == 0 and r["ok"] and r["ranks"] == ranks, res.stdout + res.stderr


@pytest.mark.parametrize("device", DEVICES)
def test_cuda_stages_over_mpi(device):
    """Three CUDA stages, host-staged over mpi (works with any number of GPUs). Each send
    has a host buffer of its own, so unlike nvshmem's reused slots (whose reuse a later
    step can catch going wrong) three AdamW steps show what ten would."""
    res, r = verify(device, 3, "--transport", "mpi", "--micro-batches", "3", "--steps", "3")
    assert res.returncode == 0 and r["ok"] and r["ranks"] == 3, res.stdout + res.stderr
    assert len(r["steps"]) == 3 and all(s["ok"] for s in r["steps"]), r["steps"]


@pytest.mark.parametrize("device,transport", [
    pytest.param(p.values[0], transport, marks=p.marks, id=f"{p.values[0]}-{transport}")
    for p, transport in ((NVSHMEM_DEVICES[0], "nvshmem"), (NVSHMEM_DEVICES[1], "nvshmem"),
                         (GPU, "nccl"))])
@pytest.mark.parametrize("schedule", [
    [], ["--schedule", "zb1p", "--micro-batches", "2"], ["--schedule", "zbv"],
    ["--schedule", "interleaved", "--virtual-stages", "2", "--micro-batches", "2"]],
    ids=["1f1b", "zb1p", "zbv", "interleaved"])
def test_pipelined_train_equals_single_device(tmp_path, device, transport, schedule):
    """Every schedule on CUDA stages (-e tiny has the 4 layers zbv and interleaved V=2 cut
    into 4 chunks on 2 ranks), in fp32: bf16 stages round the tied wte's two gradients
    apart before summing them, so they track one device only to bf16's precision
    (test_bf16.py)."""
    if transport == "nccl" and n_gpus(device) < 2:
        pytest.skip("nccl needs one GPU per rank; this machine has one")
    args = ["train", "--backend", "cuda", "-e", "tiny", "--no-tf32", "-b", "4", "-t", "32",
            "-n", "4", "-v", "0", "-g", "0", "--dtype", "fp32"]
    single = cli(*args, "-o", tmp_path / "a", env=device_env(device))
    piped = cli(*args, "--transport", transport, *schedule, "-o", tmp_path / "b", ranks=2,
                timeout=600, env=device_env(device))
    assert single.returncode == 0 and piped.returncode == 0, piped.stdout + piped.stderr
    assert losses(piped.stdout) == pytest.approx(losses(single.stdout), rel=1e-5)


@pytest.mark.parametrize("device", DEVICES)
def test_nccl_refused_with_two_ranks_on_one_gpu(device):
    if n_gpus(device) >= 2:
        pytest.skip("more than one GPU: nccl is allowed")
    res = cli("train", "--backend", "cuda", "--transport", "nccl", "-n", "1", ranks=2,
              timeout=120, env=device_env(device))
    assert res.returncode != 0 and "--transport nccl: 2 ranks but 1 GPU(s)" in res.stderr


@pytest.mark.parametrize("device,transport", [
    pytest.param(p.values[0], transport, marks=p.marks, id=f"{p.values[0]}-{transport}")
    for p, transport in ((NVSHMEM_DEVICES[0], "nvshmem"), (NVSHMEM_DEVICES[1], "nvshmem"),
                         (SIM, "nccl"), (GPU, "nccl"))])
@pytest.mark.parametrize("grid", [["--dp", "2", "--tp", "2"],
                                  ["--tp", "2", "--pp", "2", "--micro-batches", "2"]])
def test_grid_of_cuda_stages_verifies(device, transport, grid):
    """Data and tensor parallelism on the CUDA backend: the vocab-parallel kernels, and the
    transport's own collectives beside its stage handoffs (cudasim reports a GPU per rank
    for nccl, and lags each stream wait less: the collectives make many)."""
    if transport == "nccl" and device == "gpu" and n_gpus(device) < 4:
        pytest.skip("nccl needs one GPU per rank; this machine has fewer than 4")
    env = {**device_env(device), **({"CUDASIM_DEVICES": "4", "CUDASIM_LAG_S": "0.002"}
                                    if device == "sim" else {})}
    res, r = run_verify(FILES[0], "--backend", "cuda", "--transport", transport, *grid,
                        ranks=4, env=env)
    assert res.returncode == 0 and r["ok"] and r["ranks"] == 4, res.stdout + res.stderr
    assert all(s["ok"] for s in r["steps"])


@pytest.mark.parametrize("transport,grid", [
    ("nvshmem", ["--dp", "2", "--tp", "2"]),
    ("nvshmem", ["--tp", "2", "--pp", "2", "--micro-batches", "2"]),
    ("nccl", ["--dp", "2", "--tp", "2"])], ids=["nvshmem-dp2-tp2", "nvshmem-tp2-pp2",
                                                "nccl-dp2-tp2"])
def test_grid_verifies_in_any_order(transport, grid):
    """Grids on cudasim under CUDASIM_ORDER=random: each rank's streams (the compute
    stream's tp collectives and handoffs, the side stream's overlapped dp sum) interleaved
    at random, one operation at a time, the host seeing work only after waiting for it,
    blocks in any order, so a missing wait or a slot reused too early shows. With CuPy's
    stream stack (cudasim's too), leaving `with side:` made the legacy stream current:
    this gave every gradient of nvshmem's --dp 2 --tp 2 wrong here, as 4 PEs on one H200
    did. NCCL's collectives block their stream's GPU until the peers arrive, so the side
    stream's and the compute stream's must run in one order on every rank (nccl.py's
    _in_order), else two ranks wait on each other here."""
    if cudasim_missing():
        pytest.skip(cudasim_missing())
    env = {**device_env("sim"), "CUDASIM_DEVICES": "4", "CUDASIM_LAG_S": "0.002",
           "CUDASIM_ORDER": "random"}
    res, r = run_verify(FILES[0], "--backend", "cuda", "--transport", transport, *grid,
                        ranks=4, env=env)
    assert res.returncode == 0 and r["ok"] and r["ranks"] == 4, res.stdout + res.stderr
    assert all(s["ok"] for s in r["steps"])


@pytest.mark.parametrize("device", NVSHMEM_DEVICES[1:])
@pytest.mark.parametrize("grid", [["--dp", "2", "--tp", "2"],
                                  ["--dp", "2", "--tp", "2", "--no-overlap"], ["--dp", "2"]],
                         ids=["dp2-tp2", "dp2-tp2-no-overlap", "dp2"])
def test_the_replicas_sum_on_a_gpu(device, grid):
    """Where --dp 2 --tp 2 over nvshmem went wrong on an H200 (4 PEs on one GPU, every
    gradient wrong, the forward right) while the side stream's `with` left the legacy
    stream current: the replicas' sum overlapped beside the tensor-parallel sums (10 runs
    in a row: a GPU's order varies from run to run), after them, and alone."""
    runs = 10 if grid == ["--dp", "2", "--tp", "2"] else 1
    for _ in range(runs):
        res, r = run_verify(FILES[0], "--backend", "cuda", "--transport", "nvshmem", *grid,
                            ranks=4 if "--tp" in grid else 2, env=device_env(device))
        assert res.returncode == 0 and r["ok"], res.stdout + res.stderr
        assert all(s["ok"] for s in r["steps"])


def test_bench_comm_times_nvshmem_against_nccl_on_cudasim(tmp_path):
    """bench --comm on the CUDA backend times its transport (auto: nvshmem) and NCCL in the
    same run, two ranks on one GPU as NCCL 2.30 allows them; on cudasim only that the
    report has every field a GPU fills (its times say nothing of a GPU's). Without NCCL's
    variable the refusal is one line naming --against, before any timing."""
    if cudasim_missing():
        pytest.skip(cudasim_missing())
    args = ["bench", "--comm", "--backend", "cuda", "-e", "tiny", "-t", "64", "--steps", "3",
            "--warmup", "1", "--against", "nccl", "--out", tmp_path / "c.json"]
    env = {**device_env("sim"), "CUDASIM_LAG_S": "0"}
    refused = cli(*args, ranks=2, env=env)
    assert refused.returncode == 1 and "error: --against nccl: 2 ranks but 1 GPU(s)" in \
        refused.stderr and "NCCL_MULTI_RANK_GPU_ENABLE=1" in refused.stderr, refused.stderr
    assert not (tmp_path / "c.json").exists()
    res = cli(*args, ranks=2, env={**env, "NCCL_MULTI_RANK_GPU_ENABLE": "1"}, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    r = json.load(open(tmp_path / "c.json"))
    assert r["device"] == "cudasim (CPU)" and r["transports"] == ["nvshmem", "nccl"]
    assert r["ranks"] == 2 and r["devices"] == 1 and r["ranks_per_device"] == 2
    assert r["libraries"]["nccl"] == 23203 and set(r["measures"]) == {
        "host_us", "loop_us", "issue_us"}
    rows = r["rows"]
    assert [x["transport"] for x in rows[:2]] == ["nvshmem", "nccl"] and len(rows) == 2 * 16
    # the step's sizes, each on both transports in turn, fp32 then bf16
    assert [x["dtype"] for x in rows[-8:]] == ["fp32", "fp32", "bf16", "bf16"] * 2
    assert rows[-1]["bytes"] * 2 == rows[-3]["bytes"]
    measured = [f"{op}_{m}" for op in ("all_reduce", "reduce_scatter", "all_gather", "handoff")
                for m in r["measures"]]
    assert all(x[k] > 0 for x in rows for k in measured + ["all_reduce_GBps", "handoff_GBps"])
    assert set(r["crossover_bytes"]) == {"all_reduce", "reduce_scatter", "all_gather",
                                         "handoff"}
    assert all(set(c) == {"host_us", "loop_us"} and all(b is None or b in [x["bytes"] for x in
                                                                        rows] for b in c.values())
               for c in r["crossover_bytes"].values())
    for kind in ("nvshmem", "nccl"):
        seeds = r["seeds"][kind]
        assert set(seeds["handoff_8B"]) == set(r["measures"]) and len(seeds["grad_sync"]) == 6
    assert "crossover, handoff: nccl the faster from" in res.stdout


@pytest.mark.parametrize("device", NVSHMEM_DEVICES)
@pytest.mark.parametrize("ranks,grid", [
    (2, ["--schedule", "zbv"]),
    (2, ["--schedule", "interleaved", "--virtual-stages", "2", "--micro-batches", "2"]),
    (4, ["--tp", "2", "--pp", "2", "--schedule", "zb1p", "--micro-batches", "2"]),
    (4, ["--dp", "2", "--pp", "2", "--zero", "1", "--no-overlap", "--micro-batches", "2"]),
], ids=["zbv", "interleaved", "tp2-zb1p", "dp2-zero1"])
def test_graph_replayed_pipeline_steps_equal_eager_ones(tmp_path, device, ranks, grid):
    """Over nvshmem every wait is on the stream and counted per step, so each rank's whole
    step (its actions, the transfers, the tp and dp collectives, AdamW) is captured once and
    replayed: the losses are the eager steps' bits."""
    args = ["train", "--backend", "cuda", "-e", "tiny", "--no-tf32", "-b", "4", "-t", "16",
            "-n", "4", "-v", "0", "-g", "0", "--transport", "nvshmem", *grid]
    env = {**device_env(device), **({"CUDASIM_LAG_S": "0.002"} if device == "sim" else {})}
    runs = {}
    for mode in ("--graphs", "--no-graphs"):
        out = tmp_path / mode
        res = cli(*args, mode, "-o", out, ranks=ranks, timeout=600, env=env)
        assert res.returncode == 0, res.stdout + res.stderr
        step = "a CUDA graph, replayed from step 2" if mode == "--graphs" else "eager"
        assert f"| step                    | {step}" in res.stdout
        runs[mode] = [r["train_loss"] for r in map(json.loads, open(out / "log.jsonl"))
                      if "train_loss" in r]
    assert len(runs["--graphs"]) == 4 and runs["--graphs"] == runs["--no-graphs"]


@pytest.mark.parametrize("device", NVSHMEM_DEVICES)
def test_bf16_grid_over_nvshmem_tracks_the_numpy_reference(tmp_path, device):
    """bf16 stages over nvshmem (ZeRO-1 replicas, the pipeline's bf16 handoffs and tied sum,
    the dp sums added in float) track the NumPy backend's one bf16 process."""
    args = ["train", "-e", "tiny", "-b", "4", "-t", "16", "-n", "4", "-v", "0", "-g", "0",
            "--dtype", "bf16"]
    ref = cli(*args, "--backend", "numpy", "-o", tmp_path / "np")
    grid = cli(*args, "--backend", "cuda", "--transport", "nvshmem", "--dp", "2", "--pp", "2",
               "--zero", "1", "--micro-batches", "2", "-o", tmp_path / "grid", ranks=4,
               timeout=600, env=device_env(device))
    assert ref.returncode == 0 and grid.returncode == 0, grid.stdout + grid.stderr
    assert losses(grid.stdout) == pytest.approx(losses(ref.stdout), rel=2e-4)


@pytest.mark.parametrize("device", NVSHMEM_DEVICES)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_zero1_with_clipping_is_bit_identical_on_cuda(tmp_path, device, dtype):
    """--zero 1 on CUDA stages (dp 2 over nvshmem, clipping at llm.c's 1.0 and the norms
    above it) writes the model of the run without it, byte for byte: the norm kernel sums
    any split of the buffer alike, and AdamW rounds a slice as the whole buffer."""
    args = ["train", "--backend", "cuda", "-e", "tiny", "--no-tf32", "-b", "4", "-t", "32",
            "-n", "3", "-v", "0", "-g", "0", "--dtype", dtype, "--dp", "2", "--transport",
            "nvshmem", "--no-overlap"]
    runs = {z: cli(*args, "--zero", z, "-o", tmp_path / z, ranks=2, timeout=600,
                   env=device_env(device)) for z in ("0", "1")}
    assert all(r.returncode == 0 for r in runs.values()), runs["1"].stdout + runs["1"].stderr
    norms = [float(ln.split(" norm ")[1].split()[0]) for ln in runs["0"].stdout.splitlines()
             if ln.startswith("[pe0] step ")]
    assert len(norms) == 3 and min(norms) > 1.0, norms  # every step clipped
    assert (tmp_path / "0" / "model.bin").read_bytes() == \
        (tmp_path / "1" / "model.bin").read_bytes()
