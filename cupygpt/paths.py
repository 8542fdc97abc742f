"""What a command reads and writes, checked before anything is opened for writing: no
output is one of the command's inputs (a log written over a train shard destroys it) nor
lies in the installed package; an input is a regular file (a FIFO blocks its reader
forever, /dev/zero never ends) and text or JSON is read up to a cap. The directories a
command writes into are made here, at its start (a config's validate only checks them:
check_dir), and listed, so that a command that fails removes those it made; what it
writes into is held (one command at a time) and written whole (atomic_write).
One module, the root layer's checks on files: the package root holds six at most."""
import atexit
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import re
import stat
import tempfile
import time
from contextlib import contextmanager

from . import CupyGPTError

PACKAGE = os.path.dirname(os.path.abspath(__file__))  # the package, as imported
PKG = os.path.realpath(PACKAGE)  # where its files are: no output may land there
DATA = os.path.join(PACKAGE, "data")            # shipped: tokenizer, tinyshakespeare, its shards
REFERENCE = os.path.join(PACKAGE, "reference")  # shipped: llm.c model + debug-state files
TOKENIZER = os.path.join(DATA, "gpt2_tokenizer.bin")
CHECKPOINT = re.compile(r"ckpt_\d{8}$")  # train's checkpoint directories' names (ckpt_STEP)
JSON_CAP = 256 << 20   # a trace of a long run, a log, a config: far below this
TEXT_CAP = 1 << 30     # prepare's text (tinyshakespeare is 1 MiB)
KINDS = ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a device"),
         (stat.S_ISBLK, "a device"), (stat.S_ISSOCK, "a socket"))


def not_regular(st):
    """What a stat result is when it is not a regular file, else None."""
    return None if stat.S_ISREG(st.st_mode) else next(
        (what for test, what in KINDS if test(st.st_mode)), "not a regular file")


def regular(path, kind):
    """Refuses an existing path that is not a regular file, before a reader opens it.
    (A missing one is left to the reader, whose message says it cannot open it.)"""
    try:
        what = not_regular(os.stat(path))
    except OSError:
        return
    if what:
        raise CupyGPTError(f"{path}: is {what}, not a regular file; give a {kind} file")


def read_bounded(path, kind, cap=JSON_CAP, text=True):
    """A text or JSON input's bytes: a regular file of at most cap bytes (OSError for the
    caller to word); text: its UTF-8 byte-order mark left out (Windows editors write one,
    and JSON's parser refused it)."""
    regular(path, kind)
    with open(path, "rb") as f:
        data = f.read(cap + 1)
    if len(data) > cap:
        raise CupyGPTError(f"{path}: larger than {cap >> 20} MiB, more than any {kind} "
                           f"cupygpt reads; is this the right file?")
    return data.removeprefix(b"\xef\xbb\xbf") if text else data


def loads(text):
    """json.loads of an input, every failure a json.JSONDecodeError (a ValueError): nesting
    deeper than Python's recursion (a RecursionError) and an integer past its digit limit
    (a bare ValueError) were tracebacks in every reader."""
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise
    except RecursionError:
        raise json.JSONDecodeError("nested too deeply", "", 0) from None
    except ValueError as e:
        raise json.JSONDecodeError(str(e).split(";")[0], "", 0) from None


def json_object(path, kind):
    """A JSON file that holds an object: the dict; anything else is refused (never
    replaced: it may be the user's)."""
    try:
        obj = loads(read_bounded(path, kind))
    except (OSError, ValueError) as e:
        obj = e
    if not isinstance(obj, dict):
        raise CupyGPTError(f"{path}: not a {kind} (not a JSON object: "
                           f"{getattr(obj, 'strerror', None) or obj}); move it away or write "
                           f"elsewhere")
    return obj


def shown(path):
    """A path as text to draw or print (a name that is not UTF-8: its bytes replaced)."""
    return os.fsencode(path).decode("utf-8", "replace")


def files_of(path):
    """The files a path argument is read from: a directory's entries (a transformers
    model), else the path itself."""
    if not path:
        return []
    if os.path.isdir(path):
        return [os.path.join(path, f) for f in sorted(os.listdir(path))]
    return [path]


def _same(a, b):
    """One file: equal resolved paths, or one inode (a hard link)."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        sa, sb = os.stat(a), os.stat(b)
    except OSError:
        return False
    return (sa.st_dev, sa.st_ino) == (sb.st_dev, sb.st_ino)


def in_package(path):
    real = os.path.realpath(path)
    return real == PKG or real.startswith(PKG + os.sep)


# compressed formats by their magic bytes: (name, the command that decompresses)
COMPRESSED = {b"\x1f\x8b": ("gzip", "gunzip -k"), b"BZh": ("bzip2", "bunzip2 -k"),
              b"\xfd7zXZ\x00": ("xz", "unxz -k"), b"\x28\xb5\x2f\xfd": ("zstd", "unzstd"),
              b"PK\x03\x04": ("zip", "unzip")}


def not_compressed(path, head):
    """Refuses a text input whose first bytes (head) are a compressed format's magic, by
    that format's name (its bytes would only be called "not UTF-8")."""
    for magic, (name, how) in COMPRESSED.items():
        if head.startswith(magic):
            raise CupyGPTError(f"{path}: {name}-compressed; decompress it first ({how})")


def link_into_package(path):
    """The link on path's way that leads into the package (a clone's data/ is one), as the
    path spells it; None when the path itself lies there."""
    parts, p = os.path.normpath(path).split(os.sep), ""
    for part in parts:
        p = os.path.join(p, part) if p or part else os.sep
        if os.path.islink(p) and in_package(p):
            return p
    return None


def check_outputs(outputs, inputs):
    """outputs: (config field, path written, or a directory written into) pairs; inputs:
    the paths the command reads. Refuses an output in the installed package, an output
    that is an input or another output (--trace X --log-file X: the trace over the log),
    and an existing output that is no regular file (replacing /dev/null as root would
    replace the device)."""
    for i, (name, path) in enumerate(outputs):
        if path is None:
            continue
        for other, earlier in outputs[:i]:
            if earlier is not None and other != name and _same(path, earlier):
                raise CupyGPTError("is also another of this command's outputs; one would "
                                   "be written over the other: give each its own path", name,
                                   path)
        if in_package(path):
            link = link_into_package(path)
            how = (f" through {link}, a link to its {os.path.relpath(os.path.realpath(link), PKG)}"
                   f" (as a clone's data is)" if link else "")
            raise CupyGPTError(f"lies in the installed package ({PKG}){how}, whose files are "
                               f"cupygpt's own; give a path outside it", name, path)
        for src in inputs:
            if _same(path, src):
                raise CupyGPTError(f"is also an input of this command ({src}); writing it "
                                   f"would destroy that: give another path", name, path)
        try:
            what = not_regular(os.stat(path))
        except OSError:
            continue
        if what and what != "a directory":  # (a directory: out_file says so)
            raise CupyGPTError(f"is {what}, not a file or directory this command can write; "
                               f"give another path", name, path)


MADE = []  # the directories make_dir created (and claimed files), in order: a failure removes them


def _nearest(path):
    """(path's missing directories, innermost first; the nearest one that exists)."""
    missing, p = [], os.path.abspath(path)
    while not os.path.lexists(p):
        missing.append(p)
        p = os.path.dirname(p)
    return missing, p


def check_dir(name, path):
    """What make_dir would refuse, seen without making anything (a config's validate makes
    no directory): path a file, a dangling link on its way, its nearest existing directory
    none or not writable. As root, access() says yes to /proc: make_dir's probe finds it."""
    _, p = _nearest(path)
    if os.path.exists(path) and not os.path.isdir(path):
        raise CupyGPTError("is a file, not a directory; give a directory", name, path)
    if os.path.islink(p) and not os.path.exists(p):
        raise CupyGPTError(f"{p} is a symbolic link to {os.readlink(p)!r}, which does not "
                           f"resolve (missing, or a loop); give a directory", name, path)
    # the words os.makedirs' and the probe's errors would give
    if not os.path.isdir(p):
        raise CupyGPTError(f"cannot create this directory ({os.strerror(errno.ENOTDIR)})",
                           name, path)
    if not os.access(p, os.W_OK | os.X_OK):
        code = errno.EROFS if os.statvfs(p).f_flag & os.ST_RDONLY else errno.EACCES
        what = "write files in" if p == os.path.abspath(path) else "create"
        raise CupyGPTError(f"cannot {what} this directory ({os.strerror(code)})", name, path)


def _to_make(path):
    """The directories makedirs(path) makes, outermost first, spelled as path does (made
    absolute): `ghost/../pd` makes ghost too, which a normalized path would not show. Past
    the first one missing, a prefix resolves through fresh directories, so normalized."""
    parts, out, fresh = path.split(os.sep), [], False
    for i, part in enumerate(parts):
        prefix = os.sep.join(parts[:i + 1]) or os.sep
        if part in ("", ".", "..") or os.path.lexists(os.path.abspath(prefix) if fresh
                                                       else prefix):
            continue
        fresh = True
        out.append(prefix if os.path.isabs(prefix) else os.path.join(os.getcwd(), prefix))
    return out


def make_dir(name, path):
    """path made (with its missing parents) and writable; what it made is listed in MADE."""
    check_dir(name, path)
    missing = _to_make(path)
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        raise CupyGPTError(f"cannot create this directory ({e.strerror})", name, path) from None
    finally:  # (what it made before failing too)
        MADE.extend(d for d in missing if os.path.isdir(d))
    try:  # a file made and removed: access() says yes to root on /proc or /sys
        fd, probe = tempfile.mkstemp(dir=path, prefix=".cupygpt-probe-")
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise CupyGPTError(f"cannot write files in this directory ({e.strerror})", name,
                           path) from None


def unmake_dirs():
    """A command that failed: the directories it made go, the innermost first, where
    empty (what it wrote into one is kept); so do the empty files train's claim made to
    hold them (its log), listed after their directory."""
    for d in reversed(MADE):
        try:
            if os.path.isdir(d):
                os.rmdir(d)
            elif os.path.getsize(d) == 0:
                os.unlink(d)
        except OSError:
            pass  # (not empty: something of the command's is worth keeping)
    MADE.clear()


def file_dir(act, name, path):
    """act (check_dir or make_dir) on the directory of a file the command writes; a refusal
    names the file's flag and path, then its directory."""
    try:
        act(name, os.path.dirname(os.path.abspath(path)))
    except CupyGPTError as e:
        raise CupyGPTError(f"in {e.value}: {e.args[0]}", name, path) from None


def make_parent(name, path, writer=True, overwrite=None):
    """The directory of a file the command writes (None: not asked for), made at the
    command's start: its validate checked it (config/sections.out_file) and made nothing;
    then the file claimed (claim_file) by the process that writes it (writer: under
    mpiexec, rank 0; every rank makes the directory, a disk of its own perhaps). overwrite
    False: a file there now is refused again, once claimed (a command that ended between
    the validate's look and this claim wrote it: two verify --trace X at once both ran)."""
    if path is not None:
        file_dir(make_dir, name, path)
        if writer:
            claim_file(name, path)
            if overwrite is False and os.path.lexists(path):
                raise CupyGPTError("exists (another command wrote it since this one "
                                   "started); add --overwrite to replace it, or give another "
                                   "path", name, path)


def claim_file(name, path):
    """A file the command writes (at its end: atomic_write), claimed at its start as a
    directory is (claim): a second command writing it is refused, naming the first's PID
    (two bench --trace X ran, and the last to end won). The lock is on a file of its own
    in a directory of this user's among the system's temporary files (claim_key), named by
    the path's real name, so the command leaves nothing beside its output; where that
    directory cannot be made (no writable temporary directory), nothing is claimed. A file
    or directory another command holds as train holds its log and -o is refused too (plot
    --out RUN/log.jsonl replaced a live run's log)."""
    for held, what in ((path, "this file"), (os.path.dirname(os.path.abspath(path)),
                                             "into its directory")):
        pid = holder(held) if os.path.exists(held) else None  # (a run's log, its -o)
        if pid and pid != os.getpid():
            raise CupyGPTError(f"another command (pid {pid}) is writing {what}; wait for it "
                               f"to end, or give another path", name, path)
    try:  # (no usable temporary directory: gettempdir raises FileNotFoundError)
        key = claim_key(path)
        os.makedirs(os.path.dirname(key), mode=0o700, exist_ok=True)
        st = os.lstat(os.path.dirname(key))
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
            return  # (another user's, or writable by others: claim nothing there)
        sweep(os.path.dirname(key))
        fd, why = _lock_key(key)
    except OSError:
        return
    if why:
        raise CupyGPTError(why, name, path)
    if fd is not None:
        HELD.append(fd)
        CLAIMED.append((key, fd))


def _lock_key(key):
    """(an fd holding the lock of the claim file key, None), (None, the refusal), or
    (None, None) where key is no regular file. A key that sweep removed while this opened
    it (it holds the lock only to remove it) is made afresh."""
    for _ in range(3):
        # (a FIFO there blocked an open; a link would make its target)
        fd = os.open(key, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o600)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            return None, None
        inode = os.fstat(fd).st_ino
        fd, why = lock(key, fd)
        if fd is not None and _is(key, inode):
            return fd, None
        if fd is not None:
            os.close(fd)
            continue
        time.sleep(0.05)  # (a sweep holds a stale file's lock only to remove it)
        if _is(key, inode):
            return None, why  # (a live command's)
    return None, why


def _is(path, inode):
    """Whether path is still the file of that inode."""
    try:
        return os.stat(path, follow_symlinks=False).st_ino == inode
    except OSError:
        return False


def sweep(directory):
    """Removes the claim files no command holds (one was left for every path ever claimed),
    each while holding its lock: a command that opened it meanwhile finds it gone once it
    has the lock, and makes it afresh (_lock_key)."""
    try:
        names = os.listdir(directory)
    except OSError:
        return
    for name in names:
        key = os.path.join(directory, name)
        try:
            fd = os.open(key, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            if stat.S_ISREG(os.fstat(fd).st_mode) and _is(key, os.fstat(fd).st_ino):
                os.unlink(key)
        except OSError:
            pass  # (held: a live command's claim)
        finally:
            os.close(fd)


@atexit.register
def _unclaim():
    """This process's claim files go as it ends, each still locked (sweep takes what a
    killed one left)."""
    for key, fd in CLAIMED:
        with contextlib.suppress(OSError):
            if _is(key, os.fstat(fd).st_ino):
                os.unlink(key)


def claim_key(path):
    """The file whose lock claims path (claim_file): in /tmp, whatever $TMPDIR says (a job
    scheduler gives each job a TMPDIR of its own, where two jobs never saw each other's
    claims), else in the temporary directory Python finds."""
    base = "/tmp" if os.access("/tmp", os.W_OK | os.X_OK) else tempfile.gettempdir()
    return os.path.join(base, f"cupygpt-{os.getuid()}-claims", hashlib.blake2b(
        os.fsencode(os.path.realpath(path)), digest_size=12).hexdigest())


def holder(path):
    """The PID holding a flock on path, from /proc/locks (None where it does not say)."""
    st = os.stat(path)
    ident = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    try:
        with open("/proc/locks") as f:
            rows = [line.split() for line in f]
    except OSError:
        return None
    # "1: FLOCK  ADVISORY  WRITE 1234 fd:01:5678 0 EOF"; a waiter's row has "->" after 1:
    return next((int(r[4]) for r in rows if len(r) > 5 and r[1] == "FLOCK" and r[5] == ident),
                None)


def lock(path, fd=None):
    """An fd of the directory path (or fd: the file path, open) holding its exclusive lock
    (closed when the process ends, however it ends), or the refusal: one command writes
    into a directory, or appends to a file (train's log: hold), at a time."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY) if fd is None else fd
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        pid = None
        with contextlib.suppress(OSError):  # (a claim file swept meanwhile: no holder)
            pid = holder(path)
        what = "into this directory" if os.path.isdir(path) else "this file"
        return None, (f"another command ({f'pid {pid}' if pid else 'another process'}) "
                      f"is writing {what}; wait for it to end, or give another "
                      f"{'directory' if what.endswith('directory') else 'path'}")
    return fd, None


def hold(path):
    """(an fd of the file path holding its lock, whether this call made it (empty), the
    refusal): a file a command appends to for its life, as train's log, is held as the
    directory it writes into is (lock)."""
    try:
        try:
            fd, made = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_EXCL, 0o666), True
        except FileExistsError:
            fd, made = os.open(path, os.O_RDONLY), False
    except OSError as e:
        return None, False, f"cannot open it ({e.strerror})"
    fd, why = lock(path, fd)
    return fd, made, why


HELD = []  # claim's locks, held until the process ends
CLAIMED = []  # (claim file, its fd in HELD) of claim_file: removed at the end


def held_above(path):
    """The refusal of a directory inside one that another command writes into (a run's -o
    nested in a live run's would sit among that run's checkpoints), or None."""
    up = os.path.realpath(path)
    while up != (up := os.path.dirname(up)):
        with contextlib.suppress(OSError):  # (/proc/locks unreadable: holder says None)
            pid = holder(up)
            if pid and pid != os.getpid():
                return (f"lies inside {up}, which another command (pid {pid}) is writing "
                        f"into; wait for it to end, or give a directory outside it")
    return None


def claim(name, out):
    """Every command that writes into a directory claims it first (train's -o: rundir):
    a second command writing there, or inside it, is refused, naming the first's PID; only
    then does it look at what the directory holds (an earlier output is replaced only when
    asked)."""
    why = held_above(out)
    if why:
        raise CupyGPTError(why, name, out)
    fd, why = lock(out)
    if why:
        raise CupyGPTError(why, name, out)
    HELD.append(fd)


UMASK = os.umask(0)
os.umask(UMASK)


@contextmanager
def atomic_write(path):
    """Yields a file object; the file appears under path only if the block completes."""
    path = os.fspath(path)
    d = os.path.dirname(os.path.abspath(path))
    try:
        os.makedirs(d, exist_ok=True)
        # (the name cut so that its 13 more characters keep a legal name legal)
        fd, tmp = tempfile.mkstemp(dir=d, prefix=os.path.basename(path)[:200] + ".",
                                   suffix=".tmp")
    except OSError as e:
        raise CupyGPTError(f"{path}: cannot write here ({e.strerror})") from None
    try:
        with os.fdopen(fd, "wb") as f:
            yield f
            f.flush()
            os.fchmod(f.fileno(), 0o666 & ~UMASK)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        with contextlib.suppress(FileNotFoundError):  # (a signal just after the rename)
            os.unlink(tmp)
        if full(e):
            raise disk_full(path, e) from None
        if isinstance(e, OSError):  # (the rename: a directory or link where the file goes)
            raise CupyGPTError(f"{path}: cannot write it ({e.strerror}); nothing was "
                               f"written there") from None
        raise


# what a write that found no room met, by errno: its words, and what to do
FULL = {errno.ENOSPC: ("disk full (or over quota)", "free some space"),
        errno.EDQUOT: ("disk full (or over quota)", "free some space"),
        errno.EFBIG: ("over the file-size limit (ulimit -f)", "raise it (ulimit -f unlimited)")}


def full(e):
    """FULL's words for e when it says there is no room (else None): an OSError's errno,
    or the OS's error quoted by a library that raises its own type (safetensors: "...
    (os error 28)")."""
    if isinstance(e, OSError):
        return FULL.get(e.errno)
    return next((w for n, w in FULL.items() if isinstance(e, Exception) and
                 f"(os error {n})" in str(e)), None)


def disk_full(path, e):
    """The one line for a write that found no room (the partial output already removed)."""
    what, fix = full(e)
    return CupyGPTError(f"{path}: {what} while writing it; nothing was written there: "
                        f"{fix} and run again")
