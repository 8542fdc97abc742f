"""The rank-conditional runner: executes this rank's action list over its stage.

The single process is the pipeline of one stage (no sends, no receives), so `train`,
`verify` and `sample` have one code path for every world size. Which ranks are the
neighbours, and which one holds the loss, the Mesh says.
"""
import numpy as np

from ... import CupyGPTError
from ...layout import (PARAM_NAMES, WHOLE, Part, activation_layout, assemble, copy_part,
                       param_layout, scratch_layout)
from ...model import Stage
from ...comm.base import chunks
from ...optim import AdamW
from .plan import plan_split
from .schedule import (SCHEDULES, Op, chunks_per_rank, forward_only, holders, placement,
                       slot_plan)


TRACE_MAX = 100_000  # actions a rank records under --trace (a few MB of JSON)


class Runner:
    def __init__(self, cfg, be, transport, mesh, B, T, micro_batches=1, schedule="1f1b",
                 counts=None, dtype=np.float32, adamw=None, graphs=False, zero=False,
                 overlap=True, virtual=None):
        """counts: layers per model chunk (plan_split's, already checked); a rank holds the
        chunks the schedule places on it (one per rank, or `virtual` for an interleaved
        schedule; None: its default), a Stage each. B the batch of one step: each
        data-parallel replica computes B / dp of its rows, in micro_batches. zero: AdamW's
        state sharded across the replicas (ZeRO-1). overlap: the replicas' gradient sum
        starts layer by layer during each chunk's last backward (an all-reduce; with ZeRO-1
        each replica then updates its slice of the sums instead of reduce-scattering after
        the backward: twice the bytes, hidden behind the backward)."""
        p, r, M = mesh.pp, mesh.stage, micro_batches
        v = chunks_per_rank(schedule, virtual)
        K = p * v                               # model chunks
        counts = counts or plan_split(cfg, T, K)
        self.cfg, self.be, self.tr, self.mesh = cfg, be, transport, mesh
        self.B, self.T, self.M, self.schedule = B, T, M, schedule
        self.Bl = B // mesh.dp                  # this replica's rows
        self.Bm = self.Bl // M
        self.zero = zero
        self.overlap = overlap and mesh.dp > 1
        self.summed = True  # whether the step's gradients are the replicas' sums (sync_grads)
        self.in_flight = []
        self.counts, self.chunks = counts, placement(schedule, p, v, r)
        self.train_actions = SCHEDULES[schedule](p, M, r, v)
        self.eval_actions = forward_only(p, M, r, v, schedule)
        self.first_actions = forward_only(p, 1, r, v, schedule)
        split = any(a.op == Op.BWD_WEIGHT for a in self.train_actions)
        # each chunk's last backward pass (its layers' gradients are final after it)
        self.last_bwd = {a.chunk: a.mb for a in self.train_actions
                         if a.op in (Op.BWD, Op.BWD_WEIGHT)}
        self.parts = [Part(sum(counts[:k]), sum(counts[:k + 1]), k == 0, k == K - 1, mesh.tp,
                           mesh.shard) for k in self.chunks]
        slots = [max(slot_plan([a for a in acts if a.chunk == c])[0]
                     for acts in (self.train_actions, self.eval_actions))
                 for c in range(len(self.chunks))]
        need = sum(self.bytes_needed(pt, n, dtype, adamw is not None, split)
                   for pt, n in zip(self.parts, slots))
        free = be.device_memory()
        if free is not None and need > free:
            raise CupyGPTError(
                f"rank {mesh.rank}: out of GPU memory at start: its stages need "
                f"{need / 2**30:.2f} GiB (parameters, gradients, AdamW state, activations for "
                f"{sum(slots)} micro-batch(es) of {self.Bm}x{T}) and {free / 2**30:.2f} GiB is "
                f"free; lower the batch size or sequence length, use more micro-batches, or "
                f"more pipeline stages or tensor-parallel ranks")
        self.stages = [Stage(cfg, be, self.Bm, T, pt, n, dtype, transport, split)
                       for pt, n in zip(self.parts, slots)]
        self.embed = next((st for st in self.stages if st.embed), None)
        self.head = next((st for st in self.stages if st.head), None)
        self.first, self.last = self.embed is not None, self.head is not None
        # the ranks that hold the loss (replica 0, shard 0's reports it) and the tied wte
        at = holders(schedule, p, v)  # model chunk -> (rank, its chunk index there)
        embed_rank, head_rank = at[0][0], at[K - 1][0]
        self.loss_rank = mesh.rank_at(head_rank)
        ends = (embed_rank, head_rank)
        self.tied_peer = mesh.stage_rank(ends[1 - ends.index(r)]) \
            if r in ends and embed_rank != head_rank else None
        # where each chunk's activation goes and its gradient comes back from: a rank, or
        # ("local", that chunk's index here) for a chunk of this rank
        def peer(k):
            if not 0 <= k < K:
                return None
            rk, c = at[k]
            return ("local", c) if rk == r else mesh.stage_rank(rk)
        self.next = [peer(k + 1) for k in self.chunks]
        self.prev = [peer(k - 1) for k in self.chunks]
        self.local = {}   # (kind, receiving chunk) -> copies handed over on this rank, in order
        self.spare = []
        parts = [chunks(st.params.size, mesh.dp)[mesh.replica] for st in self.stages] \
            if zero else None
        self.opt = AdamW(self.stages, adamw, transport, parts) if adamw is not None else None
        Bl = self.Bl
        self.x_dev = be.zeros(Bl * T, np.int32).reshape(Bl, T) if self.first else None
        self.y_dev = be.zeros(Bl * T, np.int32).reshape(Bl, T) if self.last else None
        self.loss_acc = be.zeros(1, np.float64)
        # CUDA graphs: on a backend that has them, alone or over a transport whose step is
        # all on the stream (transport.graphable); the overlapped gradient sum packs its
        # buckets in fresh memory on a side stream, so it stays eager
        self.graphs = graphs and be.supports_graphs and (
            mesh.size == 1 or (transport.graphable and not self.overlap))
        self.graph, self.steps_done = None, 0
        self.trace = None  # [(action, start, end)] while tracing (start_trace)
        io = (self.Bm, T, cfg.C)
        # the same shapes on every rank (NVSHMEM allocates symmetrically): the largest wte
        # shard's rows for the tied sum
        transport.prepare({"act": (io, 2), "grad": (io, 2),
                           "tied": ((-(-cfg.Vp // mesh.tp), cfg.C), 1)})
        sts = self.stages
        # The action table: an op missing here is refused (_execute), never skipped.
        self.ops = {
            Op.FWD: self._forward, Op.BWD: self._backward,
            Op.BWD_INPUT: lambda a, slot: sts[a.chunk].backward_input(slot),
            Op.BWD_WEIGHT: self._backward_weight,
            Op.SEND_ACT: lambda a, slot: self._send("act", sts[a.chunk].output(slot),
                                                    self.next[a.chunk], a.mb),
            Op.RECV_ACT: lambda a, slot: self._recv("act", sts[a.chunk].input(slot),
                                                    self.prev[a.chunk], a),
            Op.SEND_GRAD: lambda a, slot: self._send("grad", sts[a.chunk].grad_io(),
                                                     self.prev[a.chunk], a.mb),
            Op.RECV_GRAD: lambda a, slot: self._recv("grad", sts[a.chunk].grad_io(),
                                                     self.next[a.chunk], a),
            Op.STEP: lambda a, slot: self.sync_grads()}

    def bytes_needed(self, pt, slots, dtype, with_adamw, split):
        """Bytes a Stage of part pt allocates, with AdamW's state for it."""
        cfg = self.cfg
        n_params = param_layout(cfg, pt).size
        adam = 2 * (-(-n_params // self.mesh.dp) if self.zero else n_params)
        n = n_params * 2 + (adam if with_adamw else 0)
        n += activation_layout(cfg, self.Bm, self.T, pt.l1 - pt.l0, pt.head, pt.tp,
                               pt.vocab(cfg)[1], split, pt.embed).size * slots
        n += scratch_layout(cfg, self.Bm, self.T, pt.tp).size
        return n * np.dtype(dtype).itemsize

    def _run(self, actions, x, y, dloss, on_logits=None, decode=None):
        """Executes actions on micro-batches of the host batch x, y (B, T). Returns the loss
        sum over the batch on the rank holding the head (0 elsewhere)."""
        self._feed(x, y)
        self._execute(actions, dloss, y is not None, on_logits, decode)
        self.tr.finish_sends()
        return self._loss()

    def rows(self, mb=None):
        """Rows of the step's batch that this replica (or its micro-batch mb) computes."""
        a = self.mesh.replica * self.Bl + (0 if mb is None else mb * self.Bm)
        return slice(a, a + (self.Bl if mb is None else self.Bm))

    def _feed(self, x, y):
        if self.first:
            self.be.upload(self.x_dev, x[self.rows()])
        if self.last and y is not None:
            self.be.upload(self.y_dev, y[self.rows()])

    def _loss(self):
        """The loss sum over the whole batch (the replicas' sums added) on the head's rank."""
        if not self.last:
            return 0.0
        self.tr.all_reduce(self.loss_acc, "dp")
        return float(self.be.to_host(self.loss_acc)[0])

    def _execute(self, actions, dloss, with_targets, on_logits=None, decode=None):
        """The device side of _run: no host transfers but the transport's, so a
        single-stage step can be captured as a CUDA graph. decode: a position, for
        generation's one-position forwards (Stage.decode)."""
        _, release = slot_plan(actions)
        free = [list(range(len(st.acts)))[::-1] for st in self.stages]
        slot_of = {}
        self.loss_acc.fill(0)
        self.pass_args = (dloss, with_targets, on_logits, decode)
        for i, a in enumerate(actions):
            do = self.ops.get(a.op)
            if do is None:
                raise CupyGPTError(f"rank {self.mesh.rank}: unknown pipeline action {a.op!r} "
                                   f"(micro-batch {a.mb}); the runner knows "
                                   f"{', '.join(op.value for op in self.ops)}")
            key = (a.mb, a.chunk)
            if a.mb is not None and key not in slot_of:
                slot_of[key] = free[a.chunk].pop()
            if self.trace is not None and len(self.trace) < TRACE_MAX:
                t0 = self.be.stamp()
                do(a, slot_of.get(key))
                self.trace.append((a, t0, self.be.stamp()))
            else:
                do(a, slot_of.get(key))
            if i in release:
                k = release[i]
                free[k[1]].append(slot_of.pop(k))
        self.tr.end_step()

    def _send(self, kind, arr, peer, mb):
        """To a peer rank, or to a chunk of this rank: a copy in a buffer kept for reuse
        (the source may change before the receive; the same buffers serve every step, so
        a captured step allocates nothing)."""
        if not isinstance(peer, tuple):
            return self.tr.send(kind, arr, peer, mb)
        buf = self.spare.pop() if self.spare else self.be.zeros(arr.size, arr.dtype)
        buf.reshape(arr.shape)[...] = arr
        self.local.setdefault((kind, peer[1]), []).append(buf)

    def _recv(self, kind, out, peer, a):
        if not isinstance(peer, tuple):
            return self.tr.recv(kind, out, peer, a.mb)
        # a chunk's micro-batches keep their order, so its hand-overs arrive in order
        buf = self.local[(kind, a.chunk)].pop(0)
        out[...] = buf.reshape(out.shape)
        self.spare.append(buf)

    def _rows(self, mb):
        return slice(mb * self.Bm, (mb + 1) * self.Bm)

    def _tokens(self, st, mb):
        return self.x_dev[self._rows(mb)] if st.embed else None

    def _forward(self, a, slot):
        dloss, with_targets, on_logits, t = self.pass_args
        st, mb = self.stages[a.chunk], a.mb
        if t is not None:
            st.decode(slot, t, self.x_dev[0:1, t:t + 1] if st.embed else None)
            if st.head and on_logits is not None:
                on_logits(mb, st.acts[slot]["logits"])
            return
        targets = self.y_dev[self._rows(mb)] if st.head and with_targets else None
        st.forward(slot, self._tokens(st, mb), targets, dloss)
        if targets is not None:
            self.be.loss_accumulate(self.loss_acc, st.acts[slot]["losses"])
        if st.head and on_logits is not None:
            on_logits(mb, st.acts[slot]["logits"])

    def _done_hook(self, a):
        """Overlap: the layer-by-layer start of the replicas' sum, in the chunk's last pass."""
        if self.overlap and a.mb == self.last_bwd[a.chunk]:
            return lambda l: self._layer_done(self.stages[a.chunk], l)
        return None

    def _backward(self, a, slot):
        st = self.stages[a.chunk]
        st.backward(slot, self._tokens(st, a.mb), self._done_hook(a))

    def _backward_weight(self, a, slot):
        st = self.stages[a.chunk]
        st.backward_weight(slot, self._tokens(st, a.mb), self._done_hook(a))

    def _layer_done(self, st, l):
        """Overlap: layer l's gradients are final (the step's last backward passed it), so
        the replicas start summing them while the layers below are computed."""
        for h in self.in_flight:  # in start order, stopping at the first not ready
            if not h.progress():
                break
        self.in_flight.append(self.tr.start_all_reduce(
            [st.g[n][l] for n in PARAM_NAMES if n in st.g and n not in WHOLE], "dp"))

    def sync_grads(self):
        """After the step's last backward: GPT-2 ties the LM head to wte, so the embedding's
        and the head's chunks sum their wte gradients (through the transport when they are
        on two ranks); then the replicas sum theirs (with ZeRO-1 the optimizer
        reduce-scatters them instead)."""
        if self.tied_peer is not None:
            self.tr.sum_tied((self.embed or self.head).g["wte"], self.tied_peer)
        elif self.embed is not None and self.embed is not self.head and self.head is not None:
            e, h = self.embed.g["wte"], self.head.g["wte"]
            e += h          # the order sum_tied adds in: the embedding's + the head's
            h[...] = e
        self.summed = bool(self.in_flight) or not self.zero
        if self.in_flight:  # overlapped: the layers' sums are under way; add the rest
            rest = [st.g[n] for st in self.stages for n in WHOLE if n in st.g]
            if rest:  # (a middle chunk has none)
                self.in_flight.append(self.tr.start_all_reduce(rest, "dp"))
            for h in self.in_flight:
                h.wait()
            self.in_flight = []
        elif not self.zero:
            for st in self.stages:
                self.tr.all_reduce(st.grads, "dp")

    def optimizer_step(self, lr=None):
        """AdamW after gradients(): with ZeRO-1 it reduce-scatters the gradients first,
        unless the overlapped sum did."""
        self.opt.step(lr, self.summed)

    def zero_grad(self):
        for st in self.stages:
            st.zero_grad()

    def load(self, params):
        """Every chunk's part of the whole model's host parameters."""
        for st in self.stages:
            st.load(params)

    def gradients(self, x, y):
        """Forward and backward over the batch (gradients summed, the tied wte synced);
        returns the mean loss on every rank."""
        self.zero_grad()
        loss = self._run(self.train_actions, x, y, 1.0 / (self.B * self.T))
        return self.tr.bcast(loss / (self.B * self.T), root=self.loss_rank)

    def train_step(self, x, y, lr=None):
        if not self.graphs or self.steps_done == 0:  # the first step allocates workspaces
            loss = self.gradients(x, y)
            self.optimizer_step(lr)
            self.steps_done += 1
            return loss
        self.launch_graph_step(x, y, lr)
        self.tr.finish_sends()
        return self.tr.bcast(self._loss() / (self.B * self.T), root=self.loss_rank)

    def launch_graph_step(self, x, y, lr=None):
        """One step as a replayed CUDA graph (captured on the first call): zero the
        gradients, forward and backward over the micro-batches, the transfers, AdamW.
        Returns once launched, without waiting for the GPU."""
        be, opt = self.be, self.opt
        self._feed(x, y)
        sched = opt.advance(lr)
        be.adamw_schedule(sched)
        if self.graph is None:
            def body():
                self.zero_grad()
                self._execute(self.train_actions, 1.0 / (self.B * self.T), True)
                opt.apply(sched, self.summed)
            self.graph = be.capture(body)
        be.replay(self.graph)
        self.steps_done += 1

    def eval_loss(self, x, y, on_logits=None):
        loss = self._run(self.eval_actions, x, y, None, on_logits)
        return self.tr.bcast(loss / (self.B * self.T), root=self.loss_rank)

    def forward_first(self, x, on_logits):
        """Forward of the first micro-batch only (sampling reads one row of its logits)."""
        self._run(self.first_actions, x, None, None, on_logits)

    def decode(self, x, t, on_logits):
        """Position t of x's row 0 alone through every stage, on the activations that
        forward_first and the decodes before it left (the KV cache)."""
        self._run(self.first_actions, x, None, None, on_logits, decode=t)

    def start_trace(self):
        """Records every action's start and end from now on (the first TRACE_MAX)."""
        self.trace = []

    def _gather_whole(self, *host):
        """Whole-model tensors from every part's host buffers (host: per buffer kind, a list
        over this rank's stages), on rank 0 (None elsewhere); replicas hold the same ones,
        so replica 0's are sent."""
        mine = [(st.part, [h[i] for h in host]) for i, st in enumerate(self.stages)] \
            if self.mesh.replica == 0 else []
        parts = [p for ps in self.tr.gather(mine) or [] for p in ps]
        if self.tr.rank != 0:
            return [None] * len(host)
        return [assemble(self.cfg, [(pt, h[i]) for pt, h in parts]) for i in range(len(host))]

    def gather_params(self):
        """The whole model's host parameters on rank 0 (None elsewhere)."""
        return self._gather_whole([st.export() for st in self.stages])[0]

    def gather_adamw(self):
        """AdamW's m and v in the whole model's layout on rank 0 (None elsewhere)."""
        per_stage = self.opt.stage_state()
        return self._gather_whole([m for m, _ in per_stage], [v for _, v in per_stage])

    def load_adamw(self, m, v):
        """m, v: whole-model host arrays (a checkpoint's); this rank takes its parts."""
        self.opt.load_stage_state([[copy_part(np.empty(st.layout.size, np.float32), st.part,
                                              x, self.cfg) for x in (m, v)]
                                   for st in self.stages])
