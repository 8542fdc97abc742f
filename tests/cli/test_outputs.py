"""Every file a command writes goes through one claim rule (an existing file is replaced
only with --overwrite, never a file of the installed package), and a command's standard
output that cannot be written (closed, a full disk) is a write error, said once. Outputs are
claimed before they are written: one command at a time per directory, no two outputs of a
command on one path, and an -o a failed run made is removed whichever rank made it."""
import os
import subprocess
import sys
import time

import pytest
from harness import CLI, FIX, ROOT, TINY, cli, one_line

PKG = os.path.join(ROOT, "cupygpt")
BENCH = ["bench", "--backend", "numpy", "-e", "tiny", "-b", "1", "-t", "16", "--steps", "1",
         "--warmup", "0"]


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
    import test_signals_and_limits as limits  # (its small tmpfs)
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


def test_prepare_claims_its_out_as_train_claims_its_o(tmp_path):
    """A prepare writing into --out holds it: a second one there is refused, naming the
    first's PID, and writes nothing (two corpora's shards are never mixed)."""
    import fcntl

    from harness import ROOT, cli
    text = os.path.join(ROOT, "data", "tinyshakespeare.txt")
    out = tmp_path / "d"
    out.mkdir()
    fd = os.open(out, os.O_RDONLY)
    fcntl.flock(fd, fcntl.LOCK_EX)  # (as the first prepare holds it)
    try:
        for args in ([], ["--shard-size", "100000"], ["--hellaswag"]):
            one_line(cli("prepare", text, "--out", out, "--name", "corp", *args),
                     f"--out {out}: another command (pid {os.getpid()}) is writing into "
                     f"this directory; wait for it to end, or give another directory")
        assert os.listdir(out) == []
    finally:
        os.close(fd)


def test_convert_never_replaces_a_file_unasked_and_writes_with_the_umask(tmp_path):
    from harness import cli, fixture
    model = fixture("tiny_model.bin")
    res = cli("convert", model, tmp_path / "hf")
    assert res.returncode == 0, res.stderr
    assert os.stat(tmp_path / "hf" / "model.safetensors").st_mode & 0o777 == 0o644
    (tmp_path / "x.bin").write_bytes(b"mine")
    one_line(cli("convert", tmp_path / "hf", tmp_path / "x.bin"),
             f"{tmp_path / 'x.bin'}: already exists; add --overwrite to replace it")
    assert (tmp_path / "x.bin").read_bytes() == b"mine"
    assert cli("convert", tmp_path / "hf", tmp_path / "x.bin", "--force").returncode == 0
    assert open(tmp_path / "x.bin", "rb").read() == open(model, "rb").read()


def test_two_outputs_of_one_command_on_one_path_are_refused(tmp_path):
    from harness import cli
    one_line(cli(*TINY, "-n", 1, "-o", tmp_path / "o", "--trace", tmp_path / "x",
                 "--log-file", tmp_path / "x"),
             f"--trace {tmp_path / 'x'}: is also another of this command's outputs")
    assert os.listdir(tmp_path) == []
    one_line(cli("bench", "--backend", "numpy", "-e", "tiny", "-b", 1, "-t", 16, "--steps", 1,
                 "--out", tmp_path / "b.json", "--trace", tmp_path / "." / "b.json"),
             "is also another of this command's outputs")  # (bench's --out beside --trace)
    assert os.listdir(tmp_path) == []


def test_a_rank_failing_before_its_first_log_leaves_no_empty_o(tmp_path):
    """Under mpiexec every rank validates at once, so the rank that made -o need not be
    rank 0 (which holds the lock and removes it): the ranks agree whether the run made it.
    Rank 0 fails alone at step 1 (as a --peer-timeout does), before any log line."""
    from harness import cli
    for i in range(3):  # (which rank makes -o is a race: a few runs meet both orders)
        out = tmp_path / f"o{i}"
        res = cli(*TINY, "-n", "3", "-o", out, ranks=2, timeout=120, fault="raise:1:0")
        assert res.returncode != 0 and "injected fault on rank 0 at step 1" in res.stderr
        assert not out.exists(), os.listdir(out)


def test_the_rank_holding_the_lock_removes_an_o_another_rank_made(tmp_path):
    """The deterministic half of the race above: rank 0 found -o made (by rank 1, an
    instant earlier), so claim made none itself; the run made it all the same."""
    from types import SimpleNamespace

    from cupygpt.paths import unmake_dirs
    from cupygpt.train import rundir

    class Rank0:  # rank 0 of two, rank 1 having made -o
        rank = 0

        def any(self, flag):
            return True

        def bcast(self, obj, root=0):
            return obj
    out = tmp_path / "o"
    out.mkdir()
    opts = SimpleNamespace(out=str(out), resume=None, overwrite=False, keep=2,
                           log_file=str(out / "log.jsonl"))
    rundir.unmake(opts, Rank0(), rundir.claim(opts, Rank0(), (0, 0, (0, "model.bin"))))
    unmake_dirs()  # (the CLI's, once the job's end is settled)
    assert not out.exists()


@pytest.mark.parametrize("redirect", list(WRITE_ERROR))
def test_help_to_a_failing_stdout_says_so_once_and_exits_1(redirect):
    """click writes --help itself, outside a command's own guard: the same one line."""
    res = shell(["train", "--help"], redirect)
    lines = res.stderr.strip().splitlines()
    assert res.returncode == 1 and len(lines) == 1, res.stderr
    assert lines[0].startswith(WRITE_ERROR[redirect]), lines[0]


def test_a_run_into_a_directory_named_in_other_bytes_than_utf8_trains(tmp_path):
    """A -o whose name is not UTF-8 (a file system's bytes) is printed as given, not a
    traceback after the model is written."""
    out = os.path.join(os.fsencode(tmp_path), b"out\xff")
    res = subprocess.run([sys.executable, CLI, *TINY, "-n", "2", "-o", out],
                         capture_output=True, timeout=300)
    assert res.returncode == 0 and b"Traceback" not in res.stderr, res.stderr
    assert os.fsencode(os.path.join(out, b"model.bin")) in res.stdout
    assert os.path.getsize(os.path.join(out, b"model.bin")) > 0


def test_an_empty_resume_is_refused_not_a_fresh_run(tmp_path):
    res = cli(*TINY, "-n", "1", "--resume", "", "-o", tmp_path / "o")
    one_line(res, "--resume '': is empty; give a checkpoint directory")
    assert not (tmp_path / "o").exists()


def test_a_file_another_command_writes_is_refused_naming_it(tmp_path):
    """Every file a command writes at its end (bench --out and --trace, verify --trace,
    plot --out, convert's DST) is claimed at its start: a second command writing it is
    refused, naming the first's PID, and writes nothing (two bench --trace X ran, the last
    to end won). convert's siblings in one directory are not each other's."""
    import fcntl

    from harness import cli, fixture

    from cupygpt.paths import claim_key
    out = tmp_path / "x.json"
    os.makedirs(os.path.dirname(claim_key(out)), exist_ok=True)
    fd = os.open(claim_key(out), os.O_RDONLY | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)  # (as the first command holds it)
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 1, "train_loss": 3.0}\n')
    try:
        for flag, args in (("--out", ["bench", "--out", out]),
                           ("--trace", ["bench", "--trace", out, "--out", tmp_path / "b.json"]),
                           ("--trace", ["verify", "--trace", out]),
                           ("DST", ["convert", fixture("tiny_model.bin"), out])):
            one_line(cli(*args, env={"TMPDIR": str(tmp_path)}),  # (a job's own TMPDIR)
                     f"{flag} {out}: another command (pid {os.getpid()}) is writing this "
                     f"file; wait for it to end, or give another path")
        png = os.open(claim_key(tmp_path / "p.png"), os.O_RDONLY | os.O_CREAT)
        fcntl.flock(png, fcntl.LOCK_EX)
        one_line(cli("plot", log, "--out", tmp_path / "p.png"), "another command (pid")
        os.close(png)
        assert sorted(os.listdir(tmp_path)) == ["log.jsonl"]
        assert cli("convert", fixture("tiny_model.bin"), tmp_path / "hf").returncode == 0
    finally:
        os.close(fd)


@pytest.mark.parametrize("name,kind", [("model.bin", "dir"), ("latest", "dir"),
                                       ("ckpt_00000001", "file")])
def test_what_a_run_writes_over_of_another_kind_is_refused_at_the_start(tmp_path, name, kind):
    """-o holding a directory named model.bin or latest, or a file named as a checkpoint:
    the run died at its first write (a traceback, the trained model lost) even with
    --overwrite; now one line before step 1, and -o as it was."""
    out = tmp_path / "o"
    out.mkdir()
    (out / name).mkdir() if kind == "dir" else (out / name).write_text("x")
    for extra in ([], ["--overwrite"]):
        res = cli(*TINY, "-n", "1", "--checkpoint-every", "1", "-o", out, *extra)
        one_line(res, f"-o {out}: {out / name} is ")
        assert "move it away, or give another -o" in res.stderr
        assert os.listdir(out) == [name]


def test_an_earlier_log_hard_linked_elsewhere_is_replaced_by_name(tmp_path):
    """--overwrite: the log was rewritten in place, and the other name's file with it."""
    out = tmp_path / "o"
    assert cli(*TINY, "-n", "1", "-o", out).returncode == 0
    (tmp_path / "victim.txt").write_text("kept\n")
    os.unlink(out / "log.jsonl")
    os.link(tmp_path / "victim.txt", out / "log.jsonl")
    res = cli(*TINY, "-n", "1", "-o", out, "--overwrite")
    assert res.returncode == 0, res.stderr
    assert (tmp_path / "victim.txt").read_text() == "kept\n"
    assert '"step": 1' in (out / "log.jsonl").read_text()


def test_leftovers_named_as_a_runs_own_are_replaced_or_refused(tmp_path):
    """A file named ckpt_1.partial (a traceback at the first checkpoint, step 1 lost); an
    earlier ckpt_N.nan where a run goes NaN again (a traceback, latest left on the bad
    one); a directory named as a checkpoint that is none, which --overwrite removed (another
    run's -o, its log lost)."""
    out = tmp_path / "o"
    out.mkdir()
    (out / "ckpt_00000001.partial").write_text("x")
    res = cli(*TINY, "-n", "2", "--checkpoint-every", "1", "-o", out, "--overwrite")
    assert res.returncode == 0, res.stderr
    assert sorted(os.listdir(out)) == ["ckpt_00000001", "ckpt_00000002", "latest", "log.jsonl",
                                       "model.bin"]
    nan = [*TINY, "-n", "4", "-l", "1e30", "-u", "0", "--grad-clip", "0",
           "--checkpoint-every", "1", "-o", tmp_path / "n"]
    for extra in ([], ["--overwrite"]):
        one_line(cli(*nan, *extra), "step 2: train loss is nan")
        assert sorted(os.listdir(tmp_path / "n")) == ["ckpt_00000001.nan", "log.jsonl"]
    (out / "ckpt_00000009").mkdir()
    (out / "ckpt_00000009" / "log.jsonl").write_text("another run's\n")
    one_line(cli(*TINY, "-n", "1", "-o", out, "--overwrite"),
             f"-o {out}: {out / 'ckpt_00000009'} is named as this run's checkpoints are, and is "
             f"no checkpoint (it holds log.jsonl); move it away, or give another -o")
    assert (out / "ckpt_00000009" / "log.jsonl").read_text() == "another run's\n"


def test_no_usable_temporary_directory_claims_nothing_and_costs_nothing(tmp_path,
                                                                       tmp_path_factory):
    """(plot's claim asked tempfile for one outside its try: a traceback; matplotlib with no
    font cache yet warned that it could not save one, a second line)"""
    import resource
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 1, "train_loss": 3.0}\n')
    res = subprocess.run([sys.executable, CLI, "plot", log, "--out", tmp_path / "p.png"],
                         capture_output=True, text=True, timeout=300,
                         env={**os.environ, "MPLCONFIGDIR": str(tmp_path_factory.mktemp("mpl"))},
                         preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_FSIZE, (0, 0)))
    one_line(res, "p.png: over the file-size limit (ulimit -f) while writing it; nothing was "
                  "written there")
    assert sorted(os.listdir(tmp_path)) == ["log.jsonl"]


def test_claims_leave_no_file_behind_and_a_live_one_stays(tmp_path):
    """One empty lock file was left per path ever claimed (134 after a day's use): a
    command's go as it ends, and what a killed one left goes at the next claim; a claim a
    live command holds stays, and still refuses."""
    import fcntl

    from cupygpt.paths import claim_key
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 1, "train_loss": 3.0}\n')
    assert cli("plot", log, "--out", tmp_path / "a.png").returncode == 0
    assert not os.path.lexists(claim_key(tmp_path / "a.png"))
    stale, live = claim_key(tmp_path / "b.png"), claim_key(tmp_path / "c.png")
    open(stale, "w").close()  # (a command killed outright)
    fd = os.open(live, os.O_RDONLY | os.O_CREAT)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        assert cli("plot", log, "--out", tmp_path / "d.png").returncode == 0
        assert not os.path.lexists(stale) and os.path.exists(live)
        one_line(cli("plot", log, "--out", tmp_path / "c.png"),
                 f"another command (pid {os.getpid()}) is writing this file")
    finally:
        os.unlink(live)
        os.close(fd)


def test_a_claim_file_that_is_no_file_is_passed_over(tmp_path):
    """A FIFO at the claim's name blocked its open for good; a link made its target. (The
    claims' directory is in /tmp, where another user could plant them.)"""
    from cupygpt.paths import claim_key
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 1, "train_loss": 3.0}\n')
    os.makedirs(os.path.dirname(claim_key(tmp_path / "a.png")), exist_ok=True)
    os.mkfifo(claim_key(tmp_path / "a.png"))
    os.symlink(tmp_path / "target", claim_key(tmp_path / "b.png"))
    try:
        for name in ("a.png", "b.png"):
            res = cli("plot", log, "--out", tmp_path / name, timeout=60)
            assert res.returncode == 0, res.stderr
        assert sorted(os.listdir(tmp_path)) == ["a.png", "b.png", "log.jsonl"]
    finally:
        for name in ("a.png", "b.png"):
            os.unlink(claim_key(tmp_path / name))


def test_an_output_the_final_rename_cannot_place_is_one_line(tmp_path):
    """convert HF_DIR DST/: the rename of the finished file over DST/ was a traceback."""
    from harness import fixture
    assert cli("convert", fixture("tiny_model.bin"), tmp_path / "hf").returncode == 0
    one_line(cli("convert", tmp_path / "hf", f"{tmp_path / 'm'}/"),
             f"{tmp_path / 'm'}/: cannot write it (Not a directory); nothing was written there")
    assert sorted(os.listdir(tmp_path)) == ["hf"]


@pytest.mark.parametrize("flag,inside,at", [
    ("--log-file", "latest", "latest"), ("--log-file", "ckpt_00000001/x.jsonl", "ckpt_00000001"),
    ("--log-file", "ckpt_00000001.partial", "ckpt_00000001.partial"),
    ("--trace", "ckpt_00000002", "ckpt_00000002")])
def test_a_log_or_trace_at_a_checkpoints_name_is_refused(tmp_path, flag, inside, at):
    """(`latest` written over the log, exit 0; a log inside a checkpoint removed with it; a
    trace where the checkpoint's directory goes: a traceback after the run)"""
    out = tmp_path / "r"
    one_line(cli(*TINY, "-n", "2", "--checkpoint-every", "1", "-o", out, flag, out / inside),
             f"error: {flag} {out / inside}: lies at {at} in -o {out}, a name the run's "
             f"checkpoints take; give another name")
    assert os.listdir(tmp_path) == []


def test_a_file_put_where_a_checkpoint_goes_is_replaced_by_it(tmp_path):
    """A file appearing at OUT/ckpt_N while the run goes (a traceback at the rename, the
    checkpoint left .partial): the checkpoint takes its name, as a checkpoint of an earlier
    run of that step is replaced."""
    out = tmp_path / "r"
    run = subprocess.Popen([sys.executable, CLI, *TINY, "-n", "60", "--checkpoint-every", "1",
                            "--keep", "100", "-o", out], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True)
    for _ in range(600):
        if (out / "ckpt_00000002").is_dir():
            break
        time.sleep(0.1)
    (out / "ckpt_00000058").write_text("a stray file")
    stdout, stderr = run.communicate(timeout=600)
    assert run.returncode == 0, stderr
    assert (out / "ckpt_00000058" / "model.bin").is_file()
    assert not any(n.endswith(".partial") for n in os.listdir(out))


def test_failed_commands_leave_no_directory_a_dotdot_path_made(tmp_path):
    """prepare --out ghost/../pd that fails left ghost (makedirs makes it, and the list of
    what was made had only the normalized pd); convert into hfout/. made hfout."""
    res = cli("prepare", os.path.join(ROOT, "README.md"), "--out", "ghost/../pd", cwd=tmp_path)
    assert res.returncode == 1 and os.listdir(tmp_path) == [], res.stderr
    one_line(cli("convert", os.path.join(FIX, "tiny_model.bin"), "hfout/.", cwd=tmp_path),
             "error: hfout/.: names no new directory (its last part is '.'); give the new "
             "directory's own name")
    assert os.listdir(tmp_path) == []
