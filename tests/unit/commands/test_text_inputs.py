"""The text and JSON a command reads as a Windows editor saves it: a UTF-8 byte-order mark
first (JSON's parser refused it; a HellaSwag jsonl's first example was "not an example")."""
import json

import pytest

BOM = b"\xef\xbb\xbf"


def test_a_byte_order_mark_is_left_out_of_text_and_json(tmp_path):
    from cupygpt.commands.plot import read_log
    from cupygpt.commands.prepare import text_of
    from cupygpt.commands.timeline import read_trace
    from cupygpt.formats.hellaswag import from_jsonl
    from cupygpt.formats.llmc import read_expected
    from cupygpt.paths import json_object, read_bounded
    (tmp_path / "a.json").write_bytes(BOM + b'{"losses": [5.0, 4.5]}')
    assert read_bounded(tmp_path / "a.json", "JSON") == b'{"losses": [5.0, 4.5]}'
    assert read_bounded(tmp_path / "a.json", "eval", text=False).startswith(BOM)
    assert json_object(tmp_path / "a.json", "JSON") == {"losses": [5.0, 4.5]}
    assert read_expected(str(tmp_path / "a.json")) == (5.0, 4.5)
    (tmp_path / "log.jsonl").write_bytes(BOM + b'{"step": 1, "train_loss": 2.0}\n')
    assert read_log(tmp_path / "log.jsonl") == [{"step": 1, "train_loss": 2.0}]
    example = {"ctx": "A man", "endings": ["a", "b", "c", "d"], "label": 2}
    (tmp_path / "h.jsonl").write_bytes(BOM + json.dumps(example).encode() + b"\n")
    assert len(from_jsonl(text_of(str(tmp_path / "h.jsonl"), "jsonl"), lambda s: [1] * len(s),
                          "h.jsonl")) == 1
    (tmp_path / "t.json").write_bytes(BOM + b"{}")
    with pytest.raises(Exception, match="holds no action slices"):
        read_trace(tmp_path / "t.json")  # (past the BOM: read as JSON, refused as a trace)


@pytest.mark.parametrize("text,says", [("[" * 100000 + "]" * 100000, "nested too deeply"),
                                       ('{"losses": [' + "1" * 5000 + "]}", "digits")])
def test_json_past_pythons_limits_is_refused_as_any_other_bad_json(tmp_path, text, says):
    """A RecursionError and the integer digit limit's bare ValueError were tracebacks in
    every reader; each reader's own line now (two of them shown)."""
    from cupygpt import CupyGPTError
    from cupygpt.formats.llmc import read_expected
    from cupygpt.paths import loads
    with pytest.raises(json.JSONDecodeError, match=says):
        loads(text)
    (tmp_path / "e.json").write_text(text)
    with pytest.raises(CupyGPTError, match="not JSON"):
        read_expected(str(tmp_path / "e.json"))
    from cupygpt.commands.plot import read_log
    (tmp_path / "log.jsonl").write_text(text + "\n")
    with pytest.raises(CupyGPTError, match="line 1 is not JSON"):
        read_log(tmp_path / "log.jsonl")

