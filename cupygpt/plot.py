"""Train and val loss curves from a `train` JSON-lines log."""
import json

from . import CupyGPTError
from .files import atomic_write
from .paths import read_bounded


def number(x):
    """A plottable value: int or float (a float's NaN or inf is what training logged)."""
    return isinstance(x, (int, float)) and not isinstance(x, bool)


def read_log(path):
    """The log's records; a line that is not a step record is named by its number."""
    try:
        lines = read_bounded(path, "train log").decode("utf-8").splitlines()
    except OSError as e:
        raise CupyGPTError(f"{path}: cannot read the log ({e.strerror})") from None
    except UnicodeDecodeError:
        raise CupyGPTError(f"{path}: not a text file; give a run's log.jsonl") from None
    recs = []
    for n, line in enumerate(lines, 1):
        if line.strip():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                raise CupyGPTError(f"{path}: line {n} is not JSON ({e.msg}); is this a "
                                   f"train log (log.jsonl)?") from None
            if not isinstance(rec, dict) or "step" not in rec:
                raise CupyGPTError(f"{path}: line {n} is not a step record") from None
            bad = [k for k in ("step", "train_loss", "val_loss")
                   if k in rec and not number(rec[k])]
            if bad:
                raise CupyGPTError(f"{path}: line {n}'s {bad[0]} is {json.dumps(rec[bad[0]])}, "
                                   f"not a number; is this a train log (log.jsonl)?")
            recs.append(rec)
    return recs


def plot(log_path, out_path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CupyGPTError("plot needs matplotlib: pip install 'cupygpt[plot]' (in a clone: "
                           "pip install -e '.[plot]')") from None
    recs = read_log(log_path)
    train = [(r["step"], r["train_loss"]) for r in recs if "train_loss" in r]
    val = [(r["step"], r["val_loss"]) for r in recs if "val_loss" in r]
    if not train and not val:
        raise CupyGPTError(f"{log_path}: holds no train_loss or val_loss records")
    fig, ax = plt.subplots(figsize=(8, 5), dpi=110)
    for pts, label, style in ((train, "train", "-"), (val, "val", "o-")):
        if pts:
            ax.plot(*zip(*pts), style, label=label)
    ax.set_xlabel("step")
    ax.set_ylabel("loss")
    ax.set_title(log_path)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    with atomic_write(out_path) as f:
        fig.savefig(f, format="png")
    plt.close(fig)
    return len(train), len(val)
