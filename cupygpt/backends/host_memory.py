"""The host's free memory as this process may use it: the kernel's MemAvailable, lowered
to what this process's own memory cgroup and each cgroup above it have left (a container's
or a job's limit; v1 and v2), and to what RLIMIT_AS (`ulimit -v`) leaves of the address
space."""
from __future__ import annotations

import errno
import os
import resource


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _field(text, key):
    """The number after `key` in a "key value" listing (/proc/meminfo, memory.stat)."""
    for line in (text or "").splitlines():
        words = line.split()
        if len(words) > 1 and words[0].rstrip(":") == key:
            return int(words[1])
    return None


def _mounts(mountinfo):
    """{"v2": mount point, "v1": memory controller's mount point} from /proc/self/mountinfo
    (root: the cgroup path the mount shows, "/" outside a cgroup namespace)."""
    found = {}
    for line in (mountinfo or "").splitlines():
        left, _, right = line.partition(" - ")
        parts, (fstype, _, options) = left.split(), (right.split() + ["", "", ""])[:3]
        if fstype == "cgroup2":
            found.setdefault("v2", (parts[4], parts[3]))
        elif fstype == "cgroup" and "memory" in options.split(","):
            found.setdefault("v1", (parts[4], parts[3]))
    return found


V1 = ("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
V2 = ("memory.max", "memory.current", "inactive_file")


def _left(d, files):
    """Bytes the cgroup at directory d may still allocate (its limit less its use, page
    cache it can drop not counted), None without a limit there."""
    limit_f, usage_f, cache_key = files
    limit, usage = _read(os.path.join(d, limit_f)), _read(os.path.join(d, usage_f))
    if limit is None or usage is None or limit.strip() == "max" or int(limit) >= 2 ** 60:
        return None  # (v1 writes "no limit" as a huge number)
    cache = _field(_read(os.path.join(d, "memory.stat")), cache_key) or 0
    return max(0, int(limit) - (int(usage) - cache))


def cgroup_left(proc: str = "/proc/self") -> int | None:
    """The tightest of this process's memory cgroup and those above it, from
    /proc/self/cgroup's path under the mounted hierarchy (v1's memory controller, else
    v2's unified one); None without a limit."""
    mounts = _mounts(_read(os.path.join(proc, "mountinfo")))
    figures = []
    for line in (_read(os.path.join(proc, "cgroup")) or "").splitlines():
        _, controllers, path = line.split(":", 2)
        version = "v2" if controllers == "" else "v1" if "memory" in controllers.split(",") \
            else None
        if version not in mounts:
            continue
        point, root = mounts[version]
        rel = os.path.relpath(path, root) if path.startswith(root) else path.lstrip("/")
        d = os.path.normpath(os.path.join(point, rel))
        while True:  # up to the mount point: a parent's limit binds its children too
            figures.append(_left(d, V1 if version == "v1" else V2))
            if d == point or not d.startswith(point):
                break
            d = os.path.dirname(d)
    figures = [x for x in figures if x is not None]
    return min(figures) if figures else None


def address_space_left(proc: str = "/proc/self") -> int | None:
    """What RLIMIT_AS (`ulimit -v`) leaves of the address space beyond what is mapped
    now; None when unlimited."""
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft == resource.RLIM_INFINITY:
        return None
    size = _field(_read(os.path.join(proc, "status")), "VmSize")
    return max(0, soft - (size or 0) * 1024)


def out_of_memory(e):
    """Whether e is the host running out of memory (NumPy's MemoryError, or an OSError's
    ENOMEM)."""
    return isinstance(e, MemoryError) or getattr(e, "errno", None) == errno.ENOMEM


def address_limit() -> str:
    """`ulimit -v`, in words for a line saying memory ran out ("" when unlimited)."""
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    if soft == resource.RLIM_INFINITY:
        return ""
    return (f" under `ulimit -v {soft // 1024}` ({soft / 2 ** 30:.2f} GiB of address space): "
            f"raise it (ulimit -v unlimited), or")


def binding() -> tuple[int | None, str]:
    """(free host memory in bytes, None when the kernel does not say; what sets it, in
    words): the host's, or the tighter limit of its cgroup or `ulimit -v`, named so that an
    error says which to raise."""
    meminfo = _field(_read("/proc/meminfo"), "MemAvailable")
    soft = resource.getrlimit(resource.RLIMIT_AS)[0]
    figures = [(x, name) for x, name in (
        (meminfo and meminfo * 1024, "this host's memory"),
        (cgroup_left(), "the memory this process's cgroup allows"),
        (address_space_left(), f"the address space `ulimit -v` allows this process "
                               f"({soft / 2 ** 30:.2f} GiB)")) if x is not None]
    return min(figures, key=lambda f: f[0]) if figures else (None, "this host's memory")


def available() -> int | None:
    """Free host memory, bytes (None when the kernel does not say)."""
    return binding()[0]
