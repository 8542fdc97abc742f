"""Under mpiexec -n T: one training step's gradients of a tensor-parallel stage (T shards of
the whole model); the tensors every shard holds whole must have identical bits on all, and
each shard must hold about 1/T of the parameters and less of the activations."""
import sys

import numpy as np
from mpi4py import MPI

from cupygpt.backends.numpy.backend import NumpyBackend
from cupygpt.comm.mpi import Mpi
from cupygpt.formats.llmc import read_model
from cupygpt.parallel.mesh import Mesh
from cupygpt.parallel.runner import Runner
from cupygpt.parallel.settings import StepSettings

be = NumpyBackend()

cfg, params = read_model(sys.argv[1])
world = MPI.COMM_WORLD.size
mesh = Mesh(MPI.COMM_WORLD.rank, tp=world)
run = Runner(shape=cfg, be=be, transport=Mpi(be, mesh, 60.0), mesh=mesh,
             settings=StepSettings(batch=2, seq=8))
run.load_state_dict(params)
x = np.random.default_rng(0).integers(0, cfg.V, (2, 9)).astype(np.int32)
run.gradients(x[:, :-1], x[:, 1:])
whole = ("wpe", "ln1w", "ln1b", "attprojb", "ln2w", "ln2b", "fcprojb", "lnfw", "lnfb")
mine = {n: run.stages[0].g[n].copy() for n in whole}
for n, g in mine.items():
    assert np.abs(g).max() > 0, n  # a gradient that is zero everywhere would prove nothing
theirs = MPI.COMM_WORLD.allgather(mine)
for n in whole:
    assert all(np.array_equal(t[n], mine[n]) for t in theirs), n
mem = run.memory
one = Mpi(be, Mesh(0), 60.0)
one.comm = MPI.COMM_SELF  # (a one-rank world: its collectives are this rank's alone)
alone = Runner(shape=cfg, be=be, transport=one, mesh=Mesh(0),
               settings=StepSettings(batch=2, seq=8)).memory
assert mem["params"] < 1.1 * alone["params"] / world, (mem, alone)
assert mem["activations"] < alone["activations"], (mem, alone)
if mesh.rank == 0:
    print(f"replicated gradients identical on {world} shards; shard/whole: " + ", ".join(
        f"{k} {mem[k] / alone[k]:.3f}" for k in mem if alone[k]))
