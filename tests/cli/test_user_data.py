"""Never lose a user's data (issue 30): no output is an input or a package file, readers
refuse what is not a regular file, one run per -o, files with the user's umask, messages
that say what is true (test_signals_and_limits.py: signals, limits, non-finite weights).
Every refusal is one line, exit 1, and leaves the inputs byte-identical (hashed)."""
import hashlib
import json
import os
import signal
import subprocess
import sys

import pytest
from harness import CLI, ROOT, cli, fixture, small_shard
from test_bad_input import a_ckpt

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
    ("log over a train shard",
     lambda t: ["train", "-i", copy(SHIPPED + "/tiny_shakespeare_train.bin", t / "x.bin"),
                "--log-file", t / "x.bin"],
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
                                               "--state", STATE, "--trace", t / "m.bin"],
     SAME),
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
    one_line(cli("prepare", text_named(tmp_path, "mine.txt"), cwd=ROOT),
             "lies in the installed package")
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
            ["prepare", fifo, fifo, "--out", t],
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
    """A second run into the -o of one under way, with and without checkpoints, is refused
    naming the first's PID; the first's log has every step once, no torn line."""
    for n, extra in enumerate(([], ["--checkpoint-every", "100"])):
        out = tmp_path / f"run{n}"
        first = subprocess.Popen([sys.executable, os.path.join(ROOT, "cli.py"), *TINY, "-n",
                                  "1000000", *extra, "-o", str(out)], text=True,
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 env={**os.environ, "PYTHONUNBUFFERED": "1"})
        while not first.stdout.readline().startswith("step"):  # (its lock is held by then)
            assert first.poll() is None, first.communicate()
        second = cli(*TINY, "-n", "200", *extra, "-o", out)
        first.send_signal(signal.SIGTERM)
        rest, err = first.communicate(timeout=300)
        assert first.returncode == 143, err  # 128 + SIGTERM
        assert second.returncode == 1 and second.stderr.strip().splitlines() == [
            f"error: -o {out}: another command (pid {first.pid}) is writing into this "
            f"directory; wait for it to end, or give another directory"], second.stderr
        last = int(rest.split("interrupted after step ")[1].split(";")[0])
        steps = [json.loads(line)["step"] for line in open(out / "log.jsonl")]
        assert last > 1 and steps == list(range(1, last + 1))


def test_another_command_writing_into_a_live_runs_output_is_refused(tmp_path):
    """bench --out RUN/log.jsonl --overwrite replaced a live run's log with its JSON, plot
    --out RUN/x.png wrote into its -o, train -o RUN/sub trained among its checkpoints: all
    are refused naming the run's PID."""
    out = tmp_path / "run"
    first = subprocess.Popen([sys.executable, os.path.join(ROOT, "cli.py"), *TINY, "-n",
                              "1000000", "-o", str(out)], text=True, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    try:
        while not first.stdout.readline().startswith("step"):  # (its locks are held by then)
            assert first.poll() is None, first.communicate()
        log = tmp_path / "log.jsonl"
        log.write_text('{"step": 1, "train_loss": 3.0}\n')
        for args, what in ((["bench", "--out", out / "log.jsonl", "--overwrite"], "this file"),
                           (["plot", log, "--out", out / "x.png"], "into its directory")):
            one_line(cli(*args), f"another command (pid {first.pid}) is writing {what}; wait "
                                 f"for it to end, or give another path")
        one_line(cli(*TINY, "-n", "1", "-o", out / "sub" / "run"),
                 f"-o {out / 'sub' / 'run'}: lies inside {os.path.realpath(out)}, which another "
                 f"command (pid {first.pid}) is writing into; wait for it to end, or give a "
                 f"directory outside it")
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=300)
    assert sorted(os.listdir(out)) == ["log.jsonl", "model.bin"]
    assert all(json.loads(line)["step"] for line in open(out / "log.jsonl"))


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
    res = cli(*TINY, "-n", "5", "-o", tmp_path / "new", fault="raise:1:0")
    assert res.returncode == 1 and "injected fault" in res.stderr
    assert sorted(os.listdir(tmp_path)) == ["short.bin"]


def test_files_are_written_with_the_users_umask(tmp_path):
    for mask, mode in ((0o022, 0o644), (0o077, 0o600)):
        out = tmp_path / oct(mask)
        res = subprocess.run([sys.executable, CLI, *TINY, "-n", "1", "--checkpoint-every",
                              "1", "-o", out], capture_output=True,
                             preexec_fn=lambda m=mask: os.umask(m))
        assert res.returncode == 0, res.stderr
        for f in ("model.bin", "log.jsonl", "latest", "ckpt_00000001/adamw.npz"):
            assert os.stat(out / f).st_mode & 0o777 == mode, (f, oct(mask))


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
    p = subprocess.Popen([sys.executable, CLI, "verify", "--steps", "30", "--json"],
                         stdout=subprocess.PIPE, stderr=slave)
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
