"""Pipeline schedules as data: for (stages p, micro-batches m, rank r, chunks per rank v),
the ordered actions. The runner and the simulator only see the lists; SCHEDULES is the
registry the CLI offers, `placement` says which model chunks each rank holds.
"""
from __future__ import annotations

from collections import namedtuple
from collections.abc import Sequence
from enum import Enum
from functools import lru_cache

from ... import CupyGPTError


class Op(str, Enum):
    """What an action does."""
    RECV_ACT = "recv_act"    # the previous chunk's output into this micro-batch's input
    FWD = "fwd"
    SEND_ACT = "send_act"    # this micro-batch's output to the next chunk
    RECV_GRAD = "recv_grad"  # the gradient of this micro-batch's output
    BWD = "bwd"              # the whole backward: input and weight gradients
    BWD_INPUT = "bwd_input"    # zero-bubble's B: the input gradient (then SEND_GRAD)
    BWD_WEIGHT = "bwd_weight"  # zero-bubble's W: the weight gradients, deferrable
    SEND_GRAD = "send_grad"  # the gradient of this micro-batch's input, back
    STEP = "step"            # the micro-batches are done: sum the tied gradient


# How `schedule` prints each op.
LABEL = {Op.RECV_ACT: "ra", Op.FWD: "F", Op.SEND_ACT: "sa", Op.RECV_GRAD: "rg", Op.BWD: "B",
         Op.BWD_INPUT: "B", Op.BWD_WEIGHT: "W", Op.SEND_GRAD: "sg", Op.STEP: "step"}
COMPUTE = (Op.FWD, Op.BWD, Op.BWD_INPUT, Op.BWD_WEIGHT)


def short(a: Action) -> str:
    """An action as `schedule` prints it: F3, sa3, W3.1 (micro-batch 3 on the rank's chunk 1),
    step."""
    return LABEL[a.op] + ("" if a.mb is None else str(a.mb)) + (f".{a.chunk}" if a.chunk else "")

# The point-to-point ops: (channel, step along the model's chunks).
SENDS = {Op.SEND_ACT: ("act", +1), Op.SEND_GRAD: ("grad", -1)}
RECVS = {Op.RECV_ACT: ("act", -1), Op.RECV_GRAD: ("grad", +1)}

# chunk: the index into this rank's list of model chunks (placement's), 0 with one chunk
Action = namedtuple("Action", "op mb chunk", defaults=(0,))


CHUNKS = {"zbv": 2}  # chunks per rank where a schedule fixes them
DEFAULT_CHUNKS = {"interleaved": 2}  # where it only suggests (one chunk would be 1f1b)


def placement(name: str, p: int, v: int, r: int) -> list[int]:
    """The model chunks (of p * v, in model order) rank r holds, its chunk 0 first:
    interleaved deals them round the ring (Megatron); zbv folds them into a V, so the last
    chunk (the loss) is on rank 0; the others hold one stage."""
    if name == "zbv":
        return [r, 2 * p - 1 - r]
    return [r + c * p for c in range(v)]


def holders(name: str, p: int, v: int) -> list[tuple[int, int]]:
    """{model chunk: (rank, its chunk index) holding it}."""
    return {k: (r, c) for r in range(p) for c, k in enumerate(placement(name, p, v, r))}


def _emit(name, p, v, r, compute):
    """Rank r's list from its compute order [(op, mb, chunk)]: a receive just before the op
    that needs it, a send just after the op that made it. A hand-off to a chunk on this
    same rank is a send and a receive too (the runner keeps the copy in between: a chunk's
    gradient buffer is shared by its micro-batches, so it is filled only when used)."""
    place, last = placement(name, p, v, r), p * v - 1
    acts = []
    for op, mb, c in compute:
        k = place[c]
        if op in (Op.FWD, Op.BWD, Op.BWD_INPUT):
            recv, send, peer = ((Op.RECV_ACT, Op.SEND_ACT, k - 1) if op == Op.FWD
                                else (Op.RECV_GRAD, Op.SEND_GRAD, k + 1))
            nxt = 2 * k - peer               # where this op's result goes
            if 0 <= peer <= last:
                acts.append(Action(recv, mb, c))
            acts.append(Action(op, mb, c))
            if 0 <= nxt <= last:
                acts.append(Action(send, mb, c))
        else:
            acts.append(Action(op, mb, c))
    return acts


def chunks_per_rank(name: str, v: int | None = None) -> int:
    """The model chunks each rank holds: zbv's fixed 2, interleaved's v (2 by default), 1
    for the others (v None: the schedule's default). Refuses a v the schedule cannot
    take."""
    fixed = CHUNKS.get(name)
    if v is not None and fixed is not None and v != fixed:
        raise CupyGPTError(f"{name} holds {fixed} chunks per rank; leave it out",
                           "virtual_stages", v)
    v = fixed or (DEFAULT_CHUNKS.get(name, 1) if v is None else v)
    if v < 1:
        raise CupyGPTError("must be at least 1", "virtual_stages", v)
    if v > 1 and fixed is None and name != "interleaved":
        raise CupyGPTError(f"{name} holds one chunk per rank; several need the interleaved "
                           f"schedule (zbv holds its own 2)", "virtual_stages", v)
    return v


def gpipe(p: int, m: int, r: int, v: int = 1) -> list[Action]:
    """All forwards, then all backwards: m micro-batches in flight."""
    chunks_per_rank("gpipe", v)
    order = [(Op.FWD, i, 0) for i in range(m)] + [(Op.BWD, i, 0) for i in range(m)]
    return _emit("gpipe", p, v, r, order) + [Action(Op.STEP, None)]


def one_f_one_b(p: int, m: int, r: int, v: int = 1) -> list[Action]:
    """p-r-1 warm-up forwards, then one forward one backward, then the cool-down backwards:
    at most p-r micro-batches in flight on rank r."""
    chunks_per_rank("1f1b", v)
    return _interleave("1f1b", p, m, r, 1)


def interleaved(p: int, m: int, r: int, v: int = 1) -> list[Action]:
    """Megatron's interleaved 1F1B: rank r holds chunks r, r+p, ...; micro-batches go
    through a chunk in groups of p, so a group comes back round the ring just as the rank
    is ready for it. Its bubble is 1F1B's divided by about v."""
    chunks_per_rank("interleaved", v)
    if m % p:
        raise CupyGPTError(f"interleaved needs a multiple of the {p} pipeline stages",
                           "micro_batches", m)
    return _interleave("interleaved", p, m, r, v)


def _ring_forward(p, v):
    """Interleaved's k-th forward: micro-batches go through a chunk in groups of p."""
    return lambda k: (Op.FWD, k // (p * v) * p + k % p, k // p % v)


def _interleave(name, p, m, r, v):
    """Warm-up forwards, then a forward and a backward in turn, then the cool-down. The
    k-th forward is chunk (k // p) % v of micro-batch (k // pv) p + k % p; backwards take
    the chunks the other way round. Warm-up: 1F1B's p-r-1 with one chunk; with more,
    Megatron's 2(p-r-1) + (v-1)p (the simulator shows fewer leave gaps round the ring, and
    deadlock over one-message channels)."""
    n = m * v
    fwd = _ring_forward(p, v)

    def bwd(k):
        return Op.BWD, k // (p * v) * p + k % p, v - 1 - k // p % v
    warm = min((p - r - 1) * (2 if v > 1 else 1) + (v - 1) * p, n)
    order = [fwd(k) for k in range(warm)]
    for k in range(n - warm):
        order += [fwd(warm + k), bwd(k)]
    order += [bwd(k) for k in range(n - warm, n)]
    return _emit(name, p, v, r, order) + [Action(Op.STEP, None)]


def zb1p(p: int, m: int, r: int, v: int = 1) -> list[Action]:
    """ZB-H1 (Qi et al., Zero Bubble Pipeline Parallelism): 1F1B's order of forwards and
    input-gradient Bs, each micro-batch's W deferred until r more Bs have run (the rest at
    the end), so Ws fill what was 1F1B's cool-down. Rank r holds at most p micro-batches
    from forward to W (1F1B's peak, rank 0's); with t_F = t_B = t_W and m >= p the idle
    per rank is (p-1) t_F, a third of 1F1B's."""
    chunks_per_rank("zb1p", v)
    order = []
    for a in one_f_one_b(p, m, r)[:-1]:
        if a.op == Op.FWD:
            order.append((Op.FWD, a.mb, 0))
        elif a.op == Op.BWD:
            order.append((Op.BWD_INPUT, a.mb, 0))
            if a.mb >= r:
                order.append((Op.BWD_WEIGHT, a.mb - r, 0))
    order += [(Op.BWD_WEIGHT, i, 0) for i in range(max(m - r, 0), m)]
    return _emit("zb1p", p, 1, r, order) + [Action(Op.STEP, None)]


def _zbv_preference(p, m, r):
    """Rank r's forwards and input-gradient Bs, [(op, mb, chunk)] in the order it prefers
    them: ZB-V's shape, each phase sized so the next one's inputs arrive as it ends. Its
    first chunk's forwards run ahead down the V: 2(p-r)-1 fill the steps until its second
    chunk's first input comes back up; then r more alternate with the second chunk's (rank
    r+1 hands one every other step); then the second chunk's Bs come back from the
    loss, p-r of them each after a forward of that chunk, covering the wait for the first
    chunk's first B; from there on one F and one B of each chunk in turn."""
    warm = ([(Op.FWD, 0)] * (2 * (p - r) - 1) + [(Op.FWD, 1), (Op.FWD, 0)] * r
            + [(Op.FWD, 1), (Op.BWD_INPUT, 1)] * (p - r))
    rounds = [(Op.FWD, 0), (Op.BWD_INPUT, 0), (Op.FWD, 1), (Op.BWD_INPUT, 1)] * m
    left = dict.fromkeys(rounds, m)
    order = []
    for op, c in warm + rounds:  # each (op, chunk) takes its micro-batches in turn
        if left[(op, c)]:
            order.append((op, m - left[(op, c)], c))
            left[(op, c)] -= 1
    return order


@lru_cache(maxsize=16)
def _zbv_order(p, m):
    """Every rank's compute order for zbv, by running them all at once in unit steps
    (t_F = t_B = t_W, the paper's case). A free rank holding 2p chunk activations (1F1B's
    peak, p whole stages) frees one with its oldest pending W; else it takes the ready F or
    B it prefers most (_zbv_preference); else its oldest W, filling what would be idle.
    Preferences only rank the ready ops, so with few micro-batches no rank waits for one.

    Each rank does 6m ops, and rank p-1's first input passes p-1 chunks before it, so no
    order takes under 6m + p - 1 steps. This one takes that from m = p on: the warm-up
    fills the V so that rank p-1 has work from its first step; each round of six steps
    (an F and a B of each chunk, and the two Ws the cap then calls for) takes what the
    neighbours' rounds hand over; in the cool-down the left-over Ws fill the steps between
    the last Bs. So rank p-1 never waits once started (not proven:
    tests/unit/parallel/test_schedule.py checks it for p <= 8, m <= 32, over channels of
    one message and of two). A chunk's micro-batches keep their order, so each channel's
    messages arrive in the order they are taken."""
    last = 2 * p - 1
    place = [placement("zbv", p, 2, r) for r in range(p)]
    prefer = {(op, i, place[r][c]): n for r in range(p)
              for n, (op, i, c) in enumerate(_zbv_preference(p, m, r))}
    done = {}                           # (op, mb, model chunk) -> step it finished
    nf, nb = [0] * (last + 1), [0] * (last + 1)
    held = [0] * p                      # chunk activations from forward to W
    pending = [[] for _ in range(p)]
    order = [[] for _ in range(p)]
    t, left = 0, 3 * m * (last + 1)

    def ready(op, i, k):
        return done.get((op, i, k), t + 1) <= t
    while left:
        taken = []
        for r in range(p):
            # A B whose gradient climbs to rank r+1 (chunks past p) waits until that rank
            # took the previous one: in the cool-down r can run them faster than r+1 takes
            # them, and over a one-message channel (nvshmem's) the send would stall r.
            ops = [(Op.BWD_INPUT, nb[k], k) for k in place[r] if nb[k] < m
                   and ready(Op.FWD, nb[k], k)
                   and (k == last or ready(Op.BWD_INPUT, nb[k], k + 1))
                   and (k <= p or nb[k] == 0 or ready(Op.BWD_INPUT, nb[k] - 1, k - 1))]
            ops += [(Op.FWD, nf[k], k) for k in place[r] if nf[k] < m and held[r] < 2 * p
                    and (k == 0 or ready(Op.FWD, nf[k], k - 1))]
            if pending[r] and (held[r] == 2 * p or not ops):
                taken.append((r, Op.BWD_WEIGHT) + pending[r].pop(0))
            elif ops:
                taken.append((r,) + min(ops, key=prefer.get))
        if not taken:  # ops take one step: nothing is under way, so nothing will be
            raise RuntimeError(f"zbv: no schedule for p={p} m={m}")
        for r, op, i, k in taken:
            order[r].append((op, i, place[r].index(k)))
            done[(op, i, k)] = t + 1
            if op == Op.FWD:
                nf[k], held[r] = nf[k] + 1, held[r] + 1
            elif op == Op.BWD_INPUT:
                nb[k] += 1
                pending[r].append((i, k))
            else:
                held[r] -= 1
        left -= len(taken)
        t += 1
    return order


def zbv(p: int, m: int, r: int, v: int = 2) -> list[Action]:
    """ZB-V: two chunks per rank folded into a V (rank r holds chunks r and 2p-1-r), so the
    loss and the first backward are on rank 0. A rank holds at most 2p chunk activations,
    1F1B's peak of p whole-stage micro-batches. With equal times and m >= p it takes
    6m + p - 1 chunk steps, the least any order can: the only bubble is the warm-up's p-1
    steps, (p-1)/(6m+p-1). With fewer micro-batches, max(4m + 3p - 1, 2m + 4p - 1) steps
    (one micro-batch: its 4p+1 ops in a row)."""
    chunks_per_rank("zbv", v)
    return _emit("zbv", p, 2, r, _zbv_order(p, m)[r]) + [Action(Op.STEP, None)]


def forward_only(p: int, m: int, r: int, v: int = 1, name: str = "1f1b") -> list[Action]:
    """Evaluation and sampling: forwards only, no step. Chunk by chunk in model order, all
    micro-batches through each (a receive waits only on chunks that come earlier), except
    interleaved with whole groups of p micro-batches: its training order of forwards, since
    chunk by chunk a rank's later chunk would wait on messages queued behind its own
    sends, which a channel of a few slots (nvshmem's) cannot hold."""
    if name == "interleaved" and v > 1 and m % p == 0:
        return _emit(name, p, v, r, [_ring_forward(p, v)(k) for k in range(m * v)])
    order = [(Op.FWD, i, c) for c in range(len(placement(name, p, v, r))) for i in range(m)]
    return _emit(name, p, v, r, order)


SCHEDULES = {"gpipe": gpipe, "1f1b": one_f_one_b, "interleaved": interleaved, "zb1p": zb1p,
             "zbv": zbv}


def slot_plan(actions: Sequence[Action]) -> tuple[list[int], dict]:
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
