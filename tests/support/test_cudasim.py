"""cudasim's own checks: it must catch the mistakes it claims to, or its passing runs of
the CUDA backend (test_cuda_backend.py) would prove little."""
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
from harness import cudasim_module, device_env, load_cudasim, mpiexec, requires_sim

from cupygpt.precision import BF16

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


def test_cupys_cublas_refuses_a_capture_with_cupys_words(sim):
    """CuPy 14's cuBLAS wrappers set the handle's stream on each call and refuse a stream
    that captures: the GPU's first run failed there, so cudasim must too."""
    cp, _ = sim
    one = np.array(1.0, np.float32)
    A, C = cp.asarray(np.ones((4, 4), np.float32)), cp.zeros((4, 4), np.float32)
    stream = cp.cuda.Stream(non_blocking=True).use()
    stream.begin_capture()
    try:
        with pytest.raises(NotImplementedError, match="calling cuBLAS API during stream "
                                                      "capture is currently unsupported"):
            cp.cublas.sgemmStridedBatched(1, 0, 0, 4, 4, 4, one.ctypes.data, A.data.ptr, 4, 0,
                                          A.data.ptr, 4, 0, one.ctypes.data, C.data.ptr, 4, 0, 1)
    finally:
        stream.end_capture()
        cp.cuda.Stream(null=True).use()


@pytest.fixture()
def lt():
    """cudasim's cupy, the cuda backend on it, and cudasim's cuBLASLt, on a fresh stream."""
    cp, cu = load_cudasim()
    cu.configure()
    return cp, cu, cudasim_module(cu, "cublaslt").lt


def test_cublaslt_matmuls_capture_once_planned(lt):
    """A matmul's plan is made eagerly; in a capture it is recorded and replays; a shape
    first met inside a capture is refused, and so is any cuBLASLt setup there."""
    cp, cu, lib = lt
    rng = np.random.default_rng(0)
    a, w, b = (rng.normal(size=s).astype(np.float32) for s in ((6, 8), (5, 8), (5,)))
    x, wd, bd, out = cp.asarray(a), cp.asarray(w), cp.asarray(b), cp.zeros((6, 5), np.float32)
    cu.matmul_forward(out, x, wd, bd)
    np.testing.assert_allclose(cp.asnumpy(out), a @ w.T + b, rtol=1e-6)
    out.fill(0)
    stream = cp.cuda.get_current_stream()
    graph = cu.capture(lambda: cu.matmul_forward(out, x, wd, bd))
    assert not cp.asnumpy(out).any()  # recorded, not run
    cu.replay(graph)
    np.testing.assert_allclose(cp.asnumpy(out), a @ w.T + b, rtol=1e-6)
    with pytest.raises(RuntimeError, match="first seen while the stream captures"):
        cu.capture(lambda: cu.matmul_forward(out[:3], x[:3], wd))
    stream.begin_capture()
    try:
        for setup in (lib.create, lib.matmul_preference_create,
                      lambda: lib.matrix_layout_create(0, 4, 4, 4)):
            with pytest.raises(RuntimeError, match="capturing"):
                setup()
    finally:
        stream.end_capture()


def test_cublaslt_refuses_what_the_library_refuses(lt):
    """Attributes of the wrong size, an algorithm chosen for another descriptor or changed
    since, a workspace smaller than asked or misaligned, pointers less aligned than the
    algorithm was chosen for, a bias vector of another type than the descriptor says."""
    cp, cu, lib = lt
    A = cp.asarray(np.ones((8, 8), np.float32))
    D = cp.zeros((8, 8), np.float32)
    cu.matmul_forward(D, A, A)  # makes the handle and the workspace
    h, ws = cu.blas.handle, cu.blas.workspace
    key = next(k for k in cu.blas.plans if k[1] == lib.Epilogue.DEFAULT)
    plan = cu.blas.plans[key]
    one = np.array(1.0, np.float32)
    LT_WORKSPACE = cudasim_module(cu, "cublaslt").LT_WORKSPACE

    def call(desc=plan["desc"], algo=plan["algo"].ctypes.data, ws_ptr=ws.data.ptr,
             ws_size=LT_WORKSPACE, a=A.data.ptr):
        lay = plan["layouts"]
        lib.matmul(h, desc, one.ctypes.data, a, lay[0], A.data.ptr, lay[1], one.ctypes.data,
                   D.data.ptr, lay[2], D.data.ptr, lay[2], algo, ws_ptr, ws_size,
                   cp.cuda.get_current_stream().ptr)
    call()
    np.testing.assert_allclose(cp.asnumpy(D), 8 * np.ones((8, 8)) + 8, rtol=1e-6)
    size = np.array(0, np.int64)
    with pytest.raises(lib.cuBLASLtError, match="wants 4"):
        lib.matmul_desc_set_attribute(plan["desc"], lib.MatmulDescAttribute.TRANSA,
                                      size.ctypes.data, 8)
    other = lib.matmul_desc_create(68, 0)
    with pytest.raises(lib.cuBLASLtError, match="not chosen by the heuristic"):
        call(desc=other)
    with pytest.raises(lib.cuBLASLtError, match="asked"):
        call(ws_size=1024)
    with pytest.raises(lib.cuBLASLtError, match="workspace .* not 256-byte aligned"):
        call(ws_ptr=ws.data.ptr + 16, ws_size=LT_WORKSPACE - 256)
    with pytest.raises(lib.cuBLASLtError, match=r"A at .* not \d+-byte aligned"):
        call(a=cp.asarray(np.ones(65, np.float32))[1:].data.ptr)
    t = np.array(lib.Epilogue.BIAS, np.uint32)
    lib.matmul_desc_set_attribute(plan["desc"], lib.MatmulDescAttribute.EPILOGUE,
                                  t.ctypes.data, 4)
    with pytest.raises(lib.cuBLASLtError, match="not chosen"):  # the plan's desc, changed
        call()


def test_a_bias_of_another_type_than_the_descriptors_is_refused(lt):
    cp, cu, lib = lt
    x, w = cp.asarray(np.ones((4, 8), BF16)), cp.asarray(np.ones((8, 8), BF16))
    out = cp.zeros((4, 8), BF16)
    cu.matmul_forward(out, x, w, cp.asarray(np.ones(8, BF16)))
    assert (cp.asnumpy(out).astype(np.float32) == 9).all()
    plan = next(p for k, p in cu.blas.plans.items() if k[1] == lib.Epilogue.BIAS)
    wrong = cp.asarray(np.ones(8, np.float32))
    ptr = np.array(wrong.data.ptr, np.int64)
    lib.matmul_desc_set_attribute(plan["desc"], lib.MatmulDescAttribute.BIAS_POINTER,
                                  ptr.ctypes.data, 8)
    with pytest.raises(lib.cuBLASLtError, match="float32 allocation; the descriptor says "
                                                "bfloat16"):
        lay, one = plan["layouts"], np.array(1.0, np.float32)
        lib.matmul(cu.blas.handle, plan["desc"], one.ctypes.data, w.data.ptr, lay[0],
                   x.data.ptr, lay[1], one.ctypes.data, out.data.ptr, lay[2], out.data.ptr,
                   lay[2], plan["algo"].ctypes.data, cu.blas.workspace.data.ptr,
                   cudasim_module(cu, "cublaslt").LT_WORKSPACE,
                   cp.cuda.get_current_stream().ptr)


@pytest.mark.parametrize("epilogue", ["BIAS", "BGRADB"])
def test_a_bias_type_other_than_the_products_is_refused(lt, epilogue):
    """A float bias vector on a bf16 product: the heuristic refuses it with INVALID_VALUE,
    as an H100's cuBLASLt 13.1 did (the backend asked BGRADB for a float bias gradient);
    the product's own type is taken."""
    cp, cu, lib = lt
    h, blas = cu.blas.ready(), cudasim_module(cu, "cublaslt")
    d = lib.get_matmul_desc_attribute_dtype

    def heuristic(bias_type):
        desc = lib.matmul_desc_create(68, 0)
        for attr, value in (("EPILOGUE", getattr(lib.Epilogue, epilogue)), ("BIAS_DATA_TYPE",
                                                                           bias_type)):
            blas._set(lib.matmul_desc_set_attribute, desc,
                      getattr(lib.MatmulDescAttribute, attr), value, d)
        lay = lib.matrix_layout_create(14, 8, 8, 8)
        pref = lib.matmul_preference_create()
        blas._set(lib.matmul_preference_set_attribute, pref,
                  lib.MatmulPreferenceAttribute.MAX_WORKSPACE_BYTES, blas.LT_WORKSPACE,
                  lib.get_matmul_preference_attribute_dtype)
        found = np.zeros(1, lib.matmul_heuristic_result_dtype)
        count = np.zeros(1, np.int32)
        lib.matmul_algo_get_heuristic(h, desc, lay, lay, lay, lay, pref, 1,
                                      found.ctypes.data, count.ctypes.data)
        return count[0]
    assert heuristic(14) == 1  # R_16BF: the product's type
    with pytest.raises(lib.cuBLASLtError, match="INVALID_VALUE.*bias pointer type"):
        heuristic(0)  # R_32F


def test_graph_capture_rules(sim):
    """CuPy's own refusals in a capture (ndarray.set, get and fill, cupy#2079's host array
    in __setitem__), which leave the capture valid, and cudasim's rule against allocating
    there; the captured kernel reads its arguments at each replay."""
    cp, mod = sim
    f = mod.get_function("warp_sum")
    x, out = cp.asarray(np.ones(32, np.float32)), cp.zeros(32, np.float32)
    n = np.int64(32)
    stream = cp.cuda.Stream(non_blocking=True).use()
    stream.begin_capture()
    try:
        f((1,), (32,), (out, x, n))
        assert float(np.asarray(out.view(np.ndarray))[0]) == 0  # recorded, not run
        for bad, said in ((lambda: cp.zeros(4), "allocated while the stream is capturing"),
                          # (x is deleted below, after the capture: ruff takes it for unbound)
                          (lambda: x.set(np.zeros(32, np.float32)),  # noqa: F821
                           "so H2D transfers are disallowed"),
                          (lambda: cp.asnumpy(out), "so D2H transfers are disallowed"),
                          (lambda: out.get(stream=stream), "so D2H transfers"),
                          (lambda: out[3], "so D2H transfers")):
            with pytest.raises(RuntimeError, match=said):
                bad()
        with pytest.raises(ValueError, match="non-scalar numpy.ndarray cannot be used for fill"):
            x[...] = np.zeros(32, np.float32)  # refused with or without a capture
    finally:
        graph = stream.end_capture()
    x.set(np.full(32, 2, np.float32))
    graph.launch(stream)
    assert np.array_equal(cp.asnumpy(out), np.full(32, 64, np.float32))  # reads x at replay
    del x
    with pytest.raises(RuntimeError, match="freed"):
        graph.launch(stream)
    cp.cuda.Stream(null=True).use()
    with pytest.raises(RuntimeError, match="cannot capture on the default \\(legacy\\) stream"):
        cp.cuda.get_current_stream().begin_capture()


def test_the_stream_a_copy_names_is_the_one_checked(sim):
    """CuPy checks the stream ndarray.set and get are given: one that captures is refused
    while the current stream does not, and a copy on another stream may run while the
    current one captures (CuPy's capture mode is relaxed)."""
    cp, _ = sim
    a = cp.zeros(4, np.float32)
    capturing, other = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    capturing.begin_capture()
    try:
        with pytest.raises(RuntimeError, match="H2D transfers are disallowed"):
            a.set(np.ones(4, np.float32), stream=capturing)
        with capturing:
            a.set(np.ones(4, np.float32), stream=other)
            assert a.get(stream=other).tolist() == [1, 1, 1, 1]
    finally:
        capturing.end_capture()


def test_a_sync_in_a_capture_invalidates_it(sim):
    """Synchronizing or querying a capturing stream is an error in CUDA and invalidates
    the capture: every later use of the stream fails, is_capturing raises (CuPy's
    streamIsCapturing), and end_capture fails; `done` (CuPy's unchecked streamQuery) is
    False rather than an error."""
    cp, mod = sim
    f, out = mod.get_function("warp_sum"), cp.zeros(32, np.float32)
    x = cp.asarray(np.ones(32, np.float32))
    for invalid in ("synchronize", "done"):
        stream = cp.cuda.Stream(non_blocking=True).use()
        stream.begin_capture()
        if invalid == "synchronize":
            with pytest.raises(cp.cuda.runtime.CUDARuntimeError,
                               match="cudaErrorStreamCaptureUnsupported"):
                stream.synchronize()
        else:
            assert stream.done is False
        with pytest.raises(RuntimeError, match="an error has invalidated the capture"):
            stream.is_capturing()
        with pytest.raises(RuntimeError, match="cudaErrorStreamCaptureInvalidated"):
            f((1,), (32,), (out, x, np.int64(32)))
        with pytest.raises(RuntimeError, match="cudaErrorStreamCaptureInvalidated"):
            stream.end_capture()
        assert not stream.is_capturing()
    cp.cuda.Stream(null=True).use()


def test_events_in_a_capture(sim):
    """An event recorded in a capture is no graph node (a replay does not set it): its
    query is never done, its synchronize and elapsed time are cudaErrorCapturedEvent. A
    stream that waits on it joins the capture (a fork) and must be joined back; a
    capturing stream may not wait on an event recorded outside the capture."""
    cp, mod = sim
    f, x = mod.get_function("warp_sum"), cp.asarray(np.ones(32, np.float32))
    out, side_out = cp.zeros(32, np.float32), cp.zeros(32, np.float32)
    stream, side = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    before = stream.record()
    for join in (False, True):
        with stream:
            stream.begin_capture()
            fork = stream.record()
            assert fork.done is False
            for bad in (fork.synchronize, lambda: cp.cuda.get_elapsed_time(before, fork)):
                with pytest.raises(RuntimeError, match="cudaErrorCapturedEvent"):
                    bad()
            side.wait_event(fork)  # side now captures into the same graph
            assert side.is_capturing()
            with side:
                f((1,), (32,), (side_out, x, np.int64(32)))
            if join:
                stream.wait_event(side.record())
            f((1,), (32,), (out, x, np.int64(32)))
            if not join:
                with pytest.raises(RuntimeError, match="cudaErrorStreamCaptureUnjoined"):
                    stream.end_capture()
                assert not side.is_capturing()
                continue
            graph = stream.end_capture()
    assert cp.asnumpy(side_out)[0] == 0
    graph.launch(stream)
    assert cp.asnumpy(side_out)[0] == 32 and cp.asnumpy(out)[0] == 32  # both in the graph
    with pytest.raises(RuntimeError, match="cudaErrorCapturedEvent"):
        fork.synchronize()  # still last recorded in a capture
    stream.begin_capture()
    with pytest.raises(RuntimeError, match="cudaErrorStreamCaptureIsolation"):
        stream.wait_event(before)
    with pytest.raises(RuntimeError, match="cudaErrorStreamCaptureInvalidated"):
        stream.end_capture()


def test_nccl_runs_on_the_stream_it_is_given(sim):
    """NCCL enqueues on the stream its call names, not the current one, and may be
    captured (NCCL 2.9+): a call naming a capturing stream is recorded, and each replay
    runs it."""
    cp, _ = sim
    nccl = cp.cuda.nccl
    comm = nccl.NcclCommunicator(1, nccl.get_unique_id(), 0)
    a, out = cp.asarray(np.arange(4, dtype=np.float32)), cp.zeros(4, np.float32)
    stream = cp.cuda.Stream(non_blocking=True)
    stream.begin_capture()  # the current stream (the legacy one) does not capture
    comm.allReduce(a.data.ptr, out.data.ptr, 4, nccl.NCCL_FLOAT32, nccl.NCCL_SUM, stream.ptr)
    graph = stream.end_capture()
    assert cp.asnumpy(out).tolist() == [0, 0, 0, 0]
    graph.launch(stream)
    assert cp.asnumpy(out).tolist() == [0, 1, 2, 3]


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


CP_ASYNC = r'''
extern "C" __global__ void copy_async(float* out, const float* in, int waited, int src_bytes) {
    alignas(16) __shared__ float tile[2][4 * 32];
    for (int k = 0; k < 8; k++) tile[k / 4][4 * threadIdx.x + k % 4] = -1.f;
    __syncthreads();
    for (int g = 0; g < 2; g++) {  // two groups: in's halves, 16 bytes (4 floats) a thread
        cp_async16(&tile[g][4 * threadIdx.x], in + 128 * g + 4 * threadIdx.x, src_bytes);
        cp_async_commit();
    }
    if (waited == 2) cp_async_wait<0>();
    if (waited == 1) cp_async_wait<1>();
    __syncthreads();
    for (int k = 0; k < 8; k++)
        out[128 * (k / 4) + 4 * threadIdx.x + k % 4] = tile[k / 4][4 * threadIdx.x + k % 4];
}
'''


def test_cp_async_lands_only_when_waited_for(sim):
    """cp.async's copies land at the wait covering their group, not before: reading
    without waiting gets the poison written at issue (NaN), waiting for all but the last
    group gets the first half; a copy reading fewer than 16 bytes zero-fills the rest."""
    cp, _ = sim
    fn = cp.RawModule(code=CP_ASYNC).get_function("copy_async")
    x = np.arange(1, 257, dtype=np.float32)
    for waited, want_first, want_second in ((2, True, True), (1, True, False), (0, False, False)):
        out = cp.zeros(256, np.float32)
        fn((1,), (32,), (out, cp.asarray(x), np.int32(waited), np.int32(16)))
        got = cp.asnumpy(out)
        nan = np.full(128, np.nan)
        assert np.array_equal(got[:128], x[:128] if want_first else nan, equal_nan=True), waited
        assert np.array_equal(got[128:], x[128:] if want_second else nan, equal_nan=True), waited
    out = cp.zeros(256, np.float32)
    fn((1,), (32,), (out, cp.asarray(x), np.int32(2), np.int32(8)))
    assert np.array_equal(cp.asnumpy(out).reshape(64, 4)[:, 2:], np.zeros((64, 2)))
    assert np.array_equal(cp.asnumpy(out).reshape(64, 4)[:, :2], x.reshape(64, 4)[:, :2])


PREFETCH_OVER = r'''
extern "C" __global__ void prefetch_over(float* out, const float* in, int sync) {
    alignas(16) __shared__ float tile[256];
    int t = threadIdx.x, o = 4 * (63 - t);  // each thread reads another warp's pack
    for (int k = 0; k < 4; k++) tile[4 * t + k] = in[4 * t + k];
    __syncthreads();
    float a = tile[o];
    if (sync) __syncthreads();  // every read of the tile done before a prefetch overwrites it
    cp_async16(&tile[4 * t], in + 256 + 4 * t, 16);
    cp_async_commit();
    __syncthreads();  // an unrelated barrier, passed with the copies still in flight
    cp_async_wait<0>();
    __syncthreads();
    out[t] = a + tile[o];
}
'''


def test_a_prefetch_over_a_buffer_still_read_shows_up(sim):
    """A missing barrier before a prefetch (a write after read: the copy overwriting a tile
    other warps still read) gives NaN rather than the stale bytes that would pass."""
    cp, _ = sim
    fn = cp.RawModule(code=PREFETCH_OVER).get_function("prefetch_over")
    x = np.arange(1, 513, dtype=np.float32)
    o = 4 * (63 - np.arange(64))
    for sync in (1, 0):
        out = cp.zeros(64, np.float32)
        fn((1,), (64,), (out, cp.asarray(x), np.int32(sync)))
        assert np.array_equal(cp.asnumpy(out), x[o] + x[256 + o]) == bool(sync), sync


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


def test_the_current_stream_follows_cupys_stack(monkeypatch):
    """CuPy 14.2's streams (cupy/cuda/stream.pyx, _ThreadLocal): per thread and device a
    current stream and a stack `with` pushes and pops; use() sets the current one only, so
    leaving a `with` makes the stack's top current: the default stream, not one use() set
    (CuPy's issue #8377). A stream is used on the device it was made on; a new thread
    starts on the default stream."""
    monkeypatch.setenv("CUDASIM_DEVICES", "2")
    cp, _ = load_cudasim()
    compute, side = cp.cuda.Stream(non_blocking=True), cp.cuda.Stream(non_blocking=True)
    assert compute.use() is compute and cp.cuda.get_current_stream() is compute
    with side:
        assert cp.cuda.get_current_stream() is side
    assert cp.cuda.get_current_stream() is cp.cuda.Stream.null
    with compute:
        with side:
            pass
        assert cp.cuda.get_current_stream() is compute
    compute.use()
    seen = []
    thread = threading.Thread(target=lambda: seen.append(cp.cuda.get_current_stream()))
    thread.start()
    thread.join()
    assert seen == [cp.cuda.Stream.null] and cp.cuda.get_current_stream() is compute
    cp.cuda.Device(1).use()
    assert cp.cuda.get_current_stream() is cp.cuda.Stream.null  # (device 1's)
    for use in (compute.use, compute.__enter__):
        with pytest.raises(RuntimeError, match=r"created on \(0\) does not match .* \(1\)"):
            use()
    cp.cuda.Device(0).use()
    assert cp.cuda.get_current_stream(0) is compute


def test_the_legacy_stream_waits_for_blocking_streams_only(monkeypatch):
    """CUDA's legacy default stream: its work waits for the work issued before on every
    blocking stream, and theirs for its work; a non-blocking stream's work has no order
    with it, so under CUDASIM_ORDER=random a copy on the default stream reads data a
    non-blocking stream has not written yet."""
    monkeypatch.setenv("CUDASIM_ORDER", "random")
    cp, _ = load_cudasim()
    x, got = cp.zeros(1, np.float32), cp.zeros(1, np.float32)
    stale = {}
    for non_blocking in (False, True):
        writer = cp.cuda.Stream(non_blocking=non_blocking)
        stale[non_blocking] = 0
        for i in range(1, 201):
            writer.use()
            x.fill(i)
            cp.cuda.Stream.null.use()
            got[...] = x
            cp.cuda.Stream.null.synchronize()
            stale[non_blocking] += int(cp.asnumpy(got)[0]) != i
            writer.synchronize()
    assert stale[True] > 0 and stale[False] == 0, stale


@pytest.fixture()
def sdpa(monkeypatch):
    """cudasim's cupy, the cuda backend on it taking cuDNN's attention (its stand-in, told
    the library is installed), and that stand-in."""
    monkeypatch.setenv("CUDASIM_CUDNN", "1")
    cp, cu = load_cudasim()
    cu.configure()
    cu.use_attention("cudnn")
    return cp, cu, cudasim_module(cu, "cudnn").cudnn


def test_cudnn_sdpa_is_attention_from_the_strides_and_captures_once_built(sdpa):
    """The stand-in's sdpa on the packed qkv, read and written by strides, is the NumPy
    reference's attention (lse too: natural log) to bf16's rounding; a captured execute is
    recorded and replays the eager bits; a shape first met in a capture is refused."""
    from cupygpt.backends.numpy.backend import NumpyBackend
    npb = NumpyBackend()
    cp, cu, _ = sdpa
    B, T, NH, HS = 2, 5, 2, 8
    rng = np.random.default_rng(1)
    qkv = rng.normal(size=(B, T, 3 * NH * HS)).astype(BF16)
    dout = rng.normal(size=(B, T, NH * HS)).astype(BF16)
    want = {n: np.zeros(s, np.float32) for n, s in (("out", dout.shape), ("lse", (B, NH, T)),
                                                    ("dqkv", qkv.shape))}
    npb.attention_forward(want["out"], want["lse"], qkv.astype(np.float32), NH)
    npb.attention_backward(want["dqkv"], dout.astype(np.float32), qkv.astype(np.float32),
                           want["out"], want["lse"], NH)
    q, d = cp.asarray(qkv), cp.asarray(dout)
    out, lse, dqkv = cp.zeros(dout.shape, BF16), cp.zeros((B, NH, T)), cp.zeros(qkv.shape, BF16)
    cu.attention_forward(out, lse, q, NH)
    cu.attention_backward(dqkv, d, q, out, lse, NH)
    for name, got in (("out", out), ("lse", lse), ("dqkv", dqkv)):
        np.testing.assert_allclose(cp.asnumpy(got).astype(np.float32), want[name],
                                   rtol=2e-2, atol=2e-2, err_msg=name)
    eager = [cp.asnumpy(x).copy() for x in (out, lse, dqkv)]
    for x in (out, lse, dqkv):
        x.fill(0)
    graph = cu.capture(lambda: (cu.attention_forward(out, lse, q, NH),
                                cu.attention_backward(dqkv, d, q, out, lse, NH)))
    assert not cp.asnumpy(dqkv).astype(np.float32).any()  # recorded, not run
    cu.replay(graph)
    for x, e in zip((out, lse, dqkv), eager):
        assert np.array_equal(cp.asnumpy(x), e)
    with pytest.raises(RuntimeError, match=r"first seen while the stream captures.*T=4"):
        cu.capture(lambda: cu.attention_forward(out[:, :4], lse, q[:, :4], NH))


def _graph(lib, dims=(1, 2, 4, 8), strides=None, stride_o=None, mask=None):
    """A causal sdpa graph over (B, H, S, D) bf16 tensors (mask: its mask args; else the
    deprecated use_causal_mask, which the binding still takes), not yet built."""
    h = lib.create_handle()
    g = lib.pygraph(io_data_type=lib.data_type.BFLOAT16, handle=h)
    st = strides or [int(np.prod(dims[1:])), dims[2] * dims[3], dims[3], 1]
    q, k, v = (g.tensor(list(dims), st, lib.data_type.BFLOAT16, name=n) for n in "qkv")
    o, s = g.sdpa(q, k, v, generate_stats=True, attn_scale=0.5,
                  **(mask or dict(use_causal_mask=True)))
    o.set_output(True).set_dim(list(dims)).set_stride(stride_o or st).set_data_type(
        lib.data_type.BFLOAT16)
    s.set_output(True).set_dim(list(dims[:3]) + [1]).set_stride(
        [dims[1] * dims[2], dims[2], 1, 1]).set_data_type(lib.data_type.FLOAT)
    return g, h, dict(q=q, k=k, v=v, o=o, s=s)


def _build(g, lib):
    g.validate()
    g.build_operation_graph()
    g.create_execution_plans([lib.heur_mode.A, lib.heur_mode.FALLBACK])
    g.check_support()
    g.build_plans()


def test_cudnn_refuses_what_the_library_refuses(sdpa):
    """Graph stages out of order, a head dim with a stride, dims that disagree, an output
    with two elements at one address, a pack missing a tensor, a workspace missing, short
    or outside memory, a tensor outside its allocation, and setup inside a capture."""
    cp, _, lib = sdpa
    g, h, t = _graph(lib)
    with pytest.raises(RuntimeError, match="build_operation_graph.. after nothing"):
        g.build_operation_graph()
    with pytest.raises(RuntimeError, match="before build_plans"):
        g.execute({}, None, handle=h)
    for bad, err in ((dict(strides=[64, 32, 1, 4]), "last dimension"),
                     (dict(stride_o=[32, 8, 8, 1]), "two elements one address")):
        g2 = _graph(lib, **bad)[0]
        with pytest.raises(lib.cudnnGraphNotSupportedError, match=err):
            g2.validate()
    g3 = lib.pygraph(io_data_type=lib.data_type.BFLOAT16, handle=h)
    q, k, v = (g3.tensor([1, 2, n, 8], [16 * n, 8 * n, 8, 1], lib.data_type.BFLOAT16)
               for n in (4, 4, 3))
    for o in g3.sdpa(q, k, v, is_inference=True)[:1]:
        o.set_output(True).set_dim([1, 2, 4, 8]).set_stride([64, 32, 8, 1]).set_data_type(
            lib.data_type.BFLOAT16)
    with pytest.raises(lib.cudnnGraphNotSupportedError, match="v dims"):
        g3.validate()
    _build(g, lib)
    size = g.get_workspace_size()
    assert size == 4 * 2 * 4  # the stand-in's forward: a float per row
    x = {**{n: cp.zeros(64, BF16) for n in "qkvo"}, "s": cp.zeros(8),  # (kept alive: a
         "short": cp.zeros(63, BF16), "f32": cp.zeros(64), "ws": cp.zeros(size, np.uint8)}
    pack = {t[n]: x[n].data.ptr for n in "qkvos"}  # freed allocation is no live memory)
    lib.set_stream(h, cp.cuda.get_current_stream().ptr)
    with pytest.raises(RuntimeError, match="lacks tensor O"):
        g.execute({k_: p for k_, p in pack.items() if k_ is not t["o"]}, x["ws"].data.ptr,
                  handle=h)
    for ws, err in ((None, "no workspace"), (cp.zeros(size - 1, np.uint8), "less than")):
        with pytest.raises(RuntimeError, match=err):
            g.execute(pack, None if ws is None else ws.data.ptr, handle=h)
    with pytest.raises(RuntimeError, match="outside one live device allocation"):
        g.execute({**pack, t["q"]: x["short"].data.ptr}, x["ws"].data.ptr, handle=h)
    with pytest.raises(RuntimeError, match="float32 allocation"):
        g.execute({**pack, t["q"]: x["f32"].data.ptr}, x["ws"].data.ptr, handle=h)
    g.execute(pack, x["ws"].data.ptr, handle=h)  # (and all that given right, it runs)
    # zero q and k: row i averages its i + 1 keys, so its logsumexp is log(i + 1)
    np.testing.assert_allclose(cp.asnumpy(x["s"]), np.tile(np.log(np.arange(1, 5)), 2),
                               rtol=1e-6)
    stream = cp.cuda.get_current_stream()
    g4 = _graph(lib)[0]
    stream.begin_capture()
    try:
        for setup in (lib.create_handle, g4.validate, g.get_workspace_size):
            with pytest.raises(RuntimeError, match="capturing"):
                setup()
    finally:
        stream.end_capture()


def _rows(a):
    return np.asarray(a, np.float32)


def test_cudnn_mask_args_as_the_binding_takes_them(sdpa):
    """The preferred diagonal_alignment and diagonal_band_right_bound make the causal mask
    (zero q and k: row i averages its i + 1 keys, so its logsumexp is log(i + 1)); a right
    bound of 1 lets each row see one key more; the mixes and values the binding refuses
    are refused."""
    cp, _, lib = sdpa
    for right, want in ((0, np.log(np.arange(1, 5))), (1, np.log([2, 3, 4, 4]))):
        g, h, t = _graph(lib, mask=dict(diagonal_alignment=lib.diagonal_alignment.TOP_LEFT,
                                        diagonal_band_right_bound=right))
        _build(g, lib)
        x = {**{n: cp.zeros(64, BF16) for n in "qkvo"}, "s": cp.zeros(8),
             "ws": cp.zeros(g.get_workspace_size(), np.uint8)}
        lib.set_stream(h, cp.cuda.get_current_stream().ptr)
        g.execute({t[n]: x[n].data.ptr for n in "qkvos"}, x["ws"].data.ptr, handle=h)
        np.testing.assert_allclose(cp.asnumpy(x["s"]), np.tile(want, 2), rtol=1e-6)
    for mask, err in ((dict(use_causal_mask=True, diagonal_band_right_bound=0),
                       "cannot be set at the same time"),
                      (dict(diagonal_band_right_bound=-1), "larger than or equal to zero"),
                      (dict(diagonal_band_right_bound=0.5), "must be an int")):
        with pytest.raises(ValueError, match=err):
            _graph(lib, mask=mask)


def test_cudnn_refuses_a_backward_of_one_position_and_unaligned_tensors(sdpa):
    """s_q = s_kv = 1 backward (the real validator's rule); a bf16 stride that is no whole
    16 bytes (validate) and a tensor address off 16 bytes (execute)."""
    cp, _, lib = sdpa
    g = lib.pygraph(io_data_type=lib.data_type.BFLOAT16)
    q, k, v, o, do = (g.tensor([1, 2, 1, 8], [16, 8, 8, 1], lib.data_type.BFLOAT16)
                      for _ in range(5))
    stats = g.tensor([1, 2, 1, 1], [2, 1, 1, 1], lib.data_type.FLOAT)
    for d in g.sdpa_backward(q, k, v, o, do, stats, diagonal_band_right_bound=0):
        d.set_output(True).set_dim([1, 2, 1, 8]).set_stride([16, 8, 8, 1]).set_data_type(
            lib.data_type.BFLOAT16)
    with pytest.raises(lib.cudnnGraphNotSupportedError, match="s_q = s_kv = 1"):
        g.validate()
    with pytest.raises(lib.cudnnGraphNotSupportedError, match="not 16-byte aligned"):
        _graph(lib, strides=[72, 36, 9, 1])[0].validate()
    g, h, t = _graph(lib)
    _build(g, lib)
    x = {**{n: cp.zeros(72, BF16) for n in "qkvo"}, "s": cp.zeros(8),
         "ws": cp.zeros(g.get_workspace_size(), np.uint8)}
    pack = {t[n]: x[n].data.ptr for n in "qkvos"}
    lib.set_stream(h, cp.cuda.get_current_stream().ptr)
    with pytest.raises(RuntimeError, match="q at .* is not 16-byte aligned"):
        g.execute({**pack, t["q"]: x["q"].data.ptr + 2}, x["ws"].data.ptr, handle=h)
    with pytest.raises(RuntimeError, match="candidate plan"):
        g.get_workspace_size(h)


def test_cudnn_rounds_p_and_ds_to_bf16_before_their_products(sdpa):
    """O = bf16(P) V, as cuDNN's bf16 kernels feed P to the tensor cores (and the own
    kernels and the NumPy reference round it): bitwise the rounded product, not the float
    one. (The backward's P: the next test; its dS: verify's bf16 references, --attention cudnn.)"""
    cp, _, lib = sdpa
    dims, rng = (1, 2, 16, 8), np.random.default_rng(7)
    g, h, t = _graph(lib, dims=dims)
    _build(g, lib)
    host = {n: rng.normal(size=dims).astype(BF16) for n in "qkv"}
    x = {**{n: cp.asarray(host[n]) for n in "qkv"}, "o": cp.zeros(dims, BF16),
         "s": cp.zeros(dims[:3]), "ws": cp.zeros(g.get_workspace_size(), np.uint8)}
    lib.set_stream(h, cp.cuda.get_current_stream().ptr)
    g.execute({t[n]: x[n].data.ptr for n in "qkvos"}, x["ws"].data.ptr, handle=h)
    s = 0.5 * np.matmul(_rows(host["q"]), _rows(host["k"]).swapaxes(-1, -2))
    s[..., np.triu_indices(16, 1)[0], np.triu_indices(16, 1)[1]] = -np.inf
    p = np.exp(s - cp.asnumpy(x["s"])[..., None])
    got = cp.asnumpy(x["o"])
    rounded = np.matmul(_rows(p.astype(BF16)), _rows(host["v"])).astype(BF16)
    assert np.array_equal(got, rounded)
    assert not np.array_equal(got, np.matmul(p, _rows(host["v"])).astype(BF16))


def test_cudnn_backward_rounds_p_before_pt_do(sdpa):
    """The backend's cuDNN backward: dV = bf16(P)^T dO bitwise (P from the forward's
    stats, as the stand-in recomputes it), not the float product."""
    cp, cu, _ = sdpa
    B, T, NH, HS = 1, 16, 2, 8
    rng = np.random.default_rng(11)
    qkv = rng.normal(size=(B, T, 3 * NH * HS)).astype(BF16)
    dout = rng.normal(size=(B, T, NH * HS)).astype(BF16)
    out, lse, dqkv = cp.zeros(dout.shape, BF16), cp.zeros((B, NH, T)), cp.zeros(qkv.shape, BF16)
    cu.attention_forward(out, lse, cp.asarray(qkv), NH)
    cu.attention_backward(dqkv, cp.asarray(dout), cp.asarray(qkv), out, lse, NH)
    heads = _rows(qkv).reshape(B, T, 3, NH, HS).transpose(2, 0, 3, 1, 4)  # (3, B, NH, T, HS)
    q, k = np.ascontiguousarray(heads[0]), np.ascontiguousarray(heads[1])
    s = np.float32(1 / np.sqrt(HS)) * np.matmul(q, k.swapaxes(-1, -2))
    s[..., np.triu_indices(T, 1)[0], np.triu_indices(T, 1)[1]] = -np.inf
    p = np.exp(s - cp.asnumpy(lse)[..., None])
    do = np.ascontiguousarray(_rows(dout).reshape(B, T, NH, HS).transpose(0, 2, 1, 3))
    dv = cp.asnumpy(dqkv).reshape(B, T, 3, NH, HS)[:, :, 2].transpose(0, 2, 1, 3)
    rounded = np.matmul(_rows(p.astype(BF16)).swapaxes(-1, -2), do).astype(BF16)
    assert np.array_equal(dv, rounded)
    assert not np.array_equal(dv, np.matmul(p.swapaxes(-1, -2), do).astype(BF16))


# Two ranks making one NCCL communicator, each printing what its init did.
TWO_RANKS_ONE_COMM = """
import cupy
from cupy.cuda import nccl
from mpi4py import MPI
comm = MPI.COMM_WORLD
uid = comm.bcast(nccl.get_unique_id() if comm.rank == 0 else None)
cupy.cuda.Device(comm.rank % cupy.cuda.runtime.getDeviceCount()).use()
try:
    nccl.NcclCommunicator(2, uid, comm.rank)
    print("made")
except nccl.NcclError as e:
    print(e)
"""


@pytest.mark.skipif(mpiexec() is None, reason="needs mpiexec")
@pytest.mark.parametrize("devices,version,enable,said", [
    ("2", "22703", None, "made"), ("1", "22703", "1", "NCCL_ERROR_INVALID_USAGE"),
    ("1", "23203", None, "NCCL_ERROR_INVALID_USAGE"), ("1", "23203", "1", "made")])
def test_nccl_refuses_two_ranks_on_one_gpu_as_nccl_does(devices, version, enable, said):
    """NCCL's init compares its members' GPUs and refuses two on one ("Duplicate GPU
    detected"; from 2.30 on, unless NCCL_MULTI_RANK_GPU_ENABLE=1)."""
    env = {**os.environ, **device_env("sim"), "CUDASIM_DEVICES": devices,
           "CUDASIM_NCCL_VERSION": version}
    env.pop("NCCL_MULTI_RANK_GPU_ENABLE", None)
    if enable:
        env["NCCL_MULTI_RANK_GPU_ENABLE"] = enable
    res = subprocess.run([mpiexec(), "-n", "2", sys.executable, "-c", TWO_RANKS_ONE_COMM],
                         capture_output=True, text=True, timeout=120, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    other = "made" if said != "made" else "NCCL_ERROR"  # (the ranks' lines may interleave)
    assert res.stdout.count(said) == 2 and other not in res.stdout, res.stdout
