"""A checkpoint directory as a resume reads it: where the newest is, what its state file
holds, and whether it fits the run that asks to resume (read before anything is allocated)."""
import hashlib
import math
import os
import zipfile

import numpy as np

from .. import CupyGPTError
from ..model.layout import param_layout
from ..paths import CHECKPOINT as NAME
from ..paths import loads
from .llmc import read_shard, shard_order

LATEST = "latest"


# What NumPy raises on a damaged .npz: bad zip, CRC mismatch, truncation, not a zip at all
UNREADABLE = (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile)


STATE = "adamw.npz"


def named(out):
    """Everything in out named as a checkpoint is (ckpt_STEP), oldest first."""
    return sorted(d for d in os.listdir(out) if NAME.match(d))


def _top(out, where):
    """(the first part of where's path inside out, whether where lies deeper), where and
    out resolved; (None, False) where where is not inside out."""
    real = os.path.realpath(out)
    if os.path.commonpath([where, real]) != real or where == real:
        return None, False
    rel = os.path.relpath(where, real)
    top = rel.split(os.sep)[0]
    return top, rel != top


def reserved(out, path):
    """The name of out's own that path would be or lie in (a checkpoint, one being written
    or renamed .nan, `latest`), else None: a run writes, replaces and removes those. path
    need not exist: its directory is resolved."""
    top, _ = _top(out, os.path.join(os.path.realpath(os.path.dirname(os.path.abspath(path))),
                                    os.path.basename(path)))
    stem = (top or "").removesuffix(".partial").removesuffix(".nan")
    return top if top == LATEST or NAME.match(stem) else None


def holding(out, path):
    """The checkpoint directory of out (ckpt_STEP, or one a NaN renamed ckpt_STEP.nan)
    that the file at path lies in, else None: --overwrite removes those."""
    top, deeper = _top(out, os.path.realpath(path))
    return top if deeper and NAME.match(top.removesuffix(".nan")) else None


def beside(out, ckpt):
    """Whether the checkpoint directory ckpt is one of out's own."""
    return os.path.realpath(os.path.dirname(os.path.abspath(ckpt))) == os.path.realpath(out)


def newer(out, ckpt):
    """The checkpoints of out after ckpt (one of them) by step: another run's future when
    a resume goes back to ckpt in its own directory."""
    step = os.path.basename(os.path.normpath(ckpt))
    if not (beside(out, ckpt) and NAME.match(step)):
        return []
    return [d for d in named(out) if d > step]


def state_meta(z, f, path):
    """The run state a checkpoint's state file z (f, of the checkpoint at path) holds: a
    JSON object, else the checkpoint is damaged."""
    meta = loads(str(z["meta"]))
    if not isinstance(meta, dict):
        raise damaged(f, path, "its run state is not a JSON object")
    return meta


def was_major(path):
    """Whether the checkpoint at path was written as one -nm keeps: a later run (resumed
    with another -nm, or none) never prunes it. One it cannot read is kept too."""
    f = os.path.join(path, STATE)
    try:
        with np.load(f) as z:
            return bool(state_meta(z, f, path).get("major", False))
    except UNREADABLE + (CupyGPTError,):
        return True


def listed(out):
    """The complete checkpoints in out, oldest first: directories holding a model and
    AdamW's state (an empty one, or a file of that name, is passed over: a resume took the
    newest name and failed on it)."""
    return [d for d in named(out)
            if all(os.path.isfile(os.path.join(out, d, f)) for f in ("model.bin", STATE))]


def resolve(path):
    """--resume takes a checkpoint directory or a run's -o directory: its newest complete
    checkpoint (a run killed while writing `latest` may have left it one behind)."""
    if os.path.isfile(path):
        raise CupyGPTError(f"is a file; give the checkpoint directory it is in "
                           f"({os.path.dirname(os.path.abspath(path))})", "resume", path)
    if not os.path.isdir(path):
        raise CupyGPTError("no such checkpoint directory", "resume", path)
    base = os.path.basename(os.path.normpath(path))
    if base.endswith(".partial") and NAME.match(base.removesuffix(".partial")):
        raise CupyGPTError("a checkpoint never finished (a run stopped while writing it); "
                           "give a complete ckpt_STEP directory or the run's -o directory",
                           "resume", path)
    done = listed(path)
    if done:
        return os.path.join(path, done[-1])
    if not os.path.isfile(os.path.join(path, "model.bin")):
        raise CupyGPTError("not a checkpoint (no model.bin) and holds none (no ckpt_STEP "
                           "directory); give a checkpoint or a run's output directory",
                           "resume", path)
    return path


def vanished(path):
    """Whether a checkpoint found complete has lost its files since: a live run's --keep
    removed it while this command read it."""
    return not all(os.path.isfile(os.path.join(path, f)) for f in ("model.bin", STATE))


def removed(path):
    """The one line for a checkpoint removed while it was read (vanished)."""
    out = os.path.dirname(os.path.normpath(path))
    return CupyGPTError(f"{path}: removed while this run read it (a run still writing {out} "
                        f"keeps only its newest checkpoints, --keep); resume from {out} "
                        f"again to take its newest")


def damaged(f, path, why):
    """One line for a checkpoint file that cannot be read, naming the one before it."""
    out = os.path.dirname(os.path.abspath(path))
    older = [d for d in listed(out) if d < os.path.basename(path)]
    return CupyGPTError(f"{f}: damaged checkpoint file ({why}); " + (
        f"the previous checkpoint {os.path.join(out, older[-1])} can be resumed instead"
        if older else "no earlier checkpoint is left beside it"))


def _state_file(path):
    f = os.path.join(path, STATE)
    if not os.path.isfile(f):
        raise CupyGPTError(f"no {STATE} beside model.bin: not a checkpoint written by train "
                           f"--checkpoint-every (a model file alone has no optimizer state)",
                           "resume", path)
    return f


def check_matches(path, meta, want):
    diff = [f"{k}: checkpoint {meta.get(k)} vs now {v}" for k, v in want.items()
            if meta.get(k) != v]
    if diff:
        raise CupyGPTError(f"does not match this run ({'; '.join(diff)}); use the "
                           f"checkpoint's settings", "resume", path)


def _length(z, name):
    """An array's length in an open .npz, from its header alone."""
    with z.zip.open(name + ".npy") as a:
        version = np.lib.format.read_magic(a)
        read = (np.lib.format.read_array_header_1_0 if version == (1, 0)
                else np.lib.format.read_array_header_2_0)
        shape, _, dtype = read(a)
    return shape[0] if len(shape) == 1 and dtype == np.float32 else None


OUTLIER_WINDOW = 128  # llm.c's outlier detector's window of steps (train/outlier.py)


def outliers_ok(state):
    """A checkpoint's outlier detectors' state (none: a run before they were saved) is one
    train/outlier.py takes as it is: per detector a window of finite numbers, its index
    in it, and their sums."""
    if state is None:
        return True

    def number(x):
        return type(x) in (int, float) and math.isfinite(x)

    def detector(d):
        return (isinstance(d, dict) and isinstance(d.get("buffer"), list)
                and len(d["buffer"]) <= OUTLIER_WINDOW and all(map(number, d["buffer"]))
                and type(d.get("index")) is int and 0 <= d["index"] < OUTLIER_WINDOW
                and number(d.get("sum")) and number(d.get("sum_sq")))
    return isinstance(state, dict) and set(state) <= {"loss", "norm"} and all(
        map(detector, state.values()))


def model_digest(path):
    """model.bin's length and a 128-bit hash of its bytes: a checkpoint's state records
    them, so a resume knows the model beside its m and v is the one written with them."""
    h, n = hashlib.blake2b(digest_size=16), 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 24), b""):
            h.update(block)
            n += len(block)
    return {"bytes": n, "blake2b": h.hexdigest()}


def check_model(path):
    """Before the model is read: a checkpoint's model.bin is the one its state was written
    with (a checkpoint from before the state recorded it: not checked)."""
    f, model = _state_file(path), os.path.join(path, "model.bin")
    try:
        with np.load(f) as z:
            meta = state_meta(z, f, path)
    except UNREADABLE as e:
        raise damaged(f, path, type(e).__name__) from None
    if "model_bin" not in meta:
        return
    want = meta["model_bin"]
    if not (isinstance(want, dict) and set(want) == {"bytes", "blake2b"} and
            type(want["bytes"]) is int and want["bytes"] >= 0 and
            isinstance(want["blake2b"], str)):  # (null or a bad record would skip the check)
        raise damaged(f, path, "its record of model.bin is malformed")
    try:
        got = model_digest(model)
    except OSError as e:
        raise damaged(model, path, e.strerror) from None
    if got != want:
        raise damaged(model, path, f"not the model.bin its {STATE} was written with (" + (
            f"{got['bytes']:,} bytes, {want['bytes']:,} written" if got["bytes"] !=
            want["bytes"] else "other bytes of the same length") + ")")


def check_resume(path, shape, B, T, total_batch, dtype, train_files):
    """Before anything is allocated: the checkpoint's state file is readable and fits this
    run: its model shape, batch and tokens per step (-d; B x T where a checkpoint has
    none), m and v of the model's length, a usable RNG state, and its data position inside
    this run's train shards. Returns its step."""
    f = _state_file(path)
    try:
        with np.load(f) as z:
            meta = state_meta(z, f, path)
            check_matches(path, {"total_batch": B * T, "dtype": "fp32", **meta},
                          {"config": shape.__dict__, "B": B, "T": T,
                           "total_batch": total_batch, "dtype": dtype})
            # a bf16 run's fp32 master weights beside m and v
            kept = ("m", "v") + (("master",) if dtype == "bf16" else ())
            lengths = {_length(z, name) if name + ".npy" in z.zip.namelist() else None
                       for name in kept}
    except UNREADABLE as e:
        raise damaged(f, path, type(e).__name__) from None
    n = param_layout(shape).size
    if lengths != {n}:
        raise damaged(f, path, f"AdamW's {', '.join(kept[:-1])} and {kept[-1]} are not "
                               f"float32 arrays of the model's {n:,} parameters")
    try:
        np.random.default_rng().bit_generator.state = meta["rng"]
        step, t, loader = meta["step"], meta["adam_t"], meta["train_loader"]
        (shard, pos, epoch, seed, shuffle) = loader if len(loader) == 5 else (*loader, 0, 0, 0)
    except (KeyError, TypeError, ValueError):
        raise damaged(f, path, "its step, RNG or data position is missing or malformed") \
            from None
    if not all(type(x) is int and x >= 0 for x in (step, t, shard, pos, epoch, seed)):  # (true
        # is an int to isinstance: a step of true resumed as step 1)
        raise damaged(f, path, "its step or data position is not a count")
    name = os.path.basename(os.path.realpath(path))  # (a link's name may be another's)
    if NAME.match(name) and int(name[5:]) != step:  # (a run would jump to that step)
        raise damaged(f, path, f"its step {step} is not its directory's {int(name[5:])}")
    if not outliers_ok(meta.get("outliers")):
        raise damaged(f, path, "its outlier detectors' window (-sl, -sg) is malformed")
    if shard >= len(train_files) or pos + B * T + 1 > read_shard(
            train_files[shard_order(len(train_files), seed, epoch, shuffle)[shard]]).size:
        raise CupyGPTError(f"{f}: its data position (shard {shard}, token {pos:,}) lies "
                           f"outside this run's train shards (-i); resume with the run's "
                           f"own -i", "resume", path)
    return step
