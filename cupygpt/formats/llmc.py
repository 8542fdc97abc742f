"""llm.c's file formats: model (20240326), debug state (20240327), token shards (20240520).

Every reader checks magic, version and sizes and raises CupyGPTError naming the file.
Every writer goes through atomic_write, so a crash never leaves a half-written file.
"""
import glob as globlib
import json
import math
import os

import numpy as np

from .. import CupyGPTError
from ..model.layout import param_layout
from ..model.shape import PRESETS, GPT2Config
from ..paths import atomic_write, loads, read_bounded, regular
from . import hf

HEADER_INTS = 256
HEADER_BYTES = HEADER_INTS * 4
MODEL_MAGIC, STATE_MAGIC, SHARD_MAGIC, TOKENIZER_MAGIC = 20240326, 20240327, 20240520, 20240328


def read_header(path, magic, kind):
    """Returns (header int32[256], open file positioned after it)."""
    regular(path, kind)
    try:
        f = open(path, "rb")
    except OSError as e:
        raise CupyGPTError(f"{path}: cannot open {kind} file ({e.strerror})") from None
    raw = f.read(HEADER_BYTES)
    if len(raw) < HEADER_BYTES:
        f.close()
        raise CupyGPTError(f"{path}: truncated {kind} file ({len(raw)} bytes, the header "
                           f"alone is {HEADER_BYTES})")
    header = np.frombuffer(raw, dtype=np.int32)
    if header[0] != magic:
        f.close()
        raise CupyGPTError(f"{path}: bad magic {header[0]} (a {kind} file has {magic}); "
                           f"is this the right file?")
    return header, f


def expect_size(path, kind, expected_bytes, actual):
    """actual: the size of the file read_header opened (a path looked up again may be gone:
    a live run's --keep removes checkpoints)."""
    if actual != expected_bytes:
        why = "truncated" if actual < expected_bytes else "trailing data"
        raise CupyGPTError(f"{path}: {kind} file is {actual} bytes but its header implies "
                           f"{expected_bytes} ({why})")


def make_header(magic, version, *fields):
    h = np.zeros(HEADER_INTS, dtype=np.int32)
    h[:2 + len(fields)] = (magic, version) + fields
    return h


# --- model -------------------------------------------------------------------------------

HEADER_LIMITS = dict(maxT=1 << 20, V=1 << 24, Vp=1 << 24, L=1 << 12, NH=1 << 12, C=1 << 16)


def read_model_header(path):
    header, f = read_header(path, MODEL_MAGIC, "model")
    size = os.fstat(f.fileno()).st_size
    f.close()
    version = int(header[1])
    if version not in (3, 5):
        raise CupyGPTError(f"{path}: model version {version} is not supported (3 = fp32, "
                           f"5 = bf16); re-export it with llm.c")
    maxT, V, L, NH, C, Vp = (int(x) for x in header[2:8])
    for i, (name, v) in enumerate(zip(("maxT", "V", "L", "NH", "C", "Vp"), header[2:8]), 2):
        if v > HEADER_LIMITS[name]:  # (a size computed from it would overflow)
            raise CupyGPTError(f"{path}: bad model header: {name} (int {i}) is {int(v)}, more "
                               f"than any GPT-2 has (at most {HEADER_LIMITS[name]}); a "
                               f"damaged file, or not an llm.c model?")
    try:
        shape = GPT2Config(maxT=maxT, V=V, Vp=Vp, L=L, NH=NH, C=C)
    except CupyGPTError as e:
        raise CupyGPTError(f"{path}: header holds an invalid {e}") from None
    itemsize = 4 if version == 3 else 2
    expect_size(path, "model", HEADER_BYTES + param_layout(shape).size * itemsize, size)
    return shape, version


def is_model_file(spec):
    """-e names a model (an llm.c file or a transformers directory, rather than a preset)
    when it looks like a path: it exists, holds a separator or ends in .bin. A preset's
    name is the preset beside a directory of that name which holds no model (a run's -o)."""
    if spec in PRESETS and not os.path.isfile(os.path.join(spec, hf.CONFIG)):
        return os.path.isfile(spec)
    return os.path.exists(spec) or os.sep in spec or spec.endswith(".bin")


def read_model(path, out=None, mmap=False):
    """(config, fp32 parameters of the whole model); one read into out when it is given.
    With mmap an fp32 file is mapped, not read: a pipeline stage touches only its slice.
    A directory is a transformers GPT-2 model, converted as it is read."""
    if os.path.isdir(path):
        return hf.read_model(path, out)
    shape, version = read_model_header(path)
    n = param_layout(shape).size
    if mmap and version == 3 and out is None:
        return shape, np.memmap(path, dtype=np.float32, mode="r", offset=HEADER_BYTES, shape=(n,))
    with open(path, "rb") as f:
        f.seek(HEADER_BYTES)
        if version == 3:
            params = np.empty(n, np.float32) if out is None else out
            f.readinto(memoryview(params).cast("B"))
        else:  # bf16 is the top half of an fp32
            bf = np.fromfile(f, dtype=np.uint16, count=n)
            params = (bf.astype(np.uint32) << 16).view(np.float32)
            if out is not None:
                out[...] = params
                params = out
    return shape, params


def check_finite(path, params):
    """Refuses a model whose weights are not all finite (what a diverged run saved): its
    losses and samples would be NaN. In chunks: no parameter-sized temporary."""
    if not os.path.exists(path):
        return  # (a preset: made here, finite)
    for i in range(0, len(params), 1 << 22):
        if not np.isfinite(params[i:i + (1 << 22)]).all():
            raise CupyGPTError(f"{path}: holds non-finite weights (NaN or inf), as a run "
                               f"that diverged leaves; give a model saved before that")


def write_model(path, shape, params, bf16=False):
    """llm.c's model file: version 3 (fp32) or, with bf16, version 5."""
    with atomic_write(path) as f:
        f.write(make_header(MODEL_MAGIC, 5 if bf16 else 3, shape.maxT, shape.V, shape.L, shape.NH,
                            shape.C, shape.Vp).tobytes())
        if bf16:  # in chunks: the rounding's temporaries stay small
            for i in range(0, len(params), 1 << 22):
                f.write(to_bf16(params[i:i + (1 << 22)]).tobytes())
            return
        # the array's own bytes, not a copy of them (half a GiB for a d12)
        f.write(memoryview(np.ascontiguousarray(params, dtype=np.float32)).cast("B"))


def to_bf16(x):
    """fp32 -> bf16 bits, rounded to the nearest, ties to even (as torch casts); NaN stays
    NaN (its top half with the quiet bit, which rounding could carry into infinity)."""
    x = np.ascontiguousarray(x, np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    return np.where(np.isnan(x), (u >> 16).astype(np.uint16) | 0x40, r)


# --- debug state -------------------------------------------------------------------------

def read_state_header(path, shape):
    """(B, T) of a debug state for the model shape, after checking its header and size."""
    header, f = read_header(path, STATE_MAGIC, "debug state")
    f.close()
    if header[1] != 2:
        raise CupyGPTError(f"{path}: debug state version {header[1]} is not supported (2)")
    B, T = int(header[2]), int(header[3])
    if B <= 0 or T <= 0:
        raise CupyGPTError(f"{path}: debug state header has B={B}, T={T}")
    if T > shape.maxT:
        raise CupyGPTError(f"{path}: debug state T={T} exceeds the model's maxT={shape.maxT}")
    n = param_layout(shape).size
    need, actual = HEADER_BYTES + 4 * (2 * B * T + B * T * shape.V + 1 + n), os.path.getsize(path)
    if actual != need:  # the header has no model shape: say what this model's would be
        raise CupyGPTError(
            f"{path}: a debug state of this model (V={shape.V}, {n:,} parameters) at B={B}, "
            f"T={T} is {need:,} bytes, this file {actual:,}: " +
            ("truncated, or the state of another model" if actual < need else
             "the state of another model, or trailing data"))
    return B, T


def read_state(path, shape):
    """llm.c's debug state: dict with x, y (B,T) int32, logits (B,T,V), loss, grads (flat)."""
    B, T = read_state_header(path, shape)
    n = param_layout(shape).size
    with open(path, "rb") as f:
        f.seek(HEADER_BYTES)
        x = np.fromfile(f, np.int32, B * T).reshape(B, T)
        y = np.fromfile(f, np.int32, B * T).reshape(B, T)
        logits = np.fromfile(f, np.float32, B * T * shape.V).reshape(B, T, shape.V)
        loss = float(np.fromfile(f, np.float32, 1)[0])
        grads = np.fromfile(f, np.float32, n)
    for name, t in (("x", x), ("y", y)):
        if t.min() < 0 or t.max() >= shape.V:
            raise CupyGPTError(f"{path}: debug state {name} holds token "
                               f"{t.min() if t.min() < 0 else t.max()} outside the model's "
                               f"vocab 0..{shape.V - 1}")
    for name, t in (("logits", logits), ("loss", np.float32(loss)), ("gradients", grads)):
        if not np.isfinite(t).all():  # (max() over NaN differences drops them: a PASS)
            raise CupyGPTError(f"{path}: debug state's reference {name} hold NaN or inf; it "
                               f"checks nothing")
    return dict(B=B, T=T, x=x, y=y, logits=logits, loss=loss, grads=grads)


# --- token shards ------------------------------------------------------------------------

def shard_count(path):
    """A token shard's token count, its header and size checked."""
    header, f = read_header(path, SHARD_MAGIC, "token shard")
    size = os.fstat(f.fileno()).st_size
    f.close()
    if header[1] != 1:
        raise CupyGPTError(f"{path}: token shard version {header[1]} is not supported (1)")
    ntok = int(header[2])
    if ntok < 0:
        raise CupyGPTError(f"{path}: bad token shard header: token count (int 2) is {ntok}; "
                           f"it cannot be negative: is this the right file?")
    expect_size(path, "token shard", HEADER_BYTES + 2 * ntok, size)
    return ntok


def read_shard(path):
    ntok = shard_count(path)
    return np.memmap(path, dtype=np.uint16, mode="r", offset=HEADER_BYTES, shape=(ntok,))


class Shard:
    """A token shard read batch by batch with pread from a file opened once (no mmap: a
    file that shrinks under a read gives a short read, checked, never a SIGBUS)."""

    def __init__(self, path):
        self.path, self.size = path, shard_count(path)
        self.fd = os.open(path, os.O_RDONLY)

    def read(self, at, n):
        """Tokens at..at+n-1 as uint16; refused when the file no longer holds them."""
        raw = os.pread(self.fd, 2 * n, HEADER_BYTES + 2 * at)
        if len(raw) < 2 * n:
            now = os.fstat(self.fd).st_size
            raise CupyGPTError(f"{self.path}: token shard changed while training read it: it "
                               f"is now {now} bytes, its header says "
                               f"{HEADER_BYTES + 2 * self.size}; restore the shard (or "
                               f"prepare it again)")
        return np.frombuffer(raw, dtype=np.uint16)

    def outside(self, V):
        """(position, token) of the shard's first token at or above V, or None: read in
        blocks, so a scan holds 32 MiB at most."""
        for at in range(0, self.size, 1 << 24):
            block = self.read(at, min(1 << 24, self.size - at))
            if int(block.max()) >= V:
                i = int(np.argmax(block >= V))
                return at + i, int(block[i])
        return None

    def __del__(self):
        fd, self.fd = getattr(self, "fd", None), None
        if fd is not None:
            os.close(fd)


def write_shard(path, tokens, f=None):
    """Into f when given (an open atomic_write of path), else a file of its own."""
    tokens = np.asarray(tokens)
    if tokens.size and (tokens.min() < 0 or tokens.max() >= 2 ** 16):
        raise CupyGPTError(f"{path}: tokens must fit in uint16")
    if f is None:
        with atomic_write(path) as f:
            return write_shard(path, tokens, f)
    f.write(make_header(SHARD_MAGIC, 1, tokens.size).tobytes())
    f.write(tokens.astype(np.uint16).tobytes())


# --- verify's expected losses ------------------------------------------------------------

def read_expected(path):
    """The step losses of a JSON file {"losses": [numbers]} (verify --expected)."""
    try:
        data = loads(read_bounded(path, "JSON losses", 1 << 20).decode("utf-8"))
    except OSError as e:
        raise CupyGPTError(f"cannot read it ({e.strerror})", "expected", path) from None
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise CupyGPTError('not JSON; give a file like {"losses": [5.27, 5.21, ...]}',
                           "expected", path) from None
    losses = data.get("losses") if isinstance(data, dict) else None
    if not isinstance(losses, list) or not losses or not all(
            isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
            for x in losses):
        raise CupyGPTError('needs a non-empty "losses" list of numbers, one per AdamW step',
                           "expected", path)
    return tuple(float(x) for x in losses)


def shard_order(n, seed, epoch, shuffle):
    """The order in which an epoch visits n shards."""
    return np.random.default_rng([seed, epoch]).permutation(n) if shuffle else np.arange(n)


def shard_files(pattern, option):
    """The shards a -i/-j glob pattern names, sorted; refused when none. A file named as
    the pattern is spelt (its [ or * read as wildcards) gets the escaped spelling."""
    files = sorted(globlib.glob(pattern))
    if not files:
        escaped = globlib.escape(pattern)
        hint = (f"this is a glob pattern, where * ? and [...] are wildcards, so the file of "
                f"this very name is not matched: give {escaped!r}" if os.path.exists(pattern)
                and escaped != pattern else "this is a glob pattern (* ? and [...] are "
                "wildcards; a literal [ is written [[]): run `prepare` or fix the path")
        raise CupyGPTError(f"no token shard matches; {hint}", option, pattern)
    return files
