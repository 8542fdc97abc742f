"""The whole model's wiring: every parameter's gradient against finite differences (float64),
and a model cut into stages by hand giving the same loss and gradients as the whole."""
import numpy as np

from cupygpt.backends import numpy_backend as be
from cupygpt.config import GPT2Config
from cupygpt.layout import assemble, param_layout
from cupygpt.model import Stage, init_params

CFG = GPT2Config(maxT=8, V=11, Vp=16, L=2, NH=2, C=8)
B, T = 2, 5


def batch(seed=1):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, CFG.V, (B, T)).astype(np.int32),
            rng.integers(0, CFG.V, (B, T)).astype(np.int32))


def params64():
    p = init_params(CFG, seed=3).astype(np.float64)
    p += np.random.default_rng(4).normal(0, 0.05, p.size)  # no trivial 0/1 parameters
    param_layout(CFG).views(p)["wte"][CFG.V:] = 0
    return p


def test_model_gradients_match_finite_differences():
    x, y = batch()
    m = Stage(CFG, be, B, T, dtype=np.float64)
    m.load(params64())

    def loss():
        m.forward(0, x, y)
        return m.acts[0]["losses"].sum() / (B * T)

    m.zero_grad()
    m.forward(0, x, y, dloss=1.0 / (B * T))
    m.backward(0, x)
    analytic = m.grads.copy()
    numeric, eps = np.zeros_like(analytic), 1e-6
    for i in range(m.params.size):
        old = m.params[i]
        m.params[i] = old + eps
        fp = loss()
        m.params[i] = old - eps
        fm = loss()
        m.params[i] = old
        numeric[i] = (fp - fm) / (2 * eps)
    np.testing.assert_allclose(analytic, numeric, rtol=1e-5, atol=1e-9)
    assert np.all(m.g["wte"][CFG.V:] == 0), "padded vocab rows get no gradient"


def test_stages_by_hand_equal_the_whole_model():
    """Stage [0,1) with the embedding and [1,2) with the head, chained in-process."""
    x, y = batch(2)
    full = params64()
    whole = Stage(CFG, be, B, T, dtype=np.float64)
    whole.load(full)
    whole.zero_grad()
    whole.forward(0, x, y, dloss=1.0 / (B * T))
    whole.backward(0, x)

    s0 = Stage(CFG, be, B, T, 0, 1, embed=True, head=False, dtype=np.float64)
    s1 = Stage(CFG, be, B, T, 1, 2, embed=False, head=True, dtype=np.float64)
    for s in (s0, s1):
        s.load(full)
        s.zero_grad()
    s0.forward(0, x)
    s1.input(0)[...] = s0.output(0)
    s1.forward(0, None, y, dloss=1.0 / (B * T))
    assert s1.acts[0]["losses"].sum() == whole.acts[0]["losses"].sum()
    s1.backward(0)
    s0.grad_io()[...] = s1.grad_io()
    s0.backward(0, x)
    tied = s0.g["wte"] + s1.g["wte"]
    s0.g["wte"][...] = s1.g["wte"][...] = tied
    got = assemble(CFG, [(0, 1, True, False, s0.grads), (1, 2, False, True, s1.grads)])
    np.testing.assert_allclose(got, whole.grads, rtol=1e-12, atol=1e-15)
