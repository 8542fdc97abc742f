"""Flat-buffer layouts: named views in llm.c's ParameterTensors / ActivationTensors order.

A layout covers a Part: a layer range [l0, l1), with or without the embedding and the head
(what one pipeline stage owns), and one tensor-parallel shard of those tensors. The whole
model is the range [0, L) with both, unsharded.
"""
from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, replace
from typing import Any, Protocol

import numpy as np

from ..backends.protocol import StageShape


@dataclass(frozen=True)
class Layout:
    names: tuple
    shapes: tuple
    offsets: tuple
    size: int

    @staticmethod
    def of(entries: Iterable) -> Layout:
        names, shapes, offsets, off = [], [], [], 0
        for name, dims in entries:
            names.append(name)
            shapes.append(tuple(dims))
            offsets.append(off)
            off += int(np.prod(dims))
        return Layout(tuple(names), tuple(shapes), tuple(offsets), off)

    def views(self, buf: Any, base: int = 0) -> dict:
        """Named views into buf (NumPy or CuPy) starting at element base."""
        return {n: buf[base + o: base + o + int(np.prod(s))].reshape(s)
                for n, s, o in zip(self.names, self.shapes, self.offsets)}


# Kept in fp32 (the run's wide type) whatever the run's dtype, as llm.c's bf16 trainer
# keeps them: the layernorms' statistics, attention's log-sum-exp per query, the losses and
# the softmax statistics.
WIDE = ("ln1_mean", "ln1_rstd", "ln2_mean", "ln2_rstd", "att_lse", "lnf_mean", "lnf_rstd",
        "losses", "lstats")


@dataclass(frozen=True)
class Mixed:
    """A layout over two flat buffers: `narrow` in the run's dtype, `wide` (the WIDE
    tensors) in its wide type; slot i of a buffer holding several starts at i * size."""
    narrow: Layout
    wide: Layout

    @staticmethod
    def of(entries: Iterable) -> Mixed:
        entries = list(entries)
        return Mixed(Layout.of(e for e in entries if e[0] not in WIDE),
                     Layout.of(e for e in entries if e[0] in WIDE))

    def views(self, narrow_buf: Any, wide_buf: Any, slot: int = 0) -> dict:
        return {**self.narrow.views(narrow_buf, slot * self.narrow.size),
                **self.wide.views(wide_buf, slot * self.wide.size)}


PARAM_NAMES = ("wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
               "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb")
WHOLE = ("wte", "wpe", "lnfw", "lnfb")  # not per layer


class Split(Protocol):
    """One tensor-parallel shard's rules, given from outside (parallel/tensor/sharding.py's
    TensorShard): the model sizes and fills its flat buffers by them."""
    tp: int
    shard: int

    def vocab_rows(self, Vp: int, V: int) -> tuple[int, int, int]: ...
    def dims(self, name: str, dims: tuple) -> tuple: ...
    def view(self, name: str, x: Any, NH: int) -> Any: ...


@dataclass(frozen=True)
class Part:
    """What one rank holds: layers [l0, l1), the embedding and/or the head (a pipeline
    stage), and with split one tensor-parallel shard of each of those tensors (None: whole)."""
    l0: int
    l1: int
    embed: bool = True
    head: bool = True
    split: Split | None = None

    @property
    def tp(self) -> int:
        return self.split.tp if self.split else 1

    @property
    def shard(self) -> int:
        return self.split.shard if self.split else 0

    @staticmethod
    def whole(shape) -> Part:
        return Part(0, shape.L)

    def vocab(self, shape) -> tuple[int, int, int]:
        """(v0, rows, valid): this shard's rows [v0, v0 + rows) of wte's Vp and how many of
        them are real tokens (< V), not padding."""
        return self.split.vocab_rows(shape.Vp, shape.V) if self.split else (0, shape.Vp, shape.V)


def owns(name: str, part: Part) -> bool:
    """Which tensors a stage holds: wte is tied, so both the embedding and the head hold it."""
    if name == "wte":
        return part.embed or part.head
    if name == "wpe":
        return part.embed
    if name in ("lnfw", "lnfb"):
        return part.head
    return True


def param_shapes(shape, part: Part) -> dict[str, tuple]:
    """The 16 llm.c parameter tensors as `part` holds them: its layers, and its tensor-parallel
    shard of each as its split says."""
    C, nl = shape.C, part.l1 - part.l0
    whole = {"wte": (part.vocab(shape)[1], C), "wpe": (shape.maxT, C), "ln1w": (nl, C),
             "ln1b": (nl, C), "qkvw": (nl, 3 * C, C), "qkvb": (nl, 3 * C),
             "attprojw": (nl, C, C), "attprojb": (nl, C), "ln2w": (nl, C),
             "ln2b": (nl, C), "fcw": (nl, 4 * C, C), "fcb": (nl, 4 * C),
             "fcprojw": (nl, C, 4 * C), "fcprojb": (nl, C), "lnfw": (C,), "lnfb": (C,)}
    return {n: part.split.dims(n, dims) for n, dims in whole.items()} if part.split else whole


def replicated(shape, part: Part) -> set[str]:
    """The tensors part holds whole whatever its tensor-parallel shard (those param_shapes
    does not divide): the same, with the same gradients, on every shard."""
    whole = param_shapes(shape, replace(part, split=None))
    return {n for n, s in param_shapes(shape, part).items() if s == whole[n]}


def param_layout(shape, part: Part | None = None) -> Layout:
    part = part or Part.whole(shape)
    shapes = param_shapes(shape, part)
    return Layout.of((n, shapes[n]) for n in PARAM_NAMES if owns(n, part))


# What recomputation (llm.c's -r) does not keep per layer, by level: 1 GELU's output, 2 also
# the layernorms' outputs; backward makes each again, when it needs it, in scratch.
RECOMPUTED = {0: (), 1: ("fch_gelu",), 2: ("fch_gelu", "ln1", "ln2")}


# The head's logits are made a chunk of positions at a time, each chunk's loss, dlogits
# and their two products done before the next: no (B, T, Vp) tensor is kept. Chunks of
# LOGIT_CHUNK logits (128 MiB in bf16: 4 chunks of 1024 positions for d12 at B=4, T=1024;
# a chunk's products stay deep enough that, by the roofline, its re-read of wte's gradient
# costs little beside their math), but at most LOGIT_CHUNKS of them (4 launches each):
# beyond, the chunks grow with B*T (an eighth of the logits).
LOGIT_CHUNK, LOGIT_CHUNKS = 1 << 26, 8


def logit_rows(N: int, vocab_rows: int | None) -> int:
    """Positions per chunk of the head's N positions (even chunks, the last maybe shorter)."""
    chunks = max(1, min(LOGIT_CHUNKS, -(-N * vocab_rows // LOGIT_CHUNK)))
    return -(-N // chunks)


def stage_shape(shape, B: int, T: int, part: Part) -> StageShape:
    """What a stage holding part runs its ops at, micro-batches of B x T: what a backend
    sizes its kept workspaces by (its workspace_bytes)."""
    vr = part.vocab(shape)[1]
    return StageShape(batch=B, seq=T, C=shape.C, NH=shape.NH, tp=part.tp,
                      blocks=part.l1 > part.l0, embed=part.embed,
                      logits=logit_rows(B * T, vr) * vr if part.head else 0)


def activation_layout(shape, B: int, T: int, nl: int, head: bool, tp: int = 1, split: bool = False,
                      embed: bool = False, recompute: int = 0) -> Mixed:
    """One micro-batch's activations for nl layers (a tp shard's: its heads, its 4C/tp
    columns); per-layer tensors are what backward reads.

    encoded is the stage input: the embedding's output on stage 0, the received
    activation elsewhere. The head keeps no logits (scratch_layout's chunk): a training
    forward leaves lnf's gradient in place of lnf, whose last reader (wte's gradient) has
    run by then.
    qkv is its GEMM's product without the bias (attention adds it as it reads q, k, v).
    Attention keeps its output (atty) and each query's log-sum-exp (att_lse): backward
    makes the probabilities again (flash attention), so nothing is (T, T).
    split (a schedule that splits backward): the output gradients of the four matmuls
    per layer (and the embedding's, with embed), kept from bwd_input to bwd_weight.
    recompute: RECOMPUTED[recompute] are left out (scratch_layout holds one layer's).
    """
    C, NH = shape.C, shape.NH // tp
    e = [("encoded", (B, T, C)), ("ln1", (nl, B, T, C)), ("ln1_mean", (nl, B, T)),
         ("ln1_rstd", (nl, B, T)), ("qkv", (nl, B, T, 3 * C // tp)), ("atty", (nl, B, T, C // tp)),
         ("att_lse", (nl, B, NH, T)),
         ("residual2", (nl, B, T, C)), ("ln2", (nl, B, T, C)), ("ln2_mean", (nl, B, T)),
         ("ln2_rstd", (nl, B, T)), ("fch", (nl, B, T, 4 * C // tp)),
         ("fch_gelu", (nl, B, T, 4 * C // tp)), ("residual3", (nl, B, T, C))]
    if head:
        e += [("lnf", (B, T, C)), ("lnf_mean", (B, T)), ("lnf_rstd", (B, T)),
              ("losses", (B, T))]
    if split:
        e += [("dfcproj", (nl, B, T, C)), ("dfch", (nl, B, T, 4 * C // tp)),
              ("dattproj", (nl, B, T, C)), ("dqkv", (nl, B, T, 3 * C // tp))]
        e += [("dencoded", (B, T, C))] if embed else []
    return Mixed.of((n, dims) for n, dims in e if n not in RECOMPUTED[recompute])


def scratch_layout(shape, B: int, T: int, tp: int = 1, recompute: int = 0,
                   vocab_rows: int | None = None) -> Mixed:
    """Temporaries, reused by every layer and micro-batch.

    dresidual is the stage's running gradient: it arrives from the next stage and leaves
    for the previous one. proj is a layer's attproj or fcproj product on its way to the
    residual add (forward only). With a head (vocab_rows: its shard's rows of wte), one
    chunk's logits (logit_rows positions) and its softmax statistics per position and
    shard (lstats: max, sum of exponentials, target logit; gathered from the
    tensor-parallel group). With recompute, one layer's GELU output (gelu_re) and, at 2,
    one layernorm output (ln_re: ln1's and ln2's in turn).
    """
    C = shape.C
    e = [("dresidual", (B, T, C)), ("dbt_c", (B, T, C)), ("dbt_3c", (B, T, 3 * C // tp)),
         ("dbt_4c", (B, T, 4 * C // tp)), ("dbt_4c2", (B, T, 4 * C // tp)),
         ("proj", (B, T, C))]
    if vocab_rows:
        n = logit_rows(B * T, vocab_rows)
        e += [("logits", (n, vocab_rows)), ("lstats", (tp, n, 3))]
    e += [("gelu_re", (B, T, 4 * C // tp))] if recompute >= 1 else []
    e += [("ln_re", (B, T, C))] if recompute >= 2 else []
    return Mixed.of(e)


def held(shape, name: str, whole: np.ndarray, part: Part) -> np.ndarray:
    """The view of a whole-model tensor (whole: all L layers) that part holds: its layers,
    then its shard, shaped as param_shapes says or as a view that reshapes to it."""
    x = whole if name in WHOLE else whole[part.l0:part.l1]
    if name == "wte":
        v0, rows, _ = part.vocab(shape)
        return x[v0:v0 + rows]
    return part.split.view(name, x, shape.NH) if part.split else x


def copy_part(dst: np.ndarray, part: Part, src: np.ndarray, shape) -> np.ndarray:
    """dst (part's layout) = the tensors part holds of src (a whole model's host buffer)."""
    sv, dv = param_layout(shape).views(src), param_layout(shape, part).views(dst)
    for name, d in dv.items():
        d[...] = held(shape, name, sv[name], part).reshape(d.shape)
    return dst


def assemble(shape, parts: list) -> np.ndarray:
    """The whole model's parameters from (part, host params) pairs that cover it."""
    if len(parts) == 1 and parts[0][0] == Part.whole(shape):
        return parts[0][1]  # one rank holds it all: no copy
    full = np.zeros(param_layout(shape).size, parts[0][1].dtype)
    fv = param_layout(shape).views(full)
    for part, params in parts:
        for name, p in param_layout(shape, part).views(params).items():
            view = held(shape, name, fv[name], part)
            view[...] = p.reshape(view.shape)
    return full
