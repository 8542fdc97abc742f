"""Schedules as data: deadlock-free, right bubble, right number of activation slots."""
import pytest

from cupygpt.parallel.pipeline.schedule import Action, SCHEDULES, forward_only, slot_plan
from cupygpt.parallel.pipeline.simulate import simulate


@pytest.mark.parametrize("name", SCHEDULES)
@pytest.mark.parametrize("capacity", [1, 2])
def test_deadlock_free_with_the_textbook_bubble(name, capacity):
    for p in range(1, 9):
        for m in range(1, 33):
            r = simulate(p, m, SCHEDULES[name], capacity=capacity)
            assert r["bubble"] == pytest.approx((p - 1) / (m + p - 1), abs=1e-12), (p, m)


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_microbatch_goes_forward_then_back_once(name):
    for p in range(1, 6):
        for m in range(1, 9):
            for r in range(p):
                acts = SCHEDULES[name](p, m, r)
                fwd = [a.mb for a in acts if a.op == "fwd"]
                bwd = [a.mb for a in acts if a.op == "bwd"]
                assert sorted(fwd) == sorted(bwd) == list(range(m))
                assert all(acts.index(Action("fwd", i)) < acts.index(Action("bwd", i))
                           for i in range(m))
                assert acts[-1].op == "step"


def test_one_micro_batch_makes_the_schedules_the_same():
    """So the multi-process tests run gpipe only with several micro-batches: with one, the
    runner gets the very actions 1f1b gives it."""
    for p in range(1, 6):
        for r in range(p):
            assert SCHEDULES["gpipe"](p, 1, r) == SCHEDULES["1f1b"](p, 1, r), (p, r)
    assert SCHEDULES["gpipe"](2, 2, 1) != SCHEDULES["1f1b"](2, 2, 1)  # several: they differ


def test_activation_slots():
    p, m = 4, 8
    assert [slot_plan(SCHEDULES["1f1b"](p, m, r))[0] for r in range(p)] == [4, 3, 2, 1]
    assert [slot_plan(SCHEDULES["gpipe"](p, m, r))[0] for r in range(p)] == [8] * 4
    assert slot_plan(forward_only(p, m, 2))[0] == 1


def test_simulator_finds_a_deadlock():
    def backwards_first(p, m, r):  # stage 0 waits for a gradient before sending anything
        acts = SCHEDULES["gpipe"](p, m, r)
        return sorted(acts, key=lambda a: a.op != "recv_grad") if r == 0 else acts

    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(3, 2, backwards_first)


def test_simulator_catches_out_of_order_messages():
    def swapped(p, m, r):
        acts = SCHEDULES["gpipe"](p, m, r)
        if r == 1:
            i, j = acts.index(Action("recv_act", 0)), acts.index(Action("recv_act", 1))
            acts[i], acts[j] = acts[j], acts[i]
        return acts

    with pytest.raises(RuntimeError, match="expected act of micro-batch 1"):
        simulate(2, 2, swapped, capacity=2)


def test_schedule_command():
    from conftest import cli
    res = cli("schedule", "-p", "3", "-m", "4")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == "rank 0 (3 activation slots): F0 sa0 F1 sa1 F2 sa2 rg0 B0 F3 sa3 rg1 B1 rg2 B2 rg3 B3 step"
    assert lines[-1].startswith("bubble 0.3333 (equal stages: (p-1)/(m+p-1) = 0.3333)")
