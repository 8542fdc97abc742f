"""Runs every rank's action list together on a clock: proves a schedule deadlock-free and
in order, and measures its bubble and activation memory."""
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
    lists = [fn(p, m, r, v) for r in range(p)]
    last = p * v - 1
    # (rank, chunk, step along the model) -> the (rank, chunk) a message goes to / comes from
    at = holders(name, p, v)
    peer = {(r, c, d): at[k + d] for r in range(p)
            for c, k in enumerate(placement(name, p, v, r)) for d in (-1, 1)
            if 0 <= k + d <= last}
    def costs(t_fwd, t_bwd, t_wgt):
        split = t_bwd / 2 if t_wgt is None else t_bwd
        return {Op.FWD: t_fwd, Op.BWD: t_bwd if t_wgt is None else t_bwd + t_wgt,
                Op.BWD_INPUT: split, Op.BWD_WEIGHT: t_bwd - split if t_wgt is None else t_wgt}

    def of(t, r):  # a time, or a list of one per rank
        return t[r] if isinstance(t, (list, tuple)) else t
    cost = [costs(of(t_fwd, r), of(t_bwd, r), of(t_wgt, r)) for r in range(p)]
    pc = [0] * p                     # next action per rank
    clock = [0.0] * p                # time each rank is free
    busy = [0.0] * p
    events = [[] for _ in range(p)]
    live = [set() for _ in range(p)]
    peak = [0] * p
    chans = {}                       # (kind, src, dst) -> [messages waiting: (mb, chunk, t)];
    #                                  on one rank (kind, r, r, receiving chunk)
    sent, pops = {}, {}              # per channel: messages sent; when each was taken
    while any(pc[r] < len(lists[r]) for r in range(p)):
        progressed = False
        for r in range(p):
            if pc[r] == len(lists[r]):
                continue
            a = lists[r][pc[r]]
            if a.op in cost[r]:
                dt = cost[r][a.op] / v
                events[r].append((a, clock[r], clock[r] + dt))
                clock[r] += dt
                busy[r] += dt
                if a.op == Op.FWD:
                    live[r].add((a.mb, a.chunk))
                    peak[r] = max(peak[r], len(live[r]))
                elif a.op in (Op.BWD, Op.BWD_WEIGHT):
                    live[r].discard((a.mb, a.chunk))
            elif a.op in SENDS:
                kind, step = SENDS[a.op]
                dst, c = peer[(r, a.chunk, step)]
                key = (kind, r, dst) if dst != r else (kind, r, r, c)  # local: per chunk
                n, taken = sent.get(key, 0), pops.setdefault(key, [])
                if dst != r and n >= capacity:
                    if len(taken) <= n - capacity:
                        continue     # full: wait for the receiver
                    clock[r] = max(clock[r], taken[n - capacity])
                sent[key] = n + 1
                clock[r] += of(t_send, r)
                chans.setdefault(key, []).append(
                    (a.mb, c, clock[r] + (t_comm if dst != r else 0.0)))
            elif a.op in RECVS:
                kind, step = RECVS[a.op]
                src = peer[(r, a.chunk, step)][0]
                key = (kind, src, r) if src != r else (kind, r, r, a.chunk)
                q = chans.setdefault(key, [])
                if not q:
                    continue
                mb, c, t = q.pop(0)
                if (mb, c) != (a.mb, a.chunk):
                    raise RuntimeError(f"rank {r} expected {kind} of micro-batch {a.mb} chunk "
                                       f"{a.chunk}, got micro-batch {mb} chunk {c}")
                clock[r] = max(clock[r], t) + of(t_recv, r)
                pops.setdefault(key, []).append(clock[r])
            elif a.op != Op.STEP:
                raise ValueError(f"rank {r}: unknown pipeline action {a}")
            pc[r] += 1
            progressed = True
        if not progressed:
            stuck = [f"rank {r}: {lists[r][pc[r]]}" for r in range(p) if pc[r] < len(lists[r])]
            raise RuntimeError("deadlock: " + "; ".join(stuck))
    makespan = max(clock)
    return {"makespan": makespan, "busy": busy,
            "bubble": 1.0 - sum(busy) / (p * makespan) if makespan else 0.0,
            "peak": [n / v for n in peak], "events": events}
