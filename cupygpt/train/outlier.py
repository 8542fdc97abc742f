"""llm.c's outlier detector (-sl, -sg): the z-score of each step's loss or gradient norm
against a window of the last 128 values, kept as running sums in float64 as llm.c does
(the new value joins the window before its z-score is taken; none until the window is
full). Its state is part of a checkpoint, so a resumed run skips what the uninterrupted
one would."""
import math

from ..formats.checkpoint import OUTLIER_WINDOW as WINDOW


class OutlierDetector:
    def __init__(self, state=None):
        self.buffer, self.index, self.sum, self.sum_sq = [], 0, 0.0, 0.0
        if state:  # (checked by the resume's validation: formats/checkpoint.outliers_ok)
            self.buffer, self.index = [float(x) for x in state["buffer"]], int(state["index"])
            self.sum, self.sum_sq = float(state["sum"]), float(state["sum_sq"])

    def update(self, value):
        """Adds value; returns its z-score (NaN while the window fills; 0 when it is flat).
        A value that is not finite stays out of the window (its sums would never recover)
        and scores inf: an outlier however the window looks."""
        if not math.isfinite(value):
            return math.inf
        if len(self.buffer) < WINDOW:
            self.buffer.append(value)
            self.sum += value
            self.sum_sq += value * value
            return math.nan
        old, self.buffer[self.index] = self.buffer[self.index], value
        self.sum -= old  # (llm.c's order of operations: the same running sums)
        self.sum_sq -= old * old
        self.sum += value
        self.sum_sq += value * value
        self.index = (self.index + 1) % WINDOW
        mean = self.sum / WINDOW
        std = math.sqrt(max(self.sum_sq / WINDOW - mean * mean, 0.0))
        return 0.0 if std == 0 else (value - mean) / std

    def state(self):
        """JSON-ready (floats round-trip exactly)."""
        return {"buffer": self.buffer, "index": self.index, "sum": self.sum,
                "sum_sq": self.sum_sq}


class UpdateGate:
    """-sl/-sg over a run: both detectors (always fed, as llm.c's), whether each step
    updates, and the detectors' state for a checkpoint. Each rank's detectors see the same
    global loss and norm; the ranks' answers are combined all the same, so all skip alike."""

    def __init__(self, transport, skip_loss, skip_norm, state=None):
        self.transport, self.limits = transport, {"loss": skip_loss, "norm": skip_norm}
        self.detectors = {k: OutlierDetector((state or {}).get(k)) for k in self.limits}
        self.skipped = None  # the last step's reason, when it was skipped

    def keep(self, loss, norm):
        z = {k: self.detectors[k].update(v) for k, v in (("loss", loss), ("norm", norm))}
        over = [f"{k} z {z[k]:.2f} > {limit:g}" for k, limit in self.limits.items()
                if limit and z[k] > limit]
        skip = self.transport.any(bool(over))
        self.skipped = ("; ".join(over) or "on another rank") if skip else None
        return not skip

    def state(self):
        return {k: d.state() for k, d in self.detectors.items()}
