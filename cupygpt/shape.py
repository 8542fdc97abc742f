"""The model's shape: llm.c's GPT2Config and the presets (GPT-2 124M..1558M and a tiny one
that trains in seconds on a CPU)."""
from dataclasses import asdict, dataclass

from . import CupyGPTError
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
    def HS(self):
        return self.C // self.NH

    def num_parameters(self):
        return param_layout(self).size


def padded_vocab(V, multiple=128):
    return (V + multiple - 1) // multiple * multiple


GPT2_V = 50257
# name -> (L, NH, C); d12..d48 are GPT-2 124M/350M/774M/1558M, "tiny" runs in seconds on a CPU.
_SHAPES = {"tiny": (4, 4, 128, 256), "d12": (12, 12, 768, 1024), "d24": (24, 16, 1024, 1024),
           "d36": (36, 20, 1280, 1024), "d48": (48, 25, 1600, 1024)}
PRESETS = {name: GPT2Config(maxT=T, V=GPT2_V, Vp=padded_vocab(GPT2_V), L=L, NH=NH, C=C)
           for name, (L, NH, C, T) in _SHAPES.items()}


def preset(name):
    if name not in PRESETS:
        raise CupyGPTError(f"not a model file and not a preset; presets are "
                           f"{', '.join(PRESETS)}", "init", name)
    return PRESETS[name]
