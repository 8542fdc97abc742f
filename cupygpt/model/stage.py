"""GPT-2 as a stage: layers [l0, l1), with the embedding (first stage) and/or the head (last),
one tensor-parallel shard of it (Megatron's split, layout.Part).

The single process is the stage [0, L) with both, unsharded. The model calls only the
backend interface, so NumPy and CUDA run the same code; it never knows whether it is
pipelined. Tensor parallelism adds four sums over the shard's group per layer and pass (the
row-parallel outputs forward, the column-parallel inputs' gradients backward) and the
vocab-parallel cross-entropy, both run by the TensorGroup the stage is given
(parallel/tensor/comm.py; with one shard they are no-ops). Activations live in `slots`
copies of one micro-batch's layout, so a pipeline stage keeps the micro-batches that are in
flight.

The LM head is the last stage's: logits = lnf wte^T a chunk of positions at a time
(layout's LOGIT_CHUNK bounds a chunk), and the vocab-parallel softmax cross-entropy on each
chunk. In training the head's backward runs in forward too, while a chunk's dlogits exist,
so no (B, T, Vp) tensor is ever kept: what a stage keeps of the head is lnf, and after a
training forward lnf's gradient in its place; backward starts from there.

One module, a stage's forward and backward read in one place (llm.c's gpt2_forward and
gpt2_backward, the head's included), so it runs past the size a file is otherwise held to.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np
from numpy.typing import DTypeLike

from .. import CupyGPTError
from ..backends.protocol import Backend
from ..precision import dtype_name, wide
from .layout import (
    RECOMPUTED,
    Layout,
    Mixed,
    Part,
    activation_layout,
    copy_part,
    param_layout,
    scratch_layout,
)
from .shape import GPT2Config


class Stage:
    def __init__(self, shape: GPT2Config, be: Backend, *, batch: int, seq: int,
                 part: Part | None = None, slots: int = 1, dtype: DTypeLike = np.float32,
                 tp_group: Any = None, split: bool = False,
                 recompute: int = 0) -> None:
        """shape: the model's GPT2Config; be: the backend; batch, seq: a micro-batch's rows and
        T; part: what this stage holds (None: the whole model); slots: micro-batches whose
        activations it keeps at once; tp_group: its tensor-parallel group, a
        parallel/tensor/comm.py TensorGroup (None: one shard, nothing to sum); split: it
        keeps what a split backward's weight pass reads; recompute: llm.c's -r
        (layout.RECOMPUTED: what backward makes again instead of keeping)."""
        B, T = batch, seq
        if np.dtype(dtype) not in be.DTYPES:
            raise CupyGPTError(f"the {be.name} backend supports "
                               f"{', '.join(dtype_name(d) for d in be.DTYPES)}", "dtype",
                               dtype_name(dtype))
        part = part or Part.whole(shape)
        self.shape, self.be, self.B, self.T = shape, be, B, T
        self.dtype, self.wide = np.dtype(dtype), wide(dtype)
        self.part, self.tp_group = part, tp_group
        self.l0, self.l1, self.embed, self.head = part.l0, part.l1, part.embed, part.head
        self.nl, self.NH = self.l1 - self.l0, shape.NH // part.tp  # this shard's heads
        self.v0, _, self.valid = part.vocab(shape)
        self.recomputed = RECOMPUTED[recompute]
        self.layout, alay, slay = self.layouts(shape, B, T, part, split, recompute)
        self.params = be.zeros(self.layout.size, dtype)
        self.grads = be.zeros(self.layout.size, dtype)
        self.p, self.g = self.layout.views(self.params), self.layout.views(self.grads)
        # (narrow, wide) buffers of every slot's activations, and of the scratch
        self.acts_bufs = (be.zeros(alay.narrow.size * slots, dtype),
                          be.zeros(alay.wide.size * slots, self.wide))
        self.acts = [alay.views(*self.acts_bufs, i) for i in range(slots)]
        self.scratch_bufs = be.zeros(slay.narrow.size, dtype), be.zeros(slay.wide.size, self.wide)
        self.s = slay.views(*self.scratch_bufs)
        # attention output's gradient (C/tp wide) lives in dbt_c's memory: it is read once,
        # by attention_backward, before dbt_c is written
        self.s["datty"] = self.s["dbt_c"].reshape(-1)[:B * T * shape.C // part.tp].reshape(
            B, T, shape.C // part.tp)

    @staticmethod
    def layouts(shape: GPT2Config, B: int, T: int, part: Part, split: bool,
                recompute: int = 0) -> tuple[Layout, Mixed, Mixed]:
        """(parameters, one slot's activations, scratch) of a stage holding part."""
        return (param_layout(shape, part),
                activation_layout(shape, B, T, part.l1 - part.l0, part.head, part.tp, split,
                                  part.embed, recompute),
                scratch_layout(shape, B, T, part.tp, recompute,
                               part.vocab(shape)[1] if part.head else None))

    @classmethod
    def sizes(cls, shape: GPT2Config, *, batch: int, seq: int, part: Part, slots: int, split: bool,
              recompute: int = 0, dtype: DTypeLike = np.float32) -> dict[str, int]:
        """Bytes of each kind of buffer a stage allocates (the constructor allocates these;
        the memory estimate reads them before anything is allocated)."""
        params, acts, scratch = cls.layouts(shape, batch, seq, part, split, recompute)
        n, w = np.dtype(dtype).itemsize, wide(dtype).itemsize
        return {"params": params.size * n, "grads": params.size * n,
                "activations": (acts.narrow.size * n + acts.wide.size * w) * slots,
                "scratch": scratch.narrow.size * n + scratch.wide.size * w}

    def tp_sum(self, arr) -> None:
        """The tensor-parallel group's sum of arr, in place (nothing with one shard)."""
        if self.tp_group is not None:
            self.tp_group.sum(arr)

    def load(self, full_params: np.ndarray) -> None:
        """This stage's part of a whole model's host parameters (array or memmap), in one
        upload; the whole model goes straight from the file into the flat buffer."""
        if self.part == Part.whole(self.shape):
            host = full_params
        else:
            host = copy_part(np.empty(self.layout.size, full_params.dtype), self.part,
                             full_params, self.shape)
        self.be.upload(self.params, host)

    def export(self) -> np.ndarray:
        """This stage's parameters, on the host (the buffer itself on the CPU when fp32:
        a copy of a d12 is half a GiB at the run's end)."""
        return self.be.to_host(self.params).astype(np.float32, copy=False)

    def zero_grad(self) -> None:
        self.grads.fill(0)

    def input(self, slot: int = 0):
        """The stage input: written by the embedding, or by the previous stage."""
        return self.acts[slot]["encoded"]

    def output(self, slot: int = 0):
        return self.acts[slot]["residual3"][self.nl - 1]

    def grad_io(self):
        """The residual-stream gradient: arrives here from the next stage, leaves from here."""
        return self.s["dresidual"]

    def forward(self, slot: int = 0, tokens=None, targets=None, dloss: float | None = None,
                on_logits: Callable | None = None) -> None:
        """tokens (B,T) on the device when embed; targets when head. With dloss the head
        also runs its own backward (_lm_head) and leaves lnf's gradient in place of lnf.
        on_logits(first, logits): the head's logits of positions [first, first + n) of
        the micro-batch (flattened (B*T, vocab rows)), a chunk at a time."""
        be, a, NH = self.be, self.acts[slot], self.NH
        if self.embed:
            self._embed(a["encoded"], tokens, self.p["wpe"])

        def whole(name, l=None):
            return self._act(a, name, l)

        def attend(out, l):
            be.attention_forward(out, a["att_lse"][l], a["qkv"][l], NH)
        x = self._blocks(whole, attend, a["encoded"])
        if self.head:
            self._final_layernorm(whole, x)
            self._lm_head(a["lnf"].reshape(-1, self.shape.C), a["losses"].reshape(-1),
                          None if targets is None else targets.reshape(-1), dloss, on_logits)

    def _embed(self, out, tokens, wpe):
        """Vocab-parallel: each shard writes the rows of the tokens it holds (zeros for the
        rest), shard 0 adds the positions; the sum over shards is wte[token] + wpe exactly
        (the other terms are zeros)."""
        self.be.encoder_forward(out, tokens, self.p["wte"], wpe if self.part.shard == 0 else None,
                                self.v0)
        self.tp_sum(out)

    def decode(self, slot: int, t: int, tokens=None, on_logits: Callable | None = None) -> None:
        """Generation's forward of one position: row 0 at position t only. Every earlier
        position's q, k, v are still in this slot's qkv activations from the passes before
        (the KV cache), so each layer computes one row and attends over t + 1 keys. tokens
        (1,1) on the device when embed; on_logits(t, logits (1, vocab rows)) (head)."""
        be, a, NH = self.be, self.acts[slot], self.NH

        def row(name, l=None):  # the (1, 1, ...) view of row 0, position t
            return self._act(a, name, l)[0:1, t:t + 1]

        def attend(out, l):
            be.attention_decode(out, a["qkv"][l][0:1, :t + 1], NH)
        if self.embed:
            self._embed(row("encoded"), tokens, self.p["wpe"][t:])
        x = self._blocks(row, attend, row("encoded"))
        if self.head:
            self._final_layernorm(row, x)
            self._lm_head(row("lnf").reshape(1, -1), None, None, None, on_logits, first=t)

    RECOMPUTE_INTO = {"fch_gelu": "gelu_re", "ln1": "ln_re", "ln2": "ln_re"}

    def _act(self, a, name, l=None):
        """Activation `name` (of layer l) of a slot's views a: its own, or for a recomputed
        one the scratch buffer forward passes it through."""
        if name in self.recomputed or name == "proj":  # (proj: one layer's, in scratch)
            return self.s[self.RECOMPUTE_INTO.get(name, name)]
        return a[name] if l is None else a[name][l]

    def _input(self, a, name, l):
        """A matmul's input activation of layer l for its weight gradient: kept, or made
        again now (recompute) from what forward kept, the same ops on the same inputs, so
        the same bits."""
        if name not in self.recomputed:
            return a[name][l]
        out, p = self._act(a, name), self.p
        if name == "fch_gelu":
            self.be.gelu_forward(out, a["fch"][l])
        else:
            x = a["residual2"][l] if name == "ln2" else \
                a["encoded"] if l == 0 else a["residual3"][l - 1]
            self.be.layernorm_forward(out, a[name + "_mean"][l], a[name + "_rstd"][l], x,
                                      p[name + "w"][l], p[name + "b"][l])
        return out

    def _blocks(self, act, attend, x):
        """The transformer blocks on x, writing activations act(name, layer) (whole tensors
        for a pass, one row's views for a decode step); returns the last block's output.
        Every bias is added by its matmul (the GEMM's epilogue on CUDA). A row-parallel
        projection's product (scratch: backward never reads it) is summed over the tp
        shards, so only shard 0's matmul adds the bias (once in the sum); the residual add
        runs the next layernorm too."""
        be, p, proj = self.be, self.p, act("proj")
        row_bias = self.part.shard == 0  # the row-parallel projections' biases, see above
        if self.nl:
            be.layernorm_forward(act("ln1", 0), act("ln1_mean", 0), act("ln1_rstd", 0), x,
                                 p["ln1w"][0], p["ln1b"][0])
        for l in range(self.nl):
            be.matmul_forward(act("qkv", l), act("ln1", l), p["qkvw"][l], p["qkvb"][l])
            attend(act("atty", l), l)
            be.matmul_forward(proj, act("atty", l), p["attprojw"][l],
                              p["attprojb"][l] if row_bias else None)
            self.tp_sum(proj)
            be.residual_layernorm_forward(act("residual2", l), x, proj, act("ln2", l),
                                          act("ln2_mean", l), act("ln2_rstd", l),
                                          p["ln2w"][l], p["ln2b"][l])
            be.matmul_forward(act("fch", l), act("ln2", l), p["fcw"][l], p["fcb"][l])
            be.gelu_forward(act("fch_gelu", l), act("fch", l))
            be.matmul_forward(proj, act("fch_gelu", l), p["fcprojw"][l],
                              p["fcprojb"][l] if row_bias else None)
            self.tp_sum(proj)
            x = self._residual3(act, l, act("residual2", l), proj)
        return x

    def _residual3(self, act, l, x, proj):
        """Layer l's output x + proj (fcproj's product, its bias in), and the next ln1 (or the
        head's lnf)."""
        be, p, res = self.be, self.p, act("residual3", l)
        if l + 1 == self.nl and not self.head:
            be.residual_forward(res, x, proj)
            return res
        k, name = (l + 1, "ln1") if l + 1 < self.nl else (None, "lnf")
        w, b = (p[name + "w"], p[name + "b"]) if k is None else (p[name + "w"][k], p[name + "b"][k])
        be.residual_layernorm_forward(res, x, proj, act(name, k), act(name + "_mean", k),
                                      act(name + "_rstd", k), w, b)
        return res

    def _final_layernorm(self, act, x):
        """The final layernorm, where no residual add ran it (a stage of no layers)."""
        if not self.nl:
            self.be.layernorm_forward(act("lnf"), act("lnf_mean"), act("lnf_rstd"), x,
                                      self.p["lnfw"], self.p["lnfb"])

    def _lm_head(self, lnf, losses, targets, dloss, on_logits, first=0):
        """The head over lnf's positions (N, C), a chunk of the scratch's logit rows at a
        time: with targets the losses (dlogits in place of the logits with dloss); with
        dloss also wte's gradient += dlogits^T lnf, then lnf's rows := dlogits wte (a
        partial sum over the vocab shards: backward sums it over the group). In bf16 each
        chunk's addition to wte's gradient is rounded, as each micro-batch's is.
        on_logits(first + r0, logits): chunk r0's logits, as the GEMM made them."""
        if targets is None and on_logits is None:
            return  # nobody reads them
        be, p, N = self.be, self.p, lnf.shape[0]
        R, Vr = self.s["logits"].shape
        for r0 in range(0, N, R):
            n, rows = min(R, N - r0), slice(r0, r0 + R)
            logits = self.s["logits"].reshape(-1)[:n * Vr].reshape(n, Vr)
            be.matmul_forward(logits, lnf[rows], p["wte"])
            if on_logits is not None:
                on_logits(first + r0, logits)
            if targets is None:
                continue
            self._cross_entropy(logits, losses[rows], targets[rows], dloss)
            if dloss is not None:
                be.matmul_backward_weight(self.g["wte"], None, logits, lnf[rows])
                be.matmul_backward_input(lnf[rows], logits, p["wte"])

    def _cross_entropy(self, logits, losses, targets, dloss):
        """One chunk's softmax cross-entropy over the vocabulary (its shards' across the
        tensor-parallel group)."""
        if self.tp_group is None:
            return self.be.cross_entropy(logits, losses, targets, self.valid, dloss)
        self.tp_group.cross_entropy(self.be, logits, losses, targets, self.s["lstats"],
                                    self.v0, self.valid, dloss)

    def backward(self, slot: int = 0, tokens=None, layer_done: Callable | None = None) -> None:
        """Accumulates parameter gradients; on a non-head stage grad_io() must hold the
        gradient of output(slot). Leaves the gradient of input(slot) in grad_io(). The
        input gradients of the column-parallel products (the head's, qkv's, fc's) are
        partial sums over the shard's columns: summed over the shards before layernorm.
        layer_done(l), when given, is called as soon as layer l's gradients are added."""
        self._backward(slot, layer_done, weights=True, tokens=tokens)

    def backward_input(self, slot: int = 0) -> None:
        """Zero-bubble's B: backward's input gradient (grad_io() as backward leaves it) and
        the layernorms' gradients; the matmuls' output gradients are kept in the slot
        (a split stage's activations) for backward_weight."""
        self._backward(slot, None, weights=False)

    def backward_weight(self, slot: int = 0, tokens=None,
                        layer_done: Callable | None = None) -> None:
        """Zero-bubble's W: the matmuls' (and the embedding's) weight gradients of a slot
        whose backward_input ran, in backward's order, so B then W adds exactly what the
        fused backward adds."""
        be, a, g = self.be, self.acts[slot], self.g
        for l in reversed(range(self.nl)):
            for name, dout, inp in self.MATMULS:
                be.matmul_backward_weight(g[name + "w"][l], g[name + "b"][l], a[dout][l],
                                          self._input(a, inp, l))
            if layer_done:
                layer_done(l)
        if self.embed:
            be.encoder_backward(g["wte"], g["wpe"], a["dencoded"], tokens, self.v0)

    # A block's matmuls in backward's order: (parameter, its output gradient kept by a
    # split backward, its input activation).
    MATMULS = (("fcproj", "dfcproj", "fch_gelu"), ("fc", "dfch", "ln2"),
               ("attproj", "dattproj", "atty"), ("qkv", "dqkv", "ln1"))

    def _backward(self, slot, layer_done, weights, tokens=None):
        """weights: each matmul's weight gradient right after its input gradient (the fused
        backward); otherwise every output gradient a weight gradient reads goes to the
        slot's kept copies (written there directly where backward produces it)."""
        be, p, g, a, s = self.be, self.p, self.g, self.acts[slot], self.s
        dres = s["dresidual"]

        def matmul(dinp, name, l, dout, inp):
            be.matmul_backward_input(dinp, dout, p[name + "w"][l])
            if weights:
                be.matmul_backward_weight(g[name + "w"][l], g[name + "b"][l], dout,
                                          self._input(a, inp, l))

        def out(keep, l, scratch):  # where backward writes an output gradient it keeps
            return s[scratch] if weights else a[keep][l]

        def kept(dout, keep, l):  # dres changes next: a split backward keeps a copy
            if not weights:
                (a[keep] if l is None else a[keep][l])[...] = dout
            return dout
        if self.head:  # the head's products ran in forward (_lm_head): lnf is its gradient
            dres.fill(0)
            self.tp_sum(a["lnf"])
            be.layernorm_backward(dres, g["lnfw"], g["lnfb"], a["lnf"], self.output(slot),
                                  p["lnfw"], a["lnf_mean"], a["lnf_rstd"])
        for l in reversed(range(self.nl)):
            x = a["encoded"] if l == 0 else a["residual3"][l - 1]
            matmul(s["dbt_4c"], "fcproj", l, kept(dres, "dfcproj", l), "fch_gelu")
            dfch = out("dfch", l, "dbt_4c2")
            be.gelu_backward(dfch, a["fch"][l], s["dbt_4c"])
            matmul(s["dbt_c"], "fc", l, dfch, "ln2")
            self.tp_sum(s["dbt_c"])
            be.layernorm_backward(dres, g["ln2w"][l], g["ln2b"][l], s["dbt_c"],
                                  a["residual2"][l], p["ln2w"][l], a["ln2_mean"][l],
                                  a["ln2_rstd"][l])
            matmul(s["datty"], "attproj", l, kept(dres, "dattproj", l), "atty")
            dqkv = out("dqkv", l, "dbt_3c")
            be.attention_backward(dqkv, s["datty"], a["qkv"][l], a["atty"][l], a["att_lse"][l],
                                  self.NH)
            matmul(s["dbt_c"], "qkv", l, dqkv, "ln1")
            self.tp_sum(s["dbt_c"])
            be.layernorm_backward(dres, g["ln1w"][l], g["ln1b"][l], s["dbt_c"], x, p["ln1w"][l],
                                  a["ln1_mean"][l], a["ln1_rstd"][l])
            if layer_done:
                layer_done(l)
        if self.embed:
            if weights:
                be.encoder_backward(g["wte"], g["wpe"], dres, tokens, self.v0)
            else:
                kept(dres, "dencoded", None)
