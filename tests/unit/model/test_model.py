"""The whole model's wiring: every parameter's gradient against finite differences (float64),
and a model cut into stages by hand giving the same loss and gradients as the whole."""
import numpy as np

from cupygpt.backends.numpy.backend import NumpyBackend
from cupygpt.model.initialize import init_params
from cupygpt.model.layout import Part, assemble, param_layout
from cupygpt.model.shape import GPT2Config
from cupygpt.model.stage import Stage
from cupygpt.parallel.tensor.comm import TensorGroup
from cupygpt.parallel.tensor.sharding import TensorShard

be = NumpyBackend()

CFG = GPT2Config(maxT=8, V=11, Vp=16, L=2, NH=2, C=8)
# CFG with heads of 8: the CUDA backend's attention runs head sizes in multiples of 8
CFG_HS8 = GPT2Config(maxT=8, V=11, Vp=16, L=2, NH=2, C=16)
B, T = 2, 5


def batch(seed=1):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, CFG.V, (B, T)).astype(np.int32),
            rng.integers(0, CFG.V, (B, T)).astype(np.int32))


def params64(cfg=CFG):
    p = init_params(cfg, seed=3).astype(np.float64)
    p += np.random.default_rng(4).normal(0, 0.05, p.size)  # no trivial 0/1 parameters
    param_layout(cfg).views(p)["wte"][cfg.V:] = 0
    return p


def test_model_gradients_match_finite_differences():
    x, y = batch()
    m = Stage(CFG, be, batch=B, seq=T, dtype=np.float64)
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
    whole = Stage(CFG, be, batch=B, seq=T, dtype=np.float64)
    whole.load(full)
    whole.zero_grad()
    whole.forward(0, x, y, dloss=1.0 / (B * T))
    whole.backward(0, x)

    s0 = Stage(CFG, be, batch=B, seq=T, part=Part(0, 1, embed=True, head=False),
               dtype=np.float64)
    s1 = Stage(CFG, be, batch=B, seq=T, part=Part(1, 2, embed=False, head=True),
               dtype=np.float64)
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
    got = assemble(CFG, [(s0.part, s0.grads), (s1.part, s1.grads)])
    np.testing.assert_allclose(got, whole.grads, rtol=1e-12, atol=1e-15)


def test_decoding_on_the_kv_cache_matches_whole_passes():
    """Generation's KV cache: a pass over a prompt, then one position at a time, gives each
    position the logits a whole pass over the finished sequence gives, and the same tokens."""
    from cupygpt.comm.local import Local
    from cupygpt.parallel.mesh import Mesh
    from cupygpt.parallel.runner import Runner
    from cupygpt.parallel.settings import StepSettings
    from cupygpt.train.sample import generate
    cfg = GPT2Config(maxT=24, V=50, Vp=64, L=2, NH=4, C=32)
    run = Runner(shape=cfg, be=be, transport=Local(), mesh=Mesh(),
                 settings=StepSettings(batch=2, seq=24))
    run.load_state_dict(init_params(cfg, 5))  # two rows: decoding reads row 0 only
    x = np.random.default_rng(0).integers(0, cfg.V, (2, 24)).astype(np.int32)

    def row(r):
        return r.copy()
    whole = [run.next_token(x, t, row, cached=False) for t in range(24)]
    prompt = x.copy()
    prompt[:, 5:] = 0  # positions 5.. come only from the decode steps below
    run.next_token(prompt, 4, row, cached=False)
    for t in range(5, 24):
        np.testing.assert_allclose(run.next_token(x, t, row), whole[t], rtol=1e-5, atol=1e-5)
    for seed in range(3):
        ids = [generate(run, list(x[0, :3]), 20, 0, np.random.default_rng(seed), kv_cache=c)
               for c in (True, False)]
        assert ids[0] == ids[1] and len(ids[0]) == 23


def test_fresh_init_is_llmc_s():
    """N(0, 0.02) weights including the embeddings, 0.02/sqrt(2L) residual projections,
    layernorms 1/0, biases 0, padding rows of wte 0."""
    cfg = GPT2Config(maxT=64, V=300, Vp=384, L=4, NH=4, C=64)
    v = param_layout(cfg).views(init_params(cfg, 1))
    for name in ("wte", "wpe", "qkvw", "fcw"):
        w = v[name][:cfg.V] if name == "wte" else v[name]
        assert abs(w.std() - 0.02) < 0.002 and abs(w.mean()) < 0.002, name
    assert abs(v["fcprojw"].std() - 0.02 / np.sqrt(8)) < 0.001
    assert np.all(v["wte"][cfg.V:] == 0) and np.all(v["ln1w"] == 1) and np.all(v["qkvb"] == 0)


class ThreadGroup:
    """A tensor-parallel group of threads (one Stage shard each): the two collectives the
    model calls, summed and gathered in member order. A member computes only while it holds
    the group's lock (the NumPy backend's workspaces are shared), which it lets go while it
    waits for the others."""

    def __init__(self, n):
        import threading
        self.barrier, self.box = threading.Barrier(n, timeout=60), [None] * n
        self.lock = threading.Lock()

    def wait(self):
        self.lock.release()
        self.barrier.wait()
        self.lock.acquire()

    def member(self, k):
        group = self

        class Member:
            def all_reduce(self, arr, axis):
                total = group._share(k, arr)
                arr[...] = sum(total[1:], total[0])
                group.wait()

            def all_gather(self, part, out, axis):
                shares = group._share(k, part)
                out.reshape(-1)[...] = np.concatenate([p.reshape(-1) for p in shares])
                group.wait()
        return Member()

    def _share(self, k, arr):
        self.box[k] = arr.copy()
        self.wait()
        return list(self.box)


def step(stage, x, y, logits=None):
    """One training forward and backward of stage; logits[first:first+n] gets each chunk."""
    def keep(first, chunk):
        logits[first:first + len(chunk)] = chunk
    stage.zero_grad()
    stage.forward(0, x, y, dloss=1.0 / (B * T), on_logits=None if logits is None else keep)
    stage.backward(0, x)
    return stage.acts[0]["losses"].copy()


def test_the_head_in_chunks_equals_the_head_whole(monkeypatch):
    """The LM head made a few positions at a time (uneven chunks: the last one shorter), on
    the whole vocabulary and on two vocab-parallel shards (threads), gives the whole head's
    logits, losses and every gradient (float64), and keeps no (B, T, Vp) tensor."""
    import threading

    from cupygpt.model import layout
    x, y = batch(3)
    full = params64()
    whole = Stage(CFG, be, batch=B, seq=T, dtype=np.float64)
    whole.load(full)
    want = step(whole, x, y)
    assert whole.s["logits"].shape == (B * T, CFG.Vp)  # one chunk by default

    assert layout.logit_rows(1000, 1 << 20) == 125  # at most LOGIT_CHUNKS (8) chunks
    monkeypatch.setattr(layout, "LOGIT_CHUNKS", 100)
    monkeypatch.setattr(layout, "LOGIT_CHUNK", 3 * CFG.Vp // 2)  # 3 positions per shard
    chunked = Stage(CFG, be, batch=B, seq=T, dtype=np.float64)
    chunked.load(full)
    assert chunked.s["logits"].shape == (2, CFG.Vp)  # 5 chunks of 2 positions
    logits = np.zeros((B * T, CFG.Vp))
    np.testing.assert_allclose(step(chunked, x, y, logits), want, rtol=1e-13)
    np.testing.assert_allclose(chunked.grads, whole.grads, rtol=1e-12, atol=1e-15)
    lnf = whole.acts[0]["lnf"]  # forward only: lnf stays lnf
    whole.forward(0, x, y)
    np.testing.assert_allclose(logits, lnf.reshape(-1, CFG.C) @ whole.p["wte"].T, rtol=1e-12)

    group, shards = ThreadGroup(2), [None, None]

    def run(k):
        with group.lock:
            shards[k] = member(k)

    def member(k):
        st = Stage(CFG, be, batch=B, seq=T, part=Part(0, CFG.L, split=TensorShard(2, k)),
                   dtype=np.float64, tp_group=TensorGroup(group.member(k), 2, k))
        st.load(full)
        assert st.s["logits"].shape == (3, CFG.Vp // 2)  # 3, 3, 3 and 1 positions
        return st, step(st, x, y)
    threads = [threading.Thread(target=run, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for st, got in shards:
        np.testing.assert_allclose(got, want, rtol=1e-13)
    got = assemble(CFG, [(st.part, st.grads) for st, _ in shards])
    np.testing.assert_allclose(got, whole.grads, rtol=1e-11, atol=1e-14)


def check_bf16_chunks(be, monkeypatch):
    """In bf16 the head's chunks change nothing but wte's gradient (each chunk's addition
    rounded, as a micro-batch's is): the losses and every other gradient keep their bits,
    and wte's stays within a few bf16 steps of its largest value."""
    from cupygpt.model import layout
    from cupygpt.precision import BF16
    x, y = batch(4)
    full = params64(CFG_HS8).astype(np.float32).astype(BF16)
    runs = []
    for chunk in (layout.LOGIT_CHUNK, 3 * CFG_HS8.Vp):
        monkeypatch.setattr(layout, "LOGIT_CHUNK", chunk)
        st = Stage(CFG_HS8, be, batch=B, seq=T, dtype=BF16)
        st.load(full)
        st.zero_grad()
        tokens, targets = (be.zeros(B * T, np.int32).reshape(B, T) for _ in "xy")
        be.upload(tokens, x)
        be.upload(targets, y)
        st.forward(0, tokens, targets, dloss=1.0 / (B * T))
        st.backward(0, tokens)
        runs.append((st.s["logits"].shape[0], be.to_host(st.acts[0]["losses"]),
                     {n: be.to_host(g).astype(np.float32) for n, g in st.g.items()}))
    (_, want, whole), (rows, got, chunked) = runs
    assert rows == 3 and np.array_equal(got, want)
    for name, g in whole.items():
        if name != "wte":
            assert np.array_equal(chunked[name], g), name
    a, b = whole["wte"], chunked["wte"]
    assert not np.array_equal(a, b)  # rounded more often: not the same bits
    assert np.abs(a - b).max() <= 4 * 2.0 ** -8 * np.abs(a).max()


def test_bf16_chunks_round_only_wtes_gradient_more(monkeypatch):
    check_bf16_chunks(be, monkeypatch)
