"""The model's shape: llm.c's GPT2Config and the presets (llm.c's descriptors: GPT-2 by
depth, d6..d84, GPT-3 by channels, gpt3:c384..gpt3:c12288; and a tiny one that trains in
seconds on a CPU)."""
from __future__ import annotations

from dataclasses import asdict, dataclass

from .. import CupyGPTError
from ..backends.protocol import Backend
from .layout import param_layout


@dataclass(frozen=True)
class GPT2Config:
    maxT: int  # max sequence length
    V: int     # vocab size
    Vp: int    # vocab padded to a multiple of 128 (llm.c), rows V..Vp-1 stay zero
    L: int     # layers
    NH: int    # heads
    C: int     # channels

    def __post_init__(self):
        for k, v in asdict(self).items():
            if not isinstance(v, int) or v <= 0:
                raise CupyGPTError(f"model config: {k}={v} must be a positive integer")
        if self.C % self.NH:
            raise CupyGPTError(f"model config: C={self.C} is not divisible by NH={self.NH}")
        if self.Vp < self.V:
            raise CupyGPTError(f"model config: Vp={self.Vp} is smaller than V={self.V}")

    @property
    def HS(self) -> int:
        return self.C // self.NH

    def num_parameters(self) -> int:
        return param_layout(self).size


def padded_vocab(V: int, multiple: int = 128) -> int:
    return (V + multiple - 1) // multiple * multiple


GPT2_V = 50257
# llm.c's model descriptors: name -> (L, NH, C, maxT). dN: GPT-2 of depth N (d12..d48 are
# GPT-2 124M/350M/774M/1558M); gpt3:cC: GPT-3's shapes by channels, 64-, 80-, 96- or
# 128-wide heads, T 2048 (llm.c's table also lists c5140, which its 128-wide heads do not
# divide); "tiny" runs in seconds on a CPU.
_GPT2_DEPTHS = {6: (6, 384), 12: (12, 768), 24: (16, 1024), 36: (20, 1280), 48: (25, 1600),
                60: (30, 1920), 72: (30, 2880), 84: (36, 3456)}
_GPT3_CHANNELS = {384: (6, 64), 768: (12, 64), 1024: (24, 64), 1536: (24, 96),
                  2048: (24, 128), 2560: (32, 80), 4096: (32, 128), 12288: (96, 128)}
_SHAPES = {"tiny": (4, 4, 128, 256),
           **{f"d{L}": (L, NH, C, 1024) for L, (NH, C) in _GPT2_DEPTHS.items()},
           **{f"gpt3:c{C}": (L, C // hs, C, 2048) for C, (L, hs) in _GPT3_CHANNELS.items()}}
PRESETS = {name: GPT2Config(maxT=T, V=GPT2_V, Vp=padded_vocab(GPT2_V), L=L, NH=NH, C=C)
           for name, (L, NH, C, T) in _SHAPES.items()}


def preset(name: str) -> GPT2Config:
    if name not in PRESETS:
        raise CupyGPTError(f"not a model file and not one of llm.c's descriptors: "
                           f"{', '.join(PRESETS)}", "init", name)
    return PRESETS[name]


def flops_per_token(shape: GPT2Config, T: int) -> int:
    """llm.c's estimate: 6N for the weights plus 6*L*C*T for attention."""
    return 6 * shape.num_parameters() + 6 * shape.L * shape.C * T


def mfu(be: Backend, shape: GPT2Config, T: int, dtype: str, tokens: int, seconds: float,
        devices: int = 1) -> float | None:
    """The fraction of the devices' peak (the dtype's: TF32 or bf16) that tokens trained in
    seconds are; None where the backend knows no peak (the CPU)."""
    peak = be.peak_flops(dtype)
    return flops_per_token(shape, T) * tokens / seconds / (peak * devices) if peak else None
