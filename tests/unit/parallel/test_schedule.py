"""Schedules as data: deadlock-free, right bubble, right number of activation slots."""
import pytest

from cupygpt import CupyGPTError
from cupygpt.parallel.pipeline.schedule import (
    SCHEDULES,
    Action,
    Op,
    chunks_per_rank,
    forward_only,
    holders,
    placement,
    slot_plan,
)
from cupygpt.parallel.pipeline.simulate import simulate


def cases(name, most_p=8, most_m=32):
    """(p, m, v) for a schedule: every size up to P = 8, M = 32 (interleaved: V <= 4, M a
    multiple of P)."""
    for p in range(1, most_p + 1):
        for m in range(1, most_m + 1):
            if name != "interleaved":
                yield p, m, chunks_per_rank(name)
            elif m % p == 0:
                yield from ((p, m, v) for v in range(1, 5))


def published(name, p, m, v):
    """The bubble a schedule must reach with equal times (gpipe, 1f1b, interleaved: exactly;
    zb1p: at most) and the times it holds for.

    1F1B idles (p-1)(t_F + t_B) per rank, whatever their ratio; interleaved's chunks take
    1/v of that. ZB-H1 idles (p-1)(t_F + t_B - t_W) = (p-1) t per rank with m >= p (the
    paper's figure); with fewer it is still never worse than 1F1B. (zbv: its own test.)"""
    one = (p - 1) / (m + p - 1)
    if name == "interleaved":
        return (p - 1) / (v * m + p - 1), {}
    if name == "zb1p":
        return ((p - 1) / (3 * m + p - 1) if m >= p else one), dict(t_fwd=1.0, t_bwd=1.0,
                                                                     t_wgt=1.0)
    return one, {}


@pytest.mark.parametrize("name", [n for n in SCHEDULES if n != "zbv"])
@pytest.mark.parametrize("capacity", [1, 2])
def test_deadlock_free_with_the_published_bubble(name, capacity):
    for p, m, v in cases(name):
        bubble, times = published(name, p, m, v)
        r = simulate(p, m, name, v, capacity=capacity, **times)
        if name == "zb1p":
            assert r["bubble"] <= bubble + 1e-12, (p, m)
        else:
            assert r["bubble"] == pytest.approx(bubble, abs=1e-12), (p, m, v)


@pytest.mark.parametrize("capacity", [1, 2])
def test_zbv_reaches_the_lower_bound(capacity):
    """Equal times, free transfers, p <= 8, m <= 32. The simulator's times are per
    whole-stage micro-batch, so a chunk's F, B or W takes 1/2. Each rank does 2m of each
    (3m in all), and rank p-1 first waits (p-1)/2 for its input to pass p-1 chunks: no
    order takes under 3m + (p-1)/2, and zbv takes that from m = p on, bubble
    (p-1)/(6m+p-1). With fewer micro-batches it takes max(4m + 3p - 1, 2m + 4p - 1) chunk
    steps (m = 1: the micro-batch's 4p+1 chunk ops in a row, as few as can be). Every rank
    holds at most p whole stages (2p chunk activations, 1F1B's peak); with m < p, all m."""
    for p in range(1, 9):
        for m in range(1, 33):
            r = simulate(p, m, "zbv", 2, t_fwd=1.0, t_bwd=1.0, t_wgt=1.0, capacity=capacity)
            steps = 6 * m + p - 1 if m >= p else max(4 * m + 3 * p - 1, 2 * m + 4 * p - 1)
            assert r["makespan"] == steps / 2, (p, m)
            assert r["peak"] == [min(m, p)] * p, (p, m)


def test_zero_bubble_schedules_beat_1f1b():
    """ZB-H1 reaches its formula exactly from m = p; ZB-V its floor, half ZB-H1's idle."""
    for p, m in ((4, 8), (8, 32)):
        one = simulate(p, m, "1f1b", t_fwd=1.0, t_bwd=1.0, t_wgt=1.0)["bubble"]
        h1 = simulate(p, m, "zb1p", t_fwd=1.0, t_bwd=1.0, t_wgt=1.0)["bubble"]
        zv = simulate(p, m, "zbv", 2, t_fwd=1.0, t_bwd=1.0, t_wgt=1.0)["bubble"]
        assert h1 == pytest.approx((p - 1) / (3 * m + p - 1), abs=1e-12)
        assert h1 < one / 2 and zv == pytest.approx((p - 1) / (6 * m + p - 1), abs=1e-12)


def test_peak_live_activations():
    for p in range(1, 7):
        for m in (1, p, 2 * p + 1, 16):
            assert simulate(p, m, "1f1b")["peak"] == [min(p - r, m) for r in range(p)]
            assert simulate(p, m, "gpipe")["peak"] == [m] * p
            assert max(simulate(p, m, "zb1p")["peak"]) <= p  # 1F1B's, on its rank 0
            assert max(simulate(p, m, "zbv", 2)["peak"]) <= p  # a chunk counts 1/2


@pytest.mark.parametrize("name", SCHEDULES)
def test_every_chunk_goes_forward_then_back_once(name):
    """Per (micro-batch, chunk): one forward, then one backward (fused, or B then W); a
    send after what it sends, a receive before what needs it, and every send received by
    the rank holding the next (or previous) model chunk, in the same order."""
    for p, m, v in cases(name, 5, 8):
        lists = [SCHEDULES[name](p, m, r, v) for r in range(p)]
        holder = holders(name, p, v)
        msgs = {}
        for r, acts in enumerate(lists):
            assert acts[-1] == Action(Op.STEP, None) and Op.STEP not in [a.op for a in acts[:-1]]
            place = placement(name, p, v, r)
            for c, k in enumerate(place):
                at = {}
                for i, a in enumerate(acts):
                    if a.chunk == c and a.mb is not None:
                        assert (a.op, a.mb) not in at, (p, m, v, r, a)
                        at[(a.op, a.mb)] = i
                split = (Op.BWD_INPUT, 0) in at
                for i in range(m):
                    bwd = at[(Op.BWD_INPUT if split else Op.BWD, i)]
                    assert at[(Op.FWD, i)] < bwd < at.get((Op.BWD_WEIGHT, i), bwd + 1)
                    assert ((Op.BWD, i) in at) != split
                    for op, before, after, edge in (
                            (Op.RECV_ACT, None, Op.FWD, k > 0),
                            (Op.SEND_ACT, Op.FWD, None, k < p * v - 1),
                            (Op.RECV_GRAD, None, Op.BWD_INPUT if split else Op.BWD,
                             k < p * v - 1),
                            (Op.SEND_GRAD, Op.BWD_INPUT if split else Op.BWD, None, k > 0)):
                        assert ((op, i) in at) == edge, (p, m, v, r, c, op, i)
                        if edge and before:
                            assert at[(before, i)] < at[(op, i)]
                        if edge and after and holder[k + (
                                -1 if op == Op.RECV_ACT else 1)][0] != r:
                            assert at[(op, i)] < at[(after, i)]
            for a in acts:
                if a.op in (Op.SEND_ACT, Op.SEND_GRAD):
                    kind, step = ("act", 1) if a.op == Op.SEND_ACT else ("grad", -1)
                    dst, c2 = holder[place[a.chunk] + step]
                    msgs.setdefault((kind, r, dst), []).append((a.mb, c2))
        for (kind, src, dst), sent in msgs.items():
            recv = Op.RECV_ACT if kind == "act" else Op.RECV_GRAD
            got = [(a.mb, a.chunk) for a in lists[dst] if a.op == recv and holder[
                placement(name, p, v, dst)[a.chunk] + (-1 if kind == "act" else 1)][0] == src]
            assert got == sent, (p, m, v, kind, src, dst)


def test_placement():
    assert placement("interleaved", 4, 3, 1) == [1, 5, 9]
    assert placement("zbv", 4, 2, 1) == [1, 6] and holders("zbv", 4, 2)[6] == (1, 1)
    assert placement("1f1b", 4, 1, 2) == [2] and holders("1f1b", 4, 1)[2] == (2, 0)


def test_interleaved_of_one_chunk_is_1f1b():
    for p in range(1, 6):
        for m in range(p, 13, p):
            for r in range(p):
                assert SCHEDULES["interleaved"](p, m, r, 1) == SCHEDULES["1f1b"](p, m, r)


def test_interleaved_wants_whole_groups_of_micro_batches():
    with pytest.raises(CupyGPTError, match="multiple of the 4 pipeline stages"):
        SCHEDULES["interleaved"](4, 6, 0, 2)


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
    def backwards_first(p, m, r, v):  # stage 0 waits for a gradient before sending anything
        acts = SCHEDULES["gpipe"](p, m, r)
        return sorted(acts, key=lambda a: a.op != "recv_grad") if r == 0 else acts

    with pytest.raises(RuntimeError, match="deadlock"):
        simulate(3, 2, backwards_first)


def test_simulator_catches_out_of_order_messages():
    def swapped(p, m, r, v):
        acts = SCHEDULES["gpipe"](p, m, r)
        if r == 1:
            i, j = acts.index(Action("recv_act", 0)), acts.index(Action("recv_act", 1))
            acts[i], acts[j] = acts[j], acts[i]
        return acts

    with pytest.raises(RuntimeError, match="expected act of micro-batch 1"):
        simulate(2, 2, swapped, capacity=2)


def test_transfer_time_between_ranks_only():
    """A message between ranks costs t_comm; zbv's turn on rank p-1 is a local copy."""
    r = simulate(2, 1, "1f1b", t_fwd=1.0, t_bwd=2.0, t_comm=0.5)
    assert r["makespan"] == 1 + 0.5 + 1 + 2 + 0.5 + 2
    r = simulate(1, 1, "zbv", 2, t_fwd=1.0, t_bwd=1.0, t_wgt=1.0, t_comm=5.0)
    assert r["makespan"] == 3.0 and r["bubble"] == 0.0


@pytest.mark.parametrize("name", SCHEDULES)
def test_forward_only_lists_fit_few_slot_channels(name):
    """Evaluation and sampling lists: deadlock-free over channels of one and two messages
    (nvshmem's slots), every rank's receives in its sender's order (interleaved: the
    micro-batch counts it runs, whole groups of p, and sampling's one)."""
    for p in range(1, 7):
        for m in range(1, 17):
            if name == "interleaved" and m % p and m > 1:
                continue
            for v in ((1, 2, 3) if name == "interleaved" else (chunks_per_rank(name),)):
                for capacity in (1, 2):
                    r = simulate(p, m, lambda p_, m_, r_, v_: forward_only(p_, m_, r_, v_, name),
                                 v, capacity=capacity, placed=name)
                    assert r["bubble"] < 1, (p, m, v)


def test_transfers_keep_their_ranks_busy():
    """A host-staged send and a receive whose message has come take their rank's time, not
    counted as compute: 2 stages, one micro-batch, F 1, B 2, each copy 0.5."""
    plain = simulate(2, 1, "1f1b")
    staged = simulate(2, 1, "1f1b", t_send=0.5, t_recv=0.5)
    assert plain["makespan"] == 6.0 and staged["makespan"] == 8.0  # four copies on the path
    assert staged["busy"] == plain["busy"] == [3.0, 3.0]


def test_schedule_command_makes_each_ranks_list_once(monkeypatch):
    """The simulator and the printout read the same lists (the command made each twice:
    at -p 256 -m 2048, 3 million actions built twice over)."""
    from click.testing import CliRunner

    from cupygpt.cli.tools import schedule
    made = []
    real = SCHEDULES["1f1b"]
    monkeypatch.setitem(SCHEDULES, "1f1b", lambda p, m, r, v=1: made.append(r) or real(p, m, r, v))
    res = CliRunner().invoke(schedule, ["-p", "8", "-m", "16"])
    assert res.exit_code == 0, res.output
    assert sorted(made) == list(range(8)), made
    assert "deadlock-free" in res.output
