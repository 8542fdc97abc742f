"""paths.py: outputs written whole under any legal name."""
import os


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
