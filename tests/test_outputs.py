"""Every file a command writes goes through one claim rule (an existing file is replaced
only with --overwrite, never a file of the installed package), and a command's standard
output that cannot be written (closed, a full disk) is a write error, said once."""
import os
import subprocess
import sys

import pytest

from conftest import CLI, FIX, ROOT, cli

PKG = os.path.join(ROOT, "cupygpt")
BENCH = ["bench", "--backend", "numpy", "-e", "tiny", "-b", "1", "-t", "16", "--steps", "1",
         "--warmup", "0"]
TINY = ["train", "--backend", "numpy", "-b", "1", "-t", "16", "-v", "0", "-g", "0"]


def one_line(res, expect):
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 1 and len(lines) == 1 and lines[0].startswith("error: "), \
        (res.stdout, res.stderr)
    assert expect in lines[0], lines[0]


def someones(path, data=b"a run's model, not this command's"):
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("args", [
    lambda t: [*BENCH, "--out", t / "mine"],
    lambda t: [*BENCH, "--trace", t / "mine", "--out", t / "b.json"],
    lambda t: ["plot", t / "log.jsonl", "--out", t / "mine"],
    lambda t: ["timeline", t / "trace.json", "--out", t / "mine"],
    lambda t: [*TINY, "-n", 1, "-o", t / "o", "--trace", t / "mine"],
    lambda t: ["verify", "--backend", "numpy", "--trace", t / "mine"],
], ids=["bench out", "bench trace", "plot out", "timeline out", "train trace",
        "verify trace"])
def test_no_command_replaces_an_existing_file_unasked(tmp_path, args):
    mine = someones(tmp_path / "mine")
    (tmp_path / "log.jsonl").write_text('{"step": 1, "train_loss": 3.0}\n')
    (tmp_path / "trace.json").write_text("{}")
    one_line(cli(*args(tmp_path)), f"{tmp_path / 'mine'}: exists; add --overwrite to replace "
                                   f"it, or give another path")
    assert mine.read_bytes() == b"a run's model, not this command's"
    assert not (tmp_path / "o").exists() and not (tmp_path / "b.json").exists()


def test_bench_replaces_its_outputs_when_asked_atomically_with_the_umask(tmp_path):
    out, trace = someones(tmp_path / "b.json"), someones(tmp_path / "t.json")
    res = cli(*BENCH, "--out", out, "--trace", trace, "--overwrite")
    assert res.returncode == 0, res.stderr
    assert f"wrote the trace {trace}" in res.stdout
    for path in (out, trace):
        assert path.read_bytes().startswith(b"{")
        assert os.stat(path).st_mode & 0o777 == 0o644
    assert sorted(os.listdir(tmp_path)) == ["b.json", "t.json"]  # (no temporary left)


def test_gpucheck_writes_nothing_into_the_installed_package(tmp_path):
    (tmp_path / "link").symlink_to(PKG)
    for out in (os.path.join(PKG, "gpurep"), tmp_path / "link" / "gpurep"):
        one_line(cli("gpucheck", "--out", out, "--budget", 20, "--part", "peers"),
                 f"--out {out}: lies in the installed package")
        assert not os.path.exists(os.path.join(PKG, "gpurep"))


def shell(args, redirect):
    """The command with its stdout redirected (`>&-`: closed; `> /dev/full`): the result."""
    cmd = " ".join(f"'{a}'" for a in (sys.executable, CLI, *map(str, args)))
    return subprocess.run(f"{cmd} {redirect}", shell=True, capture_output=True, text=True,
                          timeout=300)


WRITE_ERROR = {">&-": "error: standard output: write error (Bad file descriptor)",
               "> /dev/full": "error: standard output: write error (No space left on device)"}


@pytest.mark.parametrize("redirect", list(WRITE_ERROR))
@pytest.mark.parametrize("args", [
    ["schedule", "-p", 4, "-m", 8], ["verify", "--backend", "numpy", "--json"],
    ["sample", "--backend", "numpy", "--model", os.path.join(FIX, "gpt2v_model.bin"),
     "--max-new-tokens", 4]], ids=["schedule", "verify", "sample"])
def test_a_command_whose_stdout_fails_says_so_once_and_exits_1(args, redirect):
    res = shell(args, redirect)
    lines = [ln for ln in res.stderr.splitlines() if ln.startswith(("error", "Traceback"))]
    assert res.returncode == 1 and lines == [lines[0]], res.stderr
    assert lines[0].startswith(WRITE_ERROR[redirect]), lines[0]


@pytest.mark.parametrize("redirect", list(WRITE_ERROR))
def test_a_training_run_whose_stdout_fails_trains_on_and_exits_1(tmp_path, redirect):
    res = shell([*TINY, "-n", 3, "-o", tmp_path], redirect)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert res.stderr.count("error: ") == 1 and WRITE_ERROR[redirect] in res.stderr
    assert (tmp_path / "model.bin").stat().st_size > 0
    log = [line for line in open(tmp_path / "log.jsonl")]
    assert len(log) == 3 and all(line.startswith('{"step"') for line in log)


def test_convert_to_a_full_disk_says_so_in_one_line_and_leaves_nothing(tmp_path):
    import test_stops_and_limits as limits  # (its small tmpfs)
    small = limits.a_small_filesystem(tmp_path / "small", "1m")
    try:
        one_line(cli("convert", os.path.join(FIX, "gpt2v_model.bin"), small / "hf"),
                 f"{small / 'hf'}: disk full (or over quota) while writing it; nothing was "
                 f"written there")
        assert os.listdir(small) == []
    finally:
        subprocess.run(["umount", str(small)])


def test_prepare_and_convert_take_the_overwrite_flag_every_other_command_takes(tmp_path):
    text = os.path.join(PKG, "data", "tinyshakespeare.txt")
    assert cli("prepare", text, "--out", tmp_path).returncode == 0
    one_line(cli("prepare", text, "--out", tmp_path), "exists; add --overwrite to replace")
    assert cli("prepare", text, "--out", tmp_path, "--overwrite").returncode == 0
    model = os.path.join(FIX, "gpt2v_model.bin")
    someones(tmp_path / "m.bin")
    assert cli("convert", model, tmp_path / "hf").returncode == 0
    one_line(cli("convert", tmp_path / "hf", tmp_path / "m.bin"),
             "already exists; add --overwrite to replace it")
    assert cli("convert", tmp_path / "hf", tmp_path / "m.bin", "--overwrite").returncode == 0
