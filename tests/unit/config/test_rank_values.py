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
    big = bytes(range(256)) * 1024  # 256 KiB: a middle the hash does not read
    (tmp_path / "a.bin").write_bytes(big)
    (tmp_path / "b.bin").write_bytes(big)
    assert held(str(tmp_path / "a.bin")) == held(str(tmp_path / "b.bin"))
    assert held(str(tmp_path / "a.bin")).startswith("<1 file: 262,144 bytes, sampled hash ")
    assert held(str(tmp_path / "*.bin")).startswith("<2 files: 524,288 bytes, ")
    for at in (0, len(big) - 1):  # a byte in either end, or one more byte
        changed = bytearray(big)
        changed[at] ^= 1
        (tmp_path / "b.bin").write_bytes(changed)
        assert held(str(tmp_path / "a.bin")) != held(str(tmp_path / "b.bin")), at
    (tmp_path / "b.bin").write_bytes(big + b"x")
    assert held(str(tmp_path / "a.bin")) != held(str(tmp_path / "b.bin"))
    assert held(str(tmp_path / "none*.bin")) == os.fsencode(str(tmp_path / "none*.bin"))


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
