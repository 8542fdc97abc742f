"""A training run's output directory (-o): one run at a time, holding an advisory lock
for its life; a fresh run does not replace another run's output unless asked; the disk
holds what the run will write before step 1; a run that fails before its first step
leaves no directory it made. The run's start makes its directories (its config's validate
checked them and made none): --trace's and a --log-file's elsewhere, then -o."""
import math
import os
import resource
import shutil

from .. import CupyGPTError
from ..formats.checkpoint import LATEST, NAME, STATE, listed, named, newer
from ..formats.llmc import HEADER_BYTES
from ..model.layout import param_layout
from ..paths import MADE, held_above, hold, holder, lock, make_dir, make_parent, not_regular

MODEL = "model.bin"


def earlier_output(out, log_file):
    """What a fresh run would replace in out: an earlier run's model, log, checkpoints (a
    --log-file elsewhere is log_elsewhere's)."""
    found = [os.path.basename(p) for p in (os.path.join(out, MODEL), log_file)
             if os.path.exists(p) and not log_elsewhere(out, p)]
    done = listed(out)
    if done:
        found.append(f"{len(done)} checkpoint(s), the newest {done[-1]}, which a resume "
                     f"from it would take for this run's")
    return found


def misshapen(out):
    """What in out the run would write over that is not of the kind it writes (a directory
    or FIFO named model.bin or latest, a file named as a checkpoint): one line at the
    start, resumed, replaced or fresh (the run died at its first write, the trained model
    lost). A link is judged by what it names; one that names nothing is replaced."""
    for name in (MODEL, LATEST):
        try:
            what = not_regular(os.stat(os.path.join(out, name)))
        except FileNotFoundError:
            continue
        if what:
            return (f"{os.path.join(out, name)} is {what}, where this run writes its "
                    f"{'model' if name == MODEL else 'newest checkpoint name'}; move it away, "
                    f"or give another -o")
    for name in named(out):
        path = os.path.join(out, name)
        if not os.path.isdir(path):
            return (f"{path} is not a directory, and is named as this run's checkpoints are; "
                    f"move it away, or give another -o")
        other = sorted(set(os.listdir(path)) - {MODEL, STATE})
        pid = holder(path)
        if other or (pid and pid != os.getpid()):  # (--overwrite would remove it)
            return (f"{path} is named as this run's checkpoints are, and is " + (
                f"another command's output (pid {pid})" if pid else
                f"no checkpoint (it holds {other[0]})") + "; move it away, or give another -o")
    return None


def log_elsewhere(out, log_file):
    """Whether the log is not in out (a --log-file of its own): refused by that name."""
    return os.path.realpath(os.path.dirname(os.path.abspath(log_file))) != os.path.realpath(out)


def replace_earlier(out):
    """--overwrite: the earlier run's checkpoints go (a resume would take them for this
    run's); its model and log are replaced as this run writes its own."""
    for name in named(out):  # (checkpoints: misshapen refused anything else)
        shutil.rmtree(os.path.join(out, name))
    for name in os.listdir(out):  # (those a NaN loss renamed)
        if name.endswith(".nan") and NAME.match(name.removesuffix(".nan")):
            shutil.rmtree(os.path.join(out, name), ignore_errors=True)
    if os.path.exists(os.path.join(out, LATEST)):
        os.unlink(os.path.join(out, LATEST))


def checkpoints_held(config):
    """The most checkpoints this run's -o holds at once (a bound: a resume writes fewer):
    while the last one is written, --keep newest before it, and the older ones at -nm's
    multiples (never removed). Counted, not listed: -n may be 10^9 steps."""
    every, steps = config.checkpoint_every, config.steps
    if not every:
        return 0
    saves = steps // every + (steps % every != 0)      # every K steps, and the last
    older = saves - 1 - min(config.keep, saves - 1)       # before the newest --keep
    major = config.checkpoint_major
    kept = (older * every) // math.lcm(every, major) if major and older else 0
    return 1 + min(config.keep, saves - 1) + kept


def need_bytes(shape, bf16, config):
    """What a run writes at most at once: (checkpoints, bytes, the largest file's bytes and
    name): its model file and the checkpoints it holds at once (each the model again,
    AdamW's m and v, a bf16 run's fp32 master weights, a little for its state)."""
    n = param_layout(shape).size
    model = HEADER_BYTES + n * (2 if bf16 else 4)
    held = checkpoints_held(config)
    state = 4 * n * (3 if bf16 else 2) + (1 << 20)
    largest = (state, f"a checkpoint's {STATE}") if held and state > model else (model, MODEL)
    return held, model + held * (model + state), largest


def over_limit(size):
    """The words for a file of size bytes that the file-size limit (RLIMIT_FSIZE) does not
    let be written, else None: ulimit -f counts KiB."""
    limit = resource.getrlimit(resource.RLIMIT_FSIZE)[0]
    if limit == resource.RLIM_INFINITY or size <= limit:
        return None
    return (f"over the file-size limit (ulimit -f {limit >> 10}: {limit / 2**20:.1f} MiB); "
            f"raise it (ulimit -f unlimited)")


def on_disk(path):
    """The bytes path's regular files take on their filesystem (blocks, not lengths)."""
    return sum(os.lstat(os.path.join(d, f)).st_blocks * 512
               for d, _, files in os.walk(path) for f in files)


def room(out, need, resumed=False, keep=0):
    """Refuses a run whose files will not fit on out's filesystem, or whose largest file
    the file-size limit (ulimit -f) would cut off after hours of training. resumed: a run
    continuing in out, whose newest keep checkpoints there are among those need counts
    (a run stopped by a full disk resumes with the room its checkpoints already take)."""
    held, need, (largest, name) = need
    over = over_limit(largest)
    if over:
        return (f"this run writes {name} of {largest / 2**20:.1f} MiB, {over}, or train a "
                f"smaller model")
    st = os.statvfs(out)
    there = listed(out)[-min(keep, held - 1):] if resumed and held > 1 and keep else []
    free, own = st.f_bavail * st.f_frsize, sum(on_disk(os.path.join(out, c)) for c in there)
    if free + own < need:
        return (f"its filesystem has {free / 2**20:.1f} MiB free" + (
                    f" (and {own / 2**20:.1f} MiB in the checkpoints it keeps)" if own else "") +
                f" and this run writes {need / 2**20:.1f} MiB (the final model" + (
                    f" and the {held} checkpoint(s) it holds at once: --keep's newest, the "
                    f"one being written, -nm's" if held else "") +
                "); free some space, give another -o" + (
                    ", or lower --keep" if held > 1 else ""))
    return None


def make_parents(config, rank):
    """--trace's directory and a --log-file's outside -o, made (claim makes -o), in the
    order validate checked them."""
    make_parent("trace", config.trace, rank == 0, config.overwrite)
    if config.log_file != os.path.join(config.out, "log.jsonl"):  # (the default's is -o)
        make_parent("log_file", config.log_file, rank == 0)


def claim(config, transport, need):
    """Collective, before anything is allocated: every rank makes -o (each checked it, and
    may write on a disk of its own), then rank 0 locks it and the log for the run's life
    and checks what -o holds and its room; every rank raises the same refusal. Returns
    what unmake needs: the lock's fd on rank 0 (None elsewhere), whether any rank made -o
    (the ranks start at once: the one that made it need not be rank 0), the identity of
    the directory rank 0 locked (None: not locked), and that of the log rank 0 made to
    hold it (None: it made none)."""
    made_here = not os.path.isdir(config.out)
    make_dir("out", config.out)
    fd, why, log_made, made = None, None, False, transport.any(made_here)
    if transport.rank == 0:
        fd, why, log_made = _claim_here(config, need)
    why, locked, log = transport.bcast((why, _identity(config.out) if fd is not None else None,
                                 _identity(config.log_file) if log_made else None))
    claimed = (fd, made, locked, log)
    if why:
        unmake(config, transport, claimed)
        if fd is not None:
            os.close(fd)
        raise CupyGPTError(why[2], why[0], why[1])
    return claimed


def _claim_here(config, need):
    """claim's work on rank 0: (-o's lock fd, the refusal as (field, path, why) or None,
    whether it made the log, empty, to hold it). The log, written for the run's life, is
    held as -o is, until the process ends (hold): a second run given the same --log-file
    (another -o) would interleave its lines with this one's. What an earlier run left is
    replaced last, once nothing refuses."""
    fd, why = lock(config.out)
    why = why or held_above(config.out)
    if why:
        if fd is not None:
            os.close(fd)
        return None, ("out", config.out, why), False
    real = os.path.realpath(config.out)  # a resume continues its own directory:
    own = config.resume and any(  # (a ckpt_ there may be a link to another run's)
        os.path.commonpath([os.path.realpath(p), real]) == real
        for p in (config.resume, os.path.dirname(os.path.abspath(config.resume))))
    found = [] if own else earlier_output(config.out, config.log_file)
    why = misshapen(config.out)
    if found and not config.overwrite and not why:
        why = (f"holds an earlier run's output ({'; '.join(found)}); " +
               (f"add --resume {config.out} to continue that run, " if listed(config.out)
                else "") + "add --overwrite to replace it, or give another -o")
    why = why or room(config.out, need, own, config.keep)
    if why:
        return fd, ("out", config.out, why), False
    log = config.log_file
    log_fd, log_made, why = hold(log)
    if why:
        return fd, ("log_file", log, why), False
    if log_elsewhere(config.out, log) and not log_made and not config.overwrite:
        os.close(log_fd)
        link = f", a link to {os.readlink(log)!r}" if os.path.islink(log) else ""
        return fd, ("log_file", log, f"exists{link}; add --overwrite to replace it, or "
                                     f"give another --log-file"), False
    if found:
        replace_earlier(config.out)
    later = newer(config.out, config.resume) if own else []  # (--overwrite's: validate)
    for name in later:
        shutil.rmtree(os.path.join(config.out, name))
    if later and os.path.lexists(os.path.join(config.out, LATEST)):  # (it named one of
        os.unlink(os.path.join(config.out, LATEST))  # them; the resumed run writes its own)
    return fd, None, log_made


def _identity(path):
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


def unmake(config, transport, claimed):
    """A run that failed before its first step: the log claim made goes, when empty (its
    first line comes later), and the -o it made, when empty (its lock held, so no other
    run's). claimed: claim's answer. Any rank that sees them (a filesystem the ranks share)
    counts them among what the command made, which the CLI removes once the job's end is
    settled: a rank failing alone aborts the others before they could, and until that
    abort rank 0 may still be writing there."""
    _, made, locked, log = claimed
    for path, ident in ((config.out, locked if made else None), (config.log_file, log)):
        path = os.path.abspath(path)  # (-o first: the log in it goes before it)
        if ident is not None and _identity(path) == ident and path not in MADE:
            MADE.append(path)
