"""What people see: the JSON log, the plot (what it cannot draw left out and said),
progress bars on a terminal, rank prefixes."""
import json
import os
import pty
import subprocess
import sys

import pytest
from harness import CLI, FIX, ROOT, cli, one_line


def test_log_plot_and_checkpoint_model(tmp_path):
    res = cli("train", "-n", "6", "-v", "3", "-g", "0", "--checkpoint-every", "3", "-o", tmp_path)
    assert res.returncode == 0, res.stderr
    recs = [json.loads(line) for line in open(tmp_path / "log.jsonl")]
    steps = [r for r in recs if "train_loss" in r]
    assert [r["step"] for r in steps] == [1, 2, 3, 4, 5, 6]
    for r in steps:
        assert {"step", "train_loss", "lr", "ms", "tok_s", "mem_bytes"} <= set(r)
        assert r["ms"] > 0 and r["tok_s"] > 0 and r["mem_bytes"] > 0
    assert [r["step"] for r in recs if "val_loss" in r] == [0, 3, 6]
    from cupygpt.formats.llmc import read_model
    cfg, params = read_model(tmp_path / "ckpt_00000006" / "model.bin")
    assert (tmp_path / "ckpt_00000006" / "model.bin").read_bytes() == \
        (tmp_path / "model.bin").read_bytes()
    pytest.importorskip("matplotlib")
    out = cli("plot", tmp_path / "log.jsonl", "--out", tmp_path / "loss.png")
    assert out.returncode == 0 and "6 train, 3 val points" in out.stdout, out.stderr
    png = (tmp_path / "loss.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_plot_bad_log(tmp_path):
    (tmp_path / "x.jsonl").write_text("not json\n")
    res = cli("plot", tmp_path / "x.jsonl", "--out", tmp_path / "x.png")
    assert res.returncode == 1 and res.stderr.startswith("error: ")
    assert "line 1 is not JSON" in res.stderr and not (tmp_path / "x.png").exists()


def test_plot_leaves_out_the_line_a_live_run_is_writing(tmp_path):
    """A live run's log may end in a line not yet whole: that line is left out, and a log
    of nothing else says so rather than asking whether it is a train log."""
    pytest.importorskip("matplotlib")
    whole = '{"step": 1, "train_loss": 3.5}\n{"step": 2, "train_loss": 3.25}\n'
    (tmp_path / "log.jsonl").write_text(whole + '{"step": 3, "train_lo')
    res = cli("plot", tmp_path / "log.jsonl", "--out", tmp_path / "a.png")
    assert res.returncode == 0 and "2 train, 0 val points" in res.stdout, res.stderr
    (tmp_path / "one.jsonl").write_text('{"step": 1, "tr')
    one_line(cli("plot", tmp_path / "one.jsonl", "--out", tmp_path / "b.png"),
             "one.jsonl: its one line is not whole yet (a live run's log being written?)")
    assert not (tmp_path / "b.png").exists()
    (tmp_path / "ended.jsonl").write_text(whole + 'not json\n')  # (whole: a wrong log)
    one_line(cli("plot", tmp_path / "ended.jsonl", "--out", tmp_path / "c.png"),
             "ended.jsonl: line 3 is not JSON")


def on_terminal(*args):
    """Runs cli.py with stdout and stderr on a pseudo-terminal; returns what it showed."""
    main, sub = pty.openpty()
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "cli.py"), *map(str, args)],
                         stdout=sub, stderr=sub, env={**os.environ, "COLUMNS": "100"})
    os.close(sub)
    chunks = []
    while True:
        try:
            data = os.read(main, 4096)
        except OSError:
            break
        if not data:
            break
        chunks.append(data)
    p.wait(timeout=120)
    return p.returncode, b"".join(chunks).decode(errors="replace")


def test_progress_bars_on_a_terminal(tmp_path):
    rc, shown = on_terminal("prepare", os.path.join(ROOT, "data", "tinyshakespeare.txt"),
                            "--out", tmp_path)
    assert rc == 0 and "tokenizing" in shown and "100%" in shown and "#" in shown
    rc, shown = on_terminal("sample", "--model", os.path.join(FIX,
                                                              "gpt2v_model.bin"),
                            "--max-new-tokens", "8")
    assert rc == 0 and "generating" in shown and "100%" in shown


def test_plain_lines_when_not_a_terminal(tmp_path):
    res = cli("prepare", os.path.join(ROOT, "data", "tinyshakespeare.txt"), "--out", tmp_path)
    assert res.returncode == 0 and "#" not in res.stderr and "%" not in res.stderr


def test_bench_on_the_cpu_defaults_to_the_cpu_preset(tmp_path):
    out = tmp_path / "b.json"
    res = cli("bench", "--backend", "numpy", "-b", "1", "-t", "16", "--steps", "2",
              "--warmup", "1", "--out", out)
    assert res.returncode == 0, res.stderr
    r = json.loads(out.read_text())
    assert r["model"] == "tiny" and r["backend"] == "numpy" and r["ms_per_step_median"] > 0
    assert "host_launch_fraction" not in r and "host launch" not in res.stdout  # no meaning here
    rc, shown = on_terminal("bench", "--backend", "numpy", "-b", "1", "-t", "16", "--steps", "2",
                            "--warmup", "0", "--out", out, "--overwrite")  # (its own, asked)
    assert rc == 0 and "benchmarking" in shown and "100%" in shown


def test_sample_says_when_the_context_cuts_it_short():
    res = cli("sample", "--backend", "numpy", "--model", os.path.join(FIX, "gpt2v_model.bin"),
              "--max-new-tokens", "1000")
    assert res.returncode == 0, res.stderr
    assert "note: --max-new-tokens 1000: the model's context leaves room for 15" in res.stderr


def test_plot_leaves_out_what_it_cannot_draw_and_refuses_nothing_to_draw(tmp_path):
    pytest.importorskip("matplotlib")
    from harness import cli
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 1, "train_loss": 1e308}\n{"step": 2, "train_loss": -1e308}\n'
                   '{"step": 3, "train_loss": 2.5}\n{"step": 4, "val_loss": NaN}\n'
                   '{"step": 1e308, "train_loss": 2.0}\n')
    res = cli("plot", log, "--out", tmp_path / "a.png")
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert "(1 train, 0 val points; left out 4 whose step or loss is NaN, infinite or out of " \
           "range)" in res.stdout
    log.write_text('{"step": 1, "train_loss": NaN}\n{"step": 2, "val_loss": Infinity}\n')
    one_line(cli("plot", log, "--out", tmp_path / "b.png"), "no loss to plot")
    log.write_text('{"step": 1, "train_loss": ' + "9" * 5000 + "}\n")
    one_line(cli("plot", log, "--out", tmp_path / "c.png"), "line 1 is not JSON")
    assert sorted(os.listdir(tmp_path)) == ["a.png", "log.jsonl"]


def test_plot_draws_a_log_whose_name_is_not_utf8(tmp_path):
    """The log's name is the plot's title: a name in other bytes is drawn with them
    replaced, not matplotlib's TypeError."""
    pytest.importorskip("matplotlib")
    res = cli("train", "-n", "2", "-v", "1", "-g", "0", "-o", tmp_path / "o")
    assert res.returncode == 0, res.stderr
    log = os.path.join(os.fsencode(tmp_path), b"log\xfe.jsonl")
    os.rename(tmp_path / "o" / "log.jsonl", log)
    out = subprocess.run([sys.executable, CLI, "plot", log, "--out", tmp_path / "p.png"],
                         capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_writes_the_kind_of_image_its_name_says(tmp_path):
    """--out x.jpg held PNG data; an extension matplotlib has no writer for is refused
    before the log is read (timeline takes --out through the same image_format); drawn
    whatever MPLBACKEND says."""
    pytest.importorskip("matplotlib")
    log = tmp_path / "log.jsonl"
    log.write_text('{"step": 1, "train_loss": 3.0}\n{"step": 2, "train_loss": 2.5}\n')
    heads = {"a.jpg": b"\xff\xd8\xff", "a.svg": b"<?xml", "a.pdf": b"%PDF", "a": b"\x89PNG"}
    for name, head in heads.items():
        res = cli("plot", log, "--out", tmp_path / name)
        assert res.returncode == 0, res.stderr
        assert (tmp_path / name).read_bytes().startswith(head), name
    res = cli("plot", log, "--out", tmp_path / "b.png", "--overwrite",
              env={"MPLBACKEND": "nonsense"})  # (matplotlib's import refused it)
    assert res.returncode == 0 and (tmp_path / "b.png").read_bytes()[:4] == b"\x89PNG", \
        res.stderr
    os.unlink(tmp_path / "b.png")
    one_line(cli("plot", log, "--out", tmp_path / "a.gif"),
             f"--out {tmp_path / 'a.gif'}: cannot write .gif images; give --out an extension of "
             f"png, pdf")
    assert sorted(os.listdir(tmp_path)) == sorted([*heads, "log.jsonl"])
