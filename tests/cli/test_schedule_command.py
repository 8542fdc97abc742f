"""`schedule`: each rank's action list as the command prints it, and the simulator's bubble
and peak under it (the schedules themselves: unit/parallel/test_schedule.py)."""
from cupygpt.parallel.pipeline.simulate import simulate


def test_schedule_command():
    from harness import cli
    res = cli("schedule", "-p", "3", "-m", "4")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0] == ("rank 0 (3 activation slots): F0 sa0 F1 sa1 F2 sa2 rg0 B0 F3 sa3 rg1 B1 "
                        "rg2 B2 rg3 B3 step")
    assert lines[-1].startswith("bubble 0.3333 (1F1B's with equal stages: (p-1)/(m+p-1) = "
                                "0.3333)")


def test_schedule_command_shows_chunks_and_weight_passes():
    from harness import cli
    res = cli("schedule", "-p", "2", "-m", "4", "--schedule", "zbv")
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[0].startswith("rank 0 (") and " F0.1 B0.1 sg0.1 W0.1 " in lines[0]
    assert " sa0 ra0.1 " in lines[1]  # rank 1 hands chunk 1 to its own chunk 2: a local copy
    sim = simulate(2, 4, "zbv", 2)
    assert f"bubble {sim['bubble']:.4f} " in lines[-1]
    assert "peak live activations per rank (whole stages) 2 2;" in lines[-1]
