"""Runs every stage's action list together on a clock: proves a schedule deadlock-free and
in order, and measures its bubble."""
from .schedule import RECVS, SENDS, Op


def simulate(p, m, schedule, t_fwd=1.0, t_bwd=2.0, capacity=1):
    """Runs all ranks' lists together. Sends are buffered in a channel of `capacity` messages
    per (kind, direction) and block when it is full; receives block until a message arrives.

    Returns dict(makespan, busy per rank, bubble fraction). Raises RuntimeError naming the
    stuck actions when no rank can progress (a deadlock) or a message is out of order.
    """
    lists = [schedule(p, m, r) for r in range(p)]
    pc = [0] * p                     # next action per rank
    clock = [0.0] * p                # time each rank is free
    busy = [0.0] * p
    chans = {}                       # (kind, src, dst) -> list of (mb, time sent)
    popped = {}                      # (kind, src, dst) -> when the receiver last took one
    done = False
    while not done:
        progressed, done = False, True
        for r in range(p):
            if pc[r] == len(lists[r]):
                continue
            done = False
            a = lists[r][pc[r]]
            if a.op in (Op.FWD, Op.BWD):
                dt = t_fwd if a.op == Op.FWD else t_bwd
                clock[r] += dt
                busy[r] += dt
            elif a.op in SENDS:
                kind, step = SENDS[a.op]
                dst = r + step
                q = chans.setdefault((kind, r, dst), [])
                if len(q) >= capacity:
                    continue
                clock[r] = max(clock[r], popped.get((kind, r, dst), 0.0))
                q.append((a.mb, clock[r]))
            elif a.op in RECVS:
                kind, step = RECVS[a.op]
                src = r + step
                q = chans.setdefault((kind, src, r), [])
                if not q:
                    continue
                mb, t = q.pop(0)
                popped[(kind, src, r)] = max(clock[r], t)
                if mb != a.mb:
                    raise RuntimeError(f"rank {r} expected {kind} of micro-batch {a.mb}, "
                                       f"got {mb}")
                clock[r] = max(clock[r], t)
            elif a.op != Op.STEP:
                raise ValueError(f"rank {r}: unknown pipeline action {a}")
            pc[r] += 1
            progressed = True
        if not progressed and not done:
            stuck = [f"rank {r}: {lists[r][pc[r]]}" for r in range(p) if pc[r] < len(lists[r])]
            raise RuntimeError("deadlock: " + "; ".join(stuck))
    makespan = max(clock)
    return {"makespan": makespan, "busy": busy,
            "bubble": 1.0 - sum(busy) / (p * makespan)}
