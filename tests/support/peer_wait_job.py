"""One rank of test_peer_waits.py's jobs: `mpiexec -n 2 python peer_wait_job.py TRANSPORT
WAIT`, on cudasim. Rank 0 stops itself (SIGSTOP) once the transport is up; rank 1 waits on
it as WAIT says, with a peer timeout of 2 s, and prints the error it gets (then aborts the
job, as the CLI does): a wait that never ends is the test's failure. A gather waits on
its root's side: there rank 1 stops and rank 0 waits."""
import os
import signal
import sys
import time

import cupy as cp
import numpy as np
from mpi4py import MPI  # noqa: E402

from cupygpt import CupyGPTError
from cupygpt.backends.cuda.backend import CudaBackend
from cupygpt.comm import make_transport
from cupygpt.parallel.mesh import Mesh

be = CudaBackend()
name, wait = sys.argv[1:3]
rank = MPI.COMM_WORLD.Get_rank()
tr = make_transport(name, be, Mesh(rank, 2, 1, 1), 2)
tr.prepare({kind: ((4,), 2, np.float32) for kind in ("act", "grad")})
tr.barrier()
if rank == (1 if wait == "gather" else 0):
    os.kill(os.getpid(), signal.SIGSTOP)
got = cp.zeros(4, np.float32)
try:
    if wait in ("to_host", "synchronize"):  # rank 0's activation, which never comes
        tr.recv("act", got, 0)
        be.to_host(got) if wait == "to_host" else be.synchronize()
    elif wait == "close":  # at exit: NVSHMEM's collective frees
        tr.close()
    elif wait == "bcast":
        tr.bcast(None, root=0)
    else:
        tr.gather(rank)
    print(f"rank {rank}: {wait} returned", flush=True)
except CupyGPTError as e:
    print(f"error: {e}", flush=True)
except SystemExit:  # close's own line (launch.fail, which under the CLI aborts the job)
    sys.stderr.flush()
time.sleep(0.5)  # the launcher forwards the line before the abort tears the job down
MPI.COMM_WORLD.Abort(1)
