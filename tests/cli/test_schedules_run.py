"""The bubble-shrinking schedules, run: a split backward adds exactly what the fused one
adds; interleaved, zb1p and zbv pass verify through 1 to 4 stages (on llm.c's files where
they have the layers, else on a float64 single-process state of an 8-layer model), alone
and inside a grid; zb1p trains to 1f1b's bits."""
import json
import os

import numpy as np
import pytest
from harness import FILES, cli, fixture, mpiexec
from test_verify import verify_numpy

needs_mpi = pytest.mark.skipif(mpiexec() is None and not os.environ.get("CI"),
                               reason="needs mpiexec (pip install mpich)")
TINY, ODD = FILES[0], FILES[1]


def test_split_backward_adds_what_the_fused_one_adds():
    """bwd_input on every micro-batch, then bwd_weight on each: the fused backward's bits,
    parameter gradients and the input gradient alike."""
    from cupygpt.backends.numpy.backend import NumpyBackend
    be = NumpyBackend()
    from cupygpt.formats.llmc import read_model
    from cupygpt.model.layout import Part
    from cupygpt.model.stage import Stage
    cfg, params = read_model(fixture("tiny_model.bin"))
    B, T, M = 2, 16, 3
    rng = np.random.default_rng(0)
    x, y = (rng.integers(0, cfg.V, (M, B, T)).astype(np.int32) for _ in range(2))
    for part in (Part.whole(cfg), Part(0, cfg.L, False, True)):  # + a head-only one
        got = []
        for split in (False, True):
            st = Stage(cfg, be, batch=B, seq=T, part=part, slots=M, split=split)
            st.load(params)
            st.zero_grad()
            dio = []
            for mb in range(M):
                st.forward(mb, x[mb] if part.embed else None, y[mb], 1.0 / (M * B * T))
            for mb in range(M):
                if split:
                    st.backward_input(mb)
                else:
                    st.backward(mb, x[mb] if part.embed else None)
                dio.append(st.grad_io().copy())
            for mb in range(M if split else 0):
                st.backward_weight(mb, x[mb] if part.embed else None)
            got.append((st.grads.copy(), np.stack(dio)))
        assert np.abs(got[0][0]).max() > 0
        assert np.array_equal(got[0][0], got[1][0]) and np.array_equal(got[0][1], got[1][1])


SCHEDULES = {"interleaved": ["--schedule", "interleaved", "--virtual-stages", "2"],
             "zb1p": ["--schedule", "zb1p"], "zbv": ["--schedule", "zbv"]}


@pytest.mark.parametrize("name", SCHEDULES)
def test_one_process_runs_every_schedule_on_llmc_state(name):
    """One rank holding both chunks (interleaved, zbv: every handoff local, the tied wte
    summed on the rank) or splitting its backward (zb1p)."""
    res, r = verify_numpy(TINY, *SCHEDULES[name], "--micro-batches", "2")
    assert res.returncode == 0 and r["ok"], res.stdout + res.stderr
    assert len(r["grads"]) == 16 and all(s["ok"] for s in r["steps"])


@pytest.fixture(scope="module")
def deep(tmp_path_factory):
    """8 layers (interleaved V=2 and zbv on 4 stages need 8 chunks), 4 heads, a vocab of
    301 padded to 320; B=12 splits into 2, 3, 4 or 6 micro-batches. Its reference: the
    single process's float64 state."""
    from statefile import make_state64

    from cupygpt.formats.llmc import read_shard, write_model, write_shard
    from cupygpt.model.initialize import init_params
    from cupygpt.model.shape import GPT2Config
    d = tmp_path_factory.mktemp("deep")
    cfg = GPT2Config(maxT=16, V=301, Vp=320, L=8, NH=4, C=32)
    write_model(d / "model.bin", cfg, init_params(cfg, 11))
    toks = read_shard(os.path.join(os.path.dirname(fixture("x")), "..", "data",
                                   "tiny_shakespeare_val.bin"))
    write_shard(d / "tokens.bin", toks[:4000] % cfg.V)  # the shipped text, in its vocab
    return make_state64(d / "model.bin", d, 12, 8)


@needs_mpi
@pytest.mark.mpi
@pytest.mark.parametrize("files,ranks,grid", [
    (TINY, 2, SCHEDULES["zb1p"] + ["--micro-batches", "4"]),
    (ODD, 3, SCHEDULES["zb1p"] + ["--micro-batches", "3"]),
    ("deep", 2, SCHEDULES["interleaved"] + ["--micro-batches", "4"]),
    ("deep", 3, SCHEDULES["interleaved"] + ["--micro-batches", "6"]),
    ("deep", 4, SCHEDULES["interleaved"] + ["--micro-batches", "4"]),
    ("deep", 2, SCHEDULES["zbv"] + ["--micro-batches", "4"]),
    ("deep", 3, SCHEDULES["zbv"] + ["--micro-batches", "6"]),
    ("deep", 4, SCHEDULES["zbv"] + ["--micro-batches", "4"]),
    ("deep", 4, SCHEDULES["zb1p"] + ["--micro-batches", "6"]),
    ("deep", 4, SCHEDULES["zbv"] + ["--dp", "2", "--micro-batches", "2"]),
    ("deep", 4, SCHEDULES["interleaved"] + ["--tp", "2", "--micro-batches", "2"]),
    ("deep", 8, SCHEDULES["zb1p"] + ["--dp", "2", "--tp", "2", "--micro-batches", "3",
                                     "--zero", "1"]),
], ids=lambda v: v if isinstance(v, str) else None)
def test_pipelines_verify(deep, files, ranks, grid):
    res, r = verify_numpy(deep if files == "deep" else files, *grid, ranks=ranks)
    assert res.returncode == 0 and r["ok"] and r["ranks"] == ranks, res.stdout + res.stderr
    assert len(r["grads"]) == 16 and all(s["ok"] for s in r["steps"])


@needs_mpi
@pytest.mark.mpi
def test_zb1p_trains_to_1f1b_bits_and_traces_w(deep, tmp_path):
    """The same arithmetic in the same order of accumulation (each W right where its
    micro-batch's turn comes): zb1p's losses are 1f1b's, bit for bit; its trace shows the
    W passes and says which schedule ran."""
    model = deep[0]
    tokens = model.parent / "tokens.bin"
    runs = {}
    for name in ("1f1b", "zb1p"):
        out = tmp_path / name
        res = cli("train", "-e", model, "-i", tokens, "-j", tokens, "-b", "4", "-t", "8",
                  "-n", "3", "-v", "0", "-g", "0", "-o", out, "--schedule", name,
                  "--micro-batches", "4", "--trace", tmp_path / f"{name}.json", ranks=2)
        assert res.returncode == 0, res.stdout + res.stderr
        runs[name] = [r["train_loss"] for r in map(json.loads, open(out / "log.jsonl"))
                      if "train_loss" in r]
    assert len(runs["zb1p"]) == 3 and runs["zb1p"] == runs["1f1b"]
    trace = json.loads((tmp_path / "zb1p.json").read_text())
    assert trace["pipeline"] == {"schedule": "zb1p", "stages": 2, "micro_batches": 4,
                                 "virtual_stages": 1}
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {f"{k}{i}" for k in "FBW" for i in range(4)} <= names
