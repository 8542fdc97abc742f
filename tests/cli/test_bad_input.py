"""Bad input: each case ends in ONE line naming the file or flag, exit 1, no traceback; the
user's JSON (HellaSwag's jsonl, transformers' config.json) read strictly."""
import json
import os
import shutil

import numpy as np
import pytest
from harness import ROOT, cli, fixture, gpu_available, one_line, small_shard

MODEL, STATE = fixture("tiny_model.bin"), fixture("tiny_debug_state.bin")
TRAIN = os.path.join(ROOT, "data", "tiny_shakespeare_train.bin")
TEXT = os.path.join(ROOT, "data", "tinyshakespeare.txt")
DATA = os.path.join(ROOT, "cupygpt", "data")


def corrupt(tmp_path, src, name, edit):
    raw = bytearray(open(src, "rb").read())
    raw = edit(raw)
    p = tmp_path / name
    p.write_bytes(bytes(raw))
    return str(p)


def set_int(i, v):
    def edit(raw):
        raw[4 * i: 4 * i + 4] = np.int32(v).tobytes()
        return raw
    return edit


def repeat_first_token(raw):
    """GPT-2's token 1 (a byte) made token 0's: a vocabulary tiktoken panicked on."""
    raw[1024 + 3] = raw[1024 + 1]
    return raw


def short_shard(tmp_path):
    from cupygpt.formats.llmc import write_shard
    write_shard(tmp_path / "short.bin", np.arange(100))
    return str(tmp_path / "short.bin")


# (id, args builder(tmp_path) -> CLI args, text the one line must contain)
CASES = [
    ("model missing", lambda t: ["verify", "--model", t / "nope.bin", "--state", STATE],
     "nope.bin: no such model: give an llm.c model file"),
    ("model bad magic", lambda t: ["verify", "--model", corrupt(t, MODEL, "m.bin", set_int(0, 7)),
                                   "--state", STATE], "bad magic 7"),
    ("model bad version", lambda t: ["verify", "--model", corrupt(t, MODEL, "m.bin", set_int(1, 4)),
                                     "--state", STATE], "model version 4 is not supported"),
    ("model truncated", lambda t: ["verify", "--model",
                                   corrupt(t, MODEL, "m.bin", lambda r: r[:5000]),
                                   "--state", STATE], "(truncated)"),
    ("model trailing", lambda t: ["verify", "--model",
                                  corrupt(t, MODEL, "m.bin", lambda r: r + b"xxxx"),
                                  "--state", STATE], "(trailing data)"),
    ("model header only part", lambda t: ["verify", "--model",
                                          corrupt(t, MODEL, "m.bin", lambda r: r[:100]),
                                          "--state", STATE], "header alone is 1024"),
    ("model bad header", lambda t: ["verify", "--model",
                                    corrupt(t, MODEL, "m.bin", set_int(6, 0)),
                                    "--state", STATE], "header holds an invalid"),
    ("state bad magic", lambda t: ["verify", "--model", MODEL, "--state",
                                   corrupt(t, STATE, "s.bin", set_int(0, 1))], "bad magic 1"),
    ("state bad version", lambda t: ["verify", "--model", MODEL, "--state",
                                     corrupt(t, STATE, "s.bin", set_int(1, 9))],
     "debug state version 9"),
    ("state T > maxT", lambda t: ["verify", "--model", MODEL, "--state",
                                  corrupt(t, STATE, "s.bin", set_int(3, 65))],
     "exceeds the model's maxT"),
    ("state truncated", lambda t: ["verify", "--model", MODEL, "--state",
                                   corrupt(t, STATE, "s.bin", lambda r: r[:-8])],
     "truncated, or the state of another model"),
    ("state for another model", lambda t: ["verify", "--model", fixture("odd_model.bin"),
                                           "--state", STATE],
     "a debug state of this model (V=300, 641,152 parameters) at B=4, T=32"),
    ("shard missing", lambda t: ["train", "-i", t / "none_*.bin", "-n", "1"],
     "no token shard matches"),
    ("shard bad magic", lambda t: ["train", "-i", corrupt(t, TRAIN, "x.bin", set_int(0, 3)),
                                   "-n", "1"], "bad magic 3"),
    ("shard bad version", lambda t: ["train", "-i", corrupt(t, TRAIN, "x.bin", set_int(1, 2)),
                                     "-n", "1"], "token shard version 2"),
    ("shard truncated", lambda t: ["train", "-i", corrupt(t, TRAIN, "x.bin", lambda r: r[:-2]),
                                   "-n", "1"], "(truncated)"),
    ("shard too short", lambda t: ["train", "-i", short_shard(t), "-n", "1"],
     "fewer than B*T+1 = 257"),
    ("token >= V", lambda t: ["train", "-e", MODEL, "-t", "32", "-n", "1"],
     "outside the model's vocab (V=300)"),
    ("T > maxT", lambda t: ["train", "-e", MODEL, "-t", "65", "-n", "1"],
     "-t 65: longer than the model's maxT=64"),
    ("unknown preset", lambda t: ["train", "-e", "d13", "-n", "1"], "-e d13: not a model file"),
    ("zero batch", lambda t: ["train", "-b", "0", "-n", "1"], "must be positive"),
    ("zero seq", lambda t: ["train", "-t", "0", "-n", "1"], "-t 0: must be positive"),
    ("negative steps", lambda t: ["train", "-n", "-1"], "-n -1: must not be negative"),
    ("negative checkpoint", lambda t: ["train", "--checkpoint-every", "-2"],
     "--checkpoint-every -2: must not be negative"),
    ("resume missing", lambda t: ["train", "--resume", t / "nope"], "no such checkpoint"),
    ("more stages than layers", lambda t: ["train", "-e", MODEL, "--split", "1,1,1", "-n", "1"],
     "--split 1,1,1: 3 stages but 1 ranks"),
    ("plot missing log", lambda t: ["plot", t / "none.jsonl"], "cannot read the log"),
    ("prepare not utf-8", lambda t: ["prepare", MODEL, "--out", t], "not UTF-8 text"),
    *[(f"prepare shard size {n}", lambda t, n=n: ["prepare", TEXT, "--shard-size", n, "--out",
                                                  t],
       f"--shard-size {n}: must be at least 2 tokens per shard") for n in ("0", "1")],
    ("prepare missing input", lambda t: ["prepare", TEXT, t / "gone.txt", "--out", t],
     "gone.txt: no such file; give text, jsonl or parquet files"),
    ("prepare no workers", lambda t: ["prepare", TEXT, TEXT, "--workers", "0", "--out", t],
     "--workers 0: must be at least 1"),
    ("prepare jsonl without text", lambda t: ["prepare", a_jsonl(t, '{"t": 1}\n'),
                                              "--out", t / "o"],
     "r.jsonl:1: not a JSON object with a string `text`"),
    ("micro-batches", lambda t: ["train", "-b", "4", "--micro-batches", "3", "-n", "1"],
     "--micro-batches 3: must divide"),
    ("chunks without interleaved", lambda t: ["train", "--virtual-stages", "2", "-n", "1"],
     "--virtual-stages 2: 1f1b holds one chunk per rank; several need the interleaved "
     "schedule (zbv holds its own 2)"),
    ("zbv's chunks", lambda t: ["train", "--schedule", "zbv", "--virtual-stages", "3", "-n", "1"],
     "--virtual-stages 3: zbv holds 2 chunks per rank"),
    ("more chunks than layers", lambda t: ["verify", "--schedule", "interleaved",
                                           "--virtual-stages", "3"],
     "--virtual-stages 3: 3 model chunks (1 stage(s) x 3) but the model has 2 layers"),
    ("no chunks", lambda t: ["train", "--schedule", "interleaved", "--virtual-stages", "0",
                             "-n", "1"], "--virtual-stages 0: must be at least 1"),
    ("a count per chunk", lambda t: ["verify", "--schedule", "interleaved", "--virtual-stages",
                                     "2", "--split", "2"],
     "--split 2: 1 counts but 2 model chunks (1 ranks x 2); give one layer count per chunk"),
    ("interleaved groups", lambda t: ["schedule", "-p", "4", "-m", "6", "--schedule",
                                      "interleaved", "-v", "2"],
     "--micro-batches 6: interleaved needs a multiple of the 4 pipeline stages"),
    ("timeline missing", lambda t: ["timeline", t / "none.json"], "cannot read the trace"),
    ("timeline not json", lambda t: ["timeline", MODEL], "not JSON; give the file that --trace"),
    ("timeline no slices", lambda t: ["timeline", a_file(t, '{"traceEvents": []}')],
     "holds no action slices"),
    ("tokenizer vocab", lambda t: ["sample", "--model", MODEL], "model's vocab is 300"),
    ("tokenizer bad magic", lambda t: ["sample", "--model", MODEL, "--tokenizer",
                                       corrupt(t, MODEL, "tok.bin", lambda r: r)],
     "a tokenizer file has 20240328"),
    ("tokenizer truncated", lambda t: ["sample", "--model", MODEL, "--tokenizer",
                                       corrupt(t, os.path.join(ROOT, "data", "gpt2_tokenizer.bin"),
                                               "tok.bin", lambda r: r[:5000])],
     "truncated tokenizer"),
    ("prompt too long", lambda t: ["sample", "--model", fixture("gpt2v_model.bin"),
                                   "--prompt", "word " * 40], "shorten it"),
    ("negative tokens", lambda t: ["sample", "--model", fixture("gpt2v_model.bin"),
                                   "--max-new-tokens", "-1"], "must not be negative"),
    ("top-k too big", lambda t: ["sample", "--model", fixture("gpt2v_model.bin"),
                                 "--top-k", "60000"], "--top-k 60000: must be between 1 and"),
    ("out under a file", lambda t: ["train", "-n", "1", "-o", a_file(t) + "/run"],
     "/run: cannot create this directory (Not a directory)"),
    ("out in /proc", lambda t: ["train", "-n", "1", "-o", "/proc/cupygpt"],
     "-o /proc/cupygpt: cannot create this directory"),
    ("prepare out under a file", lambda t: ["prepare", TEXT, "--out", a_file(t)],
     "plain.txt: is a file, not a directory; give a directory"),
    ("plot out under a file", lambda t: ["plot", a_log(t), "--out", a_file(t) + "/l.png"],
     "plain.txt: is a file, not a directory; give a directory"),
    ("plot binary", lambda t: ["plot", MODEL], "not a text file"),
    ("plot bad json line", lambda t: ["plot", a_log(t, '{"step": 2, "train_loss": 1.0}\n{oops\n')],
     "line 3 is not JSON"),
    ("negative lr", lambda t: ["train", "-l", "-0.1", "-n", "1"], "-l -0.1: must be positive"),
    ("nan lr", lambda t: ["train", "-l", "nan", "-n", "1", "-o", t / "never"],
     "-l nan: must be a finite number"),
    ("verify negative steps", lambda t: ["verify", "--steps", "-1"],
     "--steps -1: must be positive"),
    ("prepare short text", lambda t: ["prepare", a_file(t), "--out", t],
     "nothing is left to train on"),
    ("resume empty dir", lambda t: ["train", "--resume", t], "not a checkpoint (no model.bin)"),
]

# Issue 21: what a new user tried. Outputs point at t/never: nothing may appear there.
NEVER = ["-n", "1", "-o"]
CASES += [
    ("seed negative", lambda t: ["train", "--seed", "-1", *NEVER, t / "never"],
     "--seed -1: must not be negative"),
    ("sample seed negative", lambda t: ["sample", "--model", fixture("gpt2v_model.bin"),
                                        "--seed", "-1"], "--seed -1: must not be negative"),
    ("expected not json", lambda t: ["verify", "--expected", a_file(t)],
     "plain.txt: not JSON; give a file like"),
    *[(f"expected {what}", lambda t, text=text: ["verify", "--expected", a_file(t, text)],
       'needs a non-empty "losses" list of numbers')
      for what, text in (("without losses", '{"loss": [1.0]}'), ("strings", '{"losses": ["a"]}'),
                         ("a number", "3"), ("null", '{"losses": [1.0, null]}'))],
    ("trace a directory", lambda t: ["train", "--trace", t, *NEVER, t / "never"],
     "is a directory; give a file name"),
    ("verify trace a directory", lambda t: ["verify", "--trace", t], "is a directory"),
    ("bench trace a directory", lambda t: ["bench", "--trace", t, "--out", t / "never"],
     "is a directory; give a file name"),
    ("bench out a directory", lambda t: ["bench", "--out", t], "is a directory"),
    ("plot out a directory", lambda t: ["plot", a_log(t), "--out", t], "is a directory"),
    ("timeline out a directory", lambda t: ["timeline", "x.json", "--out", t], "is a directory"),
    ("log-file a directory", lambda t: ["train", "--log-file", t, *NEVER, t / "never"],
     "is a directory; give a file name"),
    ("log-file under a file", lambda t: ["train", "--log-file", a_file(t) + "/log.jsonl",
                                         *NEVER, t / "never"],
     "plain.txt: is a file, not a directory; give a directory"),
    ("log-file read-only", lambda t: ["train", "--log-file", "/proc/log.jsonl",
                                      *NEVER, t / "never"],
     "--log-file /proc/log.jsonl: in /proc: cannot write files in this directory"),
    ("trace pipeline stages", lambda t: ["timeline", a_trace(t, {"stages": "two"}),
                                         "--out", t / "never.png"],
     'pipeline\'s stages is "two", not a positive integer'),
    ("trace pipeline zero", lambda t: ["timeline", a_trace(t, {"micro_batches": 0}),
                                       "--out", t / "never.png"],
     "micro_batches is 0, not a positive integer"),
    ("adamw wrong length", lambda t: ["train", "--resume", a_ckpt(t, m_len=10), "-e", MODEL,
                                      "-b", "4", "-t", "32", *NEVER, t / "never"],
     "adamw.npz: damaged checkpoint file (AdamW's m and v are not float32 arrays of the "
     "model's 128,768 parameters)"),
    ("adamw loader out of range", lambda t: ["train", "--resume", a_ckpt(t, loader=[5, 0]),
                                             "-b", "4", "-t", "32", *NEVER, t / "never"],
     "adamw.npz: its data position (shard 5, token 0) lies outside this run's train shards"),
    ("adamw loader past the end", lambda t: ["train", "--resume", a_ckpt(t, loader=[0, 10**9]),
                                             "-b", "4", "-t", "32", *NEVER, t / "never"],
     "(shard 0, token 1,000,000,000) lies outside"),
    ("adamw step true", lambda t: ["train", "--resume", a_ckpt(t, step=True), "-b", "4", "-t",
                                   "32", *NEVER, t / "never"],
     "adamw.npz: damaged checkpoint file (its step or data position is not a count)"),
    *[(f"adamw m, v {mv}", lambda t, mv=mv: [
        "train", "--resume", a_ckpt(t, mv=mv), "-b", "4", "-t", "32", "-i",
        small_shard(t / "s.bin"), "-j", "", *NEVER, t / "never"],
       "adamw.npz: damaged checkpoint file (AdamW's m or v holds values no run writes")
      for mv in ((np.nan, 0.0), (0.0, -1.0), (0.0, np.inf))],
    ("adamw rng", lambda t: ["train", "--resume", a_ckpt(t, rng=7), "-b", "4", "-t", "32",
                             *NEVER, t / "never"], "its step, RNG or data position is missing"),
    ("resume another shape", lambda t: ["train", "--resume", a_ckpt(t), "-e", "tiny", "-b", "4",
                                        "-t", "32", *NEVER, t / "never"],
     "-e tiny: a resumed run continues its checkpoint's own model"),
    ("final lr negative", lambda t: ["train", "-q", "-3", *NEVER, t / "never"],
     "-q -3.0: must be between 0 and 1"),
    ("final lr nan", lambda t: ["train", "-q", "nan", *NEVER, t / "never"],
     "-q nan: must be between 0 and 1"),
    ("no val batches", lambda t: ["train", "-m", "0", *NEVER, t / "never"],
     "-m 0: validation needs at least one batch; give -v 0"),
    ("backward cost nan", lambda t: ["schedule", "--backward-cost", "nan"],
     "--backward-cost nan: must be a positive number"),
    ("backward cost negative", lambda t: ["schedule", "--backward-cost", "-1"],
     "--backward-cost -1.0: must be a positive number"),
    ("lr inf", lambda t: ["train", "-l", "inf", *NEVER, t / "never"],
     "-l inf: must be a finite number"),
    *[(f"temperature {v}", lambda t, v=v: ["sample", "--model", fixture("gpt2v_model.bin"),
                                           "--temperature", v],
       f"--temperature {v}: must be a finite number") for v in ("nan", "inf")],
    ("transport on one rank", lambda t: ["train", "--transport", "nvshmem", *NEVER, t / "never"],
     "--transport nvshmem: carries arrays between ranks, and this is one process"),
    ("tokenizer missing", lambda t: ["train", "--tokenizer", t / "nope.bin", *NEVER,
                                     t / "never"], "nope.bin: no such file"),
    ("prepare an input that is a link loop", lambda t: (
        os.symlink(t / "b", t / "a"), os.symlink(t / "a", t / "b"),
        ["prepare", t / "a", "--out", t / "never"])[2],
     "a: cannot read it (Too many levels of symbolic links)"),
    ("prepare empty name", lambda t: ["prepare", TEXT, "--name", "", "--out", t / "never"],
     "--name '': must be a plain file-name prefix"),
    ("prepare name with a directory", lambda t: ["prepare", TEXT, "--name", "../x",
                                                 "--out", t / "never"],
     "--name '../x': must be a plain file-name prefix"),
    ("prepare over the shipped data", lambda t: ["prepare", TEXT, "--out", DATA, "--name",
                                                 "tiny_shakespeare", "--force"],
     "lies in the installed package"),
    ("plot a string", lambda t: ["plot", a_log(t, '{"step": 2, "train_loss": "1.5"}\n'),
                                 "--out", t / "never.png"],
     "line 2's train_loss is \"1.5\", not a number"),
    ("log-file empty", lambda t: ["train", "--log-file", "", *NEVER, t / "never"],
     "--log-file '': is empty; give a file name"),
    ("expected empty", lambda t: ["verify", "--expected", ""],
     "--expected '': is empty; give a file name"),
    ("bench a model file", lambda t: ["bench", "-e", MODEL, "--out", t / "never.json"],
     "bench times a preset's shape (tiny, d6, d12, d24, d36, d48, d60, d72, d84, gpt3:c384"),
    ("plot a null", lambda t: ["plot", a_log(t, '{"step": 2, "val_loss": null}\n'),
                               "--out", t / "never.png"], "line 2's val_loss is null"),
]

# Issue 30: results and files that are not what they claim.
TOK = os.path.join(DATA, "gpt2_tokenizer.bin")
CASES += [
    *[(f"tokenizer eot {eot}", lambda t, eot=eot: [
        "sample", "--model", fixture("gpt2v_model.bin"), "--tokenizer",
        corrupt(t, TOK, "tok.bin", lambda r: set_int(3, eot)(set_int(1, 2)(r)))],
       f"its end-of-text id {eot} is outside its 50257 tokens") for eot in (10 ** 9, -1)],
    *[(f"tokenizer not a byte-level BPE: {cmd[0]}", lambda t, cmd=cmd: [
        *cmd, "--tokenizer", corrupt(t, TOK, "tok.bin", repeat_first_token)],
       "tok.bin: not a byte-level BPE vocabulary as GPT-2's (1 of its tokens repeat others)")
      for cmd in (["sample", "--model", fixture("gpt2v_model.bin"), "--prompt", "Hi"],
                  ["prepare", TEXT, "--out", "never"],
                  ["convert", fixture("gpt2v_model.bin"), "never"])],
    ("backward cost overflows", lambda t: ["schedule", "--backward-cost", "1e308"],
     "--backward-cost 1e+308: the simulated times overflow (not finite)"),
    *[(f"trace dur {dur}", lambda t, dur=dur: ["timeline", a_trace(t, {}, dur=dur), "--out",
                                               t / "never.png"],
       "slice 0 has ts 0 and dur") for dur in (float("nan"), -5, float("inf"))],
    *[(f"trace {what}", lambda t, kw=kw: ["timeline", a_trace(t, **kw), "--out",
                                           t / "never.png"], said)
      for what, kw, said in (
          ("a slice twice", dict(pipeline={}, slices=((0, 0, 0), (0, 0, 9))),
           "rank 0's F0 (chunk 0) is in its last step twice"),
          ("no time", dict(pipeline={}, dur=0), "every slice of its last step lasts 0"),
          ("a micro-batch past the pipeline's", dict(pipeline={"micro_batches": 1}, slices=(
              (0, 0, 0), (1, 0, 9))), "a slice is of micro-batch 1, and its pipeline has "
                                      "micro_batches 1"),
          ("a stage without slices", dict(pipeline={"stages": 3}, slices=(
              (0, 0, 0), (0, 1, 9))), "its pipeline has 3 stages, and slices come from 2"))],
    ("timeline another schedule", lambda t: [
        "timeline", a_trace(t, {"schedule": "1f1b", "stages": 1, "micro_batches": 1}),
        "--schedule", "zbv", "--out", t / "never.png"],
     "--schedule zbv: the trace was recorded with 1f1b"),
]


def an_eval(tmp_path, edit=lambda raw: raw, name="hs.bin"):
    """A 2-example HellaSwag eval file (llm.c's layout), edited."""
    from test_hellaswag import write_llmc_eval
    write_llmc_eval(tmp_path / "ok.bin", [(1, [5, 6, 7], [[8], [9, 10], [11], [12]]),
                                          (3, [1] * 20, [[2], [3], [4], [5]])])
    return corrupt(tmp_path, tmp_path / "ok.bin", name, edit)


def eval_args(t, *extra, edit=lambda raw: raw):
    return ["eval", MODEL, "--hellaswag", an_eval(t, edit), "--backend", "numpy", *extra]


# Issue 29: HellaSwag's eval file and flags.
CASES += [
    ("eval truncated", lambda t: eval_args(t, edit=lambda r: r[:1024 + 30]),
     "hs.bin: ends inside example 0"),
    ("eval bad magic", lambda t: eval_args(t, edit=set_int(0, 20240520)),
     "hs.bin: bad magic 20240520 (an eval file has 20240522)"),
    ("eval bad label", lambda t: eval_args(t, edit=lambda r: r[:1030] + b"\x07\x00" + r[1032:]),
     "example 0 (uint16 0 after the header): label 7, 4 completions"),
    ("eval trailing", lambda t: eval_args(t, edit=lambda r: r + b"\x01\x00"),
     "1 uint16 after the last of its 2 examples"),
    ("eval empty field", lambda t: eval_args(t, edit=lambda r: r[:1034] + b"\x00\x00" + r[1036:]),
     "a field of 0 tokens"),
    ("eval longest field", lambda t: eval_args(t, edit=set_int(3, 36)),
     "header says the longest example is 36 bytes, it is 68"),
    ("eval row past T", lambda t: eval_args(t, "-t", "16"),
     "its longest row is 21 tokens (context + completion), more than T = 16; raise -t"),
    ("eval batch under 4", lambda t: eval_args(t, "-b", "2"), "-b 2: HellaSwag puts"),
    ("eval -t 0", lambda t: eval_args(t, "-t", "0"), "-t 0: must be positive"),
    ("eval no file", lambda t: ["eval", MODEL, "--hellaswag", t / "nope.bin"],
     "nope.bin: no such file"),
    ("prepare hellaswag 1 ending", lambda t: [
        "prepare", a_file(t, '{"ctx": "A", "endings": ["b", "c", "d", "e"], "label": 1}\n'
                             '{"ctx": "A", "endings": ["b"], "label": 0}\n'), "--hellaswag",
        "--out", t / "never"], "plain.txt:2: not a HellaSwag example (its endings are not 4 "
                               "non-empty strings)"),
    ("train -h 2", lambda t: ["train", "-h", "2", "-o", t / "never"], "-h 2: 0 (off) or 1"),
    ("train -sl negative", lambda t: ["train", "-sl", "-1", "-o", t / "never"],
     "-sl -1.0: must not be negative"),
    ("train -sg nan", lambda t: ["train", "-sg", "nan", "-o", t / "never"],
     "-sg nan: must be a finite number"),
    ("train -nm negative", lambda t: ["train", "-nm", "-2", "-o", t / "never"],
     "-nm -2: must not be negative"),
    ("train -a 2", lambda t: ["train", "-a", "2", "-o", t / "never"], "-a 2: 0 (off) or 1"),
    *[(f"{cmd} {flag} ending in /", lambda t, cmd=cmd, flag=flag: [
        cmd, flag, f"{t / 'never'}/"], "never/: ends in /, naming a directory; give a file name")
      for cmd, flag in (("bench", "--out"), ("verify", "--trace"), ("train", "--trace"))],
    ("plot --out ending in /", lambda t: ["plot", a_log(t), "--out", f"{t / 'never'}/"],
     "never/: ends in /, naming a directory; give a file name"),
    ("train weight decay past 1/lr", lambda t: ["train", "--weight-decay", "1e308", "-o",
                                                t / "never"],
     "--weight-decay 1e+308: with -l 0.001 each update scales the weights by 1 - 1e+305, "
     "erasing them; give a weight decay below 1 / lr = 1000"),
    ("train -e a FIFO", lambda t: (os.mkfifo(t / "m.fifo"), ["train", "-e", t / "m.fifo", "-o",
                                                             t / "never"])[1],
     "m.fifo: is a FIFO, not a regular file; give a model file"),
    *[(f"train -e {d}", lambda t, d=d: ["train", "-e", d, "-o", t / "never"],
       f"-e {d}: not a model file and not one of llm.c's descriptors: tiny, d6, d12, d24, d36, "
       f"d48, d60, d72, d84, gpt3:c384, gpt3:c768") for d in ("d13", "gpt3:c5140", "gpt3:768")],
    ("train -h 1 no file", lambda t: ["train", "-h", "1", "--hellaswag-file", t / "nope.bin",
                                      "-o", t / "never"],
     "nope.bin: no such file; `cupygpt prepare hellaswag_val.jsonl --hellaswag` (HellaSwag's "
     "published jsonl) makes it"),
    ("train --peer-timeout 1e10", lambda t: ["train", "-n", "1", "--peer-timeout", "1e10",
                                             "-o", t / "never"],
     "--peer-timeout 10000000000.0: is more than a year; the most it takes is 31536000 seconds"),
    *[(f"schedule {pm}", lambda t, pm=pm: ["schedule", *pm.split()],
       f"error: {pm}: at most 512 stages and 65,536 stages x micro-batches (the simulator runs "
       f"in Python") for pm in ("-p 513 -m 1", "-p 8 -m 8193")],
    # GPU-only switches asked of the numpy backend: refused as --attention cudnn there is
    ("train --tf32 on numpy", lambda t: ["train", "--tf32", "-n", "1", "-b", "2", "-t", "32",
                                         "-o", t / "never"],
     "error: --tf32: the numpy backend has no TF32 (a GPU's matmul mode): it runs with "
     "--backend cuda"),
    ("train --graphs on numpy", lambda t: ["train", "--graphs", "-n", "1", "-b", "2", "-t",
                                           "32", "-o", t / "never"],
     "error: --graphs: the numpy backend has no CUDA graphs (a GPU's): it runs with "
     "--backend cuda"),
    ("bench --graphs on numpy", lambda t: ["bench", "--backend", "numpy", "--graphs", "-e",
                                           "tiny", "-b", "2", "-t", "32", "--steps", "1",
                                           "--warmup", "0", "--out", t / "never.json"],
     "error: --graphs: the numpy backend has no CUDA graphs"),
    ("resume a .partial", lambda t: ["train", "--resume", a_partial(t), "-b", "4", "-t", "32",
                                     "-n", "2", "-o", t / "never"],
     "ckpt_00000001.partial: a checkpoint never finished (a run stopped while writing it); "
     "give a complete ckpt_STEP directory or the run's -o directory"),
    ("resume a checkpoint's model.bin", lambda t: [
        "train", "--resume", os.path.join(a_ckpt(t), "model.bin"), "-b", "4", "-t", "32",
        "-n", "2", "-o", t / "never"],
     "model.bin: is a file; give the checkpoint directory it is in ("),
    ("model header C 1e9", lambda t: ["verify", "--model", corrupt(t, MODEL, "m.bin",
                                                                  set_int(6, 10**9)),
                                      "--state", STATE],
     "m.bin: bad model header: C (int 6) is 1000000000, more than any GPT-2 has (at most "
     "65536)"),
    ("shard count negative", lambda t: ["train", "-i", corrupt(
        t, os.path.join(DATA, "tiny_shakespeare_val.bin"), "s.bin", set_int(2, -5)), "-n", "1",
        "-o", t / "never"],
     "s.bin: bad token shard header: token count (int 2) is -5; it cannot be negative"),
    ("prepare empty corpus in shards", lambda t: [
        "prepare", a_file(t, ""), a_file(t, "", "b.txt"), "--shard-size", "100", "--out",
        t / "never"],
     "plain.txt ...: no text in the input(s) (empty documents only); nothing written"),
]


def a_partial(tmp_path):
    """A whole checkpoint, but named as one never renamed (ckpt_STEP.partial)."""
    done = a_ckpt(tmp_path)
    os.rename(done, done + ".partial")
    return done + ".partial"


def a_file(tmp_path, text="a short text\n\nin two sections\n", name="plain.txt"):
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def a_jsonl(tmp_path, text):
    p = tmp_path / "r.jsonl"
    p.write_text(text)
    return str(p)


def a_trace(tmp_path, pipeline, dur=5, slices=((0, 0, 0),)):
    """A --trace file of forward slices (micro-batch, rank, start) and the given "pipeline"
    object."""
    p = tmp_path / "trace.json"
    p.write_text(json.dumps({"traceEvents": [
        {"name": f"F{mb}", "cat": "fwd", "ph": "X", "pid": 0, "tid": rank, "ts": ts,
         "dur": dur, "args": {"micro_batch": mb, "chunk": 0}} for mb, rank, ts in slices],
        "pipeline": pipeline}))
    return str(p)


def a_ckpt(tmp_path, m_len=None, loader=(0, 0), rng=None, step=1, mv=(0.0, 0.0)):
    """A checkpoint of the tiny reference model at B=4, T=32, step 1, made by hand."""
    from cupygpt.formats.llmc import read_model_header
    shape = read_model_header(MODEL)[0]
    d = tmp_path / "ckpt_00000001"
    d.mkdir()
    shutil.copy(MODEL, d / "model.bin")
    n = m_len or shape.num_parameters()
    meta = {"config": shape.__dict__, "B": 4, "T": 32, "step": step, "adam_t": 1,
            "grid": [1, 1, 1],
            "train_loader": list(loader),
            "rng": rng or np.random.default_rng(0).bit_generator.state}
    np.savez(d / "adamw.npz", m=np.full(n, mv[0], np.float32), v=np.full(n, mv[1], np.float32),
             meta=np.array(json.dumps(meta)))
    return str(d)


def a_log(tmp_path, tail=""):
    p = tmp_path / "log.jsonl"
    p.write_text('{"step": 1, "train_loss": 2.0}\n' + tail)
    return str(p)


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_bad_input_is_one_line(tmp_path, case):
    _, args, expect = case
    argv = args(tmp_path)
    res = cli(*argv, *(["--backend", "numpy"] if argv[0] in ("train", "verify", "sample") else []))
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert res.returncode == 1, (res.stdout, res.stderr)
    assert "Traceback" not in res.stderr
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    assert expect in lines[0], lines[0]
    assert not [p for p in os.listdir(tmp_path) if p.startswith("never")]  # nothing written


def test_interleaved_micro_batches_refused_before_the_run():
    """Under mpiexec: the config refuses them before any peer is touched."""
    from cupygpt import CupyGPTError
    from cupygpt.config.sections import Pipeline
    from cupygpt.formats.model_spec import model_shape
    with pytest.raises(CupyGPTError, match="multiple of the 2 pipeline stages") as e:
        Pipeline(3, "interleaved").validate(model_shape(fixture("odd_model.bin")), 8, 2, 3)
    assert e.value.option == "micro_batches"


@pytest.mark.skipif(gpu_available(), reason="a GPU is present here")
def test_backend_cuda_without_gpu():
    res = cli("train", "--backend", "cuda", "-n", "1")
    assert res.returncode == 1 and res.stderr.startswith("error: --backend cuda: no GPU")


def test_a_peer_timeout_past_what_select_takes_is_one_line_under_mpiexec(tmp_path):
    """Each rank's start-up watchdog waited with select, which overflows near 9.2e9 s: a
    traceback per rank; now the timeout is bounded (a year) and refused once, in one line."""
    res = cli("train", "-e", "tiny", "-n", "1", "-v", "0", "-s", "0", "-g", "0", "-b", "2",
              "-t", "32", "--peer-timeout", "1e300", "-o", tmp_path / "never", ranks=2)
    assert res.returncode != 0 and "Traceback" not in res.stderr, res.stderr
    assert "error: --peer-timeout 1e+300: is more than a year; the most it takes is 31536000 " \
        "seconds" in res.stderr, res.stderr
    assert not os.path.exists(tmp_path / "never")


def test_an_eval_file_past_the_models_context_is_named_once(tmp_path):
    """The line named the --hellaswag file twice ("--hellaswag X: X: its longest ...")."""
    from test_hellaswag import write_llmc_eval
    write_llmc_eval(tmp_path / "long.bin", [(0, [1] * 70, [[2], [3], [4], [5]])])
    res = cli("eval", MODEL, "--hellaswag", tmp_path / "long.bin", "--backend", "numpy")
    assert res.returncode == 1 and res.stderr.count("\n") == 1, res.stderr
    assert res.stderr.startswith(f"error: --hellaswag {tmp_path / 'long.bin'}: its longest "
                                 f"example is 71 tokens"), res.stderr
    assert res.stderr.count("long.bin") == 1, res.stderr


def test_an_eval_row_past_t_names_the_file_once(tmp_path):
    """("--hellaswag X: X: its longest row ...")"""
    res = cli(*eval_args(tmp_path, "-t", "16"))
    path = tmp_path / "hs.bin"
    assert res.returncode == 1 and res.stderr.strip() == (
        f"error: --hellaswag {path}: its longest row is 21 tokens (context + completion), "
        f"more than T = 16; raise -t"), res.stderr


def test_a_prompt_too_long_is_refused_before_it_is_echoed(tmp_path):
    """sample printed the whole prompt to stdout, then refused it (shorten it)."""
    res = cli("sample", "--model", fixture("gpt2v_model.bin"), "--backend", "numpy",
              "--prompt", "word " * 40)
    assert res.returncode == 1 and "shorten it" in res.stderr, res.stderr
    assert res.stdout == "", res.stdout


@pytest.mark.parametrize("label", ['1.9', 'true', '"x"', '1.0'])
def test_hellaswag_jsonl_is_read_strictly(tmp_path, label):
    """(the field named: a label 1.0 was "not a HellaSwag example" of every field at once)"""
    from harness import cli
    line = '{"ctx": "A man", "endings": ["a", "b", "c", "d"], "label": ' + label + '}\n'
    (tmp_path / "h.jsonl").write_text(line)
    one_line(cli("prepare", "--hellaswag", tmp_path / "h.jsonl", "--out", tmp_path / "o"),
             f"h.jsonl:1: not a HellaSwag example (its label {label} is not a whole number "
             f"0..3)")
    assert os.listdir(tmp_path) == ["h.jsonl"]


def test_prepare_hellaswag_refuses_a_shard_size_it_would_not_use(tmp_path):
    from harness import cli
    line = '{"ctx": "A man", "endings": ["a", "b", "c", "d"], "label": 1}\n'
    (tmp_path / "h.jsonl").write_text(line)
    one_line(cli("prepare", "--hellaswag", tmp_path / "h.jsonl", "--out", tmp_path / "o",
                 "--shard-size", "100"),
             "--shard-size 100: is for token shards; prepare --hellaswag writes one eval file: "
             "leave it out")
    assert os.listdir(tmp_path) == ["h.jsonl"]


def test_transformers_config_is_read_strictly(tmp_path):
    from harness import cli, fixture
    assert cli("convert", fixture("tiny_model.bin"), tmp_path / "hf").returncode == 0
    cfg = tmp_path / "hf" / "config.json"
    good = json.loads(cfg.read_text())
    vp = "cupygpt_padded_vocab_size"
    for bad, expect in (([1], "not a JSON object"), ({**good, "n_layer": 2.0},
                                                      "n_layer 2.0 is not a whole number"),
                        ({**good, vp: 10 ** 12}, f"{vp} 1000000000000 is not vocab_size 300 "
                                                 f"padded"), ({**good, vp: 299}, f"{vp} 299")):
        cfg.write_text(json.dumps(bad))
        one_line(cli("convert", tmp_path / "hf", tmp_path / "m.bin"), expect)
    assert not (tmp_path / "m.bin").exists()


def test_convert_into_an_existing_directory_says_overwrite_is_for_a_file(tmp_path):
    """(--overwrite given, the refusal said nothing of it)"""
    from harness import cli, fixture
    assert cli("convert", fixture("tiny_model.bin"), tmp_path / "hf").returncode == 0
    before = sorted(os.listdir(tmp_path / "hf"))
    one_line(cli("convert", fixture("tiny_model.bin"), tmp_path / "hf", "--overwrite"),
             f"{tmp_path / 'hf'}: already exists; convert writes a new directory (never into "
             f"one: --overwrite replaces only an llm.c file): remove it or name another")
    assert sorted(os.listdir(tmp_path / "hf")) == before
