"""The data x tensor x pipeline grid on the CPU (NumPy + mpi under mpiexec): every layout
trains to the single process's losses and passes verify; ZeRO-1 is bit-identical to the
unsharded step; bad grids are refused in one line."""
import json
import os
import re

import numpy as np
import pytest
from harness import FILES, ROOT, SUPPORT, cli, fixture, losses, mpiexec
from test_verify import verify_numpy

pytestmark = [pytest.mark.mpi,
              pytest.mark.skipif(mpiexec() is None and not os.environ.get("CI"),
                                 reason="needs mpiexec (pip install mpich)")]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A model shaped for grids (4 layers; 6 heads: TP 2 and 3; a vocab of 301 padded to
    320, divisible by neither) and shards of the shipped text's tokens folded into it."""
    from cupygpt.formats.llmc import read_shard, write_model, write_shard
    from cupygpt.model.initialize import init_params
    from cupygpt.model.shape import GPT2Config
    d = tmp_path_factory.mktemp("grid")
    cfg = GPT2Config(maxT=32, V=301, Vp=320, L=4, NH=6, C=48)
    write_model(d / "model.bin", cfg, init_params(cfg, 7))
    toks = read_shard(os.path.join(os.path.dirname(fixture("x")), "..", "data",
                                   "tiny_shakespeare_val.bin"))
    for name, part in (("train", toks[:20000]), ("val", toks[20000:26000])):
        write_shard(d / f"{name}.bin", part % cfg.V)
    return d


@pytest.fixture(scope="module")
def state64(made):
    """A debug state (and 10 AdamW losses) for the 6-head model, made by the single process
    in float64: the reference for TP degrees no llm.c-made file has heads for (3)."""
    from statefile import make_state64
    return make_state64(made / "model.bin", made, 6, 16)


@pytest.mark.parametrize("ranks,grid", [
    (3, ["--tp", "3"]),
    (6, ["--dp", "2", "--tp", "3", "--micro-batches", "3", "--zero", "1"]),
    (6, ["--tp", "3", "--pp", "2", "--micro-batches", "2", "--schedule", "gpipe"]),
])
def test_tp3_verifies_against_the_float64_single_process(state64, ranks, grid):
    res, r = verify_numpy(state64, *grid, ranks=ranks)
    assert res.returncode == 0 and r["ok"] and r["ranks"] == ranks, res.stdout + res.stderr
    assert len(r["grads"]) == 16 and all(s["ok"] for s in r["steps"])


def train(made, out, *grid, ranks=None, steps=4):
    model = [] if "--resume" in grid else ["-e", made / "model.bin"]
    res = cli("train", *model, "-i", made / "train.bin", "-j", made / "val.bin", "-b", "4",
              "-t", "16", "-n", steps, "-v", "2", "-m", "1", "-g", "0", "-l", "3e-3", "-o", out,
              *grid, ranks=ranks)
    assert res.returncode == 0, res.stdout + res.stderr
    return res


def log(out):
    return [r for r in map(json.loads, open(out / "log.jsonl")) if "train_loss" in r]


@pytest.mark.parametrize("ranks,grid", [
    (2, ["--dp", "2"]),
    (2, ["--tp", "2"]),
    (3, ["--tp", "3"]),
    (4, ["--dp", "2", "--pp", "2", "--micro-batches", "2", "--zero", "1"]),
    (6, ["--tp", "3", "--pp", "2", "--micro-batches", "2", "--schedule", "gpipe"]),
    (8, ["--tp", "2", "--pp", "4", "--micro-batches", "4"]),
])
def test_grid_trains_like_one_process(made, tmp_path, ranks, grid):
    one = train(made, tmp_path / "one")
    res = train(made, tmp_path / "grid", *grid, ranks=ranks)
    a, b = losses(one.stdout), losses(res.stdout)
    assert len(a) == len(b) == 4 and b == pytest.approx(a, rel=1e-5)
    assert losses(res.stdout, "val loss") == pytest.approx(losses(one.stdout, "val loss"),
                                                         rel=1e-5)
    assert res.stdout.count("train loss") == 4, "one rank prints the step lines"
    assert "dp groups" in res.stdout
    from cupygpt.formats.llmc import read_model
    _, pa = read_model(tmp_path / "one" / "model.bin")
    _, pb = read_model(tmp_path / "grid" / "model.bin")
    # AdamW divides by sqrt(v): where a gradient is ~0, summation-order noise can turn one
    # step (-l 3e-3) around, so weights agree to a tenth of a step (they are ~0.02)
    assert pb == pytest.approx(pa, rel=1e-4, abs=3e-4)


def test_sampling_under_tp_draws_from_the_whole_vocabulary(made, tmp_path):
    """Each shard of the head holds a slice of the vocabulary: the sample is drawn from the
    whole row, so a tp run writes the single process's text."""
    one = train(made, tmp_path / "one", "-s", "2", "-g", "12", steps=2)
    tp = train(made, tmp_path / "tp", "--tp", "3", "-s", "2", "-g", "12", steps=2, ranks=3)

    def text(out):
        return out.split("generating:")[-1].split("---")[1].strip()
    assert text(one.stdout) and text(tp.stdout.replace("[pe0] ", "")) == text(one.stdout)


def test_zero1_is_bit_identical_and_shards_the_optimizer(made, tmp_path):
    """ZeRO-1 updates each replica's slice with the same elementwise AdamW on the same
    reduced gradients: the same bits as the unsharded step, with half the m and v."""
    plain = train(made, tmp_path / "plain", "--dp", "2", ranks=2)
    zero = train(made, tmp_path / "zero", "--dp", "2", "--zero", "1", ranks=2)
    assert [r["train_loss"] for r in log(tmp_path / "plain")] == \
        [r["train_loss"] for r in log(tmp_path / "zero")]
    assert (tmp_path / "plain" / "model.bin").read_bytes() == \
        (tmp_path / "zero" / "model.bin").read_bytes()
    again = train(made, tmp_path / "again", "--dp", "2", "--zero", "1", ranks=2)
    assert (tmp_path / "again" / "model.bin").read_bytes() == \
        (tmp_path / "zero" / "model.bin").read_bytes(), "a grid repeats itself exactly"
    # overlapped (the default): each replica updates its slice of the per-layer all-reduce;
    # without: the reduce-scatter after the backward. The same member-order sums either way
    scatter = train(made, tmp_path / "scatter", "--dp", "2", "--zero", "1", "--no-overlap",
                    ranks=2)
    assert "overlapped, per layer (zero 1)" in zero.stdout
    assert "reduce-scatter (zero 1)" in scatter.stdout
    assert (tmp_path / "scatter" / "model.bin").read_bytes() == \
        (tmp_path / "zero" / "model.bin").read_bytes()

    def optimizer_mib(text):  # two ranks' lines may interleave in mpiexec's output
        return sorted(float(x) for x in re.findall(r"optimizer ([\d.]+) MiB", text))
    full, half = optimizer_mib(plain.stdout), optimizer_mib(zero.stdout)
    assert len(full) == len(half) == 2 and again.returncode == 0
    # m and v halved, plus half the gradient (the reduce-scatter's summed slice)
    assert half == pytest.approx([f * 3 / 4 for f in full], abs=0.08)  # (.1f MiB)


@pytest.mark.parametrize("ranks,grid", [
    (2, ["--dp", "2"]),
    (2, ["--tp", "2"]),
    (4, ["--dp", "2", "--tp", "2"]),
    (4, ["--tp", "2", "--pp", "2"]),
    (8, ["--dp", "2", "--tp", "2", "--pp", "2", "--micro-batches", "2", "--schedule", "1f1b",
         "--zero", "1"]),
])
def test_grid_verifies_against_llmc(ranks, grid):
    res, r = verify_numpy(FILES[0], *grid, ranks=ranks)
    assert res.returncode == 0 and r["ok"] and r["ranks"] == ranks, res.stdout + res.stderr
    assert len(r["grads"]) == 16 and all(s["ok"] for s in r["steps"])


@pytest.mark.parametrize("ranks,grid,expect", [
    (2, ["--dp", "3"], "--dp 3 does not multiply out to the 2 rank(s)"),
    (4, ["--dp", "2", "--pp", "3"], "does not multiply out to the 4 rank(s)"),
    (3, ["--tp", "3"], "--tp 3: each tensor-parallel rank holds whole heads: 3 must divide "
                       "the model's 4 heads"),
    (None, ["--zero", "1"], "--zero 1: shards the optimizer state across data-parallel "
                            "replicas, and there is one"),
    (2, ["--dp", "2", "--zero", "2"], "--zero 2: 0 (off) or 1"),
    (4, ["--dp", "4"], "--dp 4: must divide the batch size 3"),
    (2, ["--pp", "1"], "--dp 2: must divide the batch size 3: each of the 2 data-parallel "
                       "replicas (2 ranks / (tp 1 x pp 1)) takes an equal part of it; give -b "
                       "a multiple of 2, or launch fewer ranks"),  # (--dp not given)
])
def test_bad_grids_are_refused(ranks, grid, expect):
    files = FILES[1] if "must divide the batch" in expect else FILES[0]  # odd: B = 3
    res = cli("verify", "--model", fixture(files[0]), "--state", fixture(files[1]),
              "--backend", "numpy", *grid, ranks=ranks, timeout=60)
    assert res.returncode != 0
    assert expect in res.stderr and "Traceback" not in res.stderr, res.stderr
    assert np.all([ln.startswith(("error", "[pe")) for ln in res.stderr.splitlines()])


def test_tensor_parallel_shards_hold_less_and_agree_on_replicated_gradients(made):
    """Per-rank memory shrinks with --tp 3; layernorms, wpe and the row-parallel biases get
    the same gradient bits on every shard (tests/support/tp_replicas.py)."""
    res = cli_script("tp_replicas.py", made / "model.bin", ranks=3)
    assert res.returncode == 0 and "replicated gradients identical on 3 shards" in res.stdout, \
        res.stdout + res.stderr


def test_checkpoints_move_between_grids(made, tmp_path):
    """A checkpoint holds whole tensors: written on --dp 2 --tp 2 --zero 1, it resumes on the
    same grid bit for bit, on one rank and on --tp 3 to the same losses, and its parameters
    come back unchanged through another grid."""
    ck = ["--checkpoint-every", "2"]
    a = tmp_path / "a"
    train(made, a, "--dp", "2", "--tp", "2", "--zero", "1", *ck, ranks=4)
    assert sorted(os.listdir(a / "ckpt_00000002")) == ["adamw.npz", "model.bin"]
    resume = ["--resume", a / "ckpt_00000002"]
    train(made, tmp_path / "same", "--dp", "2", "--tp", "2", "--zero", "1", *resume, ranks=4)
    assert [r["train_loss"] for r in log(tmp_path / "same")] == \
        [r["train_loss"] for r in log(a)[2:]]
    assert (tmp_path / "same" / "model.bin").read_bytes() == (a / "model.bin").read_bytes()
    for name, grid, ranks in (("one", [], None), ("tp3", ["--tp", "3"], 3)):
        train(made, tmp_path / name, *grid, *resume, ranks=ranks)
        got = [r["train_loss"] for r in log(tmp_path / name)]
        assert got == pytest.approx([r["train_loss"] for r in log(a)[2:]], rel=1e-5), name
    through = tmp_path / "through"
    train(made, through, "--tp", "3", *resume, ranks=3, steps=2)  # no step: load, write
    assert (through / "model.bin").read_bytes() == (a / "ckpt_00000002" / "model.bin").read_bytes()


def cli_script(name, *args, ranks):
    import subprocess
    import sys
    env = {**os.environ, "PYTHONPATH": ROOT}
    return subprocess.run([mpiexec(), "-n", str(ranks), sys.executable,
                           os.path.join(SUPPORT, name), *map(str, args)],
                          capture_output=True, text=True, timeout=300, env=env)


def test_overlapped_gradient_sum_is_bit_identical_and_benched(made, tmp_path):
    """The replicas' per-layer sums started during the last backward give the bits of the
    sum after it; bench times the step both ways."""
    grid = ["--dp", "2", "--tp", "2", "--micro-batches", "2"]
    over = train(made, tmp_path / "over", *grid, ranks=4)
    plain = train(made, tmp_path / "plain", *grid, "--no-overlap", ranks=4)
    assert "overlapped, per layer" in over.stdout and "after backward" in plain.stdout
    assert [r["train_loss"] for r in log(tmp_path / "over")] == \
        [r["train_loss"] for r in log(tmp_path / "plain")]
    assert (tmp_path / "over" / "model.bin").read_bytes() == \
        (tmp_path / "plain" / "model.bin").read_bytes()
    res = cli("bench", "--backend", "numpy", "--dp", "2", "-t", "16", "--steps", "2",
              "--warmup", "1", "--out", tmp_path / "b.json", ranks=2)
    assert res.returncode == 0, res.stdout + res.stderr
    r = json.load(open(tmp_path / "b.json"))
    assert r["grid"]["dp"] == 2 and r["grid"]["overlap"]
    assert r["ms_per_step_median"] > 0 and r["ms_per_step_no_overlap"] > 0


def test_bench_comm_times_every_size_and_refuses_one_rank(tmp_path):
    res = cli("bench", "--comm", "--backend", "numpy", "--steps", "3", "--warmup", "1",
              "--against", "mpi", "--out", tmp_path / "x.json", ranks=2)
    assert res.returncode == 1 and "--against mpi: is the run's transport already" in \
        res.stderr and not (tmp_path / "x.json").exists()
    res = cli("bench", "--comm", "--backend", "numpy", "--steps", "3", "--warmup", "1",
              "--out", tmp_path / "c.json", ranks=2)
    assert res.returncode == 0, res.stdout + res.stderr
    r = json.load(open(tmp_path / "c.json"))
    rows = r["rows"]
    assert [x["bytes"] for x in rows[:12]] == [8] + [2 ** k for k in range(6, 27, 2)]
    assert all(x["transport"] == "mpi" and x["ranks"] == 2 for x in rows)
    assert r["transports"] == ["mpi"] and r["ranks"] == 2 and r["crossover_bytes"] == {}
    # one host, so one memory the two ranks share
    assert r["devices"] == 1 and r["ranks_per_device"] == 2
    # tiny's gradient, its parameter count in fp32 then bf16: half the bytes
    assert [(x["dtype"], x["bytes"]) for x in rows[-2:]] == [("fp32", 4 * 7_265_024),
                                                             ("bf16", 2 * 7_265_024)]
    assert all(x[k] > 0 for x in rows for k in x if k.endswith("_us"))
    # the CPU's marks are its clock, read inside the issuing: the loop is the issuing, less
    # the two readings of the clock around it
    assert all(x[f"{op}_issue_us"] >= x[f"{op}_loop_us"] > 0.9 * x[f"{op}_issue_us"]
               for x in rows for op in ("all_reduce", "handoff"))
    seeds = r["seeds"]["mpi"]
    assert seeds["handoff_8B"]["host_us"] == rows[0]["handoff_host_us"]
    assert list(seeds["grad_sync"]) == ["4 KiB", "16 KiB", "64 KiB", "256 KiB", "1 MiB", "4 MiB"]
    assert "handoff" in res.stdout and "dp gradient" in res.stdout
    one = cli("bench", "--comm", "--backend", "numpy", "--out", tmp_path / "d.json")
    assert one.returncode == 1 and "bench --comm measures communication between ranks" in \
        one.stderr and not (tmp_path / "d.json").exists()


def test_trace_shows_every_rank_s_actions_in_causal_order(made, tmp_path):
    """--trace: one Chrome trace-event JSON, a row per rank, a slice per action; a stage
    receives micro-batch k only after the one before it began sending it."""
    path = tmp_path / "t" / "trace.json"
    train(made, tmp_path / "o", "--pp", "2", "--micro-batches", "2", "--trace", path,
          ranks=2, steps=1)
    ev = json.load(open(path))["traceEvents"]
    rows = {e["tid"]: e["args"]["name"] for e in ev if e["ph"] == "M"}
    assert rows == {0: "rank 0: stage 0, replica 0, shard 0",
                    1: "rank 1: stage 1, replica 0, shard 0"}
    slices = [e for e in ev if e["ph"] == "X"]
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in slices)
    first = [e["name"] for e in slices if e["tid"] == 0]
    assert first[:4] == ["F0", "send_act 0", "F1", "send_act 1"]  # validation first
    assert "B1" in first and first.count("step") == 1
    sends = sorted(e["ts"] for e in slices if e["name"] == "send_act 1")
    recvs = sorted(e["ts"] + e["dur"] for e in slices if e["name"] == "recv_act 1")
    assert len(sends) == len(recvs) == 3  # validation, the step, validation
    assert all(r >= s for s, r in zip(sends, recvs))


def test_trace_on_the_cuda_backend_uses_its_events(tmp_path):
    from harness import FILES, device_env, run_verify
    path = tmp_path / "cuda.json"
    res, r = run_verify(FILES[0], "--backend", "cuda", "--steps", "2", "--trace", path,
                        env=device_env("sim"))
    assert res.returncode == 0 and r["ok"], res.stdout + res.stderr
    names = [e["name"] for e in json.load(open(path))["traceEvents"] if e["ph"] == "X"]
    assert names[:3] == ["F0", "F0", "B0"] and names.count("step") == 2
