"""Flash attention (kernels_cu/flash_attention.cu, and the NumPy reference's blocks of
queries) against the attention computed whole in float64: the (T, T) probabilities
materialized, softmax, and backward through them. On cudasim in CI, on the GPU where there
is one (the compile checks, registers and spills: test_kernels_compile.py)."""
import math

import numpy as np
import pytest
from harness import cli, device_env
from test_cuda_backend import dev, device  # noqa: F401 (fixtures: cudasim, and the GPU where there is one)

from cupygpt.backends.numpy.attention import ATT_ROWS
from cupygpt.backends.numpy.backend import NumpyBackend
from cupygpt.precision import BF16

npb = NumpyBackend()

SIZES = (8, 16, 32, 64, 96, 128)   # the fixtures' head sizes (8, 16) and every kernel's
LENGTHS = (1, 17, 64, 128, 200, 1000)  # 17, 200, 1000: not a multiple of any tile


def materialized(qkv, dy, NH):
    """(y, dqkv) in float64 through the whole (T, T) attention."""
    B, T, C3 = qkv.shape
    HS = C3 // 3 // NH
    x = qkv.astype(np.float64)
    q, k, v = (x.reshape(B, T, 3, NH, HS)[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    s = q @ k.transpose(0, 1, 3, 2) / math.sqrt(HS)
    s[..., np.triu(np.ones((T, T), bool), 1)] = -np.inf
    p = np.exp(s - s.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    y = (p @ v).transpose(0, 2, 1, 3).reshape(B, T, C3 // 3)
    do = dy.astype(np.float64).reshape(B, T, NH, HS).transpose(0, 2, 1, 3)
    dp = do @ v.transpose(0, 1, 3, 2)
    ds = p * (dp - (dp * p).sum(-1, keepdims=True)) / math.sqrt(HS)
    grads = (ds @ k, ds.transpose(0, 1, 3, 2) @ q, p.transpose(0, 1, 3, 2) @ do)
    return y, np.stack(grads, 2).transpose(0, 3, 2, 1, 4).reshape(B, T, C3)


def inputs(B, T, NH, HS, dtype, seed=0):
    """qkv (its bias in), dy."""
    rng = np.random.default_rng(seed)
    return (rng.normal(size=(B, T, 3 * NH * HS)).astype(dtype),
            rng.normal(size=(B, T, NH * HS)).astype(dtype))


def run(be, qkv, dy, NH, asarray=np.asarray, asnumpy=np.asarray):
    B, T, C3 = qkv.shape
    wide = np.float64 if qkv.dtype == np.float64 else np.float32  # the run's wide type
    y, lse = asarray(np.zeros((B, T, C3 // 3), qkv.dtype)), asarray(np.zeros((B, NH, T), wide))
    dqkv = asarray(np.full((B, T, C3), 7.0, qkv.dtype))  # every element is written
    q, d = asarray(qkv), asarray(dy)
    be.attention_forward(y, lse, q, NH)
    be.attention_backward(dqkv, d, q, y, lse, NH)
    return asnumpy(y), asnumpy(dqkv)


def error(got, want):
    """The largest difference, relative to the largest magnitude."""
    return float(np.abs(got.astype(np.float64) - want).max() / np.abs(want).max())


@pytest.mark.parametrize("T", (1, 17, 300))
def test_numpy_blocks_of_queries_equal_the_whole_attention(T):
    """T = 300: three blocks of ATT_ROWS queries, the last one short."""
    assert ATT_ROWS < 300 < 3 * ATT_ROWS
    qkv, dy = inputs(2, T, 3, 16, np.float64)
    y, dqkv = run(npb, qkv, dy, 3)
    want_y, want_d = materialized(qkv, dy, 3)
    assert error(y, want_y) < 1e-13 and error(dqkv, want_d) < 1e-13


def cases():
    for HS in SIZES:  # (T = 200: four 64-wide tiles, the last 8 rows long, on every size)
        for T in LENGTHS:
            if T < 1000 or HS >= 32:
                yield HS, T


@pytest.mark.parametrize("HS,T", list(cases()))
def test_flash_kernels_fp32_equal_the_whole_attention(dev, HS, T):
    """Exact fp32 (TF32 off, verify's arithmetic): within 1e-5 of the largest value; B * NH
    = 3, a multiple of nothing."""
    dev.cu.configure(tf32=False)
    qkv, dy = inputs(3, T, 1, HS, np.float32)
    y, dqkv = run(dev.cu, qkv, dy, 1, dev.cp.asarray, dev.cp.asnumpy)
    want_y, want_d = materialized(qkv, dy, 1)
    assert error(y, want_y) < 1e-5 and error(dqkv, want_d) < 1e-5, (error(y, want_y),
                                                                    error(dqkv, want_d))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_misaligned_views_take_the_element_wise_loads_with_the_same_bits(dev, dtype):
    """qkv, y, dy and dqkv each one element into their buffers (no 16-byte access aligned:
    the element-wise loads and stores) give the aligned run's bits, for a padded head size
    (24) and a full one (64)."""
    cp = dev.cp
    dev.cu.configure(tf32=False)

    def misaligned(a):
        buf = cp.zeros(a.size + 1, a.dtype)
        buf[1:] = cp.asarray(a.reshape(-1))
        return buf[1:].reshape(a.shape)
    for HS in (24, 64):
        args = (*inputs(2, 37, 2, HS, BF16 if dtype == "bf16" else np.float32, seed=HS), 2)
        aligned = run(dev.cu, *args, cp.asarray, cp.asnumpy)
        shifted = run(dev.cu, *args, misaligned, cp.asnumpy)
        assert all(a.tobytes() == b.tobytes() for a, b in zip(aligned, shifted)), HS


@pytest.mark.parametrize("HS,T", list(cases()))
def test_flash_kernels_bf16_are_as_close_as_the_reference(dev, HS, T):
    """bf16 on tensor cores: bf16 rounds the probabilities and their gradients on their way
    into the products, which alone puts several bf16 steps between any bf16 attention and
    the float64 one (the NumPy reference, which rounds the same values, measures that). The
    kernels are within 1.5x the reference's own distance (plus a step of the rms), and the
    output within 4 steps of each row's rms."""
    NH = 1 if T == 1000 else 3  # (one head at T = 1000: cudasim's time)
    qkv, dy = inputs(1, T, NH, HS, BF16)
    y, dqkv = run(dev.cu, qkv, dy, NH, dev.cp.asarray, dev.cp.asnumpy)
    ref_y, ref_d = run(npb, qkv, dy, NH)
    want_y, want_d = materialized(qkv, dy, NH)
    for got, ref, want, what in ((y, ref_y, want_y, "y"), (dqkv, ref_d, want_d, "dqkv")):
        step = 2.0 ** (np.floor(np.log2(np.sqrt(np.mean(want ** 2)))) - 7)
        worst = np.abs(got.astype(np.float64) - want).max()
        assert worst <= 1.5 * np.abs(ref.astype(np.float64) - want).max() + step, what
    rows = want_y.reshape(1, T, NH, HS)
    steps = 2.0 ** (np.floor(np.log2(np.sqrt(np.mean(rows ** 2, -1, keepdims=True)))) - 7)
    assert (np.abs(y.astype(np.float64).reshape(rows.shape) - rows) / steps).max() <= 4


@pytest.mark.parametrize("HS", (16, 64, 128))
def test_flash_kernels_tf32(dev, HS):
    """fp32 training's arithmetic: the products on TF32 tensor cores (10-bit mantissas)."""
    dev.cu.configure(tf32=True)
    try:
        qkv, dy = inputs(2, 70, 2, HS, np.float32)
        y, dqkv = run(dev.cu, qkv, dy, 2, dev.cp.asarray, dev.cp.asnumpy)
    finally:
        dev.cu.configure(tf32=False)
    want_y, want_d = materialized(qkv, dy, 2)
    assert error(y, want_y) < 5e-3 and error(dqkv, want_d) < 5e-3
    assert error(y, want_y) > 1e-6, "TF32 rounds its inputs: exactly fp32 means it did not run"


SMALL_OPTIN = 99 * 1024  # the per-block shared memory opt-in of sm_86, sm_89 and sm_120


def test_fp32_heads_on_a_99_kib_device_take_one_buffer_or_are_refused(dev, device, monkeypatch):
    """Where a block may have 99 KiB, fp32 heads of 65..96 (two buffers: 102,400 B, 111,616
    with FMA) build with one buffer per walked tile and still equal the whole attention;
    64 keeps two; 128 fits in neither way and is refused in a line naming the bytes,
    before CUDA fails setting the opt-in."""
    from cupygpt.backends.cuda.kernels import flash_smem_bytes
    if device != "sim":
        pytest.skip("pretends a 99 KiB device: cudasim only")
    monkeypatch.setenv("CUDASIM_SMEM_OPTIN", str(SMALL_OPTIN))
    dev.cu.configure(tf32=False)  # (the opt-in read again)
    try:
        for HS in (72, 96):
            qkv, dy = inputs(2, 70, 1, HS, np.float32, seed=HS)
            y, dqkv = run(dev.cu, qkv, dy, 1, dev.cp.asarray, dev.cp.asnumpy)
            want_y, want_d = materialized(qkv, dy, 1)
            assert error(y, want_y) < 1e-5 and error(dqkv, want_d) < 1e-5, HS
        assert dev.cu.kernels.fp32_doubled() == 64  # 96 on one buffer, 64 on two
        assert flash_smem_bytes("dq", 64, 4, True, 64) > flash_smem_bytes("dq", 64, 4, True, 0)
        why = dev.cu.attention_refuses(128, np.float32)
        assert "head size 128 needs 110,848 bytes" in why and f"allows {SMALL_OPTIN:,}" in why
        assert dev.cu.attention_refuses(128, BF16) is None
    finally:
        monkeypatch.undo()
        dev.cu.configure(tf32=False)


def test_a_head_the_gpus_shared_memory_cannot_hold_is_refused_in_a_line(device, tmp_path):
    from cupygpt.formats.llmc import write_model
    from cupygpt.model.initialize import init_params
    from cupygpt.model.shape import GPT2Config
    if device != "sim":
        pytest.skip("pretends a 99 KiB device: cudasim only")
    cfg = GPT2Config(maxT=16, V=300, Vp=320, L=1, NH=1, C=128)
    write_model(tmp_path / "model.bin", cfg, init_params(cfg, 3))
    res = cli("train", "--backend", "cuda", "-e", tmp_path / "model.bin", "-b", "1", "-t", "8",
              "-n", "1", "--dtype", "fp32", "-o", tmp_path / "out",
              env=dict(device_env(device), CUDASIM_SMEM_OPTIN=str(SMALL_OPTIN)))
    assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert "fp32 attention for head size 128 needs" in res.stderr
    assert "--backend numpy" in res.stderr and not (tmp_path / "out").exists()


@pytest.mark.parametrize("NH", (4, 1))  # head sizes 12 (not a multiple of 8) and 192
def test_a_head_size_the_kernels_lack_is_refused_before_anything_runs(device, tmp_path, NH):
    from cupygpt.formats.llmc import write_model
    from cupygpt.model.initialize import init_params
    from cupygpt.model.shape import GPT2Config
    cfg = GPT2Config(maxT=16, V=300, Vp=320, L=1, NH=NH, C=48 if NH == 4 else 192)
    write_model(tmp_path / "model.bin", cfg, init_params(cfg, 3))
    res = cli("train", "--backend", "cuda", "-e", tmp_path / "model.bin", "-b", "1", "-t", "8",
              "-n", "1", "-o", tmp_path / "out", env=device_env(device))
    hs = cfg.C // cfg.NH
    assert res.returncode == 1 and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert f"multiples of 8 up to 128; this model's is {hs}" in res.stderr
    assert "--backend numpy" in res.stderr and not (tmp_path / "out").exists()


def test_the_activations_grow_linearly_with_T():
    """No (T, T) tensor is kept: d12's planned activations at B=4, T=1024 in bf16 stay under
    1.2 GiB (3.91 GiB with the materialized attention, 1.52 with the (B, T, Vp) logits
    kept), under 1.5 GiB with the scratch (the head's chunk of logits among it), and
    T=2048 (a model of maxT 2048) needs at most 2.1x that; nothing in a layout has two T
    dimensions."""
    from dataclasses import replace

    from cupygpt.model.layout import Part, activation_layout, scratch_layout
    from cupygpt.model.shape import PRESETS
    from cupygpt.model.stage import Stage

    def activations(cfg, T):
        return Stage.sizes(cfg, batch=4, seq=T, part=Part.whole(cfg), slots=1, split=True,
                           dtype=BF16)["activations"]
    d12 = PRESETS["d12"]
    plan = Stage.sizes(d12, batch=4, seq=1024, part=Part.whole(d12), slots=1, split=False,
                       dtype=BF16)
    assert plan["activations"] <= 1.2 * 2 ** 30
    assert plan["activations"] + plan["scratch"] <= 1.5 * 2 ** 30
    assert activations(replace(d12, maxT=2048), 2048) <= 2.1 * activations(d12, 1024)
    T = 97  # a T no other dimension has
    for lay in (activation_layout(d12, 2, T, 2, True, split=True, embed=True),
                scratch_layout(d12, 2, T)):
        for shape in (*lay.narrow.shapes, *lay.wide.shapes):
            assert list(shape).count(T) <= 1, shape
