"""Train and val loss curves from a `train` JSON-lines log."""
import json

from . import CupyGPTError


def plot(log_path, out_path):
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise CupyGPTError("plot needs matplotlib: pip install -e '.[plot]'") from None
    try:
        recs = [json.loads(line) for line in open(log_path) if line.strip()]
    except OSError as e:
        raise CupyGPTError(f"{log_path}: cannot read the log ({e.strerror})") from None
    except json.JSONDecodeError as e:
        raise CupyGPTError(f"{log_path}: not a JSON-lines train log (line {e.lineno})") from None
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
    from .files import atomic_write
    with atomic_write(out_path) as f:
        fig.savefig(f, format="png")
    plt.close(fig)
    return len(train), len(val)
