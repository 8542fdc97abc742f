"""HellaSwag in llm.c's eval file format (magic 20240522) and its scoring.

The file: a header of 256 int32 (magic, version 1, examples, longest example's bytes), then
per example a uint16 stream: 65535, the example's bytes, its index, its label, the number
of completions (4), the context's length and tokens, then each completion's length and
tokens. Scoring as llm.c's: each completion is a row, context then completion; its loss is
the mean cross-entropy over the completion's tokens; the lowest loss (the first on a tie)
is the model's choice. A batch holds B // 4 examples, 4 rows each.
"""
import json
import time
from collections import namedtuple

import numpy as np

from . import CupyGPTError
from .files import HEADER_BYTES, check_finite, make_header, read_model
from .paths import read_bounded
from .precision import DTYPES

MAGIC, VERSION, COMPLETIONS, START = 20240522, 1, 4, 65535
EVAL_CAP = 1 << 28  # HellaSwag's val file is 3.6 MB

Example = namedtuple("Example", "index label context endings")


def read_eval(path):
    """The examples of an eval file, every field checked before anything is allocated for
    them (a damaged file is one CupyGPTError naming what is wrong and where)."""
    try:
        raw = read_bounded(path, "eval", EVAL_CAP)
    except OSError as e:
        raise CupyGPTError(f"{path}: cannot read the eval file ({e.strerror})") from None

    def bad(what):
        return CupyGPTError(f"{path}: {what}; not an llm.c eval file, or damaged: make it "
                            f"again with `cupygpt prepare --hellaswag`")
    if len(raw) < HEADER_BYTES or (len(raw) - HEADER_BYTES) % 2:
        raise bad(f"{len(raw)} bytes: not a 1024-byte header and uint16 examples")
    header = np.frombuffer(raw[:HEADER_BYTES], np.int32)
    if header[0] != MAGIC:
        raise bad(f"bad magic {header[0]} (an eval file has {MAGIC})")
    if header[1] != VERSION:
        raise bad(f"version {header[1]} (cupygpt reads {VERSION})")
    n = int(header[2])
    if n < 1:
        raise bad(f"header says {n} examples")
    s = np.frombuffer(raw[HEADER_BYTES:], np.uint16)
    out, p, longest = [], 0, 0
    for i in range(n):
        where = f"example {i} (uint16 {p} after the header)"
        if p + 6 > len(s):
            raise bad(f"ends inside {where}: the header says {n} examples")
        delim, nbytes, index, label, k = (int(v) for v in s[p:p + 5])
        if delim != START or index != i or nbytes % 2:
            raise bad(f"{where}: expected the delimiter {START}, an even byte count and "
                      f"index {i}, found {delim}, {nbytes}, {index}")
        end, q = p + nbytes // 2, p + 5
        if end > len(s):
            raise bad(f"ends inside {where}: its {nbytes} bytes go past the file's end")
        if label >= COMPLETIONS or k != COMPLETIONS:
            raise bad(f"{where}: label {label}, {k} completions (llm.c's have "
                      f"{COMPLETIONS}, and a label below that)")
        fields = []
        for _ in range(1 + k):  # the context, then each completion: a length, its tokens
            m = int(s[q]) if q < end else 0
            if m < 1 or q + 1 + m > end:
                raise bad(f"{where}: a field of {m} tokens at uint16 {q} does not fit its "
                          f"{nbytes} bytes (each field holds at least one token)")
            fields.append(s[q + 1:q + 1 + m].astype(np.int32))
            q += 1 + m
        if q != end:
            raise bad(f"{where}: its fields end at uint16 {q}, its byte count says {end}")
        out.append(Example(i, label, fields[0], fields[1:]))
        p, longest = end, max(longest, nbytes)
    if p != len(s):
        raise bad(f"{len(s) - p} uint16 after the last of its {n} examples")
    if header[3] != longest:  # (llm.c sizes its read buffer by it)
        raise bad(f"header says the longest example is {header[3]} bytes, it is {longest}")
    return out


def longest_row(examples):
    """The most tokens a row takes: context + completion."""
    return max(len(e.context) + max(map(len, e.endings)) for e in examples)


def check_fits(path, examples, seq, V, option="hellaswag"):
    """Each row (context + completion) must fit T and its tokens the model's vocab."""
    longest = longest_row(examples)
    if longest > seq:
        raise CupyGPTError(f"{path}: its longest row is {longest} tokens (context + "
                           f"completion), more than T = {seq}; raise -t", option, path)
    top = max(int(max(e.context.max(), *(x.max() for x in e.endings))) for e in examples)
    if top >= V:
        raise CupyGPTError(f"{path}: token {top} is outside the model's vocab (V={V}); was it "
                           f"tokenized for this model?", option, path)


def write_eval(f, examples):
    """examples (Example with lists of token ids) to an open binary file, llm.c's layout."""
    streams = []
    for i, e in enumerate(examples):
        body = [i, e.label, len(e.endings), len(e.context), *e.context]
        for end in e.endings:
            body += [len(end), *end]
        streams.append([START, 2 * (len(body) + 2), *body])
    longest = max(2 * len(st) for st in streams)
    if len(examples) >= START or longest >= 1 << 16:
        raise CupyGPTError(f"{len(examples)} examples, the longest {longest} bytes: llm.c's "
                           f"uint16 fields hold fewer than 65535 of each")
    f.write(make_header(MAGIC, VERSION, len(examples), longest).tobytes())
    f.write(np.array([t for st in streams for t in st], np.uint16).tobytes())


LABELS = {str(i): i for i in range(COMPLETIONS)}


def from_jsonl(text, encode, name):
    """HellaSwag's published jsonl (ctx, 4 endings, label) as examples, tokenized as llm.c's
    script does: the context as it is, each ending with a space before it."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        try:
            rec = json.loads(line)
            ctx, endings, label = rec["ctx"], rec["endings"], rec["label"]
            # strictly: a label 1.9 or true is no label (int() would make it 1), a string
            # of 4 characters no 4 endings; the datasets library's label is a digit string
            label = LABELS.get(label) if isinstance(label, str) else label
            ok = isinstance(ctx, str) and isinstance(endings, list) and \
                len(endings) == COMPLETIONS and all(isinstance(x, str) and x for x in endings) \
                and type(label) is int and 0 <= label < COMPLETIONS
        except (ValueError, KeyError, TypeError):
            ok = False
        if not ok or not ctx:
            raise CupyGPTError(f"{name}:{n}: not a HellaSwag example (a JSON object with a "
                               f"non-empty ctx, {COMPLETIONS} non-empty endings, a label "
                               f"0..{COMPLETIONS - 1})")
        out.append(Example(len(out), label, encode(ctx), [encode(" " + x) for x in endings]))
    if not out:
        raise CupyGPTError(f"{name}: holds no examples")
    return out


def batch(examples, B, T):
    """(x, y, mask) int32 (B, T), bool (B, T) of up to B // 4 examples: row 4 i + c is
    example i's context and completion c; the mask marks the positions whose target is a
    completion token (from the context's last token on). Unused rows are zeros."""
    x, y, mask = (np.zeros((B, T), np.int32) for _ in range(3))
    for i, e in enumerate(examples):
        for c, end in enumerate(e.endings):
            row, r, k = np.concatenate([e.context, end]), 4 * i + c, len(e.context)
            x[r, :len(row)], y[r, :len(row) - 1] = row, row[1:]
            mask[r, k - 1:len(row) - 1] = 1
    return x, y, mask.astype(bool)


def completion_losses(losses, mask, n):
    """(n, 4): each of n examples' completions' mean loss over its masked positions."""
    rows = (losses * mask).sum(1) / np.maximum(mask.sum(1), 1)
    return rows[:4 * n].reshape(n, COMPLETIONS)


def evaluate(run, examples, B, T, stop=None):
    """Collective: (accuracy, (n, 4) completion losses) of the examples through the runner's
    forward (run.position_losses, on every rank alike), B // 4 examples a batch; None when
    stop() (collective, asked before each batch) says to stop."""
    per = B // COMPLETIONS
    scores = []
    for i in range(0, len(examples), per):
        if stop and stop():
            return None
        part = examples[i:i + per]
        x, y, mask = batch(part, B, T)
        scores.append(completion_losses(run.position_losses(x, y), mask, len(part)))
    scores = np.concatenate(scores)
    labels = np.array([e.label for e in examples])
    return float(np.mean(scores.argmin(1) == labels)), scores


def eval_command(sess):
    """The `eval` command over a Session holding its validated EvalConfig: the report
    (accuracy, each example's completion losses), the same on every rank."""
    c = sess.config
    shape, params = read_model(c.model, mmap=True)
    check_finite(c.model, params)
    run = sess.runner(shape, params, batch=c.batch, seq=c.seq, dtype=DTYPES[c.dtype])
    t0 = time.perf_counter()
    acc, losses = evaluate(run, c.examples, c.batch, c.seq)
    return {"model": c.model, "hellaswag": c.hellaswag, "examples": len(c.examples),
            "correct": int(round(acc * len(c.examples))), "accuracy": acc,
            "B": c.batch, "T": c.seq, "dtype": c.dtype, "ranks": sess.mesh.size,
            "seconds": time.perf_counter() - t0, "losses": losses.tolist()}
