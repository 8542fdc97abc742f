"""Where the replicas' gradient sum may overlap the backward."""
from types import SimpleNamespace

import pytest

from cupygpt.comm.mpi import Mpi
from cupygpt.comm.nccl import Nccl
from cupygpt.comm.nvshmem import Nvshmem
from cupygpt.parallel.runner import Runner


@pytest.mark.parametrize("transport,tp,overlaps", [
    (Nvshmem, 2, False), (Nvshmem, 1, True), (Mpi, 2, True), (Nccl, 2, True)])
def test_nvshmem_sums_the_replicas_after_the_backward_beside_tp(transport, tp, overlaps):
    """Over nvshmem with --tp the overlapped sum gave wrong gradients on an H200 and an H100
    (comm/nvshmem.py says what was measured): there the sum waits for the backward; every
    other placement overlaps as asked, and nothing overlaps when not asked."""
    run = SimpleNamespace(mesh=SimpleNamespace(tp=tp), transport=transport)
    assert Runner._may_overlap(run, True) is overlaps
    assert Runner._may_overlap(run, False) is False
