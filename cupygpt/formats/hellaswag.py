"""llm.c's HellaSwag eval file (20240522): read, checked and written, and built from
HellaSwag's published jsonl."""
import json
from collections import namedtuple

import numpy as np

from .. import CupyGPTError
from ..paths import loads, read_bounded
from .llmc import HEADER_BYTES, make_header

MAGIC, VERSION, COMPLETIONS, START = 20240522, 1, 4, 65535
EVAL_CAP = 1 << 28  # HellaSwag's val file is 3.6 MB


Example = namedtuple("Example", "index label context endings")


def read_eval(path):
    """The examples of an eval file, every field checked before anything is allocated for
    them (a damaged file is one CupyGPTError naming what is wrong and where)."""
    try:
        raw = read_bounded(path, "eval", EVAL_CAP, text=False)
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
        raise CupyGPTError(f"its longest row is {longest} tokens (context + completion), "
                           f"more than T = {seq}; raise -t", option, path)
    top = max(int(max(e.context.max(), *(x.max() for x in e.endings))) for e in examples)
    if top >= V:
        raise CupyGPTError(f"token {top} is outside the model's vocab (V={V}); was it "
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


def example_fields(line, where):
    """(ctx, endings, label) of one jsonl line, read strictly, or a refusal naming where it
    is and its field: a label 1.9 or true is no label (int() would make it 1), a string of 4
    characters no 4 endings; the datasets library's label is a digit string."""
    def refuse(why):
        return CupyGPTError(f"{where}: not a HellaSwag example ({why})")
    try:
        rec = loads(line)
        ctx, endings, label = rec["ctx"], rec["endings"], rec["label"]
    except (ValueError, KeyError, TypeError):
        raise refuse("not a JSON object with ctx, endings and label") from None
    if not (isinstance(ctx, str) and ctx):
        raise refuse("its ctx is not a non-empty string")
    if not (isinstance(endings, list) and len(endings) == COMPLETIONS
            and all(isinstance(x, str) and x for x in endings)):
        raise refuse(f"its endings are not {COMPLETIONS} non-empty strings")
    number = LABELS.get(label) if isinstance(label, str) else label
    if type(number) is not int or not 0 <= number < COMPLETIONS:
        raise refuse(f"its label {json.dumps(label)} is not a whole number 0..{COMPLETIONS - 1}")
    return ctx, endings, number


def from_jsonl(text, encode, name):
    """HellaSwag's published jsonl (ctx, 4 endings, label) as examples, tokenized as llm.c's
    script does: the context as it is, each ending with a space before it."""
    out = []
    for n, line in enumerate(text.splitlines(), 1):
        if not line.strip():
            continue
        ctx, endings, label = example_fields(line, f"{name}:{n}")
        out.append(Example(len(out), label, encode(ctx), [encode(" " + x) for x in endings]))
    if not out:
        raise CupyGPTError(f"{name}: holds no examples")
    return out
