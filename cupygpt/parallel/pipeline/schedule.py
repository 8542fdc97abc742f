"""Pipeline schedules as data: for (stages p, micro-batches m, stage r), the ordered
actions. The runner and the simulator only see the lists; SCHEDULES is the registry the
CLI offers. A zero-bubble schedule would add bwd_input / bwd_weight ops; an interleaved
one a chunk index to the action.
"""
from collections import namedtuple
from enum import Enum


class Op(str, Enum):
    """What an action does."""
    RECV_ACT = "recv_act"    # the previous stage's output into this micro-batch's input
    FWD = "fwd"
    SEND_ACT = "send_act"    # this micro-batch's output to the next stage
    RECV_GRAD = "recv_grad"  # the gradient of this micro-batch's output
    BWD = "bwd"
    BWD_INPUT = "bwd_input"    # zero-bubble's B: the input gradient (then SEND_GRAD)
    BWD_WEIGHT = "bwd_weight"  # zero-bubble's W: the weight gradients, deferrable
    SEND_GRAD = "send_grad"  # the gradient of this micro-batch's input, back
    STEP = "step"            # the micro-batches are done: sum the tied gradient


# How `schedule` prints each op.
LABEL = {Op.RECV_ACT: "ra", Op.FWD: "F", Op.SEND_ACT: "sa", Op.RECV_GRAD: "rg", Op.BWD: "B",
         Op.BWD_INPUT: "B", Op.BWD_WEIGHT: "W", Op.SEND_GRAD: "sg", Op.STEP: "step"}


# The point-to-point ops: (channel, direction along the pipeline).
SENDS = {Op.SEND_ACT: ("act", +1), Op.SEND_GRAD: ("grad", -1)}
RECVS = {Op.RECV_ACT: ("act", -1), Op.RECV_GRAD: ("grad", +1)}

# chunk: which of this rank's model chunks (placement's list) the action works on
Action = namedtuple("Action", "op mb chunk", defaults=(0,))


def placement(name, p, v, r):
    """The model chunks (of p * v, in model order) rank r holds, its chunk 0 first."""
    if name == "zbv":
        return [r, 2 * p - 1 - r]
    return [r + c * p for c in range(v)]


def holder(name, p, v, k):
    """(rank, its chunk index) holding model chunk k."""
    return next((r, c) for r in range(p) for c, j in enumerate(placement(name, p, v, r))
                if j == k)


def _fwd(p, r, i):
    return ([Action(Op.RECV_ACT, i)] if r > 0 else []) + [Action(Op.FWD, i)] + \
           ([Action(Op.SEND_ACT, i)] if r < p - 1 else [])


def _bwd(p, r, i):
    return ([Action(Op.RECV_GRAD, i)] if r < p - 1 else []) + [Action(Op.BWD, i)] + \
           ([Action(Op.SEND_GRAD, i)] if r > 0 else [])


def gpipe(p, m, r, v=1):
    """All forwards, then all backwards: m micro-batches in flight."""
    acts = [a for i in range(m) for a in _fwd(p, r, i)]
    acts += [a for i in range(m) for a in _bwd(p, r, i)]
    return acts + [Action(Op.STEP, None)]


def one_f_one_b(p, m, r, v=1):
    """p-r-1 warm-up forwards, then one forward one backward, then the cool-down backwards:
    at most p-r micro-batches in flight on rank r."""
    warm = min(p - r - 1, m)
    acts = [a for i in range(warm) for a in _fwd(p, r, i)]
    for k in range(m - warm):
        acts += _fwd(p, r, warm + k) + _bwd(p, r, k)
    acts += [a for i in range(m - warm, m) for a in _bwd(p, r, i)]
    return acts + [Action(Op.STEP, None)]


def forward_only(p, m, r, v=1, name="1f1b"):
    """Evaluation and sampling: forwards only, no step; chunk by chunk in model order, all
    micro-batches through each (a receive waits only on chunks that come earlier)."""
    acts = []
    for c, k in enumerate(placement(name, p, v, r)):
        for i in range(m):
            acts += ([Action(Op.RECV_ACT, i, c)] if k > 0 else []) + [Action(Op.FWD, i, c)] + \
                    ([Action(Op.SEND_ACT, i, c)] if k < p * v - 1 else [])
    return acts


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b}


def slot_plan(actions):
    """An activation slot lives from an action's first mention of a (micro-batch, chunk) to
    its last.

    Returns (slots needed, {action index: (mb, chunk) whose slot is released after it}).
    """
    last = {(a.mb, a.chunk): i for i, a in enumerate(actions) if a.mb is not None}
    seen, live, peak = set(), 0, 0
    for i, a in enumerate(actions):
        key = (a.mb, a.chunk)
        if a.mb is not None and key not in seen:
            seen.add(key)
            live += 1
            peak = max(peak, live)
        if a.mb is not None and last[key] == i:
            live -= 1
    return max(peak, 1), {i: key for key, i in last.items()}
