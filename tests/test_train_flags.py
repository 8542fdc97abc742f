"""llm.c's train flags beside the model: -a 1 (every step the first batch), -nm (major
checkpoints --keep never removes), and MFU in the step line only where a peak is known."""
import json
import os
from types import SimpleNamespace

import numpy as np
import pytest

from conftest import ROOT, cli

B, T = 4, 16


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A small model; shard A: text tokens; shard P: A's first B*T tokens over and over, so
    the sequential loader (--no-shuffle) serves A's first batch every step."""
    from cupygpt.shape import GPT2Config
    from cupygpt.files import read_shard, write_model, write_shard
    from cupygpt.initialize import init_params
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
    assert (tmp_path / "a" / "model.bin").read_bytes() == (tmp_path / "p" / "model.bin").read_bytes()
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


def test_mfu_is_llmc_flops_over_the_devices_peak():
    from cupygpt.bench import mfu
    from cupygpt.shape import PRESETS
    cfg, gpu = PRESETS["d12"], SimpleNamespace(peak_flops=lambda dtype: 989e12)
    per_token = 6 * 124475904 + 6 * 12 * 768 * 1024  # llm.c's 6N + 6LCT for d12 at T 1024
    assert mfu(gpu, cfg, 1024, "bf16", 524288, 0.5, 8) == pytest.approx(
        per_token * 524288 / 0.5 / (989e12 * 8), rel=1e-12)
    assert mfu(SimpleNamespace(peak_flops=lambda dtype: None), cfg, 1024, "fp32", 1, 1) is None
