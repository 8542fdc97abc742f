"""Train and val loss curves from a `train` JSON-lines log."""
import json
import logging
import math
import os

from .. import CupyGPTError
from ..config.tools import image_format
from ..paths import atomic_write, loads, read_bounded, shown


def number(x):
    """A plottable value: int or float (a float's NaN or inf is what training logged)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


LIMIT = 1e300  # beyond any loss, and room for the plot's range arithmetic (2e308 overflows)


def plottable(x):
    return math.isfinite(x) and abs(x) <= LIMIT


def read_log(path):
    """The log's records; a line that is not a step record is named by its number. A last
    line without its newline that is not JSON yet is one a live run is writing: left out."""
    try:
        text = read_bounded(path, "train log").decode("utf-8")
        lines = text.splitlines()
    except OSError as e:
        raise CupyGPTError(f"{path}: cannot read the log ({e.strerror})") from None
    except UnicodeDecodeError:
        raise CupyGPTError(f"{path}: not a text file; give a run's log.jsonl") from None
    recs = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                rec = loads(line)
            except ValueError as e:  # (a number of 5,000 digits is Python's ValueError)
                if n == len(lines) and not text.endswith("\n"):
                    if recs:
                        break
                    raise CupyGPTError(f"{path}: its one line is not whole yet (a live run's "
                                       f"log being written?); plot it again after a step is "
                                       f"logged") from None
                raise CupyGPTError(f"{path}: line {n} is not JSON ({getattr(e, 'msg', e)}); "
                                   f"is this a train log (log.jsonl)?") from None
            if not isinstance(rec, dict) or "step" not in rec:
                raise CupyGPTError(f"{path}: line {n} is not a step record") from None
            bad = [k for k in ("step", "train_loss", "val_loss")
                   if k in rec and not number(rec[k])]
            if bad:
                raise CupyGPTError(f"{path}: line {n}'s {bad[0]} is {json.dumps(rec[bad[0]])}, "
                                   f"not a number; is this a train log (log.jsonl)?")
            recs.append(rec)
    return recs


def pyplot(command):
    """matplotlib.pyplot drawing into files (Agg), or command's one line saying what to
    install. MPLBACKEND is set to Agg first: matplotlib's import refuses a value it does not
    know (a traceback), and these commands draw into files whatever the display."""
    os.environ["MPLBACKEND"] = "Agg"
    # a font cache matplotlib cannot save (a full disk, ulimit -f) costs it only time, and
    # its warning would be a second line beside the command's own error about that write
    logging.getLogger("matplotlib.font_manager").setLevel(logging.ERROR)
    try:
        import matplotlib.pyplot as plt
    except ImportError:
        raise CupyGPTError(f"{command} needs matplotlib: pip install 'cupygpt[plot]' (in a "
                           f"clone: pip install -e '.[plot]')") from None
    return plt


def plot(log_path, out_path):
    plt = pyplot("plot")
    recs = read_log(log_path)
    given = {k: [(r["step"], r[k]) for r in recs if k in r] for k in ("train_loss", "val_loss")}
    if not any(given.values()):
        raise CupyGPTError(f"{log_path}: holds no train_loss or val_loss records")
    train, val = ([p for p in given[k] if plottable(p[0]) and plottable(p[1])]
                  for k in ("train_loss", "val_loss"))
    if not train and not val:
        raise CupyGPTError(f"{log_path}: no loss to plot: every one is NaN, infinite or "
                           f"beyond +-{LIMIT:g} (a run that diverged); nothing written")
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for pts, label, style in ((train, "train", "-"), (val, "val", "o-")):
        if pts:
            ax.plot(*zip(*pts), style, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(shown(log_path))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_write(out_path) as f:
        fig.savefig(f, format=image_format(out_path))
    plt.close(fig)
    return len(train), len(val), sum(map(len, given.values())) - len(train) - len(val)
