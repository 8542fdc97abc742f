"""prepare's corpus mode (llm.c's FineWeb script): many text/jsonl files into shards of a
chosen size, an EOT before each document, tiktoken's GPT-2 tokens, the first shard val; a
Ctrl-C leaves no half-written shard."""
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest
from harness import ROOT, cli, tiktokens

from cupygpt.commands.prepare import shard_path
from cupygpt.formats.llmc import read_shard

WORDS = ("the of and to in is was for that on with as by at from his her they über naïve "
         "café 東京 data, model. loss! (GPU) 1024 3.14 — “quoted” it's don't \n\n").split(" ")


def corpus(d, files, words, seed=0):
    """files text and jsonl files of random documents; returns (paths, documents in order)."""
    rng, paths, docs = np.random.default_rng(seed), [], []
    for i in range(files):
        def doc():
            return " ".join(rng.choice(WORDS, int(rng.integers(1, words))))
        if i % 3 == 2:
            p, recs = d / f"part_{i:03d}.jsonl", [doc() for _ in range(int(rng.integers(1, 6)))]
            p.write_text("".join(json.dumps({"text": t, "id": k}) + "\n"
                                 for k, t in enumerate(recs)))
            docs += recs
        else:
            p = d / f"part_{i:03d}.txt"
            docs.append(doc())
            p.write_text(docs[-1], encoding="utf-8")
        paths.append(str(p))
    return paths, docs


def test_corpus_shards_hold_tiktokens_with_an_eot_before_each_document(tmp_path):
    paths, docs = corpus(tmp_path, 40, 400)
    res = cli("prepare", *paths, "--out", tmp_path / "out", "--name", "web",
              "--shard-size", "5000")
    assert res.returncode == 0, res.stderr
    want = np.concatenate(tiktokens(docs))
    names = sorted(os.listdir(tmp_path / "out"))
    n = -(-want.size // 5000)
    assert n >= 3 and names == sorted(["web_val_000000.bin"] + [f"web_train_{i:06d}.bin"
                                                                for i in range(1, n)])
    shards = [read_shard(tmp_path / "out" / (f"web_val_{0:06d}.bin" if i == 0 else
                                             f"web_train_{i:06d}.bin")) for i in range(n)]
    assert [s.size for s in shards[:-1]] == [5000] * (n - 1)  # the asked size; the last less
    assert np.array_equal(np.concatenate(shards), want)
    assert f"wrote {want.size:,} tokens in {n} shard(s)" in res.stdout
    again = cli("prepare", *paths, "--out", tmp_path / "out", "--name", "web")
    assert again.returncode == 1 and "exists; add --overwrite" in again.stderr
    # --force with bigger shards: the set replaced, none of the old one's left
    res = cli("prepare", *paths, "--out", tmp_path / "out", "--name", "web", "--force",
              "--shard-size", str(want.size))
    assert res.returncode == 0, res.stderr
    assert os.listdir(tmp_path / "out") == ["web_val_000000.bin"]
    assert f"no train shard: the corpus fits in one --shard-size ({want.size:,}" in res.stdout
    assert np.array_equal(read_shard(tmp_path / "out" / "web_val_000000.bin"), want)


def test_parquet_documents(tmp_path):
    pa = pytest.importorskip("pyarrow", reason="parquet needs the optional extra "
                                               "cupygpt[parquet] (pyarrow), not installed")
    import pyarrow.parquet as pq
    docs = ["one document", "and another, über", ""]
    pq.write_table(pa.table({"text": docs}), tmp_path / "a.parquet")
    res = cli("prepare", tmp_path / "a.parquet", "--out", tmp_path / "o", "--shard-size", "7")
    assert res.returncode == 0, res.stderr
    got = np.concatenate([read_shard(tmp_path / "o" / f) for f in
                          sorted(os.listdir(tmp_path / "o"), key=lambda f: f[-10:])])
    assert np.array_equal(got, np.concatenate(tiktokens(docs)))
    # damaged: cut short, no text column, numbers for text; one line each, nothing written
    raw = (tmp_path / "a.parquet").read_bytes()
    (tmp_path / "cut.parquet").write_bytes(raw[:len(raw) // 2])
    pq.write_table(pa.table({"body": docs}), tmp_path / "body.parquet")
    pq.write_table(pa.table({"text": [1, 2]}), tmp_path / "ints.parquet")
    for name, why in (("cut", "not a readable parquet file"),
                      ("body", "has no `text` column of strings (columns: body string)"),
                      ("ints", "has no `text` column of strings (columns: text int64)")):
        res = cli("prepare", tmp_path / f"{name}.parquet", "--out", tmp_path / name)
        assert res.returncode == 1 and res.stderr.count("\n") == 1, res.stderr
        assert res.stderr.startswith(f"error: {tmp_path / name}.parquet: {why}"), res.stderr
        assert not (tmp_path / name).exists()


@pytest.fixture(scope="module")
def big_corpus(tmp_path_factory):
    """100 text and jsonl files, 60M characters: (paths, documents)."""
    return corpus(tmp_path_factory.mktemp("big"), 100, 150000, seed=3)


@pytest.mark.parametrize("sig,workers", [(signal.SIGINT, 1), (signal.SIGTERM, 2),
                                         (signal.SIGUSR1, 2)])
def test_a_signal_leaves_no_half_shard(tmp_path, big_corpus, sig, workers):
    """Ctrl-C or SIGTERM once the first shard is there: on one worker the rest of the 22M
    tokens takes seconds (4 here), against the 20 ms the signal takes to follow; the
    workers end quietly, the command with 128 + the signal."""
    paths, _ = big_corpus
    out = tmp_path / "out"
    p = subprocess.Popen([sys.executable, os.path.join(ROOT, "cli.py"), "prepare", *paths,
                          "--out", out, "--shard-size", "1000000", "--workers", str(workers)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         start_new_session=True)  # (its group: ended whole on a failure)
    t0 = time.time()
    try:  # (a failure here must not leave the command running: it was seen to outlive one)
        while not (out.exists() and any(f.endswith(".bin") for f in os.listdir(out))):
            assert p.poll() is None and time.time() - t0 < 120, p.communicate()
            time.sleep(0.02)
        p.send_signal(sig)
        _, err = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.communicate()
    assert p.returncode == 128 + sig, err
    assert err == "interrupted: the shards written so far are whole; no shard is half " \
        "written\n", err
    left = os.listdir(out)
    assert left and not [f for f in left if not f.endswith(".bin")]  # no temporary file
    assert all(read_shard(out / f).size == 1_000_000 for f in left)  # each one whole
    assert set(left) == {os.path.basename(shard_path(out, "part_000", i))
                         for i in range(len(left))}                  # in order, none missing
    assert len(left) < 20  # (the corpus holds 23)


def test_a_corpus_of_50m_characters_uses_every_core(tmp_path, big_corpus):
    """100 files, 50M+ characters: shards of the asked size holding tiktoken's tokens (an
    EOT before each document), tokenized by a process per core (README: its tokens/s)."""
    paths, docs = big_corpus
    assert sum(map(len, docs)) >= 50_000_000
    (tmp_path / "docs.json").write_text(json.dumps(docs))
    ref = tmp_path / "ref.u16"  # the reference, in a process of its own (as tiktokens)
    subprocess.run([sys.executable, "-c", (
        "import json, sys, numpy as np; from cupygpt.formats.tokenizer import Tokenizer; "
        f"t = Tokenizer({os.path.join(ROOT, 'cupygpt', 'data', 'gpt2_tokenizer.bin')!r}); "
        f"docs = json.load(open({str(tmp_path / 'docs.json')!r})); "
        "np.array([x for d in docs for x in [t.eot] + t.encode(d)], np.uint16)"
        f".tofile({str(ref)!r})")], check=True)
    want = np.fromfile(ref, np.uint16)
    res = cli("prepare", *paths, "--out", tmp_path / "out", "--name", "big", "--shard-size",
              "4000000")
    assert res.returncode == 0, res.stderr
    n = -(-want.size // 4_000_000)
    shards = [read_shard(tmp_path / "out" / (f"big_val_{0:06d}.bin" if i == 0 else
                                             f"big_train_{i:06d}.bin")) for i in range(n)]
    assert [s.size for s in shards[:-1]] == [4_000_000] * (n - 1) and n >= 3
    assert np.array_equal(np.concatenate(shards), want)
    assert f"tokens/s, {os.cpu_count()} worker(s) on {os.cpu_count()} cores)" in res.stdout


def test_a_failure_as_the_workers_start_ends_them_all(tmp_path):
    """The pool's SIGTERM reaching a worker before its own handlers were set (here: held in
    the fork's bookkeeping for half a second) raised there and left a worker no signal
    ended, its parent joining it forever; the workers start with the stop signals blocked."""
    bad = tmp_path / "r.jsonl"
    bad.write_text('{"t": 1}\n')
    script = ("import os, sys, time\n"
              "os.register_at_fork(after_in_child=lambda: time.sleep(0.5))\n"
              "sys.argv = ['cli.py', *sys.argv[1:]]\n"
              "from cupygpt.__main__ import run\n"
              "run()\n")
    res = subprocess.run([sys.executable, "-c", script, "prepare", str(bad), "--workers", "2",
                          "--out", str(tmp_path / "o")], capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 1 and "not a JSON object with a string `text`" in res.stderr, \
        res.stderr


def test_overwrite_from_one_mode_to_the_other_leaves_no_shard_of_the_first(tmp_path):
    """NAME_train.bin beside an earlier NAME_train_000001.bin: a NAME_train* glob would
    mix the two corpora. Refused without --overwrite, both ways; with it, the other mode's
    shards go."""
    text = os.path.join(ROOT, "data", "tinyshakespeare.txt")
    out = tmp_path / "d"
    corpus_mode = ("prepare", text, "--out", out, "--name", "x", "--shard-size", "100000")
    one_file = ("prepare", text, "--out", out, "--name", "x")
    assert cli(*corpus_mode).returncode == 0
    shards = sorted(os.listdir(out))
    assert shards == ["x_train_000001.bin", "x_train_000002.bin", "x_train_000003.bin",
                      "x_val_000000.bin"]
    res = cli(*one_file)
    assert res.returncode == 1 and f"{out}/x_val_000000.bin exists; add --overwrite" in \
        res.stderr and sorted(os.listdir(out)) == shards
    assert cli(*one_file, "--overwrite").returncode == 0
    assert sorted(os.listdir(out)) == ["x_train.bin", "x_val.bin"]
    res = cli(*corpus_mode)
    assert res.returncode == 1 and f"{out}/x_val.bin exists" in res.stderr
    assert cli(*corpus_mode, "--overwrite").returncode == 0
    assert sorted(os.listdir(out)) == shards


@pytest.mark.parametrize("extra,said", [
    (["./a.txt"], "error: ./a.txt: the same file as a.txt, given before it; give each input "
                  "once"),
    (["--workers", "0"], "error: --workers 0: must be at least 1 (leave it out for one per "
                         "core)")])
def test_an_input_twice_or_no_workers_is_refused_in_every_mode(tmp_path, extra, said):
    """a.txt and ./a.txt tokenized the file twice into one corpus; --workers 0 passed
    unread in the one-file mode (the corpus mode refused it)."""
    (tmp_path / "a.txt").write_text("some text\n\nmore text\n")
    res = cli("prepare", "a.txt", *extra, "--out", "o", cwd=tmp_path)
    assert res.returncode == 1 and res.stderr.strip() == said, res.stderr
    assert os.listdir(tmp_path) == ["a.txt"]
