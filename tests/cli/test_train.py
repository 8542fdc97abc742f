"""`train` and `sample` end to end through the CLI, as a user runs them."""
import re

from harness import cli, losses


def test_default_train_lowers_the_loss_and_samples(tmp_path):
    # the defaults this checks (backend, preset, B, T); there in 12 steps with a higher
    # learning rate, a short warm-up and one val batch
    res = cli("train", "-o", tmp_path, "-n", "12", "-l", "6e-3", "-u", "2", "-v", "4", "-m", "1",
              "-g", "16")
    assert res.returncode == 0, res.stderr
    assert "backend numpy: no GPU is visible (CPU run)" in res.stdout
    assert re.search(r"\| init +\| tiny ", res.stdout)
    assert re.search(r"\| B, T +\| 4, 64 ", res.stdout)
    val = losses(res.stdout, "val loss")
    assert len(val) == 4 and val[-1] < val[0] - 1.5, val
    train = losses(res.stdout)
    assert len(train) == 12 and min(train[-5:]) < train[0] - 1.5
    assert "generating:" in res.stdout
    model = tmp_path / "model.bin"
    assert model.stat().st_size > 0
    out = cli("sample", "--model", model, "--prompt", "ROMEO:", "--max-new-tokens", "12",
              "--top-k", "40")
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("ROMEO:") and len(out.stdout.strip()) > len("ROMEO:")
    again = cli("sample", "--model", model, "--prompt", "ROMEO:", "--max-new-tokens", "12",
                "--top-k", "40")
    assert again.stdout == out.stdout, "the same seed gives the same text"


def test_help_on_every_command():
    for cmd in ("train", "verify", "prepare", "sample"):
        res = cli(cmd, "--help")
        assert res.returncode == 0 and "Usage:" in res.stdout
