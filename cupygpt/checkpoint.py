"""Checkpoints: OUT/ckpt_STEP/ holds model.bin (llm.c's format, the whole model) and
adamw.npz (AdamW's m and v for the whole model, in model.bin's order, and the run's state).
Neither depends on the grid that wrote them: a run resumes on any grid, each rank taking
its part (and with ZeRO-1 its replica's slice) of the whole tensors.

A checkpoint is written under ckpt_STEP.partial/ and renamed when every rank has written
its files, then OUT/latest names it; a crash at any moment leaves the previous one intact.
"""
import json
import os
import re
import shutil
import zipfile

import numpy as np

from . import CupyGPTError
from .data import shard_order
from .files import atomic_write, read_model, read_shard, write_model
from .layout import param_layout
from .precision import dtype_name, is_narrow

LATEST = "latest"
NAME = re.compile(r"ckpt_\d{8}$")
# What NumPy raises on a damaged .npz: bad zip, CRC mismatch, truncation, not a zip at all
UNREADABLE = (OSError, ValueError, KeyError, EOFError, zipfile.BadZipFile)


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


STATE = "adamw.npz"


def identity(run):
    """What a resume must match: the model's shape, the step's batch and the dtype (the grid,
    split and micro-batches may differ: the checkpoint holds whole tensors)."""
    return {"config": run.shape.__dict__, "B": run.plan.batch, "T": run.plan.seq,
            "dtype": dtype_name(run.dtype)}


def save(run, tr, out, step, state, keep=2, major=0):
    """Collective over all ranks (tr: their transport). state: JSON-able run state (loader,
    RNG...), the same on every rank; rank 0's is written. keep: the newest checkpoints
    kept; an older one of a step that is a multiple of major (llm.c's -nm) stays too.
    Returns the checkpoint's directory."""
    rank = tr.rank
    final = os.path.join(out, f"ckpt_{step:08d}")
    tmp = final + ".partial"
    whole = run.state_dict()
    if rank == 0:
        meta = {**identity(run), "step": step, "adam_t": whole["adam_t"],
                "grid": [run.mesh.dp, run.mesh.tp, run.mesh.pp], **state}
        try:  # (made inside: a second signal at any point leaves no .partial directory)
            shutil.rmtree(tmp, ignore_errors=True)
            os.makedirs(tmp)
            # a bf16 run's weights as they are (version 5), its fp32 master weights beside m, v
            write_model(os.path.join(tmp, "model.bin"), run.shape, whole["params"],
                        bf16=is_narrow(run.dtype))
            with atomic_write(os.path.join(tmp, STATE)) as f:
                np.savez(f, **{k: whole[k] for k in ("m", "v", "master") if k in whole},
                         meta=np.array(json.dumps(meta)))
            _fsync_dir(tmp)
        except BaseException:  # (a full disk): no half-made checkpoint is left
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_dir(out)
        _point_latest(out, os.path.basename(final))
        old = [d for d in listed(out) if d != os.path.basename(final)]
        for d in old[:max(0, len(old) - (keep - 1))]:
            if not (major and int(d[5:]) % major == 0):
                shutil.rmtree(os.path.join(out, d), ignore_errors=True)
    tr.barrier()
    return final


def listed(out):
    """The complete checkpoints in out, oldest first."""
    return sorted(d for d in os.listdir(out) if NAME.match(d))


def _point_latest(out, name):
    with atomic_write(os.path.join(out, LATEST)) as f:
        f.write(name.encode())


def demote(tr, out, path):
    """The checkpoint at path holds the parameters that gave a non-finite loss: rename it
    to .nan, point latest at the one before it, and return that one (or None)."""
    prev = None
    if tr.rank == 0:
        os.replace(path, path + ".nan")
        rest = listed(out)
        prev = os.path.join(out, rest[-1]) if rest else None
        if prev:
            _point_latest(out, rest[-1])
        elif os.path.exists(os.path.join(out, LATEST)):
            os.unlink(os.path.join(out, LATEST))
    return tr.bcast(prev)


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


def clean_litter(out):
    """What a killed run leaves: a half-written `latest` and a checkpoint never renamed."""
    for name in os.listdir(out):
        if name.startswith(LATEST + ".") and name.endswith(".tmp"):
            os.unlink(os.path.join(out, name))
        elif NAME.match(name.removesuffix(".partial")) and name.endswith(".partial"):
            shutil.rmtree(os.path.join(out, name), ignore_errors=True)


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


def check_resume(path, shape, B, T, total_batch, dtype, train_files):
    """Before anything is allocated: the checkpoint's state file is readable and fits this
    run: its model shape, batch and tokens per step (-d; B x T where a checkpoint has
    none), m and v of the model's length, a usable RNG state, and its data position inside
    this run's train shards. Returns its step."""
    f = _state_file(path)
    try:
        with np.load(f) as z:
            meta = json.loads(str(z["meta"]))
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
    if not all(isinstance(x, int) and x >= 0 for x in (step, t, shard, pos, epoch, seed)):
        raise damaged(f, path, "its step or data position is not a count")
    if shard >= len(train_files) or pos + B * T + 1 > read_shard(
            train_files[shard_order(len(train_files), seed, epoch, shuffle)[shard]]).size:
        raise CupyGPTError(f"{f}: its data position (shard {shard}, token {pos:,}) lies "
                           f"outside this run's train shards (-i); resume with the run's "
                           f"own -i", "resume", path)
    return step


def restore(run, path):
    """Loads this rank's part of the whole parameters (model.bin) and AdamW state; returns
    the saved meta. Every rank reads the same files, so all report the same difference."""
    f = _state_file(path)
    try:
        with np.load(f) as z:
            meta = json.loads(str(z["meta"]))
            check_matches(path, {"dtype": "fp32", **meta}, identity(run))
            m, v = z["m"], z["v"]
            master = z["master"] if "master" in z.files else None
    except UNREADABLE as e:
        raise damaged(f, path, type(e).__name__) from None
    run.load_state_dict(read_model(os.path.join(path, "model.bin"), mmap=True)[1], m, v,
                        meta["adam_t"], master)
    return meta
