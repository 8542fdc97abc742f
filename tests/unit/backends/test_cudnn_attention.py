"""cuDNN's fused attention (--attention, backends/cuda/cudnn.py) on cudasim's cudnn
stand-in (tests/support/cudasim/cudnn; CUDASIM_CUDNN=1: the frontend and the library installed)
and, where one is installed, on a GPU: verify on every reference and on heads of 16 with
an odd T in both attentions, graph replay, the refusals, auto's fallback and bench's side
by side. The stand-in's own strictness: test_cudasim.py."""
import json

import numpy as np
import pytest
from harness import DEVICES, FILES, cli, device_env, fixture, requires_sim, run_verify

ATTENTIONS = ("own", "cudnn")


@pytest.fixture(scope="module", params=DEVICES)
def device(request):
    return request.param


def env(device, attention="cudnn", cudnn="1"):
    """device's environment; on a GPU, the cudnn path skips where cuDNN is missing."""
    if device != "sim":
        if attention == "cudnn":
            try:
                import cudnn
                cudnn.backend_version()
            except Exception as e:
                pytest.skip(f"cuDNN's frontend or library is not installed here: {e!r}")
        return {}
    return {**device_env(device), "CUDASIM_CUDNN": cudnn}


@pytest.mark.parametrize("files", FILES, ids=[f[0] for f in FILES])
def test_verify_bf16_through_cudnn(device, files):
    """Every reference in bf16 through cuDNN's attention (the own kernels':
    test_cuda.test_verify_bf16_cuda, which asks --attention own)."""
    res, r = run_verify(files, "--backend", "cuda", "--dtype", "bf16", "--attention",
                        "cudnn", env=env(device))
    assert res.returncode == 0 and r["ok"] and r["backend"] == "cuda-bf16", res.stdout
    assert r["attention"] == "cuDNN fused sdpa (as asked)"


@pytest.fixture(scope="module")
def heads16(tmp_path_factory):
    """A model with heads of 16 (3 of them) and a float64 state at T = 37 (no multiple of
    64, nor of 16)."""
    from statefile import make_state64

    from cupygpt.formats.llmc import write_model
    from cupygpt.model.initialize import init_params
    from cupygpt.model.shape import GPT2Config
    d = tmp_path_factory.mktemp("heads16")
    cfg = GPT2Config(maxT=40, V=301, Vp=320, L=2, NH=3, C=48)
    write_model(d / "model.bin", cfg, init_params(cfg, 5))
    return make_state64(d / "model.bin", d, 2, 37)


def test_heads_of_16_at_an_odd_t_verify_in_either_attention(device, heads16):
    got = {}
    for attention in ATTENTIONS:
        res, got[attention] = run_verify(heads16, "--backend", "cuda", "--dtype", "bf16",
                                         "--attention", attention, env=env(device, attention))
        assert res.returncode == 0 and got[attention]["ok"], res.stdout + res.stderr
    # each path ran as asked (what ran names itself; the losses cannot tell them apart:
    # on an H100 both gave the same loss bits here, their bf16 outputs agreeing)
    assert got["own"]["attention"].startswith("own") and got["cudnn"]["attention"].startswith(
        "cuDNN")


SIM_ONLY = requires_sim  # (cudasim's installed states: CUDASIM_CUDNN)


@SIM_ONLY
@pytest.mark.parametrize("cudnn,extra,said", [
    ("", [], "the cuDNN library is not installed"),
    ("absent", [], "cuDNN's frontend is not installed"),
    ("1", ["--dtype", "fp32"], "runs bf16 only"),
    ("1", ["--backend", "numpy"], "the numpy backend has no cuDNN"),
])
def test_attention_cudnn_where_it_cannot_run_is_one_line(tmp_path, cudnn, extra, said):
    """Refused before anything is allocated: the run's directory is not even made."""
    res = cli("train", "--backend", "cuda", "-e", "tiny", "-b", "2", "-t", "16", "-n", "1",
              "--dtype", "bf16", "--attention", "cudnn", *extra, "-o", tmp_path / "out",
              env={**device_env("sim"), "CUDASIM_CUDNN": cudnn})
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1, res.stderr
    assert lines[0].startswith("error: --attention cudnn: ") and said in lines[0]
    assert "--attention auto" in lines[0] and not (tmp_path / "out").exists()


@SIM_ONLY
def test_cudnn_refuses_head_sizes_its_sdpa_does_not_run(monkeypatch):
    from harness import load_cudasim

    from cupygpt.precision import BF16
    cu = load_cudasim()[1]
    monkeypatch.setenv("CUDASIM_CUDNN", "1")
    assert "bf16 only" in cu.fused_attention_refuses(np.dtype("float32"), 64)
    assert cu.fused_attention_refuses(BF16, 64) is None
    for hs in (12, 136, 256):
        assert "multiples of 8 up to 128" in cu.fused_attention_refuses(BF16, hs)


@SIM_ONLY
@pytest.mark.parametrize("cudnn,dtype,said", [
    ("", "bf16", "own flash kernels (auto: the cuDNN library is not installed"),
    ("1", "fp32", "own flash kernels (auto: cuDNN's fused attention runs bf16 only"),
    ("1", "bf16", "cuDNN fused sdpa (auto)"),
])
def test_auto_takes_cudnn_where_it_runs_and_says_why_not(tmp_path, cudnn, dtype, said):
    res = cli("train", "--backend", "cuda", "-e", "tiny", "-b", "2", "-t", "16", "-n", "1",
              "-v", "0", "-g", "0", "--dtype", dtype, "-o", tmp_path / "out",
              env={**device_env("sim"), "CUDASIM_CUDNN": cudnn})
    assert res.returncode == 0, res.stderr
    row = next(line for line in res.stdout.splitlines() if line.startswith("| attention"))
    assert said in row


def test_bench_attention_both_side_by_side(device, tmp_path):
    out = tmp_path / "b.json"
    res = cli("bench", "--backend", "cuda", "-e", "tiny", "-b", "2", "-t", "32", "--steps",
              "1", "--warmup", "1", "--dtype", "bf16", "--profile", "--attention", "both",
              "--out", out, env=env(device))
    assert res.returncode == 0, res.stderr
    r = json.loads(out.read_text())
    assert r["cudnn"]["attention"].startswith("cuDNN") and r["own"]["attention"].startswith(
        "own") and r["cudnn_speedup"] > 0
    assert "attention side by side: cudnn " in res.stdout
    kernels = {k: {row["kernel"] for row in r[k]["per_kernel"]} for k in ("cudnn", "own")}
    assert {"cudnn_sdpa_forward", "cudnn_sdpa_backward"} <= kernels["cudnn"]
    assert not any(k.startswith("cudnn") for k in kernels["own"])
    assert "cudnn attention_backward: cudnn_sdpa_backward" in res.stdout
    assert "own   attention_forward: flash_forward_32" in res.stdout
    ws = {k: r[k]["planned_memory_bytes"]["workspace"] for k in ("cudnn", "own")}
    if device == "sim":  # the stand-in's backward asks a float dQ and a float per row
        assert ws["cudnn"] - ws["own"] == 4 * 2 * 4 * 32 * (32 + 1)


@SIM_ONLY
@pytest.mark.parametrize("command", [["verify"], ["sample", "--model",
                                                   fixture("tiny_model.bin")]])
def test_attention_both_is_benchs_alone(command):
    res = cli(*command, "--backend", "cuda", "--attention", "both", env=device_env("sim"))
    assert res.returncode == 1 and "error: --attention both: " in res.stderr, res.stderr


@SIM_ONLY
def test_a_head_size_cudnn_does_not_run_is_attentions_line(tmp_path):
    """Heads of 136 (a multiple of 8 past 128): --attention cudnn says cuDNN's limit, from
    the model file's header alone, before anything is read or allocated."""
    from cupygpt.formats.llmc import write_model
    from cupygpt.model.initialize import init_params
    from cupygpt.model.shape import GPT2Config
    cfg = GPT2Config(maxT=8, V=50, Vp=64, L=1, NH=1, C=136)
    write_model(tmp_path / "m.bin", cfg, init_params(cfg, 1))
    res = cli("sample", "--backend", "cuda", "--dtype", "bf16", "--attention", "cudnn",
              "--model", tmp_path / "m.bin", env=env("sim"))
    assert res.returncode == 1 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith("error: --attention cudnn: cuDNN's sdpa runs head sizes "
                                 "(C/NH) that are multiples of 8 up to 128; this model's is 136")


@SIM_ONLY
@pytest.mark.parametrize("C", [12, 136])
def test_cudnns_refusal_of_a_head_size_the_own_kernels_refuse_too_advises_numpy(tmp_path, C):
    """Heads of 12 (not a multiple of 8) or 136 (past 128): neither attention on cuda runs
    them, so the advice is the numpy backend, not --attention auto or own (refused too)."""
    from cupygpt.formats.llmc import write_model
    from cupygpt.model.initialize import init_params
    from cupygpt.model.shape import GPT2Config
    cfg = GPT2Config(maxT=8, V=50, Vp=64, L=1, NH=1, C=C)
    write_model(tmp_path / "m.bin", cfg, init_params(cfg, 1))
    res = cli("sample", "--backend", "cuda", "--dtype", "bf16", "--attention", "cudnn",
              "--model", tmp_path / "m.bin", env=env("sim"))
    assert res.returncode == 1 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith("error: --attention cudnn: cuDNN's sdpa runs head sizes")
    assert res.stderr.rstrip().endswith("; use --backend numpy for this model (the own "
                                        "kernels do not run its head size either)")


def test_bench_attention_both_refused_names_both_as_given(tmp_path):
    """bench --attention both asks cuDNN too: its refusal names the value the user gave."""
    res = cli("bench", "-e", "tiny", "-b", "2", "-t", "32", "--steps", "1", "--warmup", "0",
              "--backend", "numpy", "--attention", "both", "--out", tmp_path / "b.json")
    assert res.returncode == 1 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith("error: --attention both: the numpy backend has no cuDNN")
    assert not (tmp_path / "b.json").exists()


@SIM_ONLY
def test_tensor_parallel_shards_take_cudnn_on_their_heads():
    """--tp 2: each rank's graphs are over its 8 of the 16 heads, in its shard's packed qkv
    (and the graphs' workspace is in each rank's plan)."""
    res, r = run_verify(FILES[1], "--backend", "cuda", "--dtype", "bf16", "--attention",
                        "cudnn", "--tp", "2", ranks=2, env=env("sim"))
    assert res.returncode == 0 and r["ok"] and r["ranks"] == 2, res.stdout + res.stderr
    assert r["attention"].startswith("cuDNN")


@SIM_ONLY
@pytest.mark.parametrize("cudnn,seq,said", [
    ("1", "1", "s_q = s_kv = 1 is not supported"),
    ("unsupported", "16", "CUDASIM_CUDNN=unsupported"),
])
def test_a_shape_cudnns_checks_refuse_is_autos_fallback_and_cudnns_line(tmp_path, cudnn,
                                                                        seq, said):
    """cuDNN's own verdict on the run's graphs (a backward of one position, which its
    validator refuses; a library finding no plan): auto trains on the own kernels, saying
    why in the run table; --attention cudnn refuses in one line, no traceback, the run's
    directory taken back."""
    args = ("train", "--backend", "cuda", "-e", "tiny", "-b", "2", "-t", seq, "-n", "1",
            "-v", "0", "-g", "0", "--dtype", "bf16")
    e = {**device_env("sim"), "CUDASIM_CUDNN": cudnn}
    auto = cli(*args, "-o", tmp_path / "a", env=e)
    assert auto.returncode == 0, auto.stderr
    row = next(line for line in auto.stdout.splitlines() if line.startswith("| attention"))
    assert "own flash kernels (auto: cuDNN does not run this run's attention" in row, row
    assert said in row
    res = cli(*args, "--attention", "cudnn", "-o", tmp_path / "c", env=e)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1, res.stderr
    assert lines[0].startswith("error: --attention cudnn: cuDNN does not run this run's "
                               "attention") and said in lines[0]
    assert "--attention auto" in lines[0] and not (tmp_path / "c").exists()


@pytest.fixture()
def sim_cudnn(monkeypatch):
    """The cuda backend on cudasim, its cuDNN stand-in told the library is installed, and
    the backend's cudnn module (its graphs are the backend's sdpa)."""
    from harness import cudasim_module, load_cudasim
    monkeypatch.setenv("CUDASIM_CUDNN", "1")
    cp, cu = load_cudasim()
    cu.configure()
    return cp, cu, cudasim_module(cu, "cudnn")


@SIM_ONLY
@pytest.mark.parametrize("trains,graphs", [(False, False), (True, False), (True, True)])
def test_a_run_builds_the_graphs_it_needs_as_it_runs_them(sim_cudnn, trains, graphs):
    """The memory plan builds the forward graph alone for a run that does not train
    (sample, eval), the backward too for one that does, deterministic; replay is hinted
    only to a run that captures its step; the mask is 1.32's preferred args; one cuDNN
    workspace, the most the shape's graphs ask, is what the plan counts and what the
    first forward allocates."""
    from cupygpt.comm.local import Local
    from cupygpt.model.optim import AdamWConfig
    from cupygpt.model.shape import preset
    from cupygpt.parallel.mesh import Mesh
    from cupygpt.parallel.runner import Runner
    from cupygpt.parallel.settings import StepSettings
    from cupygpt.precision import BF16
    cp, cu, att = sim_cudnn
    from cupygpt.model.layout import stage_shape
    lib, shape = att.cudnn, preset("tiny")
    run = Runner(shape=shape, be=cu, transport=Local(), mesh=Mesh(),
                 settings=StepSettings(batch=2, seq=16, dtype=BF16, graphs=graphs,
                                       adamw=AdamWConfig(lr=1e-4) if trains else None,
                                       attention="cudnn"))
    built = {k[0]: g for k, (g, _, _) in cu.sdpa.graphs.items() if k[1:] == (2, 4, 16, 32)}
    assert set(built) == ({"forward", "backward"} if trains else {"forward"})
    for g in built.values():
        assert g._replay is graphs and "use_causal_mask" not in g._node[2]
        assert g._node[2]["diagonal_band_right_bound"] == 0
        assert g._node[2]["diagonal_alignment"] == lib.diagonal_alignment.TOP_LEFT
    if trains:
        assert built["backward"]._deterministic is True
    asks = [g.get_workspace_size() for g in built.values()]
    assert cu.sdpa.workspace_bytes(2, 4, 16, 32) == max(asks)
    assert run.memory["workspace"] - cu.workspace_bytes(stage_shape(shape, 2, 16,
                                                                    run.plan.parts[0]),
                                                        np.float32) == max(asks)
    qkv = cp.zeros((2, 16, 3 * 128), BF16)
    cu.attention_forward(cp.zeros((2, 16, 128), BF16), cp.zeros((2, 4, 16)), qkv, 4)
    assert cu.workspaces["cudnn", np.dtype(np.uint8)].size == max(asks)


@SIM_ONLY
def test_the_graph_cache_keeps_the_last_few_and_what_a_capture_runs(sim_cudnn):
    """A process meeting many shapes keeps CACHED graphs, the least recently used going,
    but never one a captured step executes (its replay runs that plan's kernels)."""
    from cupygpt.precision import BF16
    cp, cu, att = sim_cudnn
    cu.use_attention("cudnn")
    cu.sdpa.graphs.clear()
    out, lse, qkv = cp.zeros((1, 8, 16), BF16), cp.zeros((1, 2, 8)), cp.zeros((1, 8, 48), BF16)
    cu.attention_forward(out, lse, qkv, 2)
    graph = cu.capture(lambda: cu.attention_forward(out, lse, qkv, 2))
    last = 9 + att.CACHED + 3
    for T in range(9, last):
        cu.sdpa.plan(1, 2, T, 8, False, False)
    # the captured one (used least recently) and the newest CACHED - 1
    assert list(cu.sdpa.graphs) == [("forward", 1, 2, 8, 8)] + [
        ("forward", 1, 2, T, 8) for T in range(last - att.CACHED + 1, last)]
    cu.replay(graph)
