"""`python faulty_cli.py FAULT ARGS...`: the CLI (`python cli.py ARGS...`) with a fault put
into train's loop through its seam, Trainer.before_step, so a test can make what a run
meets mid-way happen on cue, with nothing in the package reading a setting of the tests:

    raise:STEP:RANK   rank RANK raises as step STEP starts (a rank failing mid-run)
    start:RANK        rank RANK refuses the run as its loop is made, -o made (a rank failing
                      alone at the start: its own memory, disk or files)
    targets:STEP      step STEP's targets all the vocabulary's last token (a loss spike,
                      for -sl/-sg)
    memory:STEP       every rank runs out of memory as step STEP starts (MemoryError, as
                      an allocation the memory check did not foresee raises)
    full:STEP         the disk fills as step STEP's checkpoint is written (its model.bin
                      meets ENOSPC, as a disk another process filled mid-run does)
    oom:STEP          memory runs out as step STEP's checkpoint is written (MemoryError),
                      under a `ulimit -v` of 4 TiB, which constrains nothing but is named

The fault is read where the loop meets it, so a malformed one is the run's error: one
line, exit 1, as any error of a run before its first step (harness.cli(fault=...) runs
this).
"""
import errno
import resource
import sys

import numpy as np

from cupygpt import CupyGPTError
from cupygpt.paths import disk_full
from cupygpt.train import checkpoint
from cupygpt.train.loop import Trainer

FAULT = sys.argv.pop(1)


def parse(spec):
    """(kind, *whole numbers) of a fault, or a CupyGPTError saying how to write one."""
    kind, _, rest = spec.partition(":")
    try:
        numbers = tuple(map(int, rest.split(":")))
    except ValueError:
        numbers = ()
    if (kind, len(numbers)) not in (("raise", 2), ("targets", 1), ("start", 1),
                                    ("memory", 1), ("full", 1), ("oom", 1)):
        raise CupyGPTError(f"fault {spec!r}: give raise:STEP:RANK, targets:STEP, memory:STEP, "
                           f"full:STEP, oom:STEP or start:RANK (whole numbers)")
    return (kind, *numbers)


def before_step(trainer, step, x, y):
    kind, at, *rank = parse(FAULT)
    if kind == "targets" and step == at:
        y = np.full_like(y, trainer.sess.shape.V - 1)
    if kind == "memory" and step == at:
        raise MemoryError()
    if kind == "raise" and (step, trainer.transport.rank) == (at, *rank):
        raise RuntimeError(f"injected fault on rank {trainer.transport.rank} at step {step}")
    return x, y


def made(init):
    def start(trainer, sess, *args):
        kind, *rank = parse(FAULT)
        if kind == "start" and sess.mesh.rank == rank[0]:
            raise CupyGPTError(f"rank {sess.mesh.rank} cannot start (an injected fault)")
        init(trainer, sess, *args)
    return start


def filling(write):
    def write_model(path, *args, **kw):
        kind, *at = parse(FAULT)
        if kind == "full" and f"ckpt_{at[0]:08d}" in path:
            raise disk_full(path, OSError(errno.ENOSPC, "No space left on device"))
        if kind == "oom" and f"ckpt_{at[0]:08d}" in path:
            raise MemoryError()
        return write(path, *args, **kw)
    return write_model


if FAULT.startswith("oom:"):
    resource.setrlimit(resource.RLIMIT_AS, (1 << 42, resource.getrlimit(resource.RLIMIT_AS)[1]))
Trainer.before_step = before_step
checkpoint.write_model = filling(checkpoint.write_model)
Trainer.__init__ = made(Trainer.__init__)
sys.argv[0] = "cli.py"  # (the name the CLI's usage lines give)
from cupygpt.__main__ import run  # noqa: E402 (after the fault is in place, as cli.py would)

run()
