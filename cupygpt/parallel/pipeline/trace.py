"""--trace: what every rank's runner did and when, as one Chrome trace-event JSON (Perfetto,
chrome://tracing): a row per rank, a slice per action."""
from __future__ import annotations

import json

from ...backends.protocol import Backend
from ...comm.base import Transport
from ...paths import atomic_write
from ..mesh import Mesh
from .schedule import COMPUTE, Action, short


def name(a: Action) -> str:
    """An action's slice name: F3, B3, W3 for compute (F3.1 on the rank's chunk 1);
    send_act 3; step."""
    if a.op in COMPUTE:
        return short(a)
    return a.op.value if a.mb is None else \
        f"{a.op.value} {a.mb}{f'.{a.chunk}' if a.chunk else ''}"


def write(path: str, records: list, be: Backend, transport: Transport, mesh: Mesh,
          pipeline: dict) -> None:
    """Collective over the ranks: rank 0 writes every rank's records ((action, start mark,
    end mark), the executor's), in microseconds from the first action of any rank, with
    pipeline (the schedule's name and sizes). Marks are the backend's stamps, turned into
    the host clock every process shares."""
    secs = be.stamp_seconds([m for _, a, b in records for m in (a, b)])
    mine = [(name(a), a.op.value, a.mb, a.chunk, secs[2 * i], secs[2 * i + 1])
            for i, (a, _, _) in enumerate(records)]
    every = transport.gather((mesh.rank, mesh.stage, mesh.replica, mesh.shard, mine))
    if every is None:
        return
    t0 = min((e[4] for *_, ev in every for e in ev), default=0.0)
    events = [{"name": "thread_name", "ph": "M", "pid": 0, "tid": r,
               "args": {"name": f"rank {r}: stage {s}, replica {d}, shard {t}"}}
              for r, s, d, t, _ in every]
    events += [{"name": label, "cat": op, "ph": "X", "pid": 0, "tid": r,
                "ts": (a - t0) * 1e6, "dur": (b - a) * 1e6,
                "args": {"micro_batch": mb, "chunk": c}}
               for r, _, _, _, ev in every for label, op, mb, c, a, b in ev]
    with atomic_write(path) as f:
        f.write(json.dumps({"traceEvents": events, "displayTimeUnit": "ms",
                            "pipeline": pipeline}).encode())
