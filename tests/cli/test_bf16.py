"""bf16 mixed precision on the NumPy reference (llm.c's mainline trainer): bf16 weights,
activations and gradients, fp32 statistics, master weights and AdamW state, stochastic
rounding of the updated weights."""
import json
import types

import numpy as np
import pytest
from harness import cli, losses

from cupygpt import CupyGPTError
from cupygpt.backends.numpy.backend import NumpyBackend
from cupygpt.comm.local import Local
from cupygpt.config.configs import SampleConfig
from cupygpt.config.sections import run_dtype
from cupygpt.formats.llmc import read_model_header
from cupygpt.model.initialize import init_params
from cupygpt.model.optim import AdamWConfig
from cupygpt.model.shape import GPT2Config, preset
from cupygpt.parallel.mesh import Mesh
from cupygpt.parallel.runner import Runner
from cupygpt.parallel.settings import StepSettings
from cupygpt.precision import BF16, stochastic_round

npb = NumpyBackend()


def test_stochastic_rounding_is_unbiased_repeatable_and_sliceable():
    lo = np.float32(1.0)
    x = np.full(1 << 16, lo + np.float32(0.3 * 2 ** -7), np.float32)  # 30% of a bf16 gap
    r = stochastic_round(x, seed=7, offset=0).astype(np.float32)
    assert set(np.unique(r)) == {lo, lo + np.float32(2 ** -7)}   # one of the two neighbours
    assert np.mean(r == lo + np.float32(2 ** -7)) == pytest.approx(0.3, abs=0.01)
    assert np.array_equal(stochastic_round(x, 7, 0), stochastic_round(x, 7, 0))
    assert not np.array_equal(stochastic_round(x, 7, 0), stochastic_round(x, 8, 0))
    # a ZeRO-1 slice [a, b) rounds as the whole buffer's elements a..b do
    assert np.array_equal(stochastic_round(x[100:900], 7, 100), stochastic_round(x, 7, 0)[100:900])
    exact = np.array([1.0, -2.5, 0.0, np.inf, -np.inf], np.float32)
    assert np.array_equal(stochastic_round(exact, 3, 0).astype(np.float32), exact)
    assert np.isnan(stochastic_round(np.array([np.nan], np.float32), 3, 0).astype(np.float32))[0]


def test_an_op_rounds_its_outputs_once_from_float32():
    """matmul_forward in bf16 is the fp32 op on the same (bf16) inputs, its bias added
    before the one rounding."""
    rng = np.random.default_rng(0)
    inp, w, b = (rng.normal(size=s).astype(BF16) for s in ((2, 3, 16), (8, 16), (8,)))
    out = np.zeros((2, 3, 8), BF16)
    npb.matmul_forward(out, inp, w, b)
    ref = np.zeros((2, 3, 8), np.float32)
    npb.matmul_forward(ref, inp.astype(np.float32), w.astype(np.float32), b.astype(np.float32))
    assert np.array_equal(out, ref.astype(BF16))
    assert not np.array_equal(out, (ref - b.astype(np.float32)).astype(BF16) + b)
    # an accumulating output reads its bf16 value, adds in fp32, rounds once
    dw = rng.normal(size=(8, 16)).astype(BF16)
    ref = dw.astype(np.float32)
    npb.matmul_backward_weight(dw, None, out, inp)
    npb.matmul_backward_weight(ref, None, out.astype(np.float32), inp.astype(np.float32))
    assert np.array_equal(dw, ref.astype(BF16))


D12_SHAPED = GPT2Config(maxT=64, V=500, Vp=512, L=2, NH=12, C=768)  # d12's widths, 2 layers


def runner(dtype, shape=None):
    shape = shape or preset("tiny")
    run = Runner(shape=shape, be=npb, transport=Local(), mesh=Mesh(),
                 settings=StepSettings(batch=2, seq=32, dtype=dtype,
                                       adamw=AdamWConfig(lr=1e-3, grad_clip=1.0)))
    run.load_state_dict(init_params(shape, 1))
    return run


@pytest.mark.parametrize("shape", [None, D12_SHAPED], ids=["tiny", "d12-shaped"])
def test_bf16_tracks_fp32_for_twenty_steps(shape):
    xy = np.random.default_rng(0).integers(0, (shape or preset("tiny")).V,
                                           (2, 33)).astype(np.int32)
    out = {}
    for dtype in (np.float32, BF16):
        run = runner(dtype, shape)
        out[dtype] = [run.step(xy[:, :-1], xy[:, 1:]) for _ in range(20)]
        st = run.stages[0]
        assert st.params.dtype == st.grads.dtype == st.acts_bufs[0].dtype == np.dtype(dtype)
        assert st.acts[0]["ln1_mean"].dtype == run.opt.state[0]["m"].dtype == np.float32
    a, b = np.array(out[np.float32]), np.array(out[BF16])
    assert a[-1] < a[0] - 1.5  # (it learns)
    # measured: tiny 1.9e-3 absolute (1.8e-4 of the loss), d12-shaped 4.3e-3 (6.8e-4)
    assert np.abs(b - a).max() <= 3e-3 * a.max()
    master = run.opt.state[0]["master"]
    assert master.dtype == np.float32
    # the weights are the master weights rounded to one of their two bf16 neighbours
    gap = np.abs(master - st.params.astype(np.float32))
    assert gap.max() <= 2 ** -7 * np.abs(master).max() and gap.max() > 0


def test_bf16_on_a_grid_tracks_one_process(tmp_path):
    """20 bf16 steps on dp 2 x tp 2 x pp 2 (zbv, ZeRO-1) over MPI track the one bf16 process
    and the one fp32 process (the tied sum, the tp and dp sums round in other places)."""
    flags = ["-e", "tiny", "-b", "4", "-t", "32", "-n", "20", "-v", "0", "-g", "0"]
    fp32 = cli("train", *flags, "--dtype", "fp32", "-o", tmp_path / "fp32")
    alone = cli("train", *flags, "--dtype", "bf16", "-o", tmp_path / "one")
    grid = cli("train", *flags, "--dtype", "bf16", "--dp", "2", "--tp", "2", "--pp", "2",
               "--schedule", "zbv", "--zero", "1", "--micro-batches", "2",
               "-o", tmp_path / "grid", ranks=8)
    assert all(r.returncode == 0 for r in (fp32, alone, grid)), grid.stderr
    assert "| dtype                   | bf16 (fp32 master weights" in alone.stdout
    a, b, c = (np.array(losses(r.stdout)) for r in (fp32, alone, grid))
    assert len(c) == 20 and a[-1] < a[0] - 1.0
    assert np.abs(c - b).max() <= 5e-4 * a.max()  # measured: 7.3e-5 of the largest loss
    assert np.abs(c - a).max() <= 5e-4 * a.max()  # measured: 7.6e-5
    assert read_model_header(str(tmp_path / "grid" / "model.bin"))[1] == 5  # llm.c's bf16
    res = cli("sample", "--model", tmp_path / "grid" / "model.bin", "--dtype", "bf16",
              "--max-new-tokens", "4")
    assert res.returncode == 0, res.stderr


def test_a_dtype_the_backend_lacks_is_one_line():
    cuda_like = types.SimpleNamespace(name="cuda", DTYPES=(np.float32,), DEFAULT_DTYPE="fp32")
    with pytest.raises(CupyGPTError) as e:
        run_dtype(SampleConfig(model="m", tokenizer="t", dtype="bf16"), cuda_like)
    assert str(e.value) == "dtype bf16: the cuda backend runs in fp32"
    assert run_dtype(SampleConfig(model="m", tokenizer="t"), npb).dtype == "fp32"
    res = cli("train", "--dtype", "fp16")
    assert res.returncode == 2 and "'fp16' is not one of 'fp32', 'bf16'" in res.stderr


def test_bench_puts_bf16_beside_fp32(tmp_path):
    res = cli("bench", "--dtype", "both", "--steps", "1", "--warmup", "0", "--out",
              tmp_path / "b.json")
    assert res.returncode == 0, res.stderr
    r = json.loads((tmp_path / "b.json").read_text())
    assert (r["fp32"]["dtype"], r["bf16"]["dtype"]) == ("fp32", "bf16")
    assert r["bf16_speedup"] == pytest.approx(r["fp32"]["ms_per_step_median"]
                                              / r["bf16"]["ms_per_step_median"])
    # bf16 plans half the bytes for parameters, gradients and activations
    p32, p16 = r["fp32"]["planned_memory_bytes"], r["bf16"]["planned_memory_bytes"]
    assert p16["params"] * 2 == p32["params"] and p16["activations"] < 0.6 * p32["activations"]
    assert p16["optimizer"] == 1.5 * p32["optimizer"]  # m, v and the fp32 master weights
    assert "bf16 is " in res.stdout


def test_every_op_in_bf16_is_fp32_rounded():
    """Each op on bf16 inputs against the same op in fp32 on the same (bf16-exact) inputs:
    within one rounding (2^-8 relative, and of the output's rms for sums that cancel), the
    attention, which rounds its probabilities to bf16 on the way, within 2^-6."""
    rng = np.random.default_rng(2)
    B, T, C, NH = 2, 16, 64, 4

    def inputs(*shapes):
        return [rng.normal(size=s).astype(BF16) for s in shapes]

    def both(fn, outs, ins, bound=2 ** -8):
        got = [np.zeros(s, BF16) for s in outs]
        want = [np.zeros(s, np.float32) for s in outs]
        fn(*got, *ins)
        fn(*want, *(x.astype(np.float32) for x in ins))
        for g, w in zip(got, want):
            rms = float(np.sqrt(np.mean(w ** 2)))
            np.testing.assert_allclose(g.astype(np.float32), w, rtol=bound, atol=bound * rms,
                                       err_msg=fn.__name__)

    x, w, qb = inputs((B, T, C), (3 * C, C), (3 * C,))
    both(npb.matmul_forward, [(B, T, 3 * C)], [x, w, qb])
    both(npb.gelu_forward, [(B, T, C)], [x])
    both(npb.gelu_backward, [(B, T, C)], inputs((B, T, C), (B, T, C)))
    both(npb.residual_forward, [(B, T, C)], inputs((B, T, C), (B, T, C)))
    both(npb.matmul_backward_input, [(B, T, C)], inputs((B, T, 3 * C), (3 * C, C)))
    both(lambda out, inp, g, bb: npb.layernorm_forward(out, np.zeros((B, T), np.float32),
                                                       np.zeros((B, T), np.float32), inp, g,
                                                       bb),
         [(B, T, C)], inputs((B, T, C), (C,), (C,)))
    both(lambda out, qkv: npb.attention_forward(out, np.zeros((B, NH, T), np.float32), qkv, NH),
         [(B, T, C)], inputs((B, T, 3 * C)), 2 ** -6)


def test_a_bf16_checkpoint_without_its_master_weights_is_refused(tmp_path):
    flags = ["-e", "tiny", "-b", "2", "-t", "32", "-v", "0", "-g", "0", "--dtype", "bf16"]
    res = cli("train", *flags, "-n", "2", "--checkpoint-every", "2", "-o", tmp_path)
    assert res.returncode == 0, res.stderr
    state = tmp_path / "ckpt_00000002" / "adamw.npz"
    with np.load(state) as z:
        kept = {k: z[k] for k in z.files if k != "master"}
    np.savez(state, **kept)
    res = cli("train", *flags, "-n", "4", "--resume", tmp_path, "-o", tmp_path / "again")
    assert res.returncode == 1 and "AdamW's m, v and master are not float32 arrays" in \
        res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
