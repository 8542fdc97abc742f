"""dev/gpumodel, the static GPU model calibrated on the H200 run: its launch list is the
one a step launches today (checked against a cudasim step's kernels), its flash kernels'
numbers are their SASS's, and it still reproduces the run it was calibrated on."""
import collections
import importlib.util
import json
import os
import re
import sys

import pytest
from harness import cli, device_env, helpers_of, requires_sim

from dev.gpumodel import hw, model_h200
from dev.gpumodel.flash import TOOLS
from dev.gpumodel.launches import cupygpt

GPUMODEL = os.path.dirname(hw.__file__)


def kinds(counts):
    """Launches per kernel kind: a matmul by its transposes, the head's (vocabulary-wide)
    apart; a flash kernel without its head size (tiny's is 32, d12's 64)."""
    out = collections.Counter()
    for name, n in counts.items():
        m = re.match(r"gemm_(\w\w) (\d+)x(\d+)x(\d+)", name)
        if m:
            name = f"gemm_{m.group(1)}" + (" head" if "50304" in m.group(0) else "")
        out[re.sub(r"^(flash_\w+?)_\d+$", r"\1", name)] += n
    return out


@requires_sim
def test_the_models_launch_list_is_what_a_step_launches(tmp_path):
    """tiny (4 layers, one chunk of logits at B=2, T=32) on cudasim, bf16 as d12 trains:
    every kernel and its launches per step, per layer and once, as the model has them (its
    B=1: one chunk too)."""
    out = tmp_path / "bench.json"
    res = cli("bench", "--backend", "cuda", "--profile", "-e", "tiny", "-b", "2", "-t", "32",
              "--dtype", "bf16", "--out", out, env=device_env("sim"), timeout=900)
    assert res.returncode == 0, res.stderr
    rows = json.loads(out.read_text())["per_kernel"]
    ran = kinds({r["kernel"]: r["calls_per_step"] for r in rows})
    model = kinds(model_h200.launch_counts(cupygpt(1, "now", layers=4)))
    one, two = (kinds(model_h200.launch_counts(cupygpt(1, "now", layers=n))) for n in (1, 2))
    per_layer = {k: two[k] - one[k] for k in two if two[k] != one[k]}
    assert per_layer["flash_forward"] == per_layer["flash_dkdv"] == 1 and per_layer["gemm_TN"] == 4
    assert ran == model, (sorted((ran - model).items()), sorted((model - ran).items()))


def test_the_model_reproduces_its_calibration_and_predicts_today(capsys, monkeypatch):
    """The measured launch list's calibrated graph step within 0.1 ms of the 16.19 measured;
    today's prediction printed for our attention and cuDNN's."""
    monkeypatch.setattr(sys, "argv", ["model_h200.py"])
    a_priori = dict(hw.GEMM)
    model_h200.main()
    assert hw.GEMM == a_priori  # the fit was main's alone
    text = capsys.readouterr().out
    step = float(re.search(r"calibrated ([\d.]+); measured 16.19", text).group(1))
    assert abs(step - 16.19) < 0.1
    assert "column_sum_x" not in str(model_h200.launch_counts(cupygpt(4, "now")))
    assert re.search(r"flash now .* step +[\d.]+ ms", text) and "cuDNN attention" in text


def require_recorded_tools(found):
    """Skips, naming both, where the installed NVRTC or cuobjdump (found) is not the version
    FLASH["now"] was read with: another compiler may count another SASS for the same source
    (dev/requirements.txt pins the 13.5 series, so CI keeps checking)."""
    if found != TOOLS:
        pytest.skip(f"FLASH['now'] was read with {TOOLS}; installed: {found}")


def test_other_tool_versions_skip_the_sass_comparison():
    with pytest.raises(pytest.skip.Exception, match=r"13\.5\.37.*13\.6\.2"):
        require_recorded_tools(dict(TOOLS, nvrtc="13.6.2"))
    require_recorded_tools(dict(TOOLS))  # the recorded ones: no skip


def test_the_flash_numbers_are_the_kernels_sass():
    """FLASH["now"] is what flash_sass.py reads from today's flash_attention.cu (sm_90),
    under the NVRTC and cuobjdump it was read with."""
    compile_test = helpers_of("unit/backends/test_kernels_compile.py")
    if not compile_test.have_nvrtc() or not compile_test.cuobjdump():
        pytest.skip("NVRTC or cuobjdump not installed")
    from dev.gpumodel import flash_sass
    require_recorded_tools(flash_sass.tool_versions())
    table = flash_sass.flash_table()
    keys = ("occ", "cols", "instr", "copy", "hmma", "ldsm")
    got = {k: {f: table[k][f] for f in keys} for k in table}
    want = {k: {f: v[f] for f in keys} for k, v in model_h200.FLASH["now"].items()}
    assert got == want


def test_the_model_leaves_the_import_path_and_generic_names_alone(monkeypatch):
    """Imported as the package dev.gpumodel: no dev/gpumodel on sys.path, no top-level
    flash or hw module to shadow another's; its settings are GPUMODEL_ names only, so a HW
    or BW meant for another tool changes nothing."""
    assert all(os.path.abspath(p or ".") != GPUMODEL for p in sys.path)
    assert not {"hw", "flash", "launches", "measured", "llmc"} & set(sys.modules)
    monkeypatch.setenv("BW", "1")
    monkeypatch.setenv("HW", "h100")
    monkeypatch.setenv("GPUMODEL_CLK", "1e9")
    # a copy of hw read under this environment (the imported one, shared, left as it is)
    spec = importlib.util.spec_from_file_location("hw_copy", hw.__file__)
    fresh = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(fresh)
    assert (fresh.BW, fresh.HWNAME, fresh.CLK) == (4.3e12, "h200", 1e9)
