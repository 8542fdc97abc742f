"""Checkpoints: OUT/ckpt_STEP/ holds model.bin (llm.c's format, the whole model) and one
rankNNN.npz per pipeline rank (its parameter slice, AdamW m and v, and the run's state).

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
from .files import atomic_write, write_model

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


def identity(run):
    """What a resume must match: the model's shape and how it is cut and batched."""
    m = run.mesh
    return {"config": run.cfg.__dict__, "ranks": m.size, "grid": [m.dp, m.tp, m.pp],
            "zero": int(run.zero), "split": run.counts, "B": run.B, "T": run.T,
            "micro_batches": run.M}


def save(run, out, step, state, keep=2):
    """Collective over all ranks. state: JSON-able run state of this rank (loader, RNG...).
    Returns the checkpoint's directory."""
    tr, rank = run.tr, run.tr.rank
    final = os.path.join(out, f"ckpt_{step:08d}")
    tmp = final + ".partial"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    tr.barrier()
    full = run.gather_params()
    if rank == 0:
        write_model(os.path.join(tmp, "model.bin"), run.cfg, full)
    st, opt = run.stage, run.opt
    meta = {**identity(run), "rank": rank, "step": step, "adam_t": opt.t, **state}
    with atomic_write(os.path.join(tmp, f"rank{rank:03d}.npz")) as f:
        np.savez(f, params=st.be.to_host(st.params), m=st.be.to_host(opt.m),
                 v=st.be.to_host(opt.v), meta=np.array(json.dumps(meta)))
    tr.barrier()
    if rank == 0:
        _fsync_dir(tmp)
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        _fsync_dir(out)
        _point_latest(out, os.path.basename(final))
        old = [d for d in _listed(out) if d != os.path.basename(final)]
        for d in old[:max(0, len(old) - (keep - 1))]:
            shutil.rmtree(os.path.join(out, d), ignore_errors=True)
    tr.barrier()
    return final


def _listed(out):
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
        rest = _listed(out)
        prev = os.path.join(out, rest[-1]) if rest else None
        if prev:
            _point_latest(out, rest[-1])
        elif os.path.exists(os.path.join(out, LATEST)):
            os.unlink(os.path.join(out, LATEST))
    return tr.bcast(prev)


def resolve(path):
    """--resume takes a checkpoint directory or a run's -o directory: its newest complete
    checkpoint (a run killed while writing `latest` may have left it one behind)."""
    if not os.path.isdir(path):
        raise CupyGPTError("no such checkpoint directory", "resume", path)
    done = _listed(path)
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
    older = [d for d in _listed(out) if d < os.path.basename(path)]
    return CupyGPTError(f"{f}: damaged checkpoint file ({why}); " + (
        f"the previous checkpoint {os.path.join(out, older[-1])} can be resumed instead"
        if older else "no earlier checkpoint is left beside it"))


def load_meta(path, rank):
    f = os.path.join(path, f"rank{rank:03d}.npz")
    if not os.path.isfile(f):
        raise CupyGPTError(f"no {os.path.basename(f)}; was this checkpoint written by a run "
                           f"with fewer ranks?", "resume", path)
    try:
        with np.load(f) as z:
            return json.loads(str(z["meta"])), f
    except UNREADABLE as e:
        raise damaged(f, path, type(e).__name__) from None


def check_matches(path, meta, run):
    want = identity(run)
    diff = [f"{k}: checkpoint {meta.get(k)} vs now {v}" for k, v in want.items()
            if meta.get(k) != v]
    if diff:
        raise CupyGPTError(f"does not match this run ({'; '.join(diff)}); use the "
                           f"checkpoint's settings", "resume", path)


def restore(run, path):
    """Loads this rank's slice and optimizer state; returns its saved meta. Every rank
    first checks the run against rank 0's file, so all ranks report the same difference."""
    check_matches(path, load_meta(path, 0)[0], run)
    meta, f = load_meta(path, run.tr.rank)
    st, opt, be = run.stage, run.opt, run.be
    try:
        with np.load(f) as z:
            for name, dst in (("params", st.params), ("m", opt.m), ("v", opt.v)):
                if z[name].shape != dst.shape:
                    raise CupyGPTError(f"{f}: {name} has {z[name].size} values, the stage "
                                       f"{dst.size}; the file does not belong to this split")
                be.upload(dst, z[name])
    except UNREADABLE as e:
        raise damaged(f, path, type(e).__name__) from None
    opt.t = meta["adam_t"]
    return meta
