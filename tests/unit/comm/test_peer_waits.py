"""A stopped peer ends a job within --peer-timeout, whatever the host waits for (issue 36):
a GPU stream waiting on a peer's signal never finishes, and CUDA's synchronize (or a copy
to the host) never gives up, so every host wait for the stream polls it against the
timeout; the control values over MPI (broadcast, gather) are polled the same way.
cudasim under CUDASIM_ORDER=random runs streams on a device thread, so a stream wait holds
only its stream, as on a GPU (in its default order it runs on the host's thread)."""
import os
import signal
import subprocess
import sys
import time

import pytest
from harness import ROOT, SUPPORT, device_env, mpiexec, requires_sim

pytestmark = [requires_sim, pytest.mark.skipif(mpiexec() is None, reason="needs mpiexec")]


@pytest.mark.parametrize("transport,wait", [
    ("nvshmem", "to_host"), ("nvshmem", "synchronize"), ("nccl", "to_host"),
    ("nvshmem", "bcast"), ("nvshmem", "gather"), ("nvshmem", "close")])
def test_a_stopped_peer_ends_every_host_wait_within_the_peer_timeout(transport, wait):
    env = {**os.environ, **device_env("sim"), "CUDASIM_DEVICES": "2", "CUDASIM_LAG_S": "0.001",
           "CUDASIM_ORDER": "random", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join((env["PYTHONPATH"], ROOT))
    p = subprocess.Popen([mpiexec(), "-n", "2", sys.executable,
                          os.path.join(SUPPORT, "peer_wait_job.py"), transport, wait],
                         stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                         start_new_session=True)
    t0 = time.monotonic()
    try:
        out = p.communicate(timeout=30)[0]
    except subprocess.TimeoutExpired:
        raise AssertionError(f"{wait} waited on the stopped rank past 30 s") from None
    finally:
        try:
            os.killpg(p.pid, signal.SIGKILL)  # a stopped rank 0 left behind
        except ProcessLookupError:
            pass
    assert time.monotonic() - t0 < 20, out
    line = next((ln for ln in out.splitlines() if ln.startswith("error:")), "")
    waiter, stopped = (0, 1) if wait == "gather" else (1, 0)
    assert line.startswith(f"error: rank {waiter}: timed out after 2s waiting for"), out
    assert f"rank {stopped}" in line.split("waiting for")[1], line
