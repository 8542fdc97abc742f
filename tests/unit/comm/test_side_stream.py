"""The GPU transports' overlapped sum on a side stream (comm/gpu.py), on cudasim's CuPy,
whose stream stack is CuPy 14.2's: the sum runs on the side stream after the compute
stream's work, and afterwards the compute stream is current again. Leaving CuPy's `with
side:` instead makes the legacy default stream current (the wrong gradients of --dp 2
--tp 2 on an H100 and an H200), and the backend refuses its next host wait."""
import sys

import numpy as np
import pytest
from harness import load_cudasim, requires_sim

from cupygpt import CupyGPTError
from cupygpt.comm.gpu import on_stream, start_on_side

pytestmark = requires_sim


@pytest.fixture()
def sim(monkeypatch):
    cp, be = load_cudasim()
    monkeypatch.setitem(sys.modules, "cupy", cp)  # (comm/gpu.py imports cupy when it runs)
    be.configure()
    return cp, be


def test_the_sum_on_the_side_leaves_the_compute_stream_current(sim):
    cp, be = sim
    compute, side = cp.cuda.get_current_stream(), cp.cuda.Stream(non_blocking=True)
    assert compute is be.stream and compute is not cp.cuda.Stream.null
    grads = [cp.asarray(np.arange(3, dtype=np.float32)), cp.asarray(np.full((2, 2), 5, np.float32))]
    ran_on = []

    def double(flat):
        ran_on.append(cp.cuda.get_current_stream())
        flat *= 2

    handle = start_on_side(side, grads, double)
    assert ran_on == [side] and cp.cuda.get_current_stream() is compute
    handle.wait()
    assert be.to_host(grads[0]).tolist() == [0, 2, 4]
    assert (be.to_host(grads[1]) == 10).all()


def test_on_stream_restores_the_stream_even_after_an_error(sim):
    cp, be = sim
    side = cp.cuda.Stream(non_blocking=True)
    with pytest.raises(ZeroDivisionError), on_stream(side):
        assert cp.cuda.get_current_stream() is side
        1 / 0
    assert cp.cuda.get_current_stream() is be.stream


def test_a_wait_off_the_compute_stream_is_refused(sim):
    cp, be = sim
    with cp.cuda.Stream(non_blocking=True):  # CuPy's with: the legacy stream after it
        pass
    assert cp.cuda.get_current_stream() is cp.cuda.Stream.null
    for wait in (be.synchronize, lambda: be.to_host(cp.zeros(1, np.float32))):
        with pytest.raises(CupyGPTError, match="not the backend's compute stream"):
            wait()
