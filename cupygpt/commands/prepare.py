"""prepare's corpus mode (llm.c's FineWeb script): documents from many files (a text file
is one document; jsonl and parquet: each record's `text`) tokenized on every core, an EOT
before each, cut into shards of a fixed token count (the last one shorter), the first the
val shard: NAME_val_000000.bin, NAME_train_000001.bin, ... A shard is written only whole
(atomically), so an interrupted run leaves none half-written."""
import collections
import json
import multiprocessing
import os
import signal

import numpy as np

from .. import CupyGPTError
from ..formats.llmc import write_shard
from ..paths import TEXT_CAP, not_compressed, read_bounded, regular
from ..formats.tokenizer import Tokenizer

TASK_CHARS = 1 << 20   # documents handed to a worker at a time: few pickles, steady order


def shard_path(out, name, index):
    return os.path.join(out, f"{name}_{'val' if index == 0 else 'train'}_{index:06d}.bin")


def check_inputs(inputs):
    """Before anything is written: each input is there and a regular file, and a parquet
    file's footer says it has a string `text` column."""
    for path in inputs:
        if not os.path.lexists(path):
            raise CupyGPTError(f"{path}: no such file; give text, jsonl or parquet files")
        regular(path, "text, jsonl or parquet")
        if path.endswith(".parquet"):
            parquet(path)
        else:
            with open(path, "rb") as f:
                not_compressed(path, f.read(8))


def parquet(path):
    """The open pyarrow ParquetFile of path, checked: one line for anything wrong."""
    try:
        import pyarrow as pa
        import pyarrow.parquet as pq
    except ImportError:
        raise CupyGPTError(f"{path}: reading parquet needs pyarrow; pip install "
                           f"'cupygpt[parquet]'") from None
    try:
        f = pq.ParquetFile(path)
    except (OSError, ValueError) as e:  # (pyarrow's ArrowInvalid is a ValueError)
        raise CupyGPTError(f"{path}: not a readable parquet file ({e})") from None
    schema = f.schema_arrow
    if "text" not in schema.names or not (pa.types.is_string(schema.field("text").type) or
                                          pa.types.is_large_string(schema.field("text").type)):
        raise CupyGPTError(f"{path}: has no `text` column of strings (columns: "
                           f"{', '.join(f'{n} {t}' for n, t in zip(schema.names, schema.types))})")
    return f


def documents(path):
    """(text, bytes of the input consumed) per document of one input."""
    if path.endswith(".parquet"):
        f = parquet(path)
        per = os.path.getsize(path) / max(1, f.metadata.num_rows)
        try:
            for batch in f.iter_batches(columns=["text"]):
                for text in batch.column(0).to_pylist():
                    yield text or "", per
        except (OSError, ValueError) as e:
            raise CupyGPTError(f"{path}: damaged parquet data ({e})") from None
    elif path.endswith(".jsonl"):
        with open(path, "rb") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    yield None, len(line)
                    continue
                try:
                    text = json.loads(line)["text"]
                except (ValueError, KeyError, TypeError):
                    text = None
                if not isinstance(text, str):
                    raise CupyGPTError(f"{path}:{n}: not a JSON object with a string `text`")
                yield text, len(line)
    else:
        try:
            body = read_bounded(path, "text", TEXT_CAP)
            yield body.decode("utf-8"), len(body)
        except UnicodeDecodeError as e:
            raise CupyGPTError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") \
                from None
        except OSError as e:
            raise CupyGPTError(f"{path}: cannot read it ({e.strerror})") from None


def tasks(inputs):
    """Lists of documents of about TASK_CHARS characters each, with their input bytes."""
    docs, chars, done = [], 0, 0
    for path in inputs:
        for text, size in documents(path):
            done += size
            if text is not None:
                docs.append(text)
                chars += len(text)
            if chars >= TASK_CHARS:
                yield docs, done
                docs, chars, done = [], 0, 0
    if docs or done:
        yield docs, done


_tok = None


def _start(tokenizer):
    global _tok
    # the parent stops the pool (terminate: SIGTERM) on a signal; a worker neither
    # handles Ctrl-C nor unwinds: it ends quietly
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
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

    with multiprocessing.get_context("fork").Pool(processes, _start, (tokenizer,)) as pool:
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
