"""Flat-buffer layouts: named views in llm.c's ParameterTensors / ActivationTensors order.

A layout covers a layer range [l0, l1), with or without the embedding and the head, which
is exactly what one pipeline stage owns. The whole model is the range [0, L) with both.
"""
from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class Layout:
    names: tuple
    shapes: tuple
    offsets: tuple
    size: int

    @staticmethod
    def of(entries):
        names, shapes, offsets, off = [], [], [], 0
        for name, shape in entries:
            names.append(name)
            shapes.append(tuple(shape))
            offsets.append(off)
            off += int(np.prod(shape))
        return Layout(tuple(names), tuple(shapes), tuple(offsets), off)

    def views(self, buf, base=0):
        """Named views into buf (NumPy or CuPy) starting at element base."""
        return {n: buf[base + o: base + o + int(np.prod(s))].reshape(s)
                for n, s, o in zip(self.names, self.shapes, self.offsets)}


PARAM_NAMES = ("wte", "wpe", "ln1w", "ln1b", "qkvw", "qkvb", "attprojw", "attprojb",
               "ln2w", "ln2b", "fcw", "fcb", "fcprojw", "fcprojb", "lnfw", "lnfb")


def param_shapes(cfg, nl):
    """All 16 llm.c parameter tensors for nl layers."""
    C, Vp = cfg.C, cfg.Vp
    return {"wte": (Vp, C), "wpe": (cfg.maxT, C), "ln1w": (nl, C), "ln1b": (nl, C),
            "qkvw": (nl, 3 * C, C), "qkvb": (nl, 3 * C), "attprojw": (nl, C, C),
            "attprojb": (nl, C), "ln2w": (nl, C), "ln2b": (nl, C), "fcw": (nl, 4 * C, C),
            "fcb": (nl, 4 * C), "fcprojw": (nl, C, 4 * C), "fcprojb": (nl, C),
            "lnfw": (C,), "lnfb": (C,)}


def owns(name, embed, head):
    """Which tensors a stage holds: wte is tied, so both the embedding and the head hold it."""
    if name == "wte":
        return embed or head
    if name == "wpe":
        return embed
    if name in ("lnfw", "lnfb"):
        return head
    return True


def param_layout(cfg, l0=0, l1=None, embed=True, head=True):
    l1 = cfg.L if l1 is None else l1
    shapes = param_shapes(cfg, l1 - l0)
    return Layout.of((n, shapes[n]) for n in PARAM_NAMES if owns(n, embed, head))


def activation_layout(cfg, B, T, nl, head):
    """One micro-batch's activations for nl layers; per-layer tensors are what backward reads.

    encoded is the stage input: the embedding's output on stage 0, the received
    activation elsewhere. The head's logits are overwritten in place by dlogits.
    """
    C, NH, Vp = cfg.C, cfg.NH, cfg.Vp
    e = [("encoded", (B, T, C)), ("ln1", (nl, B, T, C)), ("ln1_mean", (nl, B, T)),
         ("ln1_rstd", (nl, B, T)), ("qkv", (nl, B, T, 3 * C)), ("atty", (nl, B, T, C)),
         ("preatt", (nl, B, NH, T, T)), ("att", (nl, B, NH, T, T)), ("attproj", (nl, B, T, C)),
         ("residual2", (nl, B, T, C)), ("ln2", (nl, B, T, C)), ("ln2_mean", (nl, B, T)),
         ("ln2_rstd", (nl, B, T)), ("fch", (nl, B, T, 4 * C)), ("fch_gelu", (nl, B, T, 4 * C)),
         ("fcproj", (nl, B, T, C)), ("residual3", (nl, B, T, C))]
    if head:
        e += [("lnf", (B, T, C)), ("lnf_mean", (B, T)), ("lnf_rstd", (B, T)),
              ("logits", (B, T, Vp)), ("losses", (B, T))]
    return Layout.of(e)


def scratch_layout(cfg, B, T):
    """Backward temporaries, reused by every layer and micro-batch.

    dresidual is the stage's running gradient: it arrives from the next stage and leaves
    for the previous one.
    """
    C, NH = cfg.C, cfg.NH
    return Layout.of([("dresidual", (B, T, C)), ("dbt_c", (B, T, C)),
                      ("dbt_3c", (B, T, 3 * C)), ("dbt_4c", (B, T, 4 * C)),
                      ("dbt_4c2", (B, T, 4 * C)), ("datt", (B, NH, T, T)),
                      ("dpreatt", (B, NH, T, T))])


def stage_slices(stage_layout, l0):
    """(name, index into the whole model's tensor) for each tensor a stage owns."""
    for name, shape in zip(stage_layout.names, stage_layout.shapes):
        whole = name in ("wte", "wpe", "lnfw", "lnfb")
        yield name, slice(None) if whole else slice(l0, l0 + shape[0])


def copy_layer_range(dst, dst_layout, src, src_layout, l0):
    """Copy the tensors dst owns out of src, a host buffer whose layers start at layer 0."""
    sv, dv = src_layout.views(src), dst_layout.views(dst)
    for name, idx in stage_slices(dst_layout, l0):
        dv[name][...] = sv[name][idx]
    return dst


def assemble(cfg, parts):
    """The whole model's parameters from stages' (l0, l1, embed, head, host params)."""
    full_layout = param_layout(cfg)
    full = np.zeros(full_layout.size, parts[0][4].dtype)
    fv = full_layout.views(full)
    for l0, l1, embed, head, params in parts:
        lay = param_layout(cfg, l0, l1, embed, head)
        pv = lay.views(params)
        for name, idx in stage_slices(lay, l0):
            fv[name][idx] = pv[name]
    return full
