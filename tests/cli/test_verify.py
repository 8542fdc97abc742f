"""`verify` (llm.c's test_gpt2) against PyTorch-made files of several shapes; a step whose
loss is not finite fails it."""
import json

import numpy as np
import pytest
from harness import FILES, cli, fixture, run_verify


def verify_numpy(files, *extra, ranks=None):
    res, r = run_verify(files, "--backend", "numpy", *extra, ranks=ranks)
    assert res.returncode in (0, 1), res.stderr
    return res, r


@pytest.mark.parametrize("files", FILES, ids=[f[0] for f in FILES])
def test_verify_passes(files):
    res, r = verify_numpy(files)
    assert res.returncode == 0 and r["ok"], res.stdout
    assert r["logits"]["max_abs_diff"] < 1e-5
    assert len(r["grads"]) == 16 and all(g["ok"] for g in r["grads"].values())
    assert len(r["steps"]) == 10 and all(s["ok"] for s in r["steps"])
    assert r["steps"][9]["loss"] < r["steps"][0]["loss"]


@pytest.mark.parametrize("files", FILES[:3], ids=[f[0] for f in FILES[:3]])
def test_bf16_passes_at_its_tolerances_and_is_not_fp32(files):
    """bf16 against the fp32 reference: within bf16's tolerances (verify.TOLERANCES), and
    measurably not fp32 (its logits are off by more than fp32's tolerance)."""
    res, r = verify_numpy(files, "--dtype", "bf16")
    assert res.returncode == 0 and r["ok"], res.stdout
    assert r["backend"] == "numpy-bf16" and r["logits"]["tol"] == 5e-2
    assert r["logits"]["max_abs_diff"] > 1e-3
    assert all(s["ok"] for s in r["steps"]) and r["steps"][9]["loss"] < r["steps"][0]["loss"]


def test_a_model_finds_its_state_and_losses_beside_it(tmp_path):
    """--model alone: NAME_debug_state.bin and NAME_expected.json beside NAME_model.bin;
    with none beside it, one line asking for --state."""
    import json
    import shutil
    res = cli("verify", "--model", fixture("odd_model.bin"), "--steps", "2", "--json",
              "--backend", "numpy")
    r = json.loads(res.stdout)
    want = json.load(open(fixture("odd_expected.json")))["losses"]
    assert res.returncode == 0 and r["ok"] and r["state"] == fixture("odd_debug_state.bin")
    assert [s["expected"] for s in r["steps"]] == want[:2]
    shutil.copy(fixture("odd_model.bin"), tmp_path / "mine.bin")
    res = cli("verify", "--model", tmp_path / "mine.bin")
    assert res.returncode == 1 and res.stderr == (
        f"error: no NAME_debug_state.bin beside {tmp_path / 'mine.bin'}: give the model's "
        f"llm.c debug state with --state\n")


def test_verify_fails_on_a_wrong_state(tmp_path):
    """A state whose gradient is off must fail (exit 1): verify can say no."""
    import numpy as np
    from statefile import write_state

    from cupygpt.formats.llmc import read_model, read_state
    cfg, _ = read_model(fixture("tiny_model.bin"))
    st = read_state(fixture("tiny_debug_state.bin"), cfg)
    st["grads"][1000] += 1e-3
    write_state(tmp_path / "s.bin", st["x"], st["y"], st["logits"], st["loss"], st["grads"])
    res = cli("verify", "--model", fixture("tiny_model.bin"), "--state", tmp_path / "s.bin",
              "--steps", "1", "--backend", "numpy")
    assert res.returncode == 1
    assert "wte" in [ln.split()[0] for ln in res.stdout.splitlines() if ln.endswith("FAIL")]
    assert res.stdout.strip().endswith("verify: FAIL")
    assert np.isfinite(st["loss"])


def test_verify_fails_a_step_whose_loss_is_not_finite():
    from harness import cli
    res = cli("verify", "--backend", "numpy", "--steps", 2, "--lr", 1e30, "--json")
    r = json.loads(res.stdout.splitlines()[-1])
    assert res.returncode == 1 and not r["ok"], res.stdout + res.stderr
    assert [s["ok"] for s in r["steps"] if not np.isfinite(s["loss"])] == [False] * sum(
        not np.isfinite(s["loss"]) for s in r["steps"]) and r["steps"], r["steps"]
    assert not np.isfinite(r["steps"][-1]["loss"]), "the test needs a diverged step"


def test_a_pass_that_compared_fewer_step_losses_says_how_many():
    """At another --lr the shipped expected losses do not apply: none is compared, and the
    PASS says so instead of reading as a full check."""
    res = cli("verify", "--lr", "0.01", "--steps", "3")
    assert res.returncode == 0, res.stderr
    assert "step losses: 0 of 3 compared (no --expected" in res.stdout, res.stdout
    assert "step losses:" not in cli("verify", "--steps", "3").stdout  # (all 3 compared)
