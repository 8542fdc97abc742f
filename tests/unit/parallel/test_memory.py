"""Memory: what a runner allocates is what its estimate says (the estimate is the
allocators' own sizes), on every grid; more than there is is refused before allocating,
with the numbers and the fix."""
import numpy as np
import pytest
from harness import cli

from cupygpt import CupyGPTError
from cupygpt.backends import host_memory
from cupygpt.backends.numpy.backend import NumpyBackend
from cupygpt.comm.local import Local
from cupygpt.model.optim import AdamWConfig
from cupygpt.model.shape import GPT2Config, preset
from cupygpt.parallel.memory import memory_plan
from cupygpt.parallel.mesh import Mesh
from cupygpt.parallel.pipeline.plan import plan_step
from cupygpt.parallel.runner import Runner
from cupygpt.parallel.settings import StepSettings

numpy_backend = NumpyBackend()


class SmallDevice:
    """The NumPy backend pretending to be a device with 1 GiB free; allocating is an error."""
    name = "small-device"
    memory_name = "the GPU"

    def __getattr__(self, attr):
        return getattr(numpy_backend, attr)

    @staticmethod
    def device_memory():
        return 2 ** 30

    @staticmethod
    def zeros(*_):
        raise AssertionError("allocated although the memory check should have refused")


def test_refused_before_allocating_with_numbers():
    with pytest.raises(CupyGPTError) as e:
        Runner(shape=preset("d12"), be=SmallDevice(), transport=Local(), mesh=Mesh(),
               settings=StepSettings(batch=8, seq=1024, adamw=AdamWConfig()))
    msg = str(e.value)
    # (19.75 GiB with the (T, T) attention tensors, 20.3 with attproj and fcproj kept too,
    # 10.01 with the (B, T, Vp) logits kept and their exponentials in a workspace)
    assert "out of memory at start: rank 0 needs 7.37 GiB" in msg
    assert "1.00 GiB of the GPU is free" in msg and "optimizer 0.93" in msg
    assert "lower the batch size or sequence length" in msg and "pipeline stages" in msg


def allocated(run):
    """Bytes the runner's stages and optimizer hold, by kind, counted from the arrays."""
    out = dict.fromkeys(run.memory, 0)
    for st in run.stages:
        out["params"] += st.params.nbytes
        out["grads"] += st.grads.nbytes
        out["activations"] += sum(b.nbytes for b in st.acts_bufs)
        out["scratch"] += sum(b.nbytes for b in st.scratch_bufs)
    out["optimizer"] = sum(x.nbytes for state in run.opt.state for x in state.values())
    out["workspace"] = run.memory["workspace"]  # the backend's (measured by bench)
    return out


# (pp, dp, tp, zero, schedule, micro-batches): every rank of each grid is built
GRIDS = [(1, 1, 1, 0, "1f1b", 1), (2, 1, 1, 0, "1f1b", 4), (2, 2, 1, 1, "1f1b", 2),
         (1, 2, 3, 1, "gpipe", 2), (2, 1, 2, 0, "zbv", 4), (2, 1, 1, 0, "interleaved", 4),
         (3, 2, 1, 0, "zb1p", 3)]


@pytest.mark.parametrize("pp,dp,tp,zero,schedule,m", GRIDS)
def test_estimate_is_what_is_allocated_on_every_grid(pp, dp, tp, zero, schedule, m):
    shape = GPT2Config(maxT=16, V=301, Vp=320, L=6, NH=6, C=48)
    for rank in range(pp * dp * tp):
        run = Runner(shape=shape, be=numpy_backend, transport=Local(),
                     mesh=Mesh(rank, pp=pp, dp=dp, tp=tp),
                     settings=StepSettings(batch=dp * m, seq=16, micro_batches=m,
                                           schedule=schedule, adamw=AdamWConfig(),
                                           zero=bool(zero)))
        assert run.memory == allocated(run), (rank, run.memory)
        # ZeRO-1 keeps m, v and the summed gradient slice: 3 of a replica's 1/dp share
        n = run.memory["params"] // 4
        want = 3 * -(-n // dp) if zero else 2 * n
        assert abs(run.memory["optimizer"] // 4 - want) <= 3 * len(run.stages), rank


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_host_memory_reads_its_own_cgroup_and_those_above(tmp_path, version):
    """The process's cgroup (from /proc/self/cgroup under its mount), and the tightest of it
    and its parents, less what each uses (droppable page cache not counted); not the
    mount root's, which has no limit here."""
    names = (("memory.limit_in_bytes", "memory.usage_in_bytes", "total_inactive_file")
             if version == "v1" else ("memory.max", "memory.current", "inactive_file"))
    mount = tmp_path / "cg"
    job, me = mount / "job", mount / "job" / "step"
    me.mkdir(parents=True)
    for d, limit in ((mount, "max" if version == "v2" else str(2 ** 63 - 4096)),
                     (job, str(3 * 2 ** 30)), (me, "max" if version == "v2" else str(2 ** 62))):
        (d / names[0]).write_text(limit + "\n")
        (d / names[1]).write_text(str(2 ** 30 + 2 ** 28))
        (d / "memory.stat").write_text(f"anon 1\n{names[2]} {2 ** 28}\n")
    proc = tmp_path / "proc"
    proc.mkdir()
    (proc / "cgroup").write_text("4:memory:/job/step\n1:cpu:/\n" if version == "v1"
                                 else "0::/job/step\n")
    fs = "cgroup rw,memory" if version == "v1" else "cgroup2 rw"
    (proc / "mountinfo").write_text(f"30 25 0:26 / {mount} rw - {fs.split()[0]} "
                                    f"{fs.split()[0]} {fs.split()[1]}\n")
    assert host_memory.cgroup_left(str(proc)) == 2 * 2 ** 30
    (job / names[0]).write_text("max\n" if version == "v2" else str(2 ** 63 - 4096))
    assert host_memory.cgroup_left(str(proc)) is None
    assert 0 < host_memory.available()


@pytest.mark.parametrize("command", ["train", "bench"])
def test_a_batch_beyond_the_host_is_one_line(command, tmp_path):
    res = cli(command, "-b", "100000", *(["-o", tmp_path / "out"] if command == "train" else []))
    assert res.returncode == 1 and "Traceback" not in res.stderr
    line, = res.stderr.strip().splitlines()
    assert line.startswith("error: out of memory at start: rank 0 needs ")
    assert "of this host's memory is free; lower the batch size" in line
    assert not (tmp_path / "out" / "model.bin").exists()


def test_ranks_sharing_the_host_are_counted_together(tmp_path):
    """Two ranks on one host that each fit alone, not together: refused on both alike."""
    def need(rows):  # one replica's bytes at `rows` rows of tiny at T=64
        plan = plan_step(preset("tiny"), Mesh(0, dp=2), batch=2 * rows, seq=64)
        return sum(memory_plan(preset("tiny"), plan, numpy_backend, np.float32, True).values())
    rows, goal = 1, 0.6 * host_memory.available()  # the fewest rows needing 60% of it
    while need(2 * rows) < goal:
        rows *= 2
    step = rows
    while step > 1:  # (not linear in rows: the head's chunk of logits stops growing)
        step //= 2
        rows += step if need(rows + step) < goal else 0
    assert need(rows) < host_memory.available() < 2 * need(rows)
    res = cli("train", "-b", 2 * rows, "-t", "64", "--dp", "2", "-o", tmp_path, ranks=2)
    assert res.returncode == 1 and "Traceback" not in res.stderr, res.stderr
    assert "out of memory at start: the 2 ranks sharing this host's memory need" in res.stderr


def test_each_host_counts_only_its_own_ranks():
    """The check sums the ranks of each memory (a host's RAM, a GPU) apart: four ranks on
    two hosts, each host holding what its two need, pass though the four together need
    more than one host has; a host whose two ranks need more is refused on every rank."""
    from types import SimpleNamespace

    from cupygpt.parallel.memory import check_memory
    mem = {"params": 3 * 2 ** 30, "activations": 2 ** 30}  # 4 GiB a rank

    def check(frees, rank):
        every = [(f"node{r // 2}", frees[r // 2], 4 * 2 ** 30, r) for r in range(4)]
        be = SimpleNamespace(memory_domain=lambda: "", device_memory=lambda: 0,
                             memory_name="a host's RAM")
        tr = SimpleNamespace(gather=lambda mine: None, bcast=lambda obj: every)
        check_memory({**mem, "scratch": 0, "workspace": 0}, be, tr, SimpleNamespace(rank=rank))
    for rank in range(4):
        check([9 * 2 ** 30, 9 * 2 ** 30], rank)  # 8 GiB a host: fits (16 would not)
        with pytest.raises(CupyGPTError) as e:
            check([9 * 2 ** 30, 7 * 2 ** 30], rank)
        assert "the 2 ranks sharing a host's RAM need 8.00 GiB" in str(e.value)
        assert "7.00 GiB of a host's RAM is free" in str(e.value)
