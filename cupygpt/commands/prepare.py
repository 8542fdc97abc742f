"""prepare's work: one text file split as llm.c's tinyshakespeare script does, HellaSwag's
jsonl to llm.c's eval file, or the corpus mode (llm.c's FineWeb script): documents (a text
file each; jsonl and parquet: each record's `text`) tokenized on every core, an EOT before
each, cut into shards of a fixed token count, the first the val shard (NAME_val_000000.bin,
NAME_train_000001.bin, ...), each written whole (atomically): none is left half-written."""
import collections
import glob
import multiprocessing
import os
import signal
import time
from dataclasses import replace

import numpy as np

from .. import CupyGPTError
from ..backends import host_memory
from ..comm.launch import STOPPING, Stopped
from ..formats.hellaswag import from_jsonl, write_eval
from ..formats.llmc import write_shard
from ..formats.tokenizer import Tokenizer, tokenize_tinyshakespeare
from ..paths import (
    TEXT_CAP,
    atomic_write,
    check_outputs,
    claim,
    make_dir,
    not_compressed,
    read_bounded,
)
from .corpus import check_inputs, tasks

SHARD_SIZE = 10 ** 8   # the corpus mode's tokens per shard, llm.c's FineWeb script's


def shard_path(out, name, index):
    return os.path.join(out, f"{name}_{'val' if index == 0 else 'train'}_{index:06d}.bin")


_tok = None

# A worker starts with these blocked (write_shards): until _start it has the parent's handlers,
# and the pool's SIGTERM raised inside the fork's bookkeeping (a worker never ending, joined).
WORKER_BLOCKED = set(STOPPING)


def _start(tokenizer):
    global _tok
    # the parent stops the pool (terminate: SIGTERM) on a signal; a worker neither
    # handles Ctrl-C, a hangup or the others nor unwinds: it ends quietly
    for s in STOPPING:
        signal.signal(s, signal.SIG_DFL if s == signal.SIGTERM else signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, WORKER_BLOCKED)
    _tok = Tokenizer(tokenizer)


def _encode(task):
    """A task's documents as one uint16 array, EOT before each."""
    docs, done = task
    out = []
    for text in docs:
        out.append(_tok.eot)
        out.extend(_tok.encode(text))
    return np.array(out, dtype=np.uint16), done


def write_shards(inputs, out, name, shard_size, tokenizer, progress, processes):
    """Tokenizes the inputs in order on `processes` workers and writes
    shards of shard_size tokens; progress(n) gets the input bytes done. Returns the paths
    written, the token count and the documents' (each an EOT and its text's tokens)."""
    buf, fill, written, total, docs = np.empty(shard_size, np.uint16), 0, [], 0, [0]

    def flush(n):
        path = shard_path(out, name, len(written))
        write_shard(path, buf[:n])
        written.append(path)

    def results(pool, ahead):
        """The tasks' results in order, at most `ahead` in flight (the corpus is read as
        the workers keep up, never all at once)."""
        pending = collections.deque()
        for task in tasks(inputs):
            docs[0] += len(task[0])
            pending.append(pool.apply_async(_encode, (task,)))
            if len(pending) >= ahead:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()

    held = signal.pthread_sigmask(signal.SIG_BLOCK, WORKER_BLOCKED)  # (the parent's wait)
    try:
        pool = multiprocessing.get_context("fork").Pool(processes, _start, (tokenizer,))
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, held)
    with pool:
        for toks, done in results(pool, 2 * processes):
            total += toks.size
            while toks.size:  # a document longer than the shard's room goes on in the next
                take = min(toks.size, shard_size - fill)
                buf[fill: fill + take], fill, toks = toks[:take], fill + take, toks[take:]
                if fill == shard_size:
                    flush(fill)
                    fill = 0
            progress(done)
    if fill:
        flush(fill)
    return written, total, docs[0]


def prepare(c, progress, note):
    """prepare's work for c (a PrepareConfig); progress(length, label) a progress bar (a
    context manager; its update(n) counts), note(line) a line for stderr. Returns the lines
    to print (what was written)."""
    check_inputs(c.inputs)
    c = replace(c, name=os.path.splitext(os.path.basename(c.inputs[0]))[0]
                if c.name is None else c.name)
    if not c.name or c.name in (".", "..") or "/" in c.name or os.sep in c.name:
        raise CupyGPTError("must be a plain file-name prefix" + (" (no directory); put the "
            "directory in --out" if c.name else ", or left out for the first input's name"),
            "name", repr(c.name))
    Tokenizer(c.tokenizer).byte_level()  # (damaged, or no BPE: its one line, before any input)
    if c.workers is not None and c.workers < 1:  # (in every mode, one that uses none too)
        raise CupyGPTError("must be at least 1 (leave it out for one per core)", "workers",
                           c.workers)
    seen = {}
    for path in c.inputs:  # (a corpus would hold its documents twice)
        first = seen.setdefault(os.path.realpath(path), path)
        if first is not path:
            raise CupyGPTError(f"{path}: the same file as {first}, given before it; give "
                               f"each input once")
    if c.hellaswag:  # (before the corpus mode, which takes a .jsonl too)
        if len(c.inputs) != 1:
            raise CupyGPTError(f"prepare --hellaswag takes one input, HellaSwag's jsonl, "
                               f"not {len(c.inputs)}")
        if c.shard_size is not None:  # (an eval file is one file: not to pass unread)
            raise CupyGPTError("is for token shards; prepare --hellaswag writes one eval "
                               "file: leave it out", "shard_size", c.shard_size)
        return prepare_hellaswag(c.inputs[0], os.path.join(c.out, f"{c.name}.bin"),
                                 c.tokenizer, c.force)
    if (c.shard_size is not None or len(c.inputs) > 1
            or c.inputs[0].endswith((".jsonl", ".parquet"))):
        return prepare_corpus(replace(c, shard_size=SHARD_SIZE if c.shard_size is None
                                      else c.shard_size), progress, note)
    text, out = c.inputs[0], c.out
    paths = {split: os.path.join(out, f"{c.name}_{split}.bin") for split in ("val", "train")}
    # through a link too (a clone's ./data is the package's): resolved paths are compared
    check_outputs([("out", out), *(("out", p) for p in paths.values())], [text, c.tokenizer])
    before = claim_out(out, shards_of(out, c.name), c.force)
    body = text_of(text)
    tok = Tokenizer(c.tokenizer)
    with progress(body.count("\n\n") + 1, "tokenizing") as bar:
        try:
            train_tokens, val_tokens = tokenize_tinyshakespeare(body, tok, progress=bar.update)
        except CupyGPTError as e:
            raise CupyGPTError(f"{text}: {e}") from None
    # both written before either is renamed: a failure leaves neither
    with atomic_write(paths["val"]) as fv, atomic_write(paths["train"]) as ft:
        write_shard(paths["val"], val_tokens, fv)
        write_shard(paths["train"], train_tokens, ft)
    remove_stale(before, paths.values())
    return [f"wrote {len(toks):,} tokens to {paths[split]}"
            for split, toks in (("val", val_tokens), ("train", train_tokens))]


def claim_out(out, replaced, force):
    """prepare's --out made and claimed (one command writing there at a time); then what
    it would replace there (replaced(): the paths, looked at once claimed) only with
    --overwrite. Returns those paths."""
    make_dir("out", out)
    claim("out", out)
    there = replaced()
    if there and not force:
        raise CupyGPTError(f"{there[0]} exists; add --overwrite to replace "
                           f"{'it' if len(there) == 1 else 'them'}, or another --out or "
                           f"--name", "out", out)
    return there


def existing_of(*paths):
    return lambda: [p for p in paths if os.path.exists(p)]


def shards_of(out, name):
    """NAME's shards in out, as either mode writes them (a NAME_train* glob takes both)."""
    at = os.path.join(glob.escape(out), glob.escape(name))
    return lambda: [p for split in ("val", "train") for p in sorted(glob.glob(
        f"{at}_{split}.bin") + glob.glob(f"{at}_{split}_{'[0-9]' * 6}.bin"))]


def remove_stale(before, written):
    for stale in sorted(set(before) - set(written)):  # --overwrite's: an earlier set's rest
        os.unlink(stale)


def text_of(path, kind="text"):
    """A text input, decoded (a compressed file named as such)."""
    data = read_bounded(path, kind, TEXT_CAP)
    not_compressed(path, data)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CupyGPTError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def prepare_hellaswag(jsonl, path, tokenizer, force):
    """prepare --hellaswag: the jsonl's examples to llm.c's eval file at path."""
    check_outputs([("out", path)], [jsonl, tokenizer])
    claim_out(os.path.dirname(path) or ".", existing_of(path), force)
    examples = from_jsonl(text_of(jsonl, "jsonl"), Tokenizer(tokenizer).encode, jsonl)
    with atomic_write(path) as f:
        write_eval(f, examples)
    return [f"wrote {len(examples):,} examples to {path}"]


def prepare_corpus(c, progress, note):
    """The corpus mode, for c (its name and shard size given)."""
    inputs, out, name, shard_size = c.inputs, c.out, c.name, c.shard_size
    if shard_size < 2:  # (1: a shard a token, which train cannot read a sample from)
        raise CupyGPTError(f"must be at least 2 tokens per shard, the least a sample reads "
                           f"(llm.c's FineWeb script: {SHARD_SIZE})", "shard_size", shard_size)
    cores = len(os.sched_getaffinity(0))
    if c.workers is not None and c.workers > cores:  # more processes than cores only contend
        note(f"note: --workers {c.workers}: this process may run on {cores} core(s); "
             f"using {cores}")
    workers = cores if c.workers is None else min(c.workers, cores)
    free = host_memory.available()
    if 2 * shard_size > free:  # the shard filling, uint16 tokens (numpy would raise later)
        raise CupyGPTError(f"a shard is held in memory as it fills (2 bytes a token: "
                           f"{2 * shard_size / 2**30:,.1f} GiB), more than the "
                           f"{free / 2**30:,.1f} GiB free; give a smaller one (llm.c's "
                           f"FineWeb script: {SHARD_SIZE})", "shard_size", shard_size)
    check_outputs([("out", out)], [*inputs, c.tokenizer])
    before = claim_out(out, shards_of(out, name), c.force)
    t0 = time.perf_counter()
    try:
        with progress(sum(os.path.getsize(p) for p in inputs), "tokenizing") as bar:
            paths, total, docs = write_shards(inputs, out, name, shard_size, c.tokenizer,
                                              bar.update, workers)
        if total == docs:  # (each document's EOT alone: no text at all)
            for p in paths:
                os.unlink(p)
            raise CupyGPTError(f"{inputs[0]}{' ...' if len(inputs) > 1 else ''}: no "
                               f"text in the input(s) (empty documents only); nothing "
                               f"written: give a non-empty corpus")
    except Stopped:
        note("interrupted: the shards written so far are whole; no shard is half written")
        raise
    remove_stale(before, paths)
    dt = time.perf_counter() - t0
    return [f"wrote {total:,} tokens in {len(paths)} shard(s) ({paths[0]} is val) to {out} "
            f"in {dt:.1f} s ({total / dt:,.0f} tokens/s, {workers} worker(s) on {cores} "
            f"cores)"] + ([f"no train shard: the corpus fits in one --shard-size "
                          f"({shard_size:,} tokens); give a smaller one for train's -i"]
                         if len(paths) == 1 else [])
