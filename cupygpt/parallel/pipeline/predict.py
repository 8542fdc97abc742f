"""A pipelined step's time on P GPUs, predicted from parts measured elsewhere: each stage's
forward and backward per micro-batch (measured on one GPU, where a 2-stage step of one
micro-batch never runs two stages at once), a handoff's fixed cost per message (bench
--comm's small-message latency: the transport's software and the device's signalling) and
the link's bandwidth (one GPU has no link between GPUs: a published figure, such as an
H100's NVLink), run through the schedule simulator; the step's close (the tied wte's sum,
AdamW) is added after the last action."""
from .simulate import simulate


def handoff_seconds(nbytes: float, latency_s: float, bandwidth_Bps: float) -> float:
    """One message over the link: its fixed cost, then its bytes at the link's bandwidth."""
    return latency_s + nbytes / bandwidth_Bps


def predict_step(p, m, schedule, t_fwd, t_bwd, *, handoff_bytes, latency_s, bandwidth_Bps,
                 t_wgt=None, v=1, t_close=0.0, close_bytes=0):
    """The simulated step (times in seconds; t_fwd, t_bwd, t_wgt and t_close a number or one
    per rank, as simulate takes them): the pipeline's makespan with every handoff of
    handoff_bytes taking handoff_seconds, then the slowest rank's close and, where the close
    exchanges close_bytes between ranks (the tied wte's gradient), that message over the
    link. Returns {step_s, pipeline_s, bubble, handoff_s, close_s}."""
    t_comm = handoff_seconds(handoff_bytes, latency_s, bandwidth_Bps)
    sim = simulate(p, m, schedule, v, t_fwd=t_fwd, t_bwd=t_bwd, t_wgt=t_wgt, t_comm=t_comm)
    close = max(t_close) if isinstance(t_close, (list, tuple)) else t_close
    if close_bytes:
        close += handoff_seconds(close_bytes, latency_s, bandwidth_Bps)
    return {"step_s": sim["makespan"] + close, "pipeline_s": sim["makespan"],
            "bubble": sim["bubble"], "handoff_s": t_comm, "close_s": close}
