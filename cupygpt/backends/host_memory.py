"""The host's free memory as this process may use it: the kernel's MemAvailable, lowered
to what the cgroup (a container's limit) has left, where one is set."""
import os


def _read(path):
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return None


def _meminfo(key):
    text = _read("/proc/meminfo") or ""
    for line in text.splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    return None


def _cgroup_left(root="/sys/fs/cgroup"):
    """Bytes the cgroup may still allocate (its limit less what it uses, page cache it can
    drop not counted as used); None without a limit. cgroup v2, else v1."""
    for limit_f, usage_f, stat_f, cache_key in (
            ("memory.max", "memory.current", "memory.stat", "inactive_file"),
            ("memory/memory.limit_in_bytes", "memory/memory.usage_in_bytes",
             "memory/memory.stat", "total_inactive_file")):
        limit, usage = _read(os.path.join(root, limit_f)), _read(os.path.join(root, usage_f))
        if limit is None or usage is None:
            continue
        limit = limit.strip()
        if limit == "max" or int(limit) >= 2 ** 60:  # v1 writes "no limit" as a huge number
            return None
        cache = 0
        for line in (_read(os.path.join(root, stat_f)) or "").splitlines():
            k, _, v = line.partition(" ")
            if k == cache_key:
                cache = int(v)
        return max(0, int(limit) - (int(usage) - cache))
    return None


def available():
    """Free host memory, bytes (None when the kernel does not say)."""
    figures = [x for x in (_meminfo("MemAvailable"), _cgroup_left()) if x is not None]
    return min(figures) if figures else None
