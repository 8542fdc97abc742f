"""Pipeline schedules as data: for (stages p, micro-batches m, rank r), the ordered actions.

An action is (op, mb). Ops: recv_act, fwd, send_act, recv_grad, bwd, send_grad, step.
A zero-bubble schedule would add bwd_input / bwd_weight ops; an interleaved one would add
a chunk index to the action. The runner and simulator only see the lists.
"""
from collections import namedtuple

Action = namedtuple("Action", "op mb")


def _fwd(p, r, i):
    return ([Action("recv_act", i)] if r > 0 else []) + [Action("fwd", i)] + \
           ([Action("send_act", i)] if r < p - 1 else [])


def _bwd(p, r, i):
    return ([Action("recv_grad", i)] if r < p - 1 else []) + [Action("bwd", i)] + \
           ([Action("send_grad", i)] if r > 0 else [])


def gpipe(p, m, r):
    """All forwards, then all backwards: m micro-batches in flight."""
    acts = [a for i in range(m) for a in _fwd(p, r, i)]
    acts += [a for i in range(m) for a in _bwd(p, r, i)]
    return acts + [Action("step", None)]


def one_f_one_b(p, m, r):
    """p-r-1 warm-up forwards, then one forward one backward, then the cool-down backwards:
    at most p-r micro-batches in flight on rank r."""
    warm = min(p - r - 1, m)
    acts = [a for i in range(warm) for a in _fwd(p, r, i)]
    for k in range(m - warm):
        acts += _fwd(p, r, warm + k) + _bwd(p, r, k)
    acts += [a for i in range(m - warm, m) for a in _bwd(p, r, i)]
    return acts + [Action("step", None)]


def forward_only(p, m, r):
    """Evaluation and sampling: forwards only, no step."""
    return [a for i in range(m) for a in _fwd(p, r, i)]


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def slot_plan(actions):
    """An activation slot lives from an action's first mention of a micro-batch to its last.

    Returns (slots needed, {action index: micro-batch whose slot is released after it}).
    """
    last = {a.mb: i for i, a in enumerate(actions) if a.mb is not None}
    seen, live, peak = set(), 0, 0
    for i, a in enumerate(actions):
        if a.mb is not None and a.mb not in seen:
            seen.add(a.mb)
            live += 1
            peak = max(peak, live)
        if a.mb is not None and last[a.mb] == i:
            live -= 1
    return max(peak, 1), {i: mb for mb, i in last.items()}


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
            if a.op in ("fwd", "bwd"):
                dt = t_fwd if a.op == "fwd" else t_bwd
                clock[r] += dt
                busy[r] += dt
            elif a.op in ("send_act", "send_grad"):
                kind, dst = a.op[5:], r + 1 if a.op == "send_act" else r - 1
                q = chans.setdefault((kind, r, dst), [])
                if len(q) >= capacity:
                    continue
                clock[r] = max(clock[r], popped.get((kind, r, dst), 0.0))
                q.append((a.mb, clock[r]))
            elif a.op in ("recv_act", "recv_grad"):
                kind, src = a.op[5:], r - 1 if a.op == "recv_act" else r + 1
                q = chans.setdefault((kind, src, r), [])
                if not q:
                    continue
                mb, t = q.pop(0)
                popped[(kind, src, r)] = max(clock[r], t)
                if mb != a.mb:
                    raise RuntimeError(f"rank {r} expected {kind} of micro-batch {a.mb}, "
                                       f"got {mb}")
                clock[r] = max(clock[r], t)
            pc[r] += 1
            progressed = True
        if not progressed and not done:
            stuck = [f"rank {r}: {lists[r][pc[r]]}" for r in range(p) if pc[r] < len(lists[r])]
            raise RuntimeError("deadlock: " + "; ".join(stuck))
    makespan = max(clock)
    return {"makespan": makespan, "busy": busy,
            "bubble": 1.0 - sum(busy) / (p * makespan)}
