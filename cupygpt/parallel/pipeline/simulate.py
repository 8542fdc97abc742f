"""Runs every rank's action list together on a clock: proves a schedule deadlock-free and
in order, and measures its bubble and activation memory."""
from dataclasses import dataclass, field

from .schedule import RECVS, SCHEDULES, SENDS, Op, holders, placement


def simulate(p, m, schedule, v=1, t_fwd=1.0, t_bwd=2.0, t_wgt=None, t_comm=0.0,
             capacity=1, placed=None, t_send=0.0, t_recv=0.0):
    """Runs all ranks' lists together. schedule: a SCHEDULES name or function (p, m, r, v);
    placed: the schedule whose placement the lists follow (default: schedule's own; a
    function outside the registry has the one-stage-per-rank placement, or Megatron's
    with v > 1).

    Times are per whole-stage micro-batch (each a number, or a list of one per rank); a
    chunk's op takes 1/v of them. t_wgt None:
    t_bwd is the whole backward (a fused BWD; a split one's B and W take half each); else
    BWD_INPUT takes t_bwd, BWD_WEIGHT t_wgt and a fused BWD their sum. A message between
    ranks arrives t_comm after its send; a hand-off between chunks of one rank is a local
    copy (no latency, never full). t_send and t_recv: how long a send, and a receive whose
    message has come, keep their rank busy (a host-staged copy; not counted as compute).
    Between ranks, sends are buffered in a FIFO channel of `capacity` messages per (kind,
    source, destination) and block while it is full; receives block until a message
    arrives.

    Returns dict(makespan, busy per rank, bubble fraction, peak per rank: the most
    (micro-batch, chunk) activations alive at once, from forward to the end of its
    backward, in whole-stage units (1/v a chunk), events per rank: [(action, start, end)]
    of its compute actions). Raises RuntimeError naming the stuck actions when no rank can
    progress (a deadlock) or when a receive takes another message than it expects.
    """
    name = placed or (schedule if isinstance(schedule, str) else
                      next((n for n, f in SCHEDULES.items() if f is schedule), ""))
    fn = SCHEDULES[schedule] if isinstance(schedule, str) else schedule
    ranks = [_Rank(r, fn(p, m, r, v), _costs(_of(t_fwd, r), _of(t_bwd, r), _of(t_wgt, r)),
                   _of(t_send, r), _of(t_recv, r)) for r in range(p)]
    net = _Network(name, p, v, t_comm, capacity)
    # each rank runs until it waits (the clocks follow from the messages' times, not from
    # the order the ranks are run in); a sweep in which none moves is a deadlock
    while any(rk.pc < len(rk.actions) for rk in ranks):
        progressed = False
        for rk in ranks:
            while rk.pc < len(rk.actions) and net.advance(rk, rk.actions[rk.pc], v):
                rk.pc += 1
                progressed = True
        if not progressed:
            stuck = [f"rank {rk.r}: {rk.actions[rk.pc]}" for rk in ranks
                     if rk.pc < len(rk.actions)]
            raise RuntimeError("deadlock: " + "; ".join(stuck))
    makespan = max(rk.clock for rk in ranks)
    busy = [rk.busy for rk in ranks]
    return {"makespan": makespan, "busy": busy,
            "bubble": 1.0 - sum(busy) / (p * makespan) if makespan else 0.0,
            "peak": [rk.peak / v for rk in ranks], "events": [rk.events for rk in ranks]}


def _of(t, r):
    """A time, or a list of one per rank: rank r's."""
    return t[r] if isinstance(t, (list, tuple)) else t


def _costs(t_fwd, t_bwd, t_wgt):
    """Each compute op's time (see simulate's t_wgt)."""
    split = t_bwd / 2 if t_wgt is None else t_bwd
    return {Op.FWD: t_fwd, Op.BWD: t_bwd if t_wgt is None else t_bwd + t_wgt,
            Op.BWD_INPUT: split, Op.BWD_WEIGHT: t_bwd - split if t_wgt is None else t_wgt}


@dataclass
class _Rank:
    """One rank's list and where it stands: the next action, the time it is free, its busy
    time, compute events and live activations."""
    r: int
    actions: list
    cost: dict
    t_send: float
    t_recv: float
    pc: int = 0
    clock: float = 0.0
    busy: float = 0.0
    peak: int = 0
    events: list = field(default_factory=list)
    live: set = field(default_factory=set)

    def compute(self, a, v):
        dt = self.cost[a.op] / v
        self.events.append((a, self.clock, self.clock + dt))
        self.clock += dt
        self.busy += dt
        if a.op == Op.FWD:
            self.live.add((a.mb, a.chunk))
            self.peak = max(self.peak, len(self.live))
        elif a.op in (Op.BWD, Op.BWD_WEIGHT):
            self.live.discard((a.mb, a.chunk))


class _Network:
    """The channels: per (kind, source, destination) between ranks, a FIFO of `capacity`
    messages; on one rank, per (kind, r, r, receiving chunk), unbounded and instant."""

    def __init__(self, name, p, v, t_comm, capacity):
        last = p * v - 1
        at = holders(name, p, v)
        # (rank, chunk, step along the model) -> the (rank, chunk) a message goes to /
        # comes from
        self.peer = {(r, c, d): at[k + d] for r in range(p)
                     for c, k in enumerate(placement(name, p, v, r)) for d in (-1, 1)
                     if 0 <= k + d <= last}
        self.t_comm, self.capacity = t_comm, capacity
        self.queues = {}        # channel -> [messages waiting: (mb, chunk, arrival)]
        self.sent, self.taken = {}, {}  # per channel: messages sent; when each was taken

    def advance(self, rk, a, v):
        """Runs action a of rank rk if it can go now; False when it must wait."""
        if a.op in rk.cost:
            rk.compute(a, v)
        elif a.op in SENDS:
            return self._send(rk, a)
        elif a.op in RECVS:
            return self._recv(rk, a)
        elif a.op != Op.STEP:
            raise ValueError(f"rank {rk.r}: unknown pipeline action {a}")
        return True

    def _send(self, rk, a):
        kind, step = SENDS[a.op]
        dst, c = self.peer[(rk.r, a.chunk, step)]
        key = (kind, rk.r, dst) if dst != rk.r else (kind, rk.r, rk.r, c)
        n, taken = self.sent.get(key, 0), self.taken.setdefault(key, [])
        if dst != rk.r and n >= self.capacity:
            if len(taken) <= n - self.capacity:
                return False     # full: wait for the receiver
            rk.clock = max(rk.clock, taken[n - self.capacity])
        self.sent[key] = n + 1
        rk.clock += rk.t_send
        self.queues.setdefault(key, []).append(
            (a.mb, c, rk.clock + (self.t_comm if dst != rk.r else 0.0)))
        return True

    def _recv(self, rk, a):
        kind, step = RECVS[a.op]
        src = self.peer[(rk.r, a.chunk, step)][0]
        key = (kind, src, rk.r) if src != rk.r else (kind, rk.r, rk.r, a.chunk)
        q = self.queues.setdefault(key, [])
        if not q:
            return False
        mb, c, t = q.pop(0)
        if (mb, c) != (a.mb, a.chunk):
            raise RuntimeError(f"rank {rk.r} expected {kind} of micro-batch {a.mb} chunk "
                               f"{a.chunk}, got micro-batch {mb} chunk {c}")
        rk.clock = max(rk.clock, t) + rk.t_recv
        self.taken.setdefault(key, []).append(rk.clock)
        return True
