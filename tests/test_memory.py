"""Out of GPU memory at start: refused before allocating, with the numbers and the fix."""
import numpy as np
import pytest

from cupygpt import CupyGPTError
from cupygpt.backends import numpy_backend
from cupygpt.shape import preset
from cupygpt.comm.local import Local
from cupygpt.parallel.mesh import Mesh
from cupygpt.parallel.pipeline.runner import Runner


class SmallDevice:
    """The NumPy backend pretending to be a device with 1 GiB free; allocating is an error."""
    name = "small-device"

    def __getattr__(self, attr):
        return getattr(numpy_backend, attr)

    @staticmethod
    def device_memory():
        return 2 ** 30

    @staticmethod
    def zeros(*_):
        raise AssertionError("allocated although the memory check should have refused")


def test_refused_before_allocating_with_numbers():
    with pytest.raises(CupyGPTError) as e:
        Runner(preset("d12"), SmallDevice(), Local(), Mesh(), 8, 1024, adamw=object())
    msg = str(e.value)
    assert "out of GPU memory at start" in msg and "1.00 GiB is free" in msg
    assert "lower the batch size or sequence length" in msg and "pipeline stages" in msg


def test_estimate_matches_what_the_stage_allocates():
    from cupygpt.optim import AdamWConfig
    run = Runner(preset("tiny"), numpy_backend, Local(), Mesh(), 4, 64, adamw=AdamWConfig())
    st, = run.stages
    allocated = (st.params.nbytes + st.grads.nbytes + st.acts_buf.nbytes +
                 st.scratch_buf.nbytes + run.opt.state_bytes())
    assert run.bytes_needed(st.part, len(st.acts), np.float32, True, False) == allocated
