"""The grid across two hosts made on this machine: two network namespaces joined by a veth
pair, each with its own host name (a UTS namespace), MPICH's hydra launching into them
through a hostfile (its ssh launcher replaced by a script entering the host's
namespaces). --dp 2 --pp 2 on the numpy backend gives the one-host run's losses and model
bit for bit, each rank takes its index on its own host, and the run table says where
each rank runs. Skipped, saying why, where network namespaces cannot be made (not root,
no `ip`, no CAP_SYS_ADMIN)."""
import contextlib
import os
import shutil
import subprocess
import sys
import time

import pytest
from harness import ROOT, cli, losses, mpiexec

pytestmark = pytest.mark.mpi
TRAIN = ["train", "-e", "tiny", "-b", "4", "-t", "32", "-n", "3", "-v", "0", "-g", "0",
         "--dp", "2", "--pp", "2"]
LAUNCHER = """#!/bin/sh
# hydra calls this as it would ssh: [OPTIONS] HOST COMMAND; COMMAND runs in HOST's
# network namespace under HOST's name, as ssh's remote shell would run it
while [ "${1#-}" != "$1" ]; do shift; done
host=$1; shift
# a host without a namespace does not answer: ssh waits, then gives up (ConnectTimeout)
[ -f %s/$host ] || { sleep %d; echo "ssh: connect to host $host: timed out" >&2; exit 255; }
exec ip netns exec "$(cat %s/$host)" unshare --uts sh -c "hostname $host; exec $*"
"""


GIVE_UP = 12  # seconds the launcher tries a host that does not answer


def sh(*cmd):
    return subprocess.run(cmd, capture_output=True, text=True)


@pytest.fixture
def two_hosts(tmp_path):
    """{host name: its namespace}, the namespaces joined as 10.231.0.1 and .2; removed
    after the test."""
    if os.geteuid() != 0 or not shutil.which("ip") or not shutil.which("unshare"):
        pytest.skip("making network namespaces needs root and iproute2's `ip` and "
                    "util-linux's `unshare`")
    tag = f"cg{os.getpid() % 100000}"
    ns = {f"{tag}-host{k}": f"{tag}{k}" for k in "ab"}
    made = []
    try:
        for name, n in ns.items():
            res = sh("ip", "netns", "add", n)
            if res.returncode:
                pytest.skip(f"cannot make a network namespace here: {res.stderr.strip()}")
            made.append(n)
            # `ip netns exec` binds /etc/netns/NS/hosts over /etc/hosts: the names resolve
            os.makedirs(f"/etc/netns/{n}", exist_ok=True)
            with open(f"/etc/netns/{n}/hosts", "w") as f:
                f.write("127.0.0.1 localhost\n" + "".join(
                    f"10.231.0.{i + 1} {h}\n" for i, h in enumerate(ns)))
            (tmp_path / name).write_text(n)
        a, b = ns.values()
        steps = [("link", "add", f"{a}v", "type", "veth", "peer", "name", f"{b}v"),
                 *[("link", "set", f"{n}v", "netns", n) for n in (a, b)],
                 *[("-n", n, "addr", "add", f"10.231.0.{i + 1}/24", "dev", f"{n}v")
                   for i, n in enumerate((a, b))],
                 *[("-n", n, "link", "set", dev, "up") for n in (a, b) for dev in (f"{n}v", "lo")]]
        for step in steps:
            res = sh("ip", *step)
            if res.returncode:
                pytest.skip(f"cannot join the namespaces (ip {' '.join(step)}): "
                            f"{res.stderr.strip()}")
        yield ns
    finally:
        for n in made:
            sh("ip", "netns", "del", n)  # (the veth pair goes with them)
            shutil.rmtree(f"/etc/netns/{n}", ignore_errors=True)
        with contextlib.suppress(OSError):  # (when no other namespace has files there)
            os.rmdir("/etc/netns")


def launch(tmp_path, ns, slots, *args, hosts=None, wait=True):
    """mpiexec on the first host (in its namespaces), its hostfile giving each host
    `slots` ranks at a time (hosts: the hostfile's, if not the namespaces'); returns the
    finished process (wait=False: the running one)."""
    script = tmp_path / "enter"
    script.write_text(LAUNCHER % (tmp_path, GIVE_UP, tmp_path))
    script.chmod(0o755)
    (tmp_path / "hostfile").write_text("".join(f"{h}:{slots}\n" for h in hosts or ns))
    first, n = next(iter(ns.items()))
    job = [mpiexec(), "-f", str(tmp_path / "hostfile"), "-launcher", "ssh",
           "-launcher-exec", str(script), "-n", "4", sys.executable,
           os.path.join(ROOT, "cli.py"), *map(str, args)]
    p = subprocess.Popen(["ip", "netns", "exec", n, "unshare", "--uts", "sh", "-c",
                          f'hostname {first}; exec "$@"', "sh", *job],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "PYTHONUNBUFFERED": "1"})
    if wait:
        p.stdout, p.stderr = p.communicate(timeout=400)
    return p


@pytest.mark.parametrize("slots,where", [
    (2, "stage 0 on the first host, stage 1 on the second: the pipeline across them"),
    (1, "ranks alternating: each replica's pipeline on a host of its own, the dp sum "
        "across them")])
def test_a_grid_across_two_hosts_is_the_one_host_run(tmp_path, two_hosts, slots, where):
    one = cli(*TRAIN, "-o", tmp_path / "one", ranks=4)
    assert one.returncode == 0, one.stderr
    two = launch(tmp_path, two_hosts, slots, *TRAIN, "--backend", "numpy", "-o",
                 tmp_path / "two")
    assert two.returncode == 0, two.stderr + two.stdout
    assert losses(two.stdout) == losses(one.stdout) and len(losses(one.stdout)) == 3
    assert (tmp_path / "one" / "model.bin").read_bytes() == \
        (tmp_path / "two" / "model.bin").read_bytes()
    a, b = two_hosts
    hosts = [a, a, b, b] if slots == 2 else [a, b, a, b]
    for rank, host in enumerate(hosts):  # each rank's line: its host and index there
        assert f"rank {rank} = " in two.stdout
        line = next(ln for ln in two.stdout.splitlines() if f"rank {rank} = " in ln)
        assert f") on {host} as its rank {hosts[:rank].count(host)}, the CPU" in line, line


def test_a_host_that_does_not_answer_is_one_line_within_the_peer_timeout(tmp_path, two_hosts):
    """The hostfile's second host never starts its ranks (its launcher waits, as ssh on a
    dead host does, then gives up): the first host's ranks give up after --peer-timeout,
    the first of them saying so in one line, long before the launcher does; mpiexec then
    ends, failed, when the launcher gives up, with nothing written."""
    first = next(iter(two_hosts))
    p = launch(tmp_path, two_hosts, 2, "train", "-e", "tiny", "-n", "1", "--peer-timeout",
               "3", "-o", tmp_path / "o", hosts=[first, "nowhere"], wait=False)
    t0 = time.monotonic()
    try:
        lines = []  # (seconds since the launch, line)
        for line in p.stderr:
            lines.append((time.monotonic() - t0, line))
        p.wait(timeout=120)
    finally:
        p.kill()
        p.communicate()
    ended = time.monotonic() - t0
    ours = [(t, ln.strip()) for t, ln in lines if ln.startswith("error:")]
    assert [ln for _, ln in ours] == [
        f"error: --peer-timeout 3: the job's ranks did not all start within 3 s (MPI's start "
        f"takes a second or more); does every host in mpiexec's hostfile answer (and reach "
        f"this one, {first})?"], lines
    assert 3 <= ours[0][0] < GIVE_UP - 2, lines
    assert p.returncode != 0 and GIVE_UP <= ended < GIVE_UP + 30, (p.returncode, ended)
    assert not any("Traceback" in ln for _, ln in lines) and not (tmp_path / "o").exists()
