"""The runner: one rank's part of every step, the facade the commands use (step, eval_loss,
next_token, state_dict, load_state_dict, ...) and nothing deeper.

One training step, file by file (llm.c's train_gpt2.cu main loop, cut across ranks):

  parallel/runner.py             Runner.step: per batch feed, forward_backward and
                                 sync_gradients (gradients), then update; eager, or from the
                                 second step the four replayed as one CUDA graph
  parallel/pipeline/executor.py  feed: this replica's rows to the device; run: the
                                 schedule's actions (plan.train, made once by plan.py and
                                 schedule.py) in order; close: its closing STEP action
  model/stage.py                 Stage.forward: embedding, blocks, the head (logits, loss and
                                 dlogits a chunk at a time); Stage.backward: blocks,
                                 embedding (or backward_input then backward_weight)
  backends/numpy/, cuda/         the ops Stage calls (backends/protocol.py: their interface)
  comm/base.py                   the transport's sends, receives and group sums (the
                                 pipeline's hand-offs, the tensor-parallel sums)
  parallel/data/grad_sync.py     sync_gradients: the tied wte's two ends, the replicas' sum
                                 (started layer by layer in the backward when overlapped)
  model/optim.py                 update: the global gradient norm, clipping, AdamW

The single process is the pipeline of one stage: one code path for every world size.
One module, the facade: the step and every reader of the model a command uses are here, so
no command reaches past it.
"""
from collections.abc import Callable

import numpy as np

from .. import CupyGPTError
from ..backends.protocol import Backend
from ..comm.base import Transport
from ..model.layout import Part, assemble, copy_part, param_layout
from ..model.optim import AdamW
from ..model.shape import GPT2Config
from ..model.stage import Stage
from .data.grad_sync import GradSync
from .data.zero import ZeroOne
from .data.zero import zero_slices as zero_slices_of
from .memory import check_memory, memory_plan
from .mesh import Mesh
from .pipeline import trace
from .pipeline.executor import Executor, Pass
from .pipeline.plan import plan_step
from .settings import StepSettings
from .tensor.comm import TensorGroup


class Abandoned(Exception):
    """A step given up between its batches (Runner.step's stop): no update was made."""

class Runner:
    def __init__(self, *, shape: GPT2Config, be: Backend, transport: Transport, mesh: Mesh,
                 settings: StepSettings) -> None:
        """settings: what every step is (settings.py); its attention is told the backend
        before the memory plan, with whether the run trains and replays a captured step."""
        self.shape, self.be, self.transport, self.mesh = shape, be, transport, mesh
        self.settings = s = settings
        self.plan = plan = plan_step(shape, mesh, batch=s.batch, seq=s.seq,
                                     micro_batches=s.micro_batches, schedule=s.schedule,
                                     virtual=s.virtual, counts=s.counts)
        zero_slices = zero_slices_of([param_layout(shape, pt).size for pt in plan.parts],
                                     mesh.dp, mesh.replica) if s.zero else None
        # CUDA graphs: on a backend that has them, alone or over a transport whose step is
        # all on the stream (transport.graphable); the overlapped gradient sum (GradSync's
        # overlap) packs its buckets in fresh memory on a side stream, so it stays eager
        self.graphs = s.graphable and be.supports_graphs and (
            mesh.size == 1 or (transport.graphable and not (s.overlap and mesh.dp > 1)))
        if s.attention is not None:
            be.use_attention(s.attention, backward=s.adamw is not None, replay=self.graphs)
        self.memory = memory_plan(shape, plan, be, s.dtype, s.adamw is not None,
                                  zero_slices, s.recompute)
        check_memory(self.memory, be, transport, mesh)
        self.stages = [Stage(shape, be, batch=plan.mb_rows, seq=s.seq, part=pt, slots=n,
                             dtype=s.dtype, tp_group=TensorGroup(transport, pt.tp, pt.shard),
                             split=plan.split_backward,
                             recompute=s.recompute)
                       for pt, n in zip(plan.parts, plan.slots)]
        self.head = next((st for st in self.stages if st.head), None)
        self.sync = GradSync(self.stages, transport, tied_peer=plan.tied_peer, dp=mesh.dp,
                             zero=s.zero, overlap=s.overlap)
        zero = ZeroOne(transport, zero_slices) if s.zero else None
        self.opt = AdamW(self.stages, s.adamw, transport, zero) if s.adamw else None
        self.exec = Executor(plan, self.stages, be, transport, self.sync)
        self.exec.trace = [] if s.trace else None
        self.graph, self.steps_done = None, 0
        io = (plan.mb_rows, s.seq, shape.C)
        # the same shapes on every rank (NVSHMEM allocates symmetrically): the largest wte
        # shard's rows for the tied sum
        transport.prepare({"act": (io, 2, s.dtype), "grad": (io, 2, s.dtype),
                           "tied": ((-(-shape.Vp // mesh.tp), shape.C), 1, s.dtype)})

    # --- training ----------------------------------------------------------------------

    def step(self, x: np.ndarray, y: np.ndarray, lr: float | None = None,
             keep: Callable | None = None, wait: bool = True,
             stop: Callable | None = None) -> float | None:
        """One training step on the host batch x, y (B, T; several batches: see gradients);
        returns the mean loss on every rank (wait=False: None for a replayed CUDA graph,
        not waiting for the device). keep(loss, norm), when given, decides whether the
        update happens (outlier skipping; an eager step), alike on every rank. stop(), a
        collective asked between several batches' passes, abandons the step (Abandoned)
        with the parameters untouched: a signal waits one pass, not a whole step."""
        self.steps_done += 1
        if self.graphs and self.steps_done > 1 and len(x) == self.plan.batch and not keep:
            return self._replay(x, y, lr, wait)
        loss = self.gradients(x, y, stop)
        self.update(lr, keep and (lambda norm: keep(loss, norm)))
        return loss

    def gradients(self, x: np.ndarray, y: np.ndarray, stop: Callable | None = None) -> float:
        """Forward and backward over x, y (n B, T): n batches of the plan's B rows, each a
        pass adding into the gradients (llm.c's gradient accumulation), synced after the
        last; returns the mean loss on every rank."""
        n, rows = len(x) // self.plan.batch, self.plan.batch
        if n < 1 or len(x) % rows:
            raise CupyGPTError(f"a step takes whole batches of {rows} rows, not {len(x)}")
        self.zero_grad()
        total = 0.0
        for i in range(n):
            if i and stop and stop():
                raise Abandoned(f"the step stopped after {i} of its {n} batches")
            self.exec.feed(x[i * rows:(i + 1) * rows], y[i * rows:(i + 1) * rows])
            self.forward_backward(n, last=i == n - 1)
            self.sync_gradients(last=i == n - 1)
            total += self.loss()
        return total / n

    def forward_backward(self, micro_steps: int = 1, last: bool = True) -> None:
        """The schedule's forwards, backwards and transfers over the fed batch, one of
        micro_steps (scaled to the step's mean); the last pass's last backwards start the
        replicas' sums when they overlap."""
        self.exec.run(self.plan.train, Pass(
            dloss=1.0 / (micro_steps * self.plan.batch * self.plan.seq), targets=True,
            sync=last))

    def sync_gradients(self, last: bool = True) -> None:
        """The schedule's closing STEP action: after a step's last pass, the gradient sums
        (the tied wte's, the replicas'; ZeRO-1 without overlap: the update's)."""
        self.exec.close(self.sync.finish if last else None)

    def update(self, lr: float | None = None, keep: Callable | None = None) -> bool:
        """AdamW on the synced gradients (model/optim.py). keep: as AdamW.apply's."""
        return self.opt.step(lr, self.sync.summed, keep)

    def _replay(self, x, y, lr, wait):
        """The step as a CUDA graph captured on the second (the first allocated the
        workspaces), its batch and AdamW's lr and bias corrections uploaded first."""
        self.exec.feed(x, y)
        sched = self.opt.advance(lr)
        self.be.adamw_schedule(sched)
        if self.graph is None:
            self.graph = self.be.capture(lambda: self._captured_step(sched))
        self.be.replay(self.graph)
        return self.loss() if wait else None

    def _captured_step(self, sched):
        self.zero_grad()
        self.forward_backward()
        self.sync_gradients()
        self.opt.apply(sched, self.sync.summed)

    def loss(self) -> float:
        """The last pass's mean loss on every rank, once its sends are taken: the replicas'
        loss sums added on the head's ranks."""
        self.transport.finish_sends()
        total = 0.0
        if self.head is not None:
            self.transport.all_reduce(self.exec.loss_acc, "dp")
            total = float(self.be.to_host(self.exec.loss_acc)[0])
        return self.transport.bcast(total / (self.plan.batch * self.plan.seq),
                                    root=self.plan.loss_rank)

    def recompute_saves(self) -> int:
        """Bytes of activations and scratch this rank keeps fewer for recomputing (-r)."""
        kept = memory_plan(self.shape, self.plan, self.be, self.settings.dtype, False)
        return sum(kept[k] - self.memory[k] for k in ("activations", "scratch"))

    def grad_norm(self) -> float:
        """The last step's global gradient norm, before clipping (the same on every rank)."""
        return self.opt.grad_norm()

    def zero_grad(self) -> None:
        for st in self.stages:
            st.zero_grad()

    @property
    def overlap(self) -> bool:
        """Whether the replicas' gradient sum overlaps the backward."""
        return self.sync.overlap

    def set_overlap(self, on: bool) -> None:
        """Whether the replicas' sum overlaps the backward (bench times both)."""
        self.sync.overlap = on and self.mesh.dp > 1

    # --- forward only ------------------------------------------------------------------

    def eval_loss(self, x: np.ndarray, y: np.ndarray, on_logits: Callable | None = None) -> float:
        """The mean loss of x, y on every rank. on_logits(rows, v0, logits): this rank's
        rows of the batch (a slice), its first vocabulary column and those logits (host,
        (rows, T, its real vocabulary columns)), per micro-batch, on the head's ranks."""
        B, T, got = self.plan.mb_rows, self.plan.seq, {}

        def grab(mb, first, logits):  # the micro-batch's chunks, in order, on the host
            if first == 0:
                got[mb] = np.empty((B * T, self.head.valid), np.float32)
            got[mb][first:first + len(logits)] = self.be.to_host(logits)[:, :self.head.valid]
            if first + len(logits) == B * T:
                on_logits(self.plan.global_rows(mb), self.head.v0,
                          got.pop(mb).reshape(B, T, -1))
        return self._pass(self.plan.evaluate, x, y,
                          Pass(targets=True, on_logits=grab if on_logits else None))

    def position_losses(self, x: np.ndarray, y: np.ndarray) -> np.ndarray:
        """Collective: the loss at every position of x, y (host, (B, T)) as float64 host
        (B, T), the same on every rank: each replica's head (its first tensor-parallel
        shard: the others hold the same losses) sends its rows to rank 0, which shares
        them."""
        mine = []

        def grab(mb, losses):  # a copy: the next micro-batch may reuse the slot
            if self.head.part.shard == 0:
                mine.append((self.plan.global_rows(mb),
                             self.be.to_host(losses).astype(np.float64)))
        self._pass(self.plan.evaluate, x, y, Pass(targets=True, on_losses=grab))
        rows = self.transport.gather(mine)
        out = None
        if rows is not None:
            out = np.zeros(x.shape, np.float64)
            for r, losses in (p for rank in rows for p in rank):
                out[r] = losses
        return self.transport.bcast(out, root=0)

    def next_token(self, tokens: np.ndarray, t: int, choose: Callable, cached: bool = True) -> int:
        """Generation: runs row 0 of tokens (host, (rows, T)) up to position t, and returns
        choose(the logits at t over the whole vocabulary), the same on every rank. cached:
        position t alone through every stage, on the activations the passes before left
        (the KV cache: the first call is a whole pass over the prompt); else a whole pass."""
        row = {}

        def grab(mb, first, logits):  # row 0 is the first T positions
            if mb == 0 and first <= t < first + len(logits):
                row["logits"] = self.be.to_host(logits[t - first, :self.head.valid]).astype(
                    np.float32)
        self.exec.feed(tokens, None)
        self.exec.run(self.plan.first, Pass(on_logits=grab, decode=t if cached else None))
        self.exec.close()
        self.transport.finish_sends()
        # chosen on rank 0, whose RNG a checkpoint keeps: the head's row (each
        # tensor-parallel shard's slice of the vocabulary; replicas send the same) goes there
        slices = self.transport.gather((self.head.v0, row["logits"]) if self.head else None)
        tok = None
        if slices is not None:
            whole = dict(s for s in slices if s)
            tok = choose(np.concatenate([whole[v0] for v0 in sorted(whole)]))
        return self.transport.bcast(tok, root=0)

    def _pass(self, actions, x, y, ps):
        self.exec.feed(x, y)
        self.exec.run(actions, ps)
        self.exec.close()
        return self.loss()

    # --- state -------------------------------------------------------------------------

    def state_dict(self, optimizer: bool = True) -> dict | None:
        """Collective: {"params"} and, when there is an optimizer and it is asked for,
        AdamW's "m", "v" (and a bf16 run's fp32 "master" weights) and "adam_t": whole-model
        host arrays on rank 0 (None elsewhere)."""
        optimizer = optimizer and self.opt is not None
        per_stage = self.opt.stage_state() if optimizer else []
        names = ["params"] + (list(per_stage[0]) if optimizer else [])
        host = [[st.export() for st in self.stages]] + \
            [[kept[k] for kept in per_stage] for k in names[1:]]
        whole = self._gather_whole(*host)
        if self.transport.rank != 0:
            return None
        out = dict(zip(names, whole))
        return {**out, "adam_t": self.opt.t} if optimizer else out

    def load_state_dict(self, params: np.ndarray, m: np.ndarray | None = None,
                        v: np.ndarray | None = None, adam_t: int | None = None,
                        master: np.ndarray | None = None) -> None:
        """params (and AdamW's m, v, a bf16 run's master weights): the whole model's host
        arrays; this rank takes its parts. adam_t: AdamW's step count. A bf16 run given no
        master takes params, unrounded, as its master weights."""
        for st in self.stages:
            st.load(params)
        if self.opt is None:
            return
        given = {"m": m, "v": v}
        if "master" in self.opt.state[0]:
            given["master"] = params if master is None else master
        given = {k: x for k, x in given.items() if x is not None}
        if given:
            self.opt.load_stage_state([{k: copy_part(np.empty(st.layout.size, np.float32),
                                                     st.part, x, self.shape)
                                        for k, x in given.items()} for st in self.stages])
        if adam_t is not None:
            self.opt.t = adam_t

    def _gather_whole(self, *host):
        """Whole-model tensors from every part's host buffers (host: per buffer kind, a list
        over this rank's stages), on rank 0 (None elsewhere); replicas hold the same ones,
        so replica 0's are sent."""
        mine = [(st.part, [h[i] for h in host]) for i, st in enumerate(self.stages)] \
            if self.mesh.replica == 0 else []
        parts = [p for ps in self.transport.gather(mine) or [] for p in ps]
        if self.transport.rank != 0:
            return [None] * len(host)
        return [assemble(self.shape, [(pt, h[i]) for pt, h in parts]) for i in range(len(host))]

    def grads_by_part(self) -> list[tuple[Part, dict[str, np.ndarray]]]:
        """Collective: per stage, (its Part, {name: host gradient summed over replicas})."""
        return [(st.part, {n: self.be.to_host(g) for n, g in self.sync.summed_grads(st).items()})
                for st in self.stages]

    def params_finite(self) -> bool:
        return all(self.be.all_finite(st.params) for st in self.stages)

    # --- what the run table and --trace show ----------------------------------------------

    def layers(self) -> str:
        """This rank's model chunks, e.g. "0..2 +embedding and 9..11 +head"."""
        return " and ".join(f"{st.l0}..{st.l1 - 1}{' +embedding' if st.embed else ''}"
                            f"{' +head' if st.head else ''}" for st in self.stages)

    def write_trace(self, path: str) -> None:
        """Collective: rank 0 writes every rank's actions recorded since the first
        (settings.trace); recording stops."""
        trace.write(path, self.exec.trace, self.be, self.transport, self.mesh,
                    {"schedule": self.plan.schedule, "stages": self.mesh.pp,
                     "micro_batches": self.plan.micro_batches,
                     "virtual_stages": len(self.plan.chunks)})
        self.exec.trace = None
