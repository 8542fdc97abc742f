"""Every NumPy op's backward against central finite differences, in float64."""
import numpy as np
import pytest

from cupygpt.backends.numpy.backend import NumpyBackend

be = NumpyBackend()

rng = np.random.default_rng(0)
B, T, C, NH, OC = 2, 5, 8, 2, 6


def numgrad(f, x, eps=1e-6):
    g = np.zeros_like(x)
    flat, gf = x.reshape(-1), g.reshape(-1)
    for i in range(flat.size):
        old = flat[i]
        flat[i] = old + eps
        fp = f()
        flat[i] = old - eps
        fm = f()
        flat[i] = old
        gf[i] = (fp - fm) / (2 * eps)
    return g


def r(*shape):
    return rng.normal(size=shape)


def close(a, b):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-8)


def test_encoder():
    wte, wpe, inp = r(10, C), r(T + 2, C), rng.integers(0, 10, (B, T)).astype(np.int32)
    inp[0, 0] = inp[1, 0]  # a repeated token must accumulate
    out, w = np.empty((B, T, C)), r(B, T, C)
    f = lambda: (be.encoder_forward(out, inp, wte, wpe), (out * w).sum())[1]  # noqa: E731
    dwte, dwpe = np.zeros_like(wte), np.zeros_like(wpe)
    be.encoder_backward(dwte, dwpe, w, inp)
    close(dwte, numgrad(f, wte))
    close(dwpe, numgrad(f, wpe))


def test_layernorm():
    inp, wt, b, w = r(B, T, C), r(C), r(C), r(B, T, C)
    out, mean, rstd = np.empty((B, T, C)), np.empty((B, T)), np.empty((B, T))
    f = lambda: (be.layernorm_forward(out, mean, rstd, inp, wt, b), (out * w).sum())[1]  # noqa: E731
    f()
    dinp, dw, db = np.ones_like(inp), np.zeros(C), np.zeros(C)  # dinp accumulates onto 1
    be.layernorm_backward(dinp, dw, db, w, inp, wt, mean, rstd)
    close(dinp - 1, numgrad(f, inp))
    close(dw, numgrad(f, wt))
    close(db, numgrad(f, b))


@pytest.mark.parametrize("bias", [True, False])
def test_matmul(bias):
    """With bias: the product's bias (added by the matmul) and its gradient."""
    inp, wt, b, w = r(B, T, C), r(OC, C), r(OC) if bias else None, r(B, T, OC)
    out = np.empty((B, T, OC))
    f = lambda: (be.matmul_forward(out, inp, wt, b), (out * w).sum())[1]  # noqa: E731
    dinp, dw = np.full_like(inp, 7.0), np.zeros_like(wt)  # dinp is overwritten
    db = np.zeros(OC) if bias else None
    be.matmul_backward_input(dinp, w, wt)
    be.matmul_backward_weight(dw, db, w, inp)
    close(dinp, numgrad(f, inp))
    close(dw, numgrad(f, wt))
    if bias:
        close(db, numgrad(f, b))


def test_attention():
    qkv, w = r(B, T, 3 * C), r(B, T, C)
    out, lse = np.empty((B, T, C)), np.empty((B, NH, T))
    f = lambda: (be.attention_forward(out, lse, qkv, NH), (out * w).sum())[1]  # noqa
    f()
    first = out.copy()
    qkv[:, -1] += 1.0  # the last position's q, k, v: no earlier output may move (causal)
    f()
    np.testing.assert_array_equal(out[:, :-1], first[:, :-1])
    assert not np.allclose(out[:, -1], first[:, -1])
    dqkv = np.full_like(qkv, 7.0)  # overwritten
    be.attention_backward(dqkv, w, qkv, out, lse, NH)
    close(dqkv, numgrad(f, qkv))


def test_gelu():
    inp, w, out = r(B, T, C) * 2, r(B, T, C), np.empty((B, T, C))
    f = lambda: (be.gelu_forward(out, inp), (out * w).sum())[1]  # noqa: E731
    dinp = np.empty_like(inp)
    be.gelu_backward(dinp, inp, w)
    close(dinp, numgrad(f, inp))


def cross_entropy(logits, losses, tgt, V, dloss=None, shards=((0, None),)):
    """The model's vocab-parallel cross-entropy in one process: each shard (v0, rows) of
    the logits' columns makes its stats, every shard combines the stacked stats."""
    Vp = logits.shape[-1]
    parts = [(v0, logits[..., v0:v0 + (rows or Vp)]) for v0, rows in shards]
    parts = [(v0, p.copy(), max(0, min(p.shape[-1], V - v0))) for v0, p in parts]
    stats = np.empty((len(parts), B, T, 3))
    for k, (v0, p, valid) in enumerate(parts):
        be.classifier_stats(stats[k], p, tgt, v0, valid)
    for v0, p, valid in parts:
        be.classifier(p, losses, stats, tgt, v0, valid, dloss)
    if dloss is not None:
        logits[...] = np.concatenate([p for _, p, _ in parts], -1)


def test_classifier_ignores_padding():
    V, Vp = 7, 9
    logits, tgt = r(B, T, Vp), rng.integers(0, V, (B, T)).astype(np.int32)
    losses = np.empty((B, T))
    f = lambda: (cross_entropy(logits, losses, tgt, V), losses.sum())[1]  # noqa: E731
    expect = numgrad(f, logits)
    assert np.all(expect[..., V:] == 0), "padding logits must not affect the loss"
    lg = logits.copy()
    cross_entropy(lg, losses, tgt, V, dloss=1.0)
    close(lg, expect)
    full = logits[..., :V]
    logp = full - np.log(np.exp(full).sum(-1, keepdims=True))
    ref = -np.take_along_axis(logp, tgt[..., None], -1)
    close(losses, ref[..., 0])


@pytest.mark.parametrize("shards", [((0, 3), (3, 3), (6, 3)), ((0, 5), (5, 4)),
                                    ((0, 4), (4, 3), (7, 2))])
def test_vocab_parallel_cross_entropy_and_embedding_equal_the_whole(shards):
    """Shards of the vocab (the last one holding only padding in one case) give the whole
    vocab's losses and dlogits, and their embeddings sum to the whole one's."""
    V, Vp = 7, 9
    logits, tgt = r(B, T, Vp), rng.integers(0, V, (B, T)).astype(np.int32)
    whole, split = np.empty((B, T)), np.empty((B, T))
    lw, ls = logits.copy(), logits.copy()
    cross_entropy(lw, whole, tgt, V, 0.5)
    cross_entropy(ls, split, tgt, V, 0.5, shards)
    close(split, whole)
    close(ls, lw)
    wte, wpe, inp = r(Vp, C), r(T, C), rng.integers(0, V, (B, T)).astype(np.int32)
    out, got = np.empty((B, T, C)), np.zeros((B, T, C))
    be.encoder_forward(out, inp, wte, wpe)
    dwte = np.zeros_like(wte)
    for k, (v0, rows) in enumerate(shards):
        part = np.empty((B, T, C))
        be.encoder_forward(part, inp, wte[v0:v0 + rows], wpe if k == 0 else None, v0)
        got += part
        be.encoder_backward(dwte[v0:v0 + rows], np.zeros_like(wpe), out, inp, v0)
    assert np.array_equal(got, out), "the shards' sum is the whole embedding, exactly"
    want = np.zeros_like(wte)
    be.encoder_backward(want, np.zeros_like(wpe), out, inp)
    assert np.array_equal(dwte, want)


def test_adamw_matches_formula():
    p, g = r(20), r(20)
    m, v = r(20) * 0.1, np.abs(r(20)) * 0.1
    exp_m, exp_v = 0.9 * m + 0.1 * g, 0.999 * v + 0.001 * g * g
    m_hat, v_hat = exp_m / (1 - 0.9 ** 3), exp_v / (1 - 0.999 ** 3)
    exp_p = p - 0.01 * (m_hat / (np.sqrt(v_hat) + 1e-8) + 0.1 * p)
    be.adamw(p, g, m, v, (0.01, 1 - 0.9 ** 3, 1 - 0.999 ** 3, 3), 0.9, 0.999, 1e-8, 0.1,
             np.zeros(1), 0.0)
    close(p, exp_p)
    close(m, exp_m)


def test_kernel_profile_times_each_op_and_the_rest():
    x, out = r(B, T, 4 * C), np.empty((B, T, 4 * C))

    def step():
        be.gelu_forward(out, x)
        be.gelu_backward(out, x, x)
        sum(range(20000))  # outside every op: "(rest)"
    per_op, per_kernel = be.kernel_profile(step, 3)
    ops = {row["op"]: row for row in per_op}
    assert set(ops) == {"gelu_forward", "gelu_backward", "(rest)"} and per_kernel == []
    assert sum(row["share"] for row in per_op) == pytest.approx(1.0)
    assert all(row["ms_per_step"] > 0 for row in per_op)
    assert be.trace is None  # profiling ends with the call


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_the_norm_is_the_same_float_however_the_buffer_is_split(dtype):
    """sum_squares sums float squares within each 16-byte group of the stage's buffer, in
    element order, and the groups in float64: any split into slices (ZeRO-1's, at
    unaligned cuts) gives the unsharded float norm."""
    from cupygpt.precision import BF16
    dt = BF16 if dtype == "bf16" else np.float32
    g = np.random.default_rng(3).normal(size=300_001).astype(dt)
    pack = 16 // g.dtype.itemsize
    whole = np.zeros(1)
    be.sum_squares(whole, g)
    sq = np.concatenate([g.astype(np.float32), np.zeros(-g.size % pack, np.float32)]) ** 2
    groups = sq.reshape(-1, pack)
    by_hand = groups[:, 0].copy()
    for k in range(1, pack):
        by_hand += groups[:, k]
    assert whole[0] == pytest.approx(by_hand.sum(dtype=np.float64), rel=1e-13)
    for cuts in ((0, 150_000, 300_001), (0, 7, 100_003, 200_005, 300_001)):
        split = np.zeros(1)
        for a, b in zip(cuts, cuts[1:]):
            be.sum_squares(split, g[a:b].copy(), a)  # (a slice copied: ZeRO-1's buffer)
        assert np.float32(np.sqrt(split[0])) == np.float32(np.sqrt(whole[0]))
