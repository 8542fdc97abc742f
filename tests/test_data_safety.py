"""Never lose a user's data (issue 30): no output is an input, readers refuse what is not a
regular file, one run per -o, SIGTERM, memory and disk limits, non-finite weights.
Every refusal is one line, exit 1, and leaves the inputs byte-identical (hashed)."""
import hashlib
import json
import os
import resource
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import ROOT, cli, fixture, mpiexec
from test_bad_input import a_ckpt
from test_faults import log_losses, rank_pids

MODEL, STATE = fixture("tiny_model.bin"), fixture("tiny_debug_state.bin")
SHIPPED = os.path.join(ROOT, "cupygpt", "data")
# the tiny reference model (128K parameters) on a shard in its vocab: steps of milliseconds
SHARD = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"cupygpt-safety-{os.getpid()}.bin")
TINY = ["train", "--backend", "numpy", "-e", MODEL, "-b", "1", "-t", "16", "-v", "0", "-g", "0",
        "-i", SHARD, "-j", ""]


@pytest.fixture(scope="module", autouse=True)
def shard():
    small_shard(SHARD)
    yield
    os.unlink(SHARD)


def copy(src, dst):
    dst.write_bytes(open(src, "rb").read())
    return str(dst)


def digest(root):
    """{relative path: sha256} of every file under root."""
    return {os.path.relpath(os.path.join(d, f), root):
            hashlib.sha256(open(os.path.join(d, f), "rb").read()).hexdigest()
            for d, _, files in os.walk(root) for f in files}


def one_line(res, expect):
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 1 and "Traceback" not in res.stderr, (res.stdout, res.stderr)
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert expect in lines[0], lines[0]
    return lines[0]


def small_shard(path, n=5000):
    """Tokens inside the tiny reference model's vocab (300)."""
    from cupygpt.files import write_shard
    write_shard(path, np.arange(n) % 300)
    return str(path)


def an_hf_dir(t):
    res = cli("convert", MODEL, t / "hf")
    assert res.returncode == 0, res.stderr
    return str(t / "hf")


def text_named(t, name):
    p = t / name
    p.write_text(open(os.path.join(SHIPPED, "tinyshakespeare.txt")).read()[:200000])
    return str(p)


# (id, args(t), what the line says); every input lives in t, which is hashed around the run
SAME = "is also an input of this command"
CASES = [
    ("log over a train shard", lambda t: ["train", "-i", copy(SHIPPED + "/tiny_shakespeare_train.bin",
                                                            t / "x.bin"), "--log-file", t / "x.bin"],
     SAME),
    ("log over -e", lambda t: ["train", "-e", copy(MODEL, t / "init.bin"), "-t", "32",
                               "--log-file", t / "init.bin"], SAME),
    ("trace over -e", lambda t: ["train", "-e", copy(MODEL, t / "init.bin"), "-t", "32",
                                 "--trace", t / "init.bin"], SAME),
    ("trace over a val shard", lambda t: ["train", "-j", copy(SHIPPED + "/tiny_shakespeare_val.bin",
                                                              t / "v.bin"), "--trace", t / "v.bin"],
     SAME),
    ("log through a hard link", lambda t: [
        "train", "-i", copy(SHIPPED + "/tiny_shakespeare_train.bin", t / "x.bin"),
        "--log-file", os.link(t / "x.bin", t / "link.bin") or t / "link.bin"], SAME),
    ("trace through a symlink", lambda t: [
        "train", "-e", copy(MODEL, t / "init.bin"), "-t", "32", "--trace",
        os.symlink(t / "init.bin", t / "sym.json") or t / "sym.json"], SAME),
    ("log over the tokenizer", lambda t: ["train", "--tokenizer", copy(
        SHIPPED + "/gpt2_tokenizer.bin", t / "tok.bin"), "--log-file", t / "tok.bin"], SAME),
    ("model over the resumed one", lambda t: ["train", "--resume", a_ckpt(t), "-b", "4", "-t",
                                              "32", "-o", t / "ckpt_00000001"], SAME),
    ("trace over a shipped shard", lambda t: ["train", "--trace",
                                              SHIPPED + "/tiny_shakespeare_val.bin", "-o", t / "o"],
     "lies in the installed package"),
    ("-o in the package", lambda t: ["train", "-o", SHIPPED], "lies in the installed package"),
    ("verify trace over the model", lambda t: ["verify", "--model", copy(MODEL, t / "m.bin"),
                                               "--trace", t / "m.bin"], SAME),
    ("verify trace over the state", lambda t: ["verify", "--state", copy(STATE, t / "s.bin"),
                                               "--trace", t / "s.bin"], SAME),
    ("verify trace over expected", lambda t: ["verify", "--expected", copy(
        fixture("tiny_expected.json"), t / "e.json"), "--trace", t / "e.json"], SAME),
    ("plot over its log", lambda t: ["plot", copy(fixture("tiny_expected.json"), t / "l"),
                                     "--out", t / "l"], SAME),
    ("timeline over its trace", lambda t: ["timeline", copy(fixture("tiny_expected.json"),
                                                            t / "tr"), "--out", t / "tr"], SAME),
    ("convert over its source", lambda t: ["convert", an_hf_dir(t),
                                           t / "hf" / "model.safetensors"], SAME),
    ("prepare over its text", lambda t: ["prepare", text_named(t, "x_train.bin"), "--name", "x",
                                         "--out", t], SAME),
    ("bench into the package", lambda t: ["bench", "--out", SHIPPED + "/b.json"],
     "lies in the installed package"),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_an_output_is_never_an_input(tmp_path, case):
    _, args, expect = case
    argv = args(tmp_path)
    before, shipped = digest(tmp_path), digest(SHIPPED)
    one_line(cli(*argv), expect)
    assert digest(tmp_path) == before and digest(SHIPPED) == shipped


def test_prepare_never_writes_through_the_data_link_into_the_package(tmp_path):
    """A clone's ./data is a link to cupygpt/data: prepare's default --out from the root."""
    assert os.path.realpath(os.path.join(ROOT, "data")) == os.path.realpath(SHIPPED)
    shipped = digest(SHIPPED)
    one_line(cli("prepare", text_named(tmp_path, "mine.txt")), "lies in the installed package")
    assert digest(SHIPPED) == shipped


def readers(t):
    fifo = t / "fifo"
    os.mkfifo(fifo)
    return [["verify", "--model", fifo], ["verify", "--state", fifo],
            ["verify", "--expected", fifo], ["verify", "--expected", "/dev/zero"],
            ["train", "-i", fifo, "-o", t / "o"], ["train", "-e", fifo, "-o", t / "o"],
            ["train", "--tokenizer", fifo, "-o", t / "o"],
            ["sample", "--model", fixture("gpt2v_model.bin"), "--tokenizer", fifo],
            ["plot", fifo, "--out", t / "l.png"], ["plot", "/dev/zero", "--out", t / "l.png"],
            ["timeline", fifo, "--out", t / "t.png"], ["prepare", fifo, "--out", t],
            ["prepare", "/dev/zero", "--out", t], ["verify", "--state", t]]


def test_readers_refuse_what_is_not_a_regular_file(tmp_path):
    """A FIFO blocked them forever, /dev/zero filled the memory: now one line at once."""
    for argv in readers(tmp_path):
        res = cli(*argv, timeout=60)
        line = one_line(res, "not a regular file")
        assert any(w in line for w in ("is a FIFO", "is a device", "is a directory")), line
    assert sorted(os.listdir(tmp_path)) == ["fifo"]


def test_json_inputs_are_read_up_to_a_cap(tmp_path):
    big = tmp_path / "e.json"
    big.write_bytes(b'{"losses": [1.0]}' + b" " * (2 << 20))
    one_line(cli("verify", "--expected", big), "larger than 1 MiB")


def test_one_run_per_output_directory(tmp_path):
    """Two runs started together into one -o, with and without checkpoints: one runs, the
    other is refused naming the first's PID; the log has every step once, no torn line."""
    for n, extra in enumerate(([], ["--checkpoint-every", "100"])):
        out = tmp_path / f"run{n}"
        runs = [subprocess.Popen([sys.executable, os.path.join(ROOT, "cli.py"), *TINY, "-n",
                                  "200", *extra, "-o", str(out)], cwd=ROOT, text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE)
                for _ in range(2)]
        done = [(p, *p.communicate(timeout=300)) for p in runs]
        ok = [p for p, _, _ in done if p.returncode == 0]
        lost = [(p, err) for p, _, err in done if p.returncode != 0]
        assert len(ok) == 1 and len(lost) == 1, [(p.returncode, e) for p, _, e in done]
        err = lost[0][1].strip().splitlines()
        assert err == [f"error: -o {out}: another run (pid {ok[0].pid}) is writing into this "
                       f"directory; wait for it to end, or give another -o"], err
        steps = [json.loads(line)["step"] for line in open(out / "log.jsonl")]
        assert steps == list(range(1, 201))


def test_a_fresh_run_does_not_replace_another_runs_output_unasked(tmp_path):
    assert cli(*TINY, "-n", "2", "-o", tmp_path).returncode == 0
    before = digest(tmp_path)
    one_line(cli(*TINY, "-n", "3", "-o", tmp_path),
             f"-o {tmp_path}: holds an earlier run's output (model.bin; log.jsonl)")
    assert digest(tmp_path) == before
    res = cli(*TINY, "-n", "3", "-o", tmp_path, "--overwrite")
    assert res.returncode == 0, res.stderr
    assert [json.loads(ln)["step"] for ln in open(tmp_path / "log.jsonl")] == [1, 2, 3]


def test_a_run_failing_before_its_first_step_leaves_no_directory_or_log(tmp_path):
    res = cli(*TINY, "-n", "2", "-i", small_shard(tmp_path / "short.bin", 10),
              "-o", tmp_path / "new")  # (the last -i counts)
    one_line(res, "fewer than B*T+1")
    res = cli(*TINY, "-n", "5", "-o", tmp_path / "new", env={"CUPYGPT_FAULT": "raise:1:0"})
    assert res.returncode == 1 and "injected fault" in res.stderr
    assert sorted(os.listdir(tmp_path)) == ["short.bin"]


def test_files_are_written_with_the_users_umask(tmp_path):
    for mask, mode in ((0o022, 0o644), (0o077, 0o600)):
        out = tmp_path / oct(mask)
        res = subprocess.run([sys.executable, "cli.py", *TINY, "-n", "1", "--checkpoint-every",
                              "1", "-o", out], cwd=ROOT, capture_output=True,
                             preexec_fn=lambda m=mask: os.umask(m))
        assert res.returncode == 0, res.stderr
        for f in ("model.bin", "log.jsonl", "latest", "ckpt_00000001/adamw.npz"):
            assert os.stat(out / f).st_mode & 0o777 == mode, (f, oct(mask))


def start(out, *extra):
    """A 2-stage run under mpiexec, once it has logged step 2 (lr constant: a resume with
    another -n follows the same schedule)."""
    cmd = [mpiexec(), "-n", "2", sys.executable, os.path.join(ROOT, "cli.py"), "train", "-b",
           "4", "-t", "32", "-v", "0", "-g", "0", "-k", "constant", "-n", "10000", "-o",
           str(out), *extra]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                         cwd=ROOT, start_new_session=True,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    lines = []
    while not any("step    2/" in ln for ln in lines):
        lines.append(p.stdout.readline())
        assert lines[-1], "".join(lines)
    return p


def sigterm_rank_1(out, *extra):
    """SIGTERM to rank 1 alone: (the step every rank stopped after, the output)."""
    p = start(out, *extra)
    victim, = rank_pids(str(out), 1)
    os.kill(victim, signal.SIGTERM)
    text = p.communicate(timeout=120)[0]
    assert p.returncode == 130, text[-2000:]
    assert not rank_pids(str(out), 0) and not rank_pids(str(out), 1), "no rank left"
    return int(text.split("interrupted after step ")[1].split(";")[0]), text


def test_sigterm_to_one_rank_checkpoints_every_rank_and_resumes_bit_for_bit(tmp_path):
    run, full, part = tmp_path / "run", tmp_path / "full", tmp_path / "part"
    n, text = sigterm_rank_1(run, "--checkpoint-every", "1000")
    assert open(run / "latest").read() == f"ckpt_{n:08d}" and f"resume from {run}" in text
    flags = ["train", "-b", "4", "-t", "32", "-v", "0", "-g", "0", "-k", "constant", "-n",
             n + 2]
    a = cli(*flags, "-o", full, ranks=2)
    b = cli(*flags, "--resume", run / f"ckpt_{n:08d}", "-o", part, ranks=2)
    assert a.returncode == 0 and b.returncode == 0, (a.stderr, b.stderr)
    la, lr, lb = log_losses(full / "log.jsonl"), log_losses(run / "log.jsonl"), \
        log_losses(part / "log.jsonl")
    assert sorted(lr) == list(range(1, n + 1)) and all(lr[s] == la[s] for s in lr)
    assert sorted(lb) == [n + 1, n + 2] and all(lb[s] == la[s] for s in lb)  # bit for bit


def test_sigterm_without_checkpoints_writes_the_model_of_the_last_step(tmp_path):
    from cupygpt.files import read_model
    n, text = sigterm_rank_1(tmp_path)
    assert f"wrote {tmp_path / 'model.bin'} of step {n}" in text
    assert max(log_losses(tmp_path / "log.jsonl")) == n
    assert np.isfinite(read_model(str(tmp_path / "model.bin"))[1]).all()


def test_a_second_signal_stops_at_once_leaving_nothing_half_written(tmp_path):
    """The tiny preset: a step and a checkpoint long enough for the second signal to come
    while they are under way (two at once would be one: signals do not queue)."""
    p = subprocess.Popen([sys.executable, "cli.py", *TINY, "-e", "tiny", "-t", "64", "-i",
                          os.path.join(SHIPPED, "tiny_shakespeare_val.bin"), "-n", "100000",
                          "--checkpoint-every", "1", "-o", tmp_path], cwd=ROOT, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    while "step    2/" not in p.stdout.readline():
        pass
    p.send_signal(signal.SIGTERM)
    time.sleep(0.05)
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=60)
    assert p.returncode == 128 + signal.SIGTERM and "SIGTERM again: stopping now" in err, err
    assert not [f for f in os.listdir(tmp_path) if f.endswith((".tmp", ".partial"))]
    for d in (d for d in os.listdir(tmp_path) if d.startswith("ckpt_")):
        assert not [f for f in os.listdir(tmp_path / d) if f.endswith(".tmp")]


BIG = ["train", "--backend", "numpy", "-b", "32", "-t", "256", "-n", "1"]  # needs 3.9 GiB


def a_memory_cgroup(limit):
    """A child of this process's memory cgroup limited to `limit` bytes, or pytest.skip."""
    from cupygpt.backends.host_memory import _mounts
    mounts = _mounts(open("/proc/self/mountinfo").read())
    for line in open("/proc/self/cgroup"):
        _, controllers, path = line.strip().split(":", 2)
        version = "v2" if controllers == "" else "v1" if "memory" in controllers.split(",") \
            else None
        if version in mounts:
            d = os.path.join(mounts[version][0], path.lstrip("/"), f"cupygpt-test-{os.getpid()}")
            try:
                os.mkdir(d)
                with open(os.path.join(d, "memory.limit_in_bytes" if version == "v1"
                                       else "memory.max"), "w") as f:
                    f.write(str(limit))
                return d
            except OSError as e:
                pytest.skip(f"cannot make a memory cgroup under {path} ({e.strerror})")
    pytest.skip("no memory cgroup hierarchy is mounted here")


def test_a_run_beyond_its_memory_cgroup_is_refused_before_allocating(tmp_path):
    cg = a_memory_cgroup(2 << 30)

    def enter():
        with open(os.path.join(cg, "cgroup.procs"), "w") as f:
            f.write(str(os.getpid()))
    try:
        t0 = time.monotonic()
        res = subprocess.run([sys.executable, "cli.py", *BIG, "-o", tmp_path / "o"], cwd=ROOT,
                             capture_output=True, text=True, preexec_fn=enter, timeout=300)
    finally:
        os.rmdir(cg)
    line = one_line(res, "out of memory at start: rank 0 needs 3.87 GiB")
    assert "GiB of this host's memory is free" in line and time.monotonic() - t0 < 60
    assert not os.path.exists(tmp_path / "o")


def test_a_run_beyond_ulimit_v_is_refused_before_allocating(tmp_path):
    res = subprocess.run([sys.executable, "cli.py", *BIG, "-o", tmp_path / "o"], cwd=ROOT,
                         capture_output=True, text=True, timeout=300, preexec_fn=lambda: (
                             resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))))
    one_line(res, "out of memory at start: rank 0 needs 3.87 GiB")
    assert not os.path.exists(tmp_path / "o")


def a_small_filesystem(path, size):
    path.mkdir()
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                         capture_output=True, text=True)
    if res.returncode:
        pytest.skip(f"cannot mount a small tmpfs here ({res.stderr.strip()})")
    return path


def test_a_disk_without_room_for_the_model_and_a_checkpoint_is_refused_before_step_1(tmp_path):
    small = a_small_filesystem(tmp_path / "small", "40m")
    try:
        preset = ["-e", "tiny", "-i", os.path.join(SHIPPED, "tiny_shakespeare_val.bin")]
        ok = cli(*TINY, *preset, "-n", "1", "-o", small / "a")  # the model (29 MB) fits
        assert ok.returncode == 0, ok.stderr
        res = cli(*TINY, *preset, "-n", "1", "--checkpoint-every", "1", "-o", small / "b")
        one_line(res, f"-o {small / 'b'}: its filesystem has ")
        assert "the final model and one checkpoint" in res.stderr
        assert sorted(os.listdir(small)) == ["a"]
    finally:
        subprocess.run(["umount", str(small)])


def test_a_log_that_cannot_be_written_never_costs_the_model(tmp_path):
    small = a_small_filesystem(tmp_path / "small", "8k")
    try:
        res = cli(*TINY, "-n", "100", "--log-file", small / "log.jsonl", "-o", tmp_path / "o")
        assert "warning: cannot write the log" in res.stdout and "step  100/100" in res.stdout
        one_line(res, f"could not write the log {small / 'log.jsonl'}")
        assert "the model was written" in res.stderr and (tmp_path / "o" / "model.bin").exists()
    finally:
        subprocess.run(["umount", str(small)])


def test_a_trace_that_cannot_be_written_never_costs_the_model(tmp_path):
    from test_new_user import run
    rc, lines = run(*TINY[:1], *TINY[1:], "-n", "2", "--trace", tmp_path / "trace.json", "-o",
                    tmp_path / "o", full_disk_at="trace.json")
    assert rc == 1 and len(lines) == 1, lines
    assert lines[0].startswith("error: could not write the trace") and "disk full" in lines[0]
    assert (tmp_path / "o" / "model.bin").exists() and not (tmp_path / "trace.json").exists()


def with_nan(src, dst, where=5):
    from cupygpt.files import read_model, write_model
    cfg, params = read_model(src)
    params = params.copy()
    params[where] = np.nan
    write_model(dst, cfg, params)
    return str(dst)


def test_non_finite_weights_are_named_by_every_command(tmp_path):
    bad = with_nan(MODEL, tmp_path / "bad.bin")
    said = "bad.bin: holds non-finite weights (NaN or inf)"
    one_line(cli("sample", "--model", with_nan(fixture("gpt2v_model.bin"), tmp_path / "bad.bin")),
             said)
    one_line(cli("verify", "--model", with_nan(MODEL, tmp_path / "bad.bin")), said)
    one_line(cli("train", "-e", bad, "-t", "32", "-i", small_shard(tmp_path / "s.bin"), "-j",
                 "", "-n", "1", "-o", tmp_path / "o"), said)
    assert not (tmp_path / "o").exists()


def test_a_resume_from_a_non_finite_checkpoint_renames_it_and_names_the_last_good(tmp_path):
    shard = small_shard(tmp_path / "s.bin")
    run = ["train", "-e", MODEL, "-b", "1", "-t", "16", "-i", shard, "-j", "", "-g", "0"]
    a = cli(*run, "-n", "2", "--checkpoint-every", "1", "-o", tmp_path / "o")
    assert a.returncode == 0, a.stderr
    newest = tmp_path / "o" / "ckpt_00000002"
    with_nan(newest / "model.bin", newest / "model.bin")
    res = cli(*run, "-n", "4", "--resume", tmp_path / "o", "-o", tmp_path / "o")
    one_line(res, f"{newest / 'model.bin'}: holds non-finite weights (NaN or inf); renamed "
                  f"{newest}.nan. Last good checkpoint: {tmp_path / 'o' / 'ckpt_00000001'}")
    assert open(tmp_path / "o" / "latest").read() == "ckpt_00000001"
    assert (tmp_path / "o" / "ckpt_00000002.nan" / "model.bin").exists()


def test_the_weak_messages_say_what_is_true(tmp_path):
    shard = small_shard(tmp_path / "s.bin")
    res = cli("train", "-e", MODEL, "-b", "1", "-t", "8", "-g", "20", "-i", shard, "-j", "",
              "-n", "1", "-o", tmp_path / "a", "--checkpoint-every", "1")
    assert "note: -g 20: -t 8 leaves room for 7 tokens after the start token; generating 7" \
        in res.stdout, res.stdout
    other = small_shard(tmp_path / "other.bin", 6000)
    res = cli("train", "-e", MODEL, "-b", "1", "-t", "8", "-g", "0", "-i", other, "-j", "",
              "-n", "2", "--resume", tmp_path / "a", "-o", tmp_path / "a")
    assert res.returncode == 0 and "note: the checkpoint's run read other train shards" \
        f" (-i: {os.path.realpath(shard)})" in res.stdout, res.stdout
    one_line(cli("verify", "--schedule", "zbv", ranks=2),
             "--schedule zbv: zbv holds 2 model chunks per rank: 4 model chunks")
    one_line(cli("convert", MODEL, tmp_path / "x.bin"), "x.bin: names a file")
    assert not (tmp_path / "x.bin").exists()


def test_verify_shows_its_steps_progress_on_a_terminal():
    import pty
    master, slave = pty.openpty()
    p = subprocess.Popen([sys.executable, "cli.py", "verify", "--steps", "30", "--json"],
                         cwd=ROOT, stdout=subprocess.PIPE, stderr=slave)
    os.close(slave)
    seen = b""
    while True:
        try:
            chunk = os.read(master, 4096)
        except OSError:
            break
        if not chunk:
            break
        seen += chunk
    assert p.wait() == 0 and b"AdamW steps" in seen and b"100%" in seen
    json.loads(p.stdout.read())  # stdout is still the one JSON object


def test_gitignore_covers_what_readmes_commands_write():
    from test_readme import commands
    import shlex
    defaults = {"train": "out/model.bin", "plot": "loss.png", "timeline": "timeline.png",
                "bench": "bench.json"}
    written = set()
    for cmd in commands():
        words = shlex.split(cmd)
        written |= {words[i + 1] for i, w in enumerate(words[:-1])
                    if w in ("--out", "--trace", "-o") and not words[i + 1].startswith("$")}
        written |= {v for k, v in defaults.items() if k in words}
    res = subprocess.run(["git", "check-ignore", "--no-index", *sorted(written)], cwd=ROOT,
                         capture_output=True, text=True)
    if res.returncode == 128:
        pytest.skip(f"not a git checkout: {res.stderr.strip()}")
    assert sorted(res.stdout.split()) == sorted(written)
