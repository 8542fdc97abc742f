"""A fresh model: llm.c's initialisation of GPT-2's parameters."""
from __future__ import annotations

import numpy as np

from .layout import param_layout
from .shape import GPT2Config


def init_params(shape: GPT2Config, seed: int) -> np.ndarray:
    """A fresh GPT-2 (host, fp32, whole model), deterministic in seed, llm.c's scheme:
    N(0, 0.02) weights, residual projections scaled by 1/sqrt(2L), layernorm 1/0, biases 0."""
    lay = param_layout(shape)
    params = np.zeros(lay.size, np.float32)
    views = lay.views(params)
    rng = np.random.default_rng(seed)
    for name, view in views.items():
        if name in ("ln1w", "ln2w", "lnfw"):
            view[...] = 1
        elif name.endswith("w") or name in ("wte", "wpe"):
            std = 0.02 / np.sqrt(2 * shape.L) if name in ("attprojw", "fcprojw") else 0.02
            view[...] = rng.standard_normal(view.shape, dtype=np.float32) * np.float32(std)
    views["wte"][shape.V:] = 0
    return params
