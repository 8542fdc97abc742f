"""llm.c's train flags beside the model: -a 1 (every step the first batch), -nm (major
checkpoints --keep never removes), -s 0 (never sample), and MFU in the step line only where
a peak is known."""
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest
from harness import ROOT, TRAIN, cli

B, T = 4, 16


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A small model; shard A: text tokens; shard P: A's first B*T tokens over and over, so
    the sequential loader (--no-shuffle) serves A's first batch every step."""
    from cupygpt.formats.llmc import read_shard, write_model, write_shard
    from cupygpt.model.initialize import init_params
    from cupygpt.model.shape import GPT2Config
    d = tmp_path_factory.mktemp("flags")
    cfg = GPT2Config(maxT=32, V=301, Vp=320, L=2, NH=4, C=32)
    write_model(d / "model.bin", cfg, init_params(cfg, 3))
    toks = read_shard(os.path.join(ROOT, "cupygpt", "data", "tiny_shakespeare_val.bin")) % 301
    first = toks[:B * T]
    write_shard(d / "A.bin", np.concatenate([first, first[:1], toks[5000:6000]]))
    write_shard(d / "P.bin", np.concatenate([np.tile(first, 20), first[:1]]))
    return d


def train(made, out, shard, *extra):
    res = cli("train", "-e", made / "model.bin", "-i", made / shard, "-j", "", "-b", B, "-t", T,
              "-g", "0", "-l", "1e-2", "-u", "0", "--no-shuffle", "-o", out, "--backend", "numpy",
              *extra)
    assert res.returncode == 0, res.stdout + res.stderr
    return [r["train_loss"] for r in map(json.loads, open(out / "log.jsonl"))
            if "train_loss" in r], res


def test_overfit_single_batch_trains_on_the_first_batch(made, tmp_path):
    one, res = train(made, tmp_path / "a", "A.bin", "-n", "6", "-a", "1")
    same, _ = train(made, tmp_path / "p", "P.bin", "-n", "6")
    plain, _ = train(made, tmp_path / "n", "A.bin", "-n", "6")
    assert one == same and one[-1] < one[0] - 1  # bit for bit; and it overfits
    assert plain[0] == one[0] and plain[1:] != one[1:]
    model = (tmp_path / "a" / "model.bin").read_bytes()
    assert model == (tmp_path / "p" / "model.bin").read_bytes()
    assert "MFU" not in res.stdout  # the CPU has no peak to measure against


def test_major_checkpoints_outlive_keep(made, tmp_path):
    train(made, tmp_path / "o", "P.bin", "-n", "7", "--checkpoint-every", "1", "--keep", "2",
          "-nm", "3")
    assert sorted(d for d in os.listdir(tmp_path / "o") if d.startswith("ckpt")) == [
        "ckpt_00000003", "ckpt_00000006", "ckpt_00000007"]
    # (without -nm: the last two)
    train(made, tmp_path / "k", "P.bin", "-n", "7", "--checkpoint-every", "1", "--keep", "2")
    assert sorted(d for d in os.listdir(tmp_path / "k") if d.startswith("ckpt")) == [
        "ckpt_00000006", "ckpt_00000007"]
    # a resume without -nm (or with another) keeps the first run's: they were written as -nm's
    train(made, tmp_path / "o", "P.bin", "-n", "9", "--checkpoint-every", "1", "--resume",
          tmp_path / "o")
    assert sorted(d for d in os.listdir(tmp_path / "o") if d.startswith("ckpt")) == [
        "ckpt_00000003", "ckpt_00000006", "ckpt_00000008", "ckpt_00000009"]


def test_the_step_line_says_mfu_where_the_peak_is_known(made, tmp_path):
    """On a device that names itself an H100 (cudasim, told to), each step's line and log
    record carry its MFU: llm.c's FLOPs of the step's tokens over its time and the bf16
    peak (989.4 TFLOP/s)."""
    from harness import device_env

    from cupygpt.formats.llmc import read_model
    from cupygpt.model.shape import flops_per_token
    env = {**device_env("sim"), "CUDASIM_DEVICE_NAME": "NVIDIA H100 80GB HBM3"}
    res = cli("train", "-e", made / "model.bin", "-i", made / "P.bin", "-j", "", "-b", str(B), "-t",
              str(T), "-n", "2", "-g", "0", "-o", tmp_path / "o", "--backend", "cuda", "--dtype",
              "bf16", env=env)
    assert res.returncode == 0, res.stderr
    steps = [ln for ln in res.stdout.splitlines() if ln.startswith("step ")]
    assert len(steps) == 2 and all(", MFU " in ln for ln in steps), res.stdout
    cfg, _ = read_model(made / "model.bin")
    for r in (r for r in map(json.loads, open(tmp_path / "o" / "log.jsonl")) if "ms" in r):
        want = flops_per_token(cfg, int(T)) * r["tok_s"] / (2 * 494.7e12)
        assert r["mfu"] == pytest.approx(want, rel=1e-9)


def test_mfu_is_llmc_flops_over_the_devices_peak():
    from cupygpt.model.shape import PRESETS, mfu
    cfg, gpu = PRESETS["d12"], SimpleNamespace(peak_flops=lambda dtype: 989e12)
    per_token = 6 * 124475904 + 6 * 12 * 768 * 1024  # llm.c's 6N + 6LCT for d12 at T 1024
    assert mfu(gpu, cfg, 1024, "bf16", 524288, 0.5, 8) == pytest.approx(
        per_token * 524288 / 0.5 / (989e12 * 8), rel=1e-12)
    assert mfu(SimpleNamespace(peak_flops=lambda dtype: None), cfg, 1024, "fp32", 1, 1) is None


def test_descriptors_are_llmcs_shapes():
    """llm.c's train_gpt2.cu descriptors, as its source lists them: dN -> (channels, heads)
    at T 1024; gpt3:cC -> (depth, head size) at T 2048; GPT-2's vocab padded to 50304."""
    from cupygpt.model.shape import PRESETS
    gpt2 = {6: (384, 6), 12: (768, 12), 24: (1024, 16), 36: (1280, 20), 48: (1600, 25),
            60: (1920, 30), 72: (2880, 30), 84: (3456, 36)}
    gpt3 = {384: (6, 64), 768: (12, 64), 1024: (24, 64), 1536: (24, 96), 2048: (24, 128),
            2560: (32, 80), 4096: (32, 128), 12288: (96, 128)}
    want = {**{f"d{d}": (d, h, c, 1024) for d, (c, h) in gpt2.items()},
            **{f"gpt3:c{c}": (d, c // hs, c, 2048) for c, (d, hs) in gpt3.items()}}
    got = {n: (p.L, p.NH, p.C, p.maxT) for n, p in PRESETS.items() if n != "tiny"}
    assert got == want
    assert {(p.V, p.Vp) for p in PRESETS.values()} == {(50257, 50304)}
    assert PRESETS["d12"].num_parameters() == 124475904  # llm.c's count for GPT-2 124M


def test_sample_every_zero_means_never(tmp_path):
    never = cli(*TRAIN, "-n", "2", "-g", "4", "-s", "0", "-o", tmp_path)
    at_end = cli(*TRAIN, "-n", "2", "-g", "4", "-o", tmp_path, "--overwrite")
    assert never.returncode == 0 and at_end.returncode == 0, (never.stderr, at_end.stderr)
    assert "generating" not in never.stdout and at_end.stdout.count("generating:") == 1
