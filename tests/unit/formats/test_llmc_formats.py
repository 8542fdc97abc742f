"""llm.c file formats: round-trips, atomic writes, the tokenizer, and loader semantics."""
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from harness import ROOT, cli, fixture
from statefile import write_state

from cupygpt import CupyGPTError
from cupygpt.formats.llmc import read_model, read_shard, read_state, write_model, write_shard
from cupygpt.formats.tokenizer import Tokenizer
from cupygpt.paths import atomic_write
from cupygpt.train.loader import DataLoader

TOK = os.path.join(ROOT, "data", "gpt2_tokenizer.bin")


def test_model_round_trip(tmp_path):
    cfg, params = read_model(fixture("tiny_model.bin"))
    write_model(tmp_path / "m.bin", cfg, params)
    assert (tmp_path / "m.bin").read_bytes() == open(fixture("tiny_model.bin"), "rb").read()
    cfg2, p2 = read_model(tmp_path / "m.bin")
    assert cfg2 == cfg and np.array_equal(p2, params)


def test_bf16_model_reads_as_fp32():
    cfg, p32 = read_model(fixture("gpt2v_model.bin"))
    cfg16, p16 = read_model(fixture("gpt2v_model_bf16.bin"))
    assert cfg16 == cfg and p16.dtype == np.float32
    assert np.array_equal(p16, p32)  # the fixture's weights are bf16-representable


def test_state_round_trip(tmp_path):
    cfg, _ = read_model(fixture("tiny_model.bin"))
    st = read_state(fixture("tiny_debug_state.bin"), cfg)
    assert (st["B"], st["T"]) == (4, 32) and st["logits"].shape == (4, 32, 300)
    write_state(tmp_path / "s.bin", st["x"], st["y"], st["logits"], st["loss"], st["grads"])
    assert (tmp_path / "s.bin").read_bytes() == open(fixture("tiny_debug_state.bin"), "rb").read()


def test_shard_round_trip_and_loader(tmp_path):
    toks = np.arange(50, dtype=np.uint16)
    write_shard(tmp_path / "a.bin", toks)
    assert np.array_equal(read_shard(tmp_path / "a.bin"), toks)
    write_shard(tmp_path / "b.bin", toks + 100)
    dl = DataLoader(str(tmp_path / "*.bin"), 2, 10, 1000)
    x, y = dl.next_batch()  # B*T+1 = 21 tokens from position 0
    assert np.array_equal(x.ravel(), np.arange(20)) and np.array_equal(y.ravel(), np.arange(1, 21))
    x, _ = dl.next_batch()  # advances by B*T
    assert x[0, 0] == 20
    x, _ = dl.next_batch()  # 40 + 21 > 50: moved on to the next shard
    assert x[0, 0] == 100
    dl.reset()
    assert dl.next_batch()[0][0, 0] == 0


def test_tokenizer_v1_and_v2(tmp_path):
    t1 = Tokenizer(TOK)
    assert t1.vocab_size == 50257 and t1.eot == 50256
    assert t1.encode("Hello world") == [15496, 995]
    text = "First Citizen:\nBefore we proceed any further, hear me speak.\n\n"
    assert t1.decode(t1.encode(text)) == text
    raw = bytearray(open(TOK, "rb").read())
    hdr = np.frombuffer(raw[:1024], np.int32).copy()
    hdr[1], hdr[3] = 2, 50256
    (tmp_path / "t2.bin").write_bytes(hdr.tobytes() + bytes(raw[1024:]))
    t2 = Tokenizer(tmp_path / "t2.bin")
    assert t2.eot == 50256 and t2.decode([15496, 995]) == "Hello world"


SPLIT_CHECK = """
import json, sys
import tiktoken
from tiktoken_ext.openai_public import r50k_pat_str
from cupygpt.formats.tokenizer import Tokenizer
tok = Tokenizer(sys.argv[1])
theirs = tiktoken.Encoding("gpt2-published-pattern", pat_str=r50k_pat_str,
                           mergeable_ranks={t: i for i, t in enumerate(tok.tokens)
                                            if i != tok.eot},
                           special_tokens={"<|endoftext|>": tok.eot})
texts = json.load(sys.stdin)
print(json.dumps([[tok.encode(x), theirs.encode_ordinary(x)] for x in texts]))
"""


def test_tokenizer_splits_as_tiktokens_published_gpt2():
    """The encoder built from the shipped file splits text with tiktoken's own GPT-2
    pattern (tiktoken_ext.openai_public, not the project's copy) on contractions, runs of
    spaces, trailing whitespace, accents, CJK, digits and newlines; and well-known GPT-2
    ids come out as published. (In a process of its own, as harness's tiktokens.)"""
    texts = ["I'm sure you'll say they've done 'it' -- don't they'd?", "a  b   c    \n\n d ",
             "naïve café résumé über façade", "日本語のテキスト 和 中文",
             "3.14159 + 2,718 = 12345678",
             "tabs\tand\r\nwindows\n\n\nnewlines   ", "  leading and trailing  ", "😀 emoji 🚀!",
             "Hello", " world", " the", ",", ".", "\n", "\n\n", "The", " and", " of", " to"]
    res = subprocess.run([sys.executable, "-c", SPLIT_CHECK, TOK], input=json.dumps(texts),
                         text=True, capture_output=True, check=True)
    got = json.loads(res.stdout)
    for text, (ours, theirs) in zip(texts, got):
        assert ours == theirs, text
    assert [ours for ours, _ in got[8:]] == \
        [[15496], [995], [262], [11], [13], [198], [628], [464], [290], [286], [284]]


def test_atomic_write_leaves_nothing_on_failure(tmp_path):
    with pytest.raises(RuntimeError):
        with atomic_write(tmp_path / "x.bin") as f:
            f.write(b"half")
            raise RuntimeError("crash mid-write")
    assert os.listdir(tmp_path) == []


def test_a_signal_just_after_the_rename_keeps_the_whole_file(tmp_path, monkeypatch):
    """A second signal's Stopped raised as the rename returns: the file is there, whole, and
    the Stopped goes on (not a FileNotFoundError from removing the renamed temporary)."""
    from cupygpt.comm.launch import Stopped
    real = os.replace

    def replace_then_stop(a, b):
        real(a, b)
        raise Stopped(143)
    monkeypatch.setattr(os, "replace", replace_then_stop)
    with pytest.raises(Stopped):
        with atomic_write(tmp_path / "x.bin") as f:
            f.write(b"whole")
    assert os.listdir(tmp_path) == ["x.bin"] and (tmp_path / "x.bin").read_bytes() == b"whole"


def test_shipped_data_is_what_prepare_makes(tmp_path):
    res = cli("prepare", os.path.join(ROOT, "data", "tinyshakespeare.txt"), "--out", tmp_path,
              "--name", "tiny_shakespeare")
    assert res.returncode == 0, res.stderr
    assert "32,768 tokens" in res.stdout and "305,260 tokens" in res.stdout
    for split in ("train", "val"):
        name = f"tiny_shakespeare_{split}.bin"
        assert (tmp_path / name).read_bytes() == open(os.path.join(ROOT, "data", name), "rb").read()
    assert os.path.getsize(tmp_path / "tiny_shakespeare_val.bin") == 66560
    assert os.path.getsize(tmp_path / "tiny_shakespeare_train.bin") == 611544


def test_bad_state_token_is_refused(tmp_path):
    cfg, _ = read_model(fixture("tiny_model.bin"))
    st = read_state(fixture("tiny_debug_state.bin"), cfg)
    st["x"][0, 0] = 300
    write_state(tmp_path / "s.bin", st["x"], st["y"], st["logits"], st["loss"], st["grads"])
    with pytest.raises(CupyGPTError, match="outside the model's vocab"):
        read_state(tmp_path / "s.bin", cfg)


def test_a_debug_state_of_non_finite_references_is_refused(tmp_path):
    """verify passed on it: max() over NaN differences drops them."""
    import os

    import numpy as np

    from cupygpt import CupyGPTError
    from cupygpt.formats.llmc import HEADER_BYTES, read_state
    from cupygpt.formats.model_spec import model_shape
    from cupygpt.paths import REFERENCE
    model, state = (os.path.join(REFERENCE, f"tiny_{n}.bin") for n in ("model", "debug_state"))
    raw = bytearray(open(state, "rb").read())
    B, T = np.frombuffer(raw[:HEADER_BYTES], np.int32)[2:4]
    at = HEADER_BYTES + 4 * 2 * B * T  # the first reference logit
    raw[at:at + 4] = np.float32(np.nan).tobytes()
    (tmp_path / "s.bin").write_bytes(raw)
    with pytest.raises(CupyGPTError, match="reference logits hold NaN or inf"):
        read_state(str(tmp_path / "s.bin"), model_shape(model))
