"""The transports on cudasim, one mpiexec job each (transports_job.py): the collectives of
2- and 3-member dp and tp groups against a float64 NumPy sum (and, for mpi and nvshmem, the
member-order float32 sum bit for bit; NCCL adds in an order of its own), bit-identical on
every member and on a repeat, an uneven size, nvshmem's in several rounds; and "act" and
"grad" exchanged with both pipeline-ring neighbours, interleaved, as zero-bubble V and the
interleaved schedule's wrap need."""
import os
import subprocess
import sys

import pytest
from harness import ROOT, SUPPORT, device_env, mpiexec, requires_sim

pytestmark = [requires_sim, pytest.mark.skipif(mpiexec() is None, reason="needs mpiexec")]


@pytest.mark.parametrize("transport", ["mpi", "nccl", "nvshmem"])
@pytest.mark.parametrize("pp,dp,tp", [(1, 2, 2), (1, 3, 1), (3, 1, 1), (2, 1, 1)],
                         ids=["dp2xtp2", "dp3", "ring3", "ring2"])
def test_transport_on_cudasim(transport, pp, dp, tp):
    ranks = pp * dp * tp
    env = {**os.environ, **device_env("sim"), "CUDASIM_DEVICES": str(ranks),
           "CUDASIM_LAG_S": "0.001", "PYTHONUNBUFFERED": "1"}
    env["PYTHONPATH"] = os.pathsep.join((env["PYTHONPATH"], ROOT))
    res = subprocess.run([mpiexec(), "-n", str(ranks), sys.executable,
                          os.path.join(SUPPORT, "transports_job.py"), transport,
                          str(pp), str(dp), str(tp)], capture_output=True, text=True,
                         timeout=120, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    axes = [a for a, n in (("dp", dp), ("tp", tp)) if n > 1] + (["ring"] if pp > 1 else [])
    assert res.stdout.count(" ok") == ranks * len(axes), res.stdout
