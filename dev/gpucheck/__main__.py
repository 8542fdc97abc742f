"""python -m dev.gpucheck (from the repository's root): the GPU check as one command."""
import math
import os
import sys

import click

from cupygpt import CupyGPTError
from cupygpt.backends import gpu_available
from cupygpt.cli.flags import config, entry, one_process, options_of
from cupygpt.config.sections import at_most_a_year
from cupygpt.paths import check_outputs, claim, json_object, make_dir

from .check import REPORT, verdict
from .check import gpucheck as run_check
from .config import GpucheckConfig


@click.command()
@options_of(GpucheckConfig)
@entry
def gpucheck(**kw):
    """The GPU check: verify, README's training commands, all GPU tests, the benchmarks and
    their peers, a pipeline run (also under MPS) and compute-sanitizer, the most valuable
    first, within --budget seconds, in one report; exit 0 only when every part has run and
    passed."""
    one_process("gpucheck")
    c = config(GpucheckConfig, kw)
    out, budget, peers_dir = c.out, c.budget, c.peers_dir
    if not budget > 0 or math.isinf(budget):  # nan too
        raise CupyGPTError("must be a positive number of seconds", "budget", budget)
    at_most_a_year(budget, "budget")
    if peers_dir is not None and not os.path.isfile(os.path.join(peers_dir, "run-peers.sh")):
        raise CupyGPTError("must be the peers' directory (it has no run-peers.sh)",
                           "peers_dir", peers_dir)
    check_outputs([("out", out)], [])  # (not into the package, as train's -o)
    make_dir("out", out)
    claim("out", out)
    if os.path.lexists(os.path.join(out, "report.json")):  # (refused before the check)
        json_object(os.path.join(out, "report.json"), REPORT)
    if not gpu_available():
        raise CupyGPTError("gpucheck: no GPU is visible (or CuPy is missing); run it on a "
                           "GPU machine after pip install -e '.[cuda13,test,test-cuda]'")
    report, md = run_check(out, "quick" if c.quick else "full", c.parts, budget, peers_dir)
    click.echo(md)
    sys.exit(0 if verdict(report) == "PASS" else 1)


if __name__ == "__main__":
    gpucheck(prog_name="python -m dev.gpucheck")
