"""cudasim's own checks: it must catch the mistakes it claims to, or its passing runs of
the CUDA backend (test_cuda.py) would prove little."""
import numpy as np
import pytest

from conftest import load_cudasim, requires_sim

pytestmark = requires_sim

RACE = r'''
extern "C" __global__ void broadcast(float* out, const float* in, int sync) {
    __shared__ float v;
    if (threadIdx.x == 0) v = in[blockIdx.x];
    if (sync) __syncthreads();
    out[blockIdx.x * blockDim.x + threadIdx.x] = v;
}

extern "C" __global__ void half_warp_sum(float* out, const float* in) {
    if (threadIdx.x >= 16) return;
    float v = in[threadIdx.x];
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    out[threadIdx.x] = v;
}

extern "C" __global__ void warp_sum(float* out, const float* in, long long n) {
    float v = threadIdx.x < n ? in[threadIdx.x] : 0.f;
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    out[threadIdx.x] = v;
}
'''


@pytest.fixture(scope="module")
def sim():
    cp, _ = load_cudasim()
    return cp, cp.RawModule(code=RACE)


def test_a_missing_barrier_shows_up(sim):
    cp, mod = sim
    src = cp.asarray(np.arange(4, dtype=np.float32))
    want = np.repeat(np.arange(4, dtype=np.float32), 64)
    for sync, ok in ((1, True), (0, False)):
        out = cp.zeros(256, np.float32)
        mod.get_function("broadcast")((4,), (64,), (out, src, np.int32(sync)))
        assert np.array_equal(cp.asnumpy(out), want) == ok


def test_shuffles_are_exact_and_exited_lanes_are_reported(sim):
    cp, mod = sim
    x = np.arange(32, dtype=np.float32)
    out = cp.zeros(32, np.float32)
    mod.get_function("warp_sum")((1,), (32,), (out, cp.asarray(x), np.int64(32)))
    assert np.array_equal(cp.asnumpy(out), np.full(32, x.sum(), np.float32))
    with pytest.raises(RuntimeError, match="barrier that cannot complete"):
        mod.get_function("half_warp_sum")((1,), (32,), (out, cp.asarray(x)))


def test_kernel_arguments_and_launches_are_checked(sim):
    cp, mod = sim
    f, out, x = mod.get_function("warp_sum"), cp.zeros(64, np.float32), cp.zeros(32, np.float32)
    with pytest.raises(TypeError, match="needs np.int64, got int"):
        f((1,), (32,), (out, x, 32))
    with pytest.raises(TypeError, match="needs np.int64, got int32"):
        f((1,), (32,), (out, x, np.int32(32)))
    with pytest.raises(TypeError, match="needs a float32 device array"):
        f((1,), (32,), (out, np.zeros(32, np.float32), np.int64(32)))
    with pytest.raises(TypeError, match="strided view"):
        f((1,), (32,), (out[::2], x, np.int64(32)))
    with pytest.raises(RuntimeError, match="InvalidConfiguration"):
        f((1,), (2048,), (out, x, np.int64(32)))


def test_gemm_is_column_major_and_checked(sim):
    cp, _ = sim
    cublas = cp.cublas
    one, zero = np.array(1.0, np.float32), np.array(0.0, np.float32)
    rng = np.random.default_rng(0)
    a, b = rng.normal(size=(3, 5)).astype(np.float32), rng.normal(size=(5, 4)).astype(np.float32)
    A, B, C = cp.asarray(a), cp.asarray(b), cp.zeros((3, 4), np.float32)

    def call(m, n, k, lda, ldb, ldc, Bm=B):
        # row-major C = a @ b is column-major C^T = b^T a^T: operands swapped
        cublas.sgemmStridedBatched(1, 0, 0, m, n, k, one.ctypes.data, Bm.data.ptr, lda, 0,
                                   A.data.ptr, ldb, 0, zero.ctypes.data, C.data.ptr, ldc, 0, 1)
    call(4, 3, 5, 4, 5, 4)
    np.testing.assert_allclose(cp.asnumpy(C), a @ b, rtol=1e-6)
    with pytest.raises(RuntimeError, match="INVALID_VALUE"):
        call(4, 3, 5, 3, 5, 4)  # ld smaller than the rows
    with pytest.raises(RuntimeError, match="outside the device allocation"):
        call(4, 3, 5, 4, 5, 4, Bm=cp.zeros((4, 4), np.float32))  # B too small for k=5


def test_graph_capture_rules(sim):
    cp, mod = sim
    f = mod.get_function("warp_sum")
    x, out = cp.asarray(np.ones(32, np.float32)), cp.zeros(32, np.float32)
    n = np.int64(32)
    stream = cp.cuda.Stream(non_blocking=True).use()
    stream.begin_capture()
    try:
        f((1,), (32,), (out, x, n))
        assert float(np.asarray(out.view(np.ndarray))[0]) == 0  # recorded, not run
        for bad in (lambda: cp.zeros(4), lambda: x.set(np.zeros(32, np.float32)),
                    lambda: cp.asnumpy(out), stream.synchronize):
            with pytest.raises(RuntimeError, match="capturing"):
                bad()
    finally:
        graph = stream.end_capture()
    x.set(np.full(32, 2, np.float32))
    graph.launch(stream)
    assert np.array_equal(cp.asnumpy(out), np.full(32, 64, np.float32))  # reads x at replay
    del x
    with pytest.raises(RuntimeError, match="freed"):
        graph.launch(stream)
    cp.cuda.Stream(null=True).use()
    with pytest.raises(RuntimeError, match="legacy default stream"):
        cp.cuda.get_current_stream().begin_capture()


def test_uninitialized_memory_is_poisoned(sim):
    cp, _ = sim
    assert np.isnan(cp.asnumpy(cp.empty(8, np.float32))).all()
    assert (cp.asnumpy(cp.empty(8, np.int32)) == -1).all()


LDMATRIX = r'''
extern "C" __global__ void ldsm(unsigned* out, const unsigned short* in, int trans, int skew) {
    alignas(16) __shared__ unsigned short tile[16 * 16 + 8];
    for (int i = threadIdx.x; i < 256; i += 32) tile[i + skew] = in[i];
    __syncthreads();
    int l = threadIdx.x, m = l / 8, r = l % 8;  // matrix m: rows 8 (m % 2).., columns 8 (m / 2)..
    const unsigned short* row = tile + skew + (8 * (m % 2) + r) * 16 + 8 * (m / 2);
    unsigned v[4];
    if (trans) ldmatrix_x4_trans(v, row);
    else ldmatrix_x4(v, row);
    for (int k = 0; k < 4; k++) out[4 * l + k] = v[k];
}
'''


def test_ldmatrix_gives_the_ptx_fragment_layout(sim):
    """ldmatrix .x4 (and .trans) on a 16 x 16 matrix of its own indices, each 8x8 quarter a
    matrix: lane l's register m holds matrix m's (row l/4, columns 2(l%4), +1), or
    transposed (rows 2(l%4), +1, column l/4), the lower index in the low half (the PTX
    ISA's figures for ldmatrix); a row address off 16 bytes is a fault, as on the GPU."""
    cp, _ = sim
    fn = cp.RawModule(code=LDMATRIX).get_function("ldsm")
    M = np.arange(256, dtype=np.uint16).reshape(16, 16)
    for trans in (0, 1):
        out = cp.zeros(128, np.uint32)
        fn((1,), (32,), (out, cp.asarray(M.ravel()), np.int32(trans), np.int32(0)))
        got = cp.asnumpy(out).reshape(32, 4)
        for lane in range(32):
            for m in range(4):
                r0, c0 = 8 * (m % 2), 8 * (m // 2)
                if trans:
                    lo, hi = (M[r0 + 2 * (lane % 4) + h, c0 + lane // 4] for h in (0, 1))
                else:
                    lo, hi = (M[r0 + lane // 4, c0 + 2 * (lane % 4) + h] for h in (0, 1))
                assert got[lane, m] == int(lo) | int(hi) << 16, (trans, lane, m)
    with pytest.raises(RuntimeError, match="not 16-byte aligned"):
        fn((1,), (32,), (out, cp.asarray(M.ravel()), np.int32(0), np.int32(1)))


@requires_sim
def test_random_order_runs_streams_in_any_order(monkeypatch):
    """Under CUDASIM_ORDER=random a stream's work may run before another stream's work
    issued earlier, unless it waits for an event of that stream (as on a GPU)."""
    monkeypatch.setenv("CUDASIM_ORDER", "random")
    cp, _ = load_cudasim()
    a, b = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    x, got = cp.zeros(1, np.float32), cp.zeros(1, np.float32)
    stale = {False: 0, True: 0}
    for i in range(1, 201):
        for wait in (False, True):
            with a:
                x.fill(i)
            if wait:
                b.wait_event(a.record())
            with b:
                got[...] = x
            b.synchronize()
            stale[wait] += int(cp.asnumpy(got)[0]) != i
            a.synchronize()
    assert stale[False] > 0 and stale[True] == 0, stale
