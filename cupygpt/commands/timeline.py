"""`timeline`: a --trace file drawn as the classic pipeline picture (ranks as rows, compute
as boxes coloured by micro-batch), with the simulator's prediction for the same schedule,
from the measured mean op times, beneath it."""
import collections
import json
import math
import os
import textwrap

from .. import CupyGPTError
from ..config.tools import image_format
from ..parallel.pipeline.schedule import SCHEDULES, Op, chunks_per_rank
from ..parallel.pipeline.simulate import simulate
from ..paths import atomic_write, loads, read_bounded, shown
from .plot import pyplot

# Compute ops (the trace's "cat") and how they are drawn: F full colour, B darker, W paler.
LETTER = {Op.FWD: "F", Op.BWD: "B", Op.BWD_INPUT: "B", Op.BWD_WEIGHT: "W"}
TRANSFER = {Op.SEND_ACT: "send", Op.SEND_GRAD: "send", Op.RECV_ACT: "recv",
            Op.RECV_GRAD: "recv"}
SHADE = {"F": (0.0, None), "B": (0.35, "black"), "W": (0.55, "white")}


def read_trace(path):
    """({rank: [(op, mb, chunk, start, end)] of its compute slices in the trace's last
    step, seconds}, {rank: {"send": [seconds], "recv": [seconds]} of its transfers in that
    step}, the trace's top-level "pipeline" object or {}). A trace of several steps (train,
    bench) is cut at each rank's step actions: the last training step is the one warm and
    undisturbed by the start."""
    try:
        data = loads(read_bounded(path, "trace").decode("utf-8"))
    except OSError as e:
        raise CupyGPTError(f"{path}: cannot read the trace ({e.strerror})") from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CupyGPTError(f"{path}: not JSON; give the file that --trace wrote") from None
    events = data.get("traceEvents", []) if isinstance(data, dict) else data
    slices = [e for e in events if isinstance(e, dict) and e.get("ph") == "X"] \
        if isinstance(events, list) else []
    if not slices:
        raise CupyGPTError(f"{path}: holds no action slices (\"ph\": \"X\"); give the file "
                           f"that --trace wrote")
    rows, comm, steps = {}, {}, {}
    for n, e in enumerate(slices):
        try:
            rank, start, dur = int(e["tid"]), float(e["ts"]) / 1e6, float(e["dur"]) / 1e6
            if not (math.isfinite(start) and 0 <= dur < math.inf):
                raise CupyGPTError(f"{path}: slice {n} has ts {e['ts']} and dur {e['dur']}: "
                                   f"not a finite time and duration; give the file that "
                                   f"--trace wrote")
            args, cat = e.get("args") or {}, e.get("cat")
            rows.setdefault(rank, [])
            comm.setdefault(rank, [])
            if cat in LETTER:
                rows[rank].append((Op(cat), int(args["micro_batch"]),
                                   int(args.get("chunk", 0)), start, start + dur))
            elif cat in TRANSFER:
                comm[rank].append((TRANSFER[cat], start, dur))
            elif cat == Op.STEP.value:
                steps.setdefault(rank, []).append(start)
        except (KeyError, TypeError, ValueError):
            raise CupyGPTError(f"{path}: slice {n} lacks tid, ts, dur or its micro_batch; "
                               f"give the file that --trace wrote") from None
    for rank, ends in steps.items():  # the last step: between its step action and the one
        ends = sorted(set(ends))          # before (not the evaluation or sampling after it)
        lo = ends[-2] if len(ends) > 1 else float("-inf")
        rows[rank] = [x for x in rows[rank] if lo < x[3] < ends[-1]]
        comm[rank] = [x for x in comm[rank] if lo < x[1] < ends[-1]]
    if not any(rows.values()):
        raise CupyGPTError(f"{path}: holds no forward or backward slices" + (
            " in its last step (between its last two step actions)" if steps else ""))
    pipe = data.get("pipeline") if isinstance(data, dict) else None
    pipe = pipe if isinstance(pipe, dict) else {}
    for k in ("stages", "micro_batches", "virtual_stages"):
        if pipe.get(k) is not None and (not isinstance(pipe[k], int) or pipe[k] < 1):
            raise CupyGPTError(f"{path}: its pipeline's {k} is {json.dumps(pipe[k])}, not a "
                               f"positive integer; give the file that --trace wrote")
    why = inconsistent(rows, pipe)
    if why:
        raise CupyGPTError(f"{path}: {why}; give the file that --trace wrote")
    transfers = {r: {k: [d for kind, _, d in c if kind == k] for k in ("send", "recv")}
                 for r, c in comm.items()}
    return rows, transfers, pipe


def inconsistent(rows, pipe):
    """What in a trace's last step no run records, else None: a slice twice, no time at
    all, a micro-batch or a rank its "pipeline" has not (each drew a bubble from nothing)."""
    ev = [(r, *e[:3]) for r, evs in rows.items() for e in evs]
    twice = [e for e, n in collections.Counter(ev).items() if n > 1]
    if twice:
        r, op, mb, chunk = twice[0]
        return f"rank {r}'s {LETTER[op]}{mb} (chunk {chunk}) is in its last step twice"
    if all(e[4] == e[3] for evs in rows.values() for e in evs):
        return "every slice of its last step lasts 0"
    m, p = pipe.get("micro_batches"), pipe.get("stages")
    if m and max(e[2] for e in ev) >= m:
        return (f"a slice is of micro-batch {max(e[2] for e in ev)}, and its pipeline has "
                f"micro_batches {m}")
    ranks = len([r for r in rows if rows[r]])
    if p and ranks < p:
        return f"its pipeline has {p} stages, and slices come from {ranks} rank(s)"
    return None


def bubble(rows):
    """1 - compute time / (ranks x span), the span from the first compute slice's start to
    the last one's end (set-up before and the step's sums after are not the pipeline's)."""
    ev = [e for r in rows.values() for e in r]
    t0, t1 = min(e[3] for e in ev), max(e[4] for e in ev)
    busy = sum(e[4] - e[3] for e in ev)
    return 1.0 - busy / (len(rows) * (t1 - t0)) if t1 > t0 else 0.0


def predict(rows, transfers, pipe, schedule):
    """The simulator's run of the schedule from the trace's op times (a chunk's time times v
    is a whole stage's) and each rank's transfer costs: a send's mean time, and a receive's
    when its message is already there: the shortest receive of any rank (a pipeline's
    messages are all one size, and a rank ahead of a slower peer waits in every receive,
    so only the rank behind shows a receive's own cost). Returns (name, p, m, v, times,
    its result)."""
    name = schedule or pipe.get("schedule")
    if schedule and pipe.get("schedule") not in (None, schedule):
        raise CupyGPTError(f"the trace was recorded with {pipe['schedule']}, and its times "
                           f"are that schedule's; leave it out, or give {pipe['schedule']}",
                           "schedule", schedule)
    if name not in SCHEDULES:
        raise CupyGPTError(f"{'the trace names no schedule' if not name else f'unknown ({name})'}"
                           f"; give one of {', '.join(SCHEDULES)}", "schedule",
                           name or "(none)")
    ev = [e for r in rows.values() for e in r]
    p = int(pipe.get("stages") or len(rows))
    m = int(pipe.get("micro_batches") or max(e[1] for e in ev) + 1)
    # the trace's chunks per rank belong to its own schedule, not to one asked instead
    given = pipe.get("virtual_stages") if name == pipe.get("schedule") else None
    v = chunks_per_rank(name, given or (max(e[2] for e in ev) + 1 if name == "interleaved"
                                        else None))

    own = sorted(rows) == list(range(p))  # one rank a stage (in a grid: the mean of all)

    def mean(op):  # per rank: stages differ (the head's), so each keeps its own times
        def of(evs):
            d = [e[4] - e[3] for e in evs if e[0] == op]
            return v * sum(d) / len(d) if d else None
        every = of(ev) or 0.0
        return [(of(rows[r]) if own else None) or every for r in range(p)]
    def cost(kind, pick):
        return [pick(sorted(transfers.get(r, {}).get(kind, []))) if own else 0.0
                for r in range(p)]
    split = any(e[0] == Op.BWD_INPUT for e in ev)
    times = dict(t_fwd=mean(Op.FWD), t_bwd=mean(Op.BWD_INPUT if split else Op.BWD),
                 t_wgt=mean(Op.BWD_WEIGHT) if split else None,
                 t_send=cost("send", lambda d: sum(d) / len(d) if d else 0.0),
                 t_recv=[min((d for t in transfers.values() for d in t.get("recv", [])),
                             default=0.0) if own else 0.0] * p)
    sim = simulate(p, m, name, v, **times)
    if not math.isfinite(sim["bubble"]):
        raise CupyGPTError("the simulation from the trace's times is not finite (huge or "
                           "broken times); give the file that --trace wrote")
    return name, p, m, v, times, sim


def _draw(ax, rows, title, colours):
    from matplotlib.colors import to_rgb
    t0 = min(e[3] for r in rows.values() for e in r)
    for rank, ev in rows.items():
        for op, mb, chunk, a, b in ev:
            letter = LETTER[op]
            amount, toward = SHADE[letter]
            c = to_rgb(colours(mb % colours.N))
            if toward:
                end = (0, 0, 0) if toward == "black" else (1, 1, 1)
                c = tuple(x + (y - x) * amount for x, y in zip(c, end))
            ax.barh(rank, (b - a) * 1e3, left=(a - t0) * 1e3, height=0.8, color=c,
                    edgecolor="0.3", linewidth=0.4, hatch="///" if chunk else None)
            ax.text((a + b - 2 * t0) / 2 * 1e3, rank, f"{letter}{mb}", ha="center",
                    va="center", fontsize=6, clip_on=True)
    ax.set_yticks(sorted(rows))
    ax.set_yticklabels([f"rank {r}" for r in sorted(rows)])
    ax.invert_yaxis()
    ax.set_title(textwrap.fill(shown(title), 140), fontsize=9)  # a line as wide as the figure


def timeline(path, out, schedule=None):
    """Draws the trace and the prediction into the image `out`; returns (measured bubble,
    predicted bubble, schedule name)."""
    plt = pyplot("timeline")
    rows, transfers, pipe = read_trace(path)
    measured = bubble(rows)
    name, p, m, v, times, sim = predict(rows, transfers, pipe, schedule)
    predicted = {r: [(a.op, a.mb, a.chunk, s, e) for a, s, e in ev]
                 for r, ev in enumerate(sim["events"])}
    colours = plt.get_cmap("tab10" if m <= 10 else "tab20")
    height = 1.0 + 0.35 * (len(rows) + p)
    fig, (top, bottom) = plt.subplots(2, 1, figsize=(11, height + 1.5), dpi=110, sharex=True)
    _draw(top, rows, f"{os.path.basename(path)} (last step): {name}, p={p}, m={m}, v={v}; "
                     f"measured bubble {measured:.1%} "
                     f"(F, B, W shaded; hatched: a rank's second chunk on)", colours)
    ms = ", ".join(f"{k[2:]} {min(t) * 1e3 / (1 if k in ('t_send', 't_recv') else v):.3g}-"
                   f"{max(t) * 1e3 / (1 if k in ('t_send', 't_recv') else v):.3g}"
                   for k, t in times.items() if t is not None)
    _draw(bottom, predicted, f"simulated from each rank's op and transfer times: bubble "
                             f"{sim['bubble']:.1%} (ms; ops per chunk: {ms})", colours)
    bottom.set_xlabel("ms")
    fig.tight_layout()
    with atomic_write(out) as f:
        fig.savefig(f, format=image_format(out))
    plt.close(fig)
    return measured, sim["bubble"], name
