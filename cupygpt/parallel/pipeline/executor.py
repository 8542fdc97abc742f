"""Runs one rank's action list over its stages: the action table, the activation slots,
hand-offs between chunks of this rank, and the --trace record. Everything it touches per
pass comes in a Pass; nothing climbs back up to the runner. A pass is feed, run (the
schedule's forwards, backwards and transfers), close (the schedule's closing STEP action,
where the runner's gradient sync runs, then the transport's end of the step)."""
from __future__ import annotations

from collections import namedtuple
from collections.abc import Callable, Sequence

import numpy as np

from ... import CupyGPTError
from ...backends.protocol import Backend
from ...comm.base import Transport
from ...model.stage import Stage
from ..data.grad_sync import GradSync
from .plan import StepPlan
from .schedule import Action, Op, slot_plan

TRACE_MAX = 100_000  # actions a rank records under --trace (a few MB of JSON)

# One pass's arguments. dloss: the loss gradient's scale (training; None: forward only);
# targets: whether the head computes the loss; on_logits(mb, first, logits): called with
# the head's logits of each micro-batch, a chunk of positions at a time (Stage.forward);
# on_losses(mb, losses): with its losses (rows, T);
# decode: a position (generation's one-position forwards, Stage.decode), or None for whole
# passes; sync: whether this pass is its step's last, whose last backwards start the
# overlapped gradient sums (not a gradient accumulation's passes before the last).
Pass = namedtuple("Pass", "dloss targets on_logits decode sync on_losses",
                  defaults=(None, False, None, None, True, None))


class Executor:
    """plan: the rank's StepPlan; stages: a Stage per held chunk; sync: the GradSync its
    backwards report layers to."""

    def __init__(self, plan: StepPlan, stages: list[Stage], be: Backend, transport: Transport,
                 sync: GradSync) -> None:
        self.plan, self.stages, self.be, self.sync = plan, stages, be, sync
        self.transport = transport
        rows, T = plan.rows, plan.seq
        # tokens where the embedding is, targets where the head is (the plan's parts say)
        self.x_dev = (be.zeros(rows * T, np.int32).reshape(rows, T)
                      if any(pt.embed for pt in plan.parts) else None)
        self.y_dev = (be.zeros(rows * T, np.int32).reshape(rows, T)
                      if any(pt.head for pt in plan.parts) else None)
        self.loss_acc = be.zeros(1, np.float64)
        self.local = {}   # (kind, receiving chunk) -> copies handed over on this rank, in order
        self.spare = []
        self.trace = None  # [(action, start, end)] while tracing
        self.closing = None  # the STEP action ending the pass that ran, which close runs
        sts = stages
        # The action table: an op missing here is refused (run), never skipped.
        self.ops = {
            Op.FWD: self._forward, Op.BWD: self._backward,
            Op.BWD_INPUT: lambda a, slot, ps: sts[a.chunk].backward_input(slot),
            Op.BWD_WEIGHT: self._backward_weight,
            Op.SEND_ACT: lambda a, slot, ps: self._send("act", sts[a.chunk].output(slot),
                                                        plan.next[a.chunk], a.mb),
            Op.RECV_ACT: lambda a, slot, ps: self._recv("act", sts[a.chunk].input(slot),
                                                        plan.prev[a.chunk], a),
            Op.SEND_GRAD: lambda a, slot, ps: self._send("grad", sts[a.chunk].grad_io(),
                                                         plan.prev[a.chunk], a.mb),
            Op.RECV_GRAD: lambda a, slot, ps: self._recv("grad", sts[a.chunk].grad_io(),
                                                         plan.next[a.chunk], a)}

    def feed(self, x: np.ndarray, y: np.ndarray | None) -> None:
        """This replica's rows of the host batch x, y (B, T) to the device (y: None when no
        loss is computed)."""
        rows = self.plan.replica_rows()
        if self.x_dev is not None:
            self.be.upload(self.x_dev, x[rows])
        if self.y_dev is not None and y is not None:
            self.be.upload(self.y_dev, y[rows])

    def run(self, actions: Sequence[Action], ps: Pass) -> None:
        """The device side of a pass up to the schedule's closing STEP action (a training
        list's last; close runs it): no host transfers but the transport's, so a step can
        be captured as a CUDA graph. The loss sum over this replica's rows is left in
        loss_acc on the head's rank."""
        self.closing = actions[-1] if actions and actions[-1].op is Op.STEP else None
        _, release = slot_plan(actions)
        free = [list(range(len(st.acts)))[::-1] for st in self.stages]
        slot_of = {}
        self.loss_acc.fill(0)
        for i, a in enumerate(actions[:-1] if self.closing else actions):
            do = self.ops.get(a.op)
            if do is None:
                raise CupyGPTError(f"rank {self.transport.rank}: unknown pipeline action {a.op!r} "
                                   f"(micro-batch {a.mb}); the runner knows "
                                   f"{', '.join(op.value for op in self.ops)}")
            key = (a.mb, a.chunk)
            if a.mb is not None and key not in slot_of:
                slot_of[key] = free[a.chunk].pop()
            self._traced(a, lambda: do(a, slot_of.get(key), ps))
            if i in release:
                k = release[i]
                free[k[1]].append(slot_of.pop(k))

    def close(self, sync: Callable | None = None) -> None:
        """The end of the pass that ran: its STEP action (a training pass's), which calls
        sync (the step's gradient sums; None in a gradient accumulation's passes before
        the last), then the transport's end of the step; both on the stream, so a captured
        step holds them, and the STEP action in the trace (timeline's step boundary)."""
        if self.closing is not None:
            self._traced(self.closing, sync or (lambda: None))
        self.transport.end_step()

    def _traced(self, a, do):
        """do(), recorded as action a's slice while tracing (the first TRACE_MAX)."""
        if self.trace is not None and len(self.trace) < TRACE_MAX:
            t0 = self.be.stamp()
            do()
            self.trace.append((a, t0, self.be.stamp()))
        else:
            do()

    def _send(self, kind, arr, peer, mb):
        """To a peer rank, or to a chunk of this rank: a copy in a buffer kept for reuse
        (the source may change before the receive; the same buffers serve every step, so
        a captured step allocates nothing)."""
        if not isinstance(peer, tuple):
            return self.transport.send(kind, arr, peer, mb)
        buf = self.spare.pop() if self.spare else self.be.zeros(arr.size, arr.dtype)
        buf.reshape(arr.shape)[...] = arr
        self.local.setdefault((kind, peer[1]), []).append(buf)

    def _recv(self, kind, out, peer, a):
        if not isinstance(peer, tuple):
            return self.transport.recv(kind, out, peer, a.mb)
        # a chunk's micro-batches keep their order, so its hand-overs arrive in order
        buf = self.local[(kind, a.chunk)].pop(0)
        out[...] = buf.reshape(out.shape)
        self.spare.append(buf)

    def _tokens(self, st, mb):
        return self.x_dev[self.plan.mb_slice(mb)] if st.embed else None

    def _forward(self, a, slot, ps):
        st, mb = self.stages[a.chunk], a.mb
        hook = ps.on_logits and (lambda first, logits: ps.on_logits(mb, first, logits))
        if ps.decode is not None:
            t = ps.decode
            st.decode(slot, t, self.x_dev[0:1, t:t + 1] if st.embed else None, hook)
        else:
            targets = self.y_dev[self.plan.mb_slice(mb)] if st.head and ps.targets else None
            st.forward(slot, self._tokens(st, mb), targets, ps.dloss, hook)
            if targets is not None:
                self.be.loss_accumulate(self.loss_acc, st.acts[slot]["losses"])
                if ps.on_losses is not None:
                    ps.on_losses(mb, st.acts[slot]["losses"])

    def _hook(self, a, ps):
        return self.sync.layer_hook(self.stages[a.chunk],
                                    ps.sync and a.mb == self.plan.last_backward[a.chunk])

    def _backward(self, a, slot, ps):
        st = self.stages[a.chunk]
        st.backward(slot, self._tokens(st, a.mb), self._hook(a, ps))

    def _backward_weight(self, a, slot, ps):
        st = self.stages[a.chunk]
        st.backward_weight(slot, self._tokens(st, a.mb), self._hook(a, ps))
