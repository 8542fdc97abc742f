"""The GPU check's flags, declared as the product's commands declare theirs (a frozen
config whose fields carry their flags), so `python -m dev.gpucheck --help` reads alike."""
from dataclasses import dataclass
from typing import Optional

from cupygpt.config.fields import flag

# the parts in the order they run, the most valuable first so that a short budget drops
# the least (check.py maps each name to what it runs)
GPUCHECK_PARTS = ("verify", "readme", "tests", "bench", "peers", "pipeline", "sanitizer",
                  "comm")


@dataclass(frozen=True)
class GpucheckConfig:
    out: str = flag("--out", default="gpu_report", help="report directory", file="out",
                    empty="a directory name")
    budget: float = flag("--budget", default=420.0, help=(
        "seconds the whole check may take: each run gets what is left, and a part that "
        "cannot fit is skipped, the report saying why"))
    peers_dir: Optional[str] = flag("--peers", default=None, file="in", empty="a directory",
                                    help=(
        "the peers' directory (llm.c and PyTorch's GPT-2, run by its run-peers.sh): llm.c's "
        "build starts at once, in the background, and the peers run after bench at its B "
        "and T, for ratios measured side by side"))
    quick: bool = flag("--quick", default=False,
                       help="benchmark the tiny preset at short T (minutes)")
    parts: tuple[str, ...] = flag("--part", default=(), multiple=True, choices=GPUCHECK_PARTS,
                                  help="run only these parts, merged into the report in "
                                       "--out (default: all)")
