"""The process grid: every group derived from one arange, in Megatron's order; and the
runner refusing an action it does not know."""
import numpy as np
import pytest

from cupygpt import CupyGPTError
from cupygpt.backends.numpy.backend import NumpyBackend
from cupygpt.comm.local import Local
from cupygpt.model.shape import GPT2Config
from cupygpt.parallel.mesh import Mesh
from cupygpt.parallel.pipeline.executor import Pass
from cupygpt.parallel.pipeline.schedule import Action, Op
from cupygpt.parallel.runner import Runner
from cupygpt.parallel.settings import StepSettings

numpy_backend = NumpyBackend()


def own(m, axis):
    """m's rank's group along axis, as groups() lists it."""
    return next(g for g in m.groups(axis) if m.rank in g)


@pytest.mark.parametrize("pp,dp,tp", [(1, 1, 1), (4, 1, 1), (2, 2, 2), (3, 1, 2), (2, 3, 1)])
def test_groups_partition_the_world(pp, dp, tp):
    world = pp * dp * tp
    meshes = [Mesh(r, pp, dp, tp) for r in range(world)]
    for axis, size in (("pp", pp), ("dp", dp), ("tp", tp)):
        groups = Mesh(0, pp, dp, tp).groups(axis)
        assert sorted(r for g in groups for r in g) == list(range(world))  # a partition
        assert all(len(g) == size for g in groups)
        assert all(Mesh(r, pp, dp, tp).groups(axis) == groups for r in range(world))
    for m in meshes:
        stage, replica, shard = m.coords
        assert m.rank == (stage * dp + replica) * tp + shard  # tp fastest, then dp, then pp
        assert own(m, "tp") == list(range(m.rank - shard, m.rank - shard + tp))  # neighbours
        assert own(m, "dp") == [m.rank_at(stage, r, shard) for r in range(dp)]
        assert own(m, "pp") == m.pipeline and m.pipeline[m.stage] == m.rank
        if m.stage < pp - 1:  # the next stage: same replica and shard, one stage on
            nxt = meshes[m.stage_rank(m.stage + 1)]
            assert nxt.stage == m.stage + 1 and nxt.coords[1:] == m.coords[1:]
            assert nxt.stage_rank(m.stage) == m.rank and m.ring(1) == nxt.rank
        at = meshes[m.rank_at(*m.coords)]
        assert at.coords == m.coords


def test_tied_pair_and_point_to_point_pairs():
    pairs = Mesh(0, 3, 2, 1).pairs()
    assert pairs == sorted(pairs)
    assert {(a, b) for a, b, k in pairs if k == "tied"} == {(0, 4), (1, 5)}
    ring = {(0, 2), (2, 4), (4, 0), (1, 3), (3, 5), (5, 1)}  # the pipelines, wrapping round
    for kind in ("act", "grad"):
        assert {(a, b) for a, b, k in pairs if k == kind} == ring | {(b, a) for a, b in ring}
    assert [(a, b, k) for a, b, k in Mesh(0, 2).pairs() if k != "tied"] == [
        (0, 1, "act"), (0, 1, "grad"), (1, 0, "act"), (1, 0, "grad")]  # two stages: once each way
    assert Mesh(0, 1, 2, 2).pairs() == []
    assert [Mesh(r, 3).ring(1) for r in range(3)] == [1, 2, 0]
    assert [Mesh(r, 3).ring(-1) for r in range(3)] == [2, 0, 1]


def test_device_round_robin():
    assert [Mesh(r, 4).device(2) for r in range(4)] == [0, 1, 0, 1]


def test_a_ranks_gpu_is_its_index_on_its_host():
    """Two nodes of 4 GPUs, 8 ranks (--dp 2 --pp 2 --tp 2): ranks 4..7 on the second node
    take its GPUs 0..3, not 4..7 (which it lacks); hosts in any order of ranks."""
    hosts = ("a",) * 4 + ("b",) * 4
    grid = [Mesh(r, 2, 2, 2, hosts) for r in range(8)]
    assert [m.device(4) for m in grid] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [m.local_size for m in grid] == [4] * 8 and grid[5].host == "b"
    mixed = ("b", "a", "b", "a")  # a launcher placing ranks round-robin over the hosts
    assert [Mesh(r, 2, 2, 1, mixed).device(8) for r in range(4)] == [0, 0, 1, 1]
    assert [Mesh(r, 1, 3, 1, ("a", "a", "b")).local_size for r in range(3)] == [2, 2, 1]


def test_runner_refuses_an_unknown_action():
    cfg = GPT2Config(maxT=8, V=16, Vp=16, L=1, NH=2, C=8)
    run = Runner(shape=cfg, be=numpy_backend, transport=Local(), mesh=Mesh(),
                 settings=StepSettings(batch=2, seq=4))
    x = np.zeros((2, 4), np.int32)
    run.eval_loss(x, x)  # the real actions run
    with pytest.raises(CupyGPTError, match="rank 0: unknown pipeline action 'fwd_typo'"):
        run.exec.run([Action(Op.FWD, 0), Action("fwd_typo", 0)], Pass())


def test_default_split_balances_the_counted_cost():
    """The last stage carries the LM head, so by default it takes fewer blocks: the split
    minimises the largest stage's counted cost; an even split would not."""
    from cupygpt.model.shape import preset
    from cupygpt.parallel.pipeline.plan import plan_split, stage_shares
    d12 = preset("d12")
    for p in (2, 3, 4):
        counts = plan_split(d12, 1024, p)
        assert sum(counts) == 12 and min(counts) >= 1 and counts[-1] < counts[0]
        even = [12 // p] * p
        assert max(stage_shares(d12, 1024, counts)) < max(stage_shares(d12, 1024, even))
    assert plan_split(d12, 1024, 2) == [8, 4]  # shares 0.49 and 0.51
    assert plan_split(preset("tiny"), 64, 2) == [3, 1]  # GPT-2's vocab outweighs 4 blocks
    assert plan_split(d12, 64, 3, "4,4,4") == [4, 4, 4]  # --split is taken as given
