"""What ranks compare of a config (config.fields.values): an input by its content, an output
by its real path, a string by its bytes."""
import os
from dataclasses import dataclass

from cupygpt.config.fields import flag, held, values


@dataclass(frozen=True)
class Files:
    data: str = flag("-i", default="", file="in")
    out: str = flag("-o", default="", file="out")
    init: str = flag("-e", default="", file="model")
    name: str = flag("--name", default="")


def test_an_input_is_compared_by_what_it_holds(tmp_path):
    big = bytes(range(256)) * 1024  # 256 KiB
    (tmp_path / "a.bin").write_bytes(big)
    (tmp_path / "b.bin").write_bytes(big)
    assert held(str(tmp_path / "a.bin")) == held(str(tmp_path / "b.bin"))
    assert held(str(tmp_path / "a.bin")).startswith("<1 file: 262,144 bytes, hash ")
    assert held(str(tmp_path / "*.bin")).startswith("<2 files: 524,288 bytes, ")
    for at in (0, len(big) // 2 + 7, len(big) - 1):  # a byte anywhere (all of it is read)
        changed = bytearray(big)
        changed[at] ^= 1
        (tmp_path / "b.bin").write_bytes(changed)
        assert held(str(tmp_path / "a.bin")) != held(str(tmp_path / "b.bin")), at
    (tmp_path / "b.bin").write_bytes(big + b"x")
    assert held(str(tmp_path / "a.bin")) != held(str(tmp_path / "b.bin"))
    assert held(str(tmp_path / "none*.bin")) == os.fsencode(str(tmp_path / "none*.bin"))
    # past `whole` bytes: the ends and `samples` blocks between, no more
    sampled = held(str(tmp_path / "a.bin"), whole=1000, block=1024, samples=4)
    assert sampled.startswith("<1 file: 262,144 bytes, sampled hash ")
    changed = bytearray(big)
    changed[2 * 65536 + 5] ^= 1  # (in the block at 2/4 of the file)
    (tmp_path / "b.bin").write_bytes(changed)
    assert held(str(tmp_path / "b.bin"), whole=1000, block=1024, samples=4) != sampled
    changed[2 * 65536 + 5] ^= 1
    changed[3000] ^= 1  # (between blocks)
    (tmp_path / "b.bin").write_bytes(changed)
    assert held(str(tmp_path / "b.bin"), whole=1000, block=1024, samples=4) == sampled


def test_an_input_that_is_no_regular_file_is_named_not_opened(tmp_path):
    """A FIFO's open blocked every rank before any check (validation refuses it after)."""
    os.mkfifo(tmp_path / "f.bin")
    assert held(str(tmp_path / "f.bin")) == "<a FIFO>"
    (tmp_path / "s.bin").write_bytes(b"x")
    assert held(str(tmp_path / "*.bin")) == "<a FIFO>"
    assert held(str(tmp_path)) == "<a directory>"


def test_paths_compare_by_what_they_name(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "m.bin").write_bytes(b"model")
    relative = dict(values(Files(data="m.bin", out="run", init="m.bin", name="ü")))
    absolute = dict(values(Files(data=str(tmp_path / "m.bin"), out=str(tmp_path / "run"),
                                 init=str(tmp_path / "m.bin"), name="ü")))
    assert relative == absolute
    assert relative["name"] == "ü".encode() and relative["out"] == os.fsencode(tmp_path / "run")
    assert dict(values(Files(init="d12")))["init"] == b"d12"  # (a descriptor: as given)
    assert "data" not in dict(values(Files(data="m.bin"), contents=False))
