"""llm.c's -r: activations backward makes again instead of keeping. The same bits as keeping
them, on one process and across ranks (a split backward's weight pass, tensor-parallel
shards), and less memory by what is not kept."""
import re

import pytest
from harness import cli, losses

from cupygpt.model.layout import RECOMPUTED, Part
from cupygpt.model.shape import preset
from cupygpt.model.stage import Stage

FLAGS = ("-e", "tiny", "-b", "4", "-t", "32", "-n", "3", "-v", "0", "-g", "0", "-l", "3e-3",
         "-u", "1")


@pytest.mark.parametrize("ranks,grid", [(None, []), (2, ["--schedule", "zbv",
                                                         "--micro-batches", "2"]),
                                        (2, ["--tp", "2"])])
def test_recomputing_gives_the_same_bits(tmp_path, ranks, grid):
    models, saved = [], []
    for r in RECOMPUTED:
        res = cli("train", *FLAGS, *grid, "-r", r, "-o", tmp_path / str(r), ranks=ranks)
        assert res.returncode == 0, res.stderr
        assert losses(res.stdout) and f"| recompute               | {r} " in res.stdout
        models.append((tmp_path / str(r) / "model.bin").read_bytes())
        said = re.findall(r"rank 0 keeps ([\d.]+) MiB less", res.stdout)
        saved.append(float(said[0]) if said else 0.0)
    assert models[1] == models[0] and models[2] == models[0]
    assert 0 == saved[0] < saved[1] < saved[2]  # the run table says what each level saves


def test_recomputing_keeps_less():
    """Per slot, -r 1 drops GELU's output of every layer but one, -r 2 the layernorms'
    outputs too (one layer's of each kind is scratch)."""
    cfg, B, T = preset("d12"), 4, 1024
    kept = [sum(Stage.sizes(cfg, batch=B, seq=T, part=Part.whole(cfg), slots=1, split=False,
                            recompute=r)[k] for k in ("activations", "scratch"))
            for r in RECOMPUTED]
    layer = B * T * cfg.C * 4  # one layer's (B, T, C), bytes of fp32
    assert kept[0] - kept[1] == (cfg.L - 1) * 4 * layer
    assert kept[1] - kept[2] == (2 * cfg.L - 1) * layer
    assert (kept[0] - kept[2]) / 2 ** 30 > 0.75  # d12 at B=4, T=1024: 0.79 GiB of fp32


def test_an_unknown_level_is_one_line(tmp_path):
    res = cli("train", "-r", "3", "-o", tmp_path)
    assert res.returncode == 1 and res.stderr.strip().startswith("error: -r 3: one of 0, 1, 2")
