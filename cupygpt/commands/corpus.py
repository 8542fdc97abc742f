"""The corpus mode's inputs (prepare --shard-size, several files, jsonl, parquet): each
checked before anything is written, read as documents (a text file is one; jsonl and
parquet: each record's `text`), and handed out in tasks of about TASK_CHARS characters."""
import os

from .. import CupyGPTError
from ..paths import TEXT_CAP, loads, not_compressed, read_bounded, regular

TASK_CHARS = 1 << 20   # documents handed to a worker at a time: few pickles, steady order


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
            try:
                with open(path, "rb") as f:
                    not_compressed(path, f.read(8))
            except OSError as e:  # (a link loop: a traceback)
                raise CupyGPTError(f"{path}: cannot read it ({e.strerror})") from None


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
                line = line.removeprefix(b"\xef\xbb\xbf") if n == 1 else line  # (a BOM)
                if not line.strip():
                    yield None, len(line)
                    continue
                try:
                    text = loads(line)["text"]
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
            raise CupyGPTError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
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
