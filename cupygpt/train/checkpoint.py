"""Checkpoints: OUT/ckpt_STEP/ holds model.bin (llm.c's format, the whole model) and
adamw.npz (AdamW's m and v for the whole model, in model.bin's order, and the run's state).
Neither depends on the grid that wrote them: a run resumes on any grid, each rank taking
its part (and with ZeRO-1 its replica's slice) of the whole tensors.

A checkpoint is written under ckpt_STEP.partial/ and renamed when every rank has written
its files, then OUT/latest names it; a crash at any moment leaves the previous one intact.
"""
import json
import os
import shutil

import numpy as np

from .. import CupyGPTError
from ..formats.checkpoint import (
    LATEST,
    NAME,
    STATE,
    UNREADABLE,
    _state_file,
    check_matches,
    damaged,
    listed,
    model_digest,
    removed,
    state_meta,
    vanished,
    was_major,
)
from ..formats.llmc import read_model, write_model
from ..paths import atomic_write
from ..precision import dtype_name, is_narrow


def _fsync_dir(path):
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def identity(run):
    """What a resume must match: the model's shape, the step's batch and the dtype (the grid,
    split and micro-batches may differ: the checkpoint holds whole tensors)."""
    return {"config": run.shape.__dict__, "B": run.plan.batch, "T": run.plan.seq,
            "dtype": dtype_name(run.settings.dtype)}


def save(run, transport, out, step, state, keep=2, major=0):
    """Collective over all ranks (transport: their transport). state: JSON-able run state (loader,
    RNG...), the same on every rank; rank 0's is written. keep: the newest checkpoints
    kept; an older one of a step that is a multiple of major (llm.c's -nm) stays too.
    Returns the checkpoint's directory."""
    rank = transport.rank
    final = os.path.join(out, f"ckpt_{step:08d}")
    tmp = final + ".partial"
    whole = run.state_dict()
    if rank == 0:
        meta = {**identity(run), "step": step, "adam_t": whole["adam_t"],
                "grid": [run.mesh.dp, run.mesh.tp, run.mesh.pp],
                "major": bool(major and step % major == 0), **state}
        try:  # (made inside: a second signal at any point leaves no .partial directory)
            remove(tmp)  # (a killed save's, or a file of its name)
            os.makedirs(tmp)
            # a bf16 run's weights as they are (version 5), its fp32 master weights beside m, v
            write_model(os.path.join(tmp, "model.bin"), run.shape, whole["params"],
                        bf16=is_narrow(run.settings.dtype))
            meta["model_bin"] = model_digest(os.path.join(tmp, "model.bin"))
            with atomic_write(os.path.join(tmp, STATE)) as f:
                np.savez(f, **{k: whole[k] for k in ("m", "v", "master") if k in whole},
                         meta=np.array(json.dumps(meta)))
            _fsync_dir(tmp)
        except BaseException:  # (a full disk): no half-made checkpoint is left
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        remove(final)  # (an earlier run's of this step; a file put there meanwhile too)
        os.replace(tmp, final)
        _fsync_dir(out)
        _point_latest(out, os.path.basename(final))
        old = [d for d in listed(out) if d != os.path.basename(final)]
        for d in old[:max(0, len(old) - (keep - 1))]:  # (an earlier run's -nm's stay too)
            if not (major and int(d[5:]) % major == 0) and not was_major(os.path.join(out, d)):
                prune(os.path.join(out, d))
    transport.barrier()
    return final


def _point_latest(out, name):
    with atomic_write(os.path.join(out, LATEST)) as f:
        f.write(name.encode())


def demote(transport, out, path):
    """The checkpoint at path holds the parameters that gave a non-finite loss: rename it
    to .nan, point latest at the one before it, and return that one (or None)."""
    prev = None
    if transport.rank == 0:
        remove(path + ".nan")  # (an earlier run's, of the same step)
        os.replace(path, path + ".nan")
        rest = listed(out)
        prev = os.path.join(out, rest[-1]) if rest else None
        if prev:
            _point_latest(out, rest[-1])
        elif os.path.exists(os.path.join(out, LATEST)):
            os.unlink(os.path.join(out, LATEST))
    return transport.bcast(prev)


def prune(path):
    """A checkpoint --keep lets go, renamed before it is removed: a resume reading it meets
    all of it or none (a file it opened stays whole), never a part."""
    try:
        os.replace(path, path + PRUNED)
    except OSError:
        return
    shutil.rmtree(path + PRUNED, ignore_errors=True)


PRUNED = ".pruned"


def remove(path):
    """A directory or file at path (none there: nothing)."""
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    elif os.path.lexists(path):
        os.unlink(path)


def clean_litter(out):
    """What a killed run leaves: a half-written `latest`, a checkpoint never renamed and
    one half pruned."""
    for name in os.listdir(out):
        if name.startswith(LATEST + ".") and name.endswith(".tmp"):
            os.unlink(os.path.join(out, name))
        elif any(NAME.match(name.removesuffix(end)) and name.endswith(end)
                 for end in (".partial", PRUNED)):
            remove(os.path.join(out, name))


def restore(run, path):
    """Loads this rank's part of the whole parameters (model.bin) and AdamW state; returns
    the saved meta. Every rank reads the same files, so all report the same difference.
    A checkpoint removed while it is read (a live run's --keep) is named as such."""
    try:
        return _restore(run, path)
    except (CupyGPTError, OSError):
        if vanished(path):
            raise removed(path) from None
        raise


def _restore(run, path):
    f = _state_file(path)
    try:
        with np.load(f) as z:
            meta = state_meta(z, f, path)
            check_matches(path, {"dtype": "fp32", **meta}, identity(run))
            m, v = z["m"], z["v"]
            master = z["master"] if "master" in z.files else None
    except UNREADABLE as e:
        raise damaged(f, path, type(e).__name__) from None
    if not (np.isfinite(m).all() and np.isfinite(v).all() and v.min(initial=0) >= 0):
        # (the first update would make the parameters NaN: "lower the learning rate")
        raise damaged(f, path, "AdamW's m or v holds values no run writes: not finite, or a "
                               "negative v")
    run.load_state_dict(read_model(os.path.join(path, "model.bin"), mmap=True)[1], m, v,
                        meta["adam_t"], master)
    return meta
