"""paths.py: outputs written whole under any legal name."""
import os

import pytest

from cupygpt import CupyGPTError
from cupygpt.paths import make_parent


def test_a_legal_name_of_255_characters_is_written(tmp_path):
    """atomic_write's temporary added 13 characters to the name: 'File name too long' for
    a legal one (bench --out, plot --out, a log, prepare's shards); convert's DST.partial
    likewise."""
    from cupygpt.commands.convert import write_hf
    from cupygpt.formats.llmc import read_model
    from cupygpt.paths import REFERENCE, atomic_write
    name = tmp_path / ("n" * 250 + ".json")
    with atomic_write(name) as f:
        f.write(b"{}")
    assert name.read_bytes() == b"{}" and os.listdir(tmp_path) == [name.name]
    shape, params = read_model(os.path.join(REFERENCE, "tiny_model.bin"))
    write_hf(str(tmp_path / ("h" * 254)), shape, params, None)
    assert sorted(os.listdir(tmp_path / ("h" * 254)))[0] == "config.json"


def test_claim_files_are_removed_without_two_commands_ever_holding_one(tmp_path):
    """A claim's file goes as its command ends (removed while locked) and sweep removes the
    ones nobody holds, while other commands claim the same path: four processes claiming,
    releasing and sweeping 150 times each never hold one claim at once."""
    import fcntl
    import multiprocessing
    import time
    import types

    from cupygpt import paths
    from cupygpt.paths import _lock_key, sweep
    claims = tmp_path / "claims"
    claims.mkdir()
    key, record = str(claims / "k"), str(tmp_path / "record")

    def slow_flock(fd, how):  # (widens the window between a claim's open and its lock)
        time.sleep(0.001)
        return fcntl.flock(fd, how)

    def contend():
        paths.fcntl = types.SimpleNamespace(flock=slow_flock, LOCK_EX=fcntl.LOCK_EX,
                                            LOCK_NB=fcntl.LOCK_NB)
        for _ in range(150):
            fd, _ = _lock_key(key)
            if fd is not None:
                mine = os.open(record, os.O_WRONLY | os.O_APPEND | os.O_CREAT)
                os.write(mine, f"+{os.getpid()}\n".encode())
                os.write(mine, f"-{os.getpid()}\n".encode())
                os.close(mine)
                os.unlink(key)  # (as a command's end does: removed while locked)
                os.close(fd)
            sweep(str(claims))
    children = [multiprocessing.get_context("fork").Process(target=contend) for _ in range(4)]
    for c in children:
        c.start()
    for c in children:
        c.join(120)
        assert c.exitcode == 0
    rows = open(record).read().split()
    assert len(rows) > 150 and all(a[0] == "+" and b == "-" + a[1:]
                                   for a, b in zip(rows[::2], rows[1::2])), rows[:20]
    assert os.listdir(claims) == []


def test_a_file_written_between_the_check_and_the_claim_is_not_replaced_unasked(tmp_path):
    """Two verify --trace X at once: both looked (no X), the first wrote X and ended, its
    claim gone, and the second claimed X and wrote over it without --overwrite."""
    path = tmp_path / "trace.json"
    path.write_text("{}")  # (the first command's, written after the second's look)
    with pytest.raises(CupyGPTError, match="exists .another command wrote it since"):
        make_parent("trace", str(path), overwrite=False)
    asked = tmp_path / "asked.json"
    asked.write_text("{}")
    make_parent("trace", str(asked), overwrite=True)  # (asked: replaced at the end)
