"""Writes llm.c-format model + debug-state + expected-loss files of other shapes, from an
independent PyTorch GPT-2 (autograd gradients, torch.optim.AdamW). Run once when shapes
change: `pip install torch && python tests/support/make_fixtures.py`; the outputs are committed.

- odd:  odd T (17), 16 heads of size 8, 3 layers (so 3-stage pipelines have a layer each)
- gpt2v: GPT-2's full vocab (50,257 padded to 50,304); also saved as bf16 (version 5),
  its weights rounded to bf16 first so both files describe the same model.
"""
import json
import math
import os
import sys

import numpy as np
import torch
import torch.nn.functional as F

# the checkout, two folders above this one (tests/support)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
from statefile import write_state  # noqa: E402

from cupygpt.formats.llmc import MODEL_MAGIC, make_header, write_model  # noqa: E402
from cupygpt.model.layout import param_layout  # noqa: E402
from cupygpt.model.shape import GPT2Config  # noqa: E402
from cupygpt.paths import atomic_write  # noqa: E402

HERE = os.path.join(ROOT, "cupygpt", "reference")
SHAPES = {"odd": (GPT2Config(maxT=40, V=300, Vp=320, L=3, NH=16, C=128), 3, 17, False),
          "gpt2v": (GPT2Config(maxT=16, V=50257, Vp=50304, L=1, NH=2, C=16), 2, 7, True)}


def forward(cfg, p, x, y):
    B, T = x.shape
    C, NH = cfg.C, cfg.NH
    h = p["wte"][x] + p["wpe"][:T]
    mask = torch.ones(T, T, dtype=torch.bool).tril()
    for l in range(cfg.L):
        a = F.layer_norm(h, (C,), p["ln1w"][l], p["ln1b"][l], 1e-5)
        q, k, v = (a @ p["qkvw"][l].T + p["qkvb"][l]).split(C, -1)
        q, k, v = (t.view(B, T, NH, C // NH).transpose(1, 2) for t in (q, k, v))
        s = (q @ k.transpose(-1, -2)) / math.sqrt(C // NH)
        att = s.masked_fill(~mask, float("-inf")).softmax(-1)
        o = (att @ v).transpose(1, 2).reshape(B, T, C)
        h = h + o @ p["attprojw"][l].T + p["attprojb"][l]
        a = F.layer_norm(h, (C,), p["ln2w"][l], p["ln2b"][l], 1e-5)
        f = F.gelu(a @ p["fcw"][l].T + p["fcb"][l], approximate="tanh")
        h = h + f @ p["fcprojw"][l].T + p["fcprojb"][l]
    h = F.layer_norm(h, (C,), p["lnfw"], p["lnfb"], 1e-5)
    logits = (h @ p["wte"].T)[..., :cfg.V]
    return logits, F.cross_entropy(logits.reshape(-1, cfg.V), y.reshape(-1))


def make(name, cfg, B, T, bf16, seed=11):
    rng = np.random.default_rng(seed)
    lay = param_layout(cfg)
    flat = rng.normal(0, 0.05, lay.size).astype(np.float32)
    views = lay.views(flat)
    for n in ("ln1w", "ln2w", "lnfw"):
        views[n] += 1.0
    views["wte"][cfg.V:] = 0
    if bf16:
        flat = ((flat.view(np.uint32) + 0x8000) & 0xFFFF0000).view(np.float32)
    p = {n: torch.tensor(v.copy(), requires_grad=True) for n, v in lay.views(flat).items()}
    x = rng.integers(0, cfg.V, (B, T)).astype(np.int32)
    y = rng.integers(0, cfg.V, (B, T)).astype(np.int32)
    xt, yt = torch.tensor(x, dtype=torch.long), torch.tensor(y, dtype=torch.long)
    logits, loss = forward(cfg, p, xt, yt)
    loss.backward()
    grads = np.concatenate([p[n].grad.numpy().ravel() for n in lay.names])
    write_model(os.path.join(HERE, f"{name}_model.bin"), cfg, flat)
    write_state(os.path.join(HERE, f"{name}_debug_state.bin"), x, y, logits.detach().numpy(),
                loss.item(), grads)
    if bf16:
        with atomic_write(os.path.join(HERE, f"{name}_model_bf16.bin")) as f:
            f.write(make_header(MODEL_MAGIC, 5, cfg.maxT, cfg.V, cfg.L, cfg.NH, cfg.C,
                                cfg.Vp).tobytes())
            f.write((flat.view(np.uint32) >> 16).astype(np.uint16).tobytes())
    opt = torch.optim.AdamW(p.values(), lr=1e-4, betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=0.01)
    losses = []
    for _ in range(10):
        opt.zero_grad()
        _, loss = forward(cfg, p, xt, yt)
        losses.append(loss.item())
        loss.backward()
        opt.step()
    with open(os.path.join(HERE, f"{name}_expected.json"), "w") as f:
        json.dump({"config": {**cfg.__dict__, "B": B, "T": T}, "losses": losses}, f)


if __name__ == "__main__":
    torch.manual_seed(0)
    for name, (cfg, B, T, bf16) in SHAPES.items():
        make(name, cfg, B, T, bf16)
        print("wrote", name)
