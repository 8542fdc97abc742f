"""The training loader (llm.c's, shuffled per epoch): every batch of an epoch once, each
row to one replica, a new order each epoch, the same for the same seed, and a resume in
the middle of an epoch continuing the uninterrupted run's losses bit for bit."""
import json
import os

import numpy as np
import pytest
from harness import ROOT, cli, losses

from cupygpt.formats.llmc import read_shard, write_shard
from cupygpt.model.shape import preset
from cupygpt.parallel.mesh import Mesh
from cupygpt.parallel.pipeline.plan import plan_step
from cupygpt.train.loader import DataLoader

B, T = 4, 8


def shards(tmp_path, sizes):
    """Shards whose token i of the whole set is i (mod V): a batch says where it was read."""
    start = 0
    for k, n in enumerate(sizes):
        write_shard(tmp_path / f"s_{k:02d}.bin", np.arange(start, start + n) % 60000)
        start += n
    return str(tmp_path / "s_*.bin")


def epoch(dl, n):
    return [int(dl.next_batch()[0][0, 0]) for _ in range(n)]


def test_an_epoch_is_every_batch_once_and_each_row_one_replicas(tmp_path):
    sizes = [5 * B * T + 1, 3 * B * T + 7, 8 * B * T + 1]  # 5, 3, 8 batches (7 left over)
    pattern = shards(tmp_path, sizes)
    starts = np.cumsum([0] + sizes[:-1])
    want = sorted(int(s) + i * B * T for s, n in zip(starts, (5, 3, 8)) for i in range(n))
    dl = DataLoader(pattern, B, T, 65536, shuffle=True, seed=7)
    orders = [epoch(dl, 16) for _ in range(3)]
    assert all(sorted(o) == want for o in orders)  # every batch of an epoch exactly once
    assert len({tuple(o) for o in orders}) == 3     # a new order each epoch
    assert orders[0] != want                        # (not the file order)
    again = DataLoader(pattern, B, T, 65536, shuffle=True, seed=7)
    assert [epoch(again, 16) for _ in range(3)] == orders  # the same seed, the same order
    other = DataLoader(pattern, B, T, 65536, shuffle=True, seed=8)
    assert epoch(other, 16) != orders[0]
    assert epoch(DataLoader(pattern, B, T, 65536), 16) == want  # --no-shuffle: file order
    # each replica's rows of every batch (the executor's split, as the runner plans it):
    # over dp replicas, each row of the epoch goes to exactly one
    for dp in (2, 4):
        dl = DataLoader(pattern, B, T, 65536, shuffle=True, seed=7)
        rows = [dl.next_batch()[0] for _ in range(16)]
        seen = []
        for r in range(dp):
            plan = plan_step(preset("tiny"), Mesh(rank=r, dp=dp), batch=B, seq=T)
            seen += [int(x[plan.replica_rows()][i, 0]) for x in rows
                     for i in range(plan.rows)]
        assert sorted(seen) == sorted(s + i * T for s in want for i in range(B))


def test_state_resumes_the_order_mid_epoch(tmp_path):
    pattern = shards(tmp_path, [5 * B * T + 1, 3 * B * T + 1])
    dl = DataLoader(pattern, B, T, 65536, shuffle=True, seed=3)
    whole = epoch(dl, 20)  # two epochs and a half
    dl = DataLoader(pattern, B, T, 65536, shuffle=True, seed=3)
    epoch(dl, 11)
    state = json.loads(json.dumps(dl.state()))  # as a checkpoint keeps it
    assert state[2] == 1  # (in the second epoch)
    later = DataLoader(pattern, B, T, 65536, shuffle=False, seed=99)  # the state's rule wins
    later.set_state(state)
    assert epoch(later, 9) == whole[11:]
    old = DataLoader(pattern, B, T, 65536, shuffle=True)  # a checkpoint from before shuffling
    old.set_state([1, B * T])
    assert epoch(old, 2) == [(5 * B * T + 1) + B * T, (5 * B * T + 1) + 2 * B * T]


def test_a_resume_mid_epoch_is_bit_identical_on_a_grid(tmp_path):
    """Three shards of 3, 2 and 4 batches: 10 steps cross two epochs; resumed from step 4
    (the middle of the first epoch's second shard, on --dp 2), the same losses and model."""
    toks = np.asarray(read_shard(os.path.join(ROOT, "cupygpt", "data",
                                              "tiny_shakespeare_val.bin")))
    n, at = 4 * 32, 0
    for k, batches in enumerate((3, 2, 4)):
        write_shard(tmp_path / f"t_{k}.bin", toks[at: at + batches * n + 1])
        at += batches * n + 1
    train = ["train", "-e", "tiny", "-i", tmp_path / "t_*.bin", "-b", "4", "-t", "32", "-v",
             "0", "-g", "0", "-n", "10", "--dp", "2"]
    a = cli(*train, "--checkpoint-every", "4", "--keep", "3", "-o", tmp_path / "a", ranks=2)
    assert a.returncode == 0, a.stderr
    b = cli(*train, "--resume", tmp_path / "a" / "ckpt_00000004", "-o", tmp_path / "b",
            ranks=2)
    assert b.returncode == 0, b.stderr
    log = {k: {r["step"]: r["train_loss"] for r in map(json.loads, open(tmp_path / k /
                                                                         "log.jsonl"))
               if "train_loss" in r} for k in "ab"}
    assert sorted(log["b"]) == list(range(5, 11))
    assert all(log["a"][s] == log["b"][s] for s in log["b"])  # bit for bit
    assert (tmp_path / "a" / "model.bin").read_bytes() == \
        (tmp_path / "b" / "model.bin").read_bytes()
    seq = cli(*train, "--no-shuffle", "-n", "4", "-o", tmp_path / "c", ranks=2)
    assert seq.returncode == 0 and "(in order)" in seq.stdout, seq.stderr
    assert "(shuffled, seed 1337)" in a.stdout
    assert losses(seq.stdout)[1:4] != [log["a"][s] for s in (2, 3, 4)]  # other batches


def test_a_token_outside_the_vocab_is_found_in_its_batch(tmp_path):
    """The first batch is checked when the loader is made (before training allocates);
    later ones as they are read, so the whole set is never read at start."""
    from cupygpt import CupyGPTError
    toks = np.zeros(4 * 16 + 1, np.uint16)
    toks[40] = 300  # the third batch of 16 tokens
    write_shard(tmp_path / "s.bin", toks)
    dl = DataLoader(str(tmp_path / "s.bin"), 1, 16, 300)
    dl.next_batch(), dl.next_batch()
    with pytest.raises(CupyGPTError, match=r"s.bin: token 300 \(in tokens 32..48\) is outside"):
        dl.next_batch()
    toks[40], toks[3] = 0, 301
    write_shard(tmp_path / "s.bin", toks)
    with pytest.raises(CupyGPTError, match="token 301"):
        DataLoader(str(tmp_path / "s.bin"), 1, 16, 300)


def test_a_shard_that_shrinks_under_the_loader_is_named_not_a_bus_error(tmp_path):
    """A shard truncated while a run reads it (another job rewriting it): one error naming
    the shard, where a memory map's read past the new end killed the process (SIGBUS)."""
    write_shard(tmp_path / "s.bin", np.zeros(4 * 4096 + 1, np.uint16))
    code = (f"import os, sys\nfrom cupygpt import CupyGPTError\n"
            f"from cupygpt.train.loader import DataLoader\n"
            f"dl = DataLoader({str(tmp_path / 's.bin')!r}, 1, 4096, 300)\n"
            f"dl.next_batch()\nos.truncate({str(tmp_path / 's.bin')!r}, 2000)\n"
            f"try:\n    dl.next_batch()\nexcept CupyGPTError as e:\n    print(e)\n")
    import subprocess
    import sys
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                       cwd=ROOT, timeout=60)
    assert r.returncode == 0, (r.returncode, r.stderr)
    assert r.stdout.startswith(f"{tmp_path / 's.bin'}: token shard changed while training "
                               f"read it: it is now 2000 bytes"), r.stdout
    assert "checkpoint" not in r.stdout  # (train's line says what the run has: none here)
