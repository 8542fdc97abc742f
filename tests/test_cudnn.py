"""cuDNN's fused attention (--attention, backends/cudnn_attention.py) on cudasim's cudnn
stand-in (tests/cudasim/cudnn; CUDASIM_CUDNN=1: the frontend and the library installed)
and, where one is installed, on a GPU: verify on every reference and on heads of 16 with
an odd T in both attentions, graph replay, the refusals, auto's fallback and bench's side
by side. The stand-in's own strictness: test_cudasim.py."""
import json
import os

import numpy as np
import pytest

from conftest import DEVICES, cli, device_env, fixture, run_verify
from test_verify import FILES

ATTENTIONS = ("own", "cudnn")


@pytest.fixture(scope="module", params=DEVICES)
def device(request):
    return request.param


def env(device, attention="cudnn", cudnn="1"):
    """device's environment; on a GPU, the cudnn path skips where cuDNN is missing."""
    if device != "sim":
        if attention == "cudnn":
            try:
                import cudnn
                cudnn.backend_version()
            except Exception as e:
                pytest.skip(f"cuDNN's frontend or library is not installed here: {e!r}")
        return {}
    return {**device_env(device), "CUDASIM_CUDNN": cudnn}


@pytest.mark.parametrize("attention", ATTENTIONS)
@pytest.mark.parametrize("files", FILES, ids=[f[0] for f in FILES])
def test_verify_bf16_in_either_attention(device, files, attention):
    res, r = run_verify(files, "--backend", "cuda", "--dtype", "bf16", "--attention",
                        attention, env=env(device, attention))
    assert res.returncode == 0 and r["ok"] and r["backend"] == "cuda-bf16", res.stdout
    assert r["attention"].startswith("cuDNN" if attention == "cudnn" else "own")


@pytest.fixture(scope="module")
def heads16(tmp_path_factory):
    """A model with heads of 16 (3 of them) and a float64 state at T = 37 (no multiple of
    64, nor of 16)."""
    from cupygpt.files import write_model
    from cupygpt.initialize import init_params
    from cupygpt.shape import GPT2Config
    from statefile import make_state64
    d = tmp_path_factory.mktemp("heads16")
    cfg = GPT2Config(maxT=40, V=301, Vp=320, L=2, NH=3, C=48)
    write_model(d / "model.bin", cfg, init_params(cfg, 5))
    return make_state64(d / "model.bin", d, 2, 37)


def test_heads_of_16_at_an_odd_t_verify_in_either_attention(device, heads16):
    got = {}
    for attention in ATTENTIONS:
        res, got[attention] = run_verify(heads16, "--backend", "cuda", "--dtype", "bf16",
                                         "--attention", attention, env=env(device, attention))
        assert res.returncode == 0 and got[attention]["ok"], res.stdout + res.stderr
    # two arithmetics: the paths differ in their roundings, so the logits do too
    assert got["own"]["logits"]["max_abs_diff"] != got["cudnn"]["logits"]["max_abs_diff"]
