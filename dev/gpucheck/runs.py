"""How the GPU check runs things: every run a process group of its own, bounded by what is
left of the check's Budget (a run that cannot fit is skipped, its result a Skip; one the
budget's end cuts raises BudgetSpent), its output kept in a log as it comes."""
import contextlib
import os
import shutil
import signal
import subprocess
import sys
import time

from cupygpt.paths import PACKAGE


class Skip(str):
    """Why a run did not start: a part yields {name: Skip(why)} for one of its runs, or
    Skip(why) for all of them, and the report lists it apart from the results."""


class BudgetSpent(Exception):
    """A run was stopped at the budget's end: the part ends there, and so does the check."""


class Budget:
    """The seconds the whole check may take, counted from its start."""

    def __init__(self, seconds, clock=time.monotonic):
        self.clock, self.end = clock, clock() + seconds

    def left(self):
        return max(0.0, self.end - self.clock())

    def short(self, need):
        """Why a run that takes about `need` seconds cannot start now, or None."""
        left = self.left()
        return f"needs about {need:g} s, {left:.0f} s of the budget left" if left < need else None


def sh(cmd, cap, log, cwd, budget, env=None):
    """Runs cmd in cwd, in a process group of its own, for at most `cap` seconds or what is
    left of the budget, with its output going to the file log as it comes (a run killed
    from outside keeps what it printed); returns (exit status, output). At the limit the
    whole group is killed (mpiexec's ranks and pytest's workers too, which would otherwise
    hold the GPU); at the budget's end that raises BudgetSpent."""
    # the package's parent goes last on PYTHONPATH (after cudasim's stand-in cupy, in the dry run):
    # the run imports this cupygpt, also from a clone that is not pip-installed (as on a
    # lent GPU machine)
    path = [p for p in (os.environ.get("PYTHONPATH"), os.path.dirname(PACKAGE)) if p]
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "PYTHONPATH": os.pathsep.join(path),
           **(env or {})}
    timeout = min(cap, budget.left())
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=cwd, env=env,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            rc = 124
        finally:
            kill_group(proc)
    text = open(log, errors="replace").read()
    if rc == 124 and timeout < cap:
        # named as its log is (e.g. verify_tiny_tf32): the log itself goes with the work dir
        raise BudgetSpent(f"cut at the budget's end after {timeout:.0f} s, in "
                          + os.path.basename(log).split(".")[0])
    return rc, text + (f"\ntimed out after {timeout:.0f}s" if rc == 124 else "")


def kill_group(proc):
    """Kills what is left of a run's process group (a rank or worker it started) and reaps
    the run."""
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()


def launcher(name):
    """An MPI launcher: the one beside this Python (the mpich wheel's, as README says),
    else PATH's."""
    here = os.path.join(os.path.dirname(sys.executable), name)
    return here if os.path.exists(here) else shutil.which(name)


def last_line(text, rc):
    return text.strip().splitlines()[-1] if text.strip() else f"exit {rc}"
