"""A config's validate() only validates (issue 37): it makes no directory and keeps no data
it read (the commands make their directories and read their examples and losses at their
start), and every config places its command through the one step, sections.place."""
import ast
import dataclasses
import json
import os

import pytest
from harness import fixture, small_shard

import cupygpt
from cupygpt import CupyGPTError
from cupygpt.backends.numpy.backend import NumpyBackend
from cupygpt.config import configs, sections
from cupygpt.config.train import TrainConfig
from cupygpt.formats.hellaswag import Example, write_eval
from cupygpt.paths import MADE, make_parent, unmake_dirs

npb = NumpyBackend()

CONFIG = os.path.join(os.path.dirname(cupygpt.__file__), "config")
MAKERS = {"makedirs", "mkdir", "make_dir", "make_parent", "mkstemp", "mkdtemp",
          "NamedTemporaryFile", "TemporaryDirectory"}


def config_modules():
    for f in sorted(os.listdir(CONFIG)):
        if f.endswith(".py"):
            yield f, ast.parse(open(os.path.join(CONFIG, f)).read())


def called(node):
    """The names a call's function is spelt with (os.makedirs: makedirs)."""
    f = node.func
    return f.attr if isinstance(f, ast.Attribute) else getattr(f, "id", None)


def test_no_config_module_makes_a_directory_or_a_file():
    found = [f"{f}:{n.lineno} {called(n)}" for f, tree in config_modules()
             for n in ast.walk(tree) if isinstance(n, ast.Call) and called(n) in MAKERS]
    found += [f"{f}:{n.lineno} imports {a.name}" for f, tree in config_modules()
              for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)
              for a in n.names if a.name in MAKERS]
    assert not found, found


def test_every_validate_places_its_command_once():
    """The end every validate shares (attention, device, grid, pipeline) is one call."""
    for f, tree in config_modules():
        for cls in (n for n in tree.body if isinstance(n, ast.ClassDef)):
            validate = next((n for n in cls.body if isinstance(n, ast.FunctionDef)
                             and n.name == "validate"), None)
            if validate is None or cls.name in ("Device", "Grid", "Pipeline"):
                continue
            calls = [called(n) for n in ast.walk(validate) if isinstance(n, ast.Call)]
            assert calls.count("place") == 1, f"{f} {cls.name}: place x{calls.count('place')}"
            assert not {"runs_on"} & set(calls), f"{f} {cls.name} checks runs_on itself"


def an_eval_file(path):
    rows = [Example(i, i % 4, [1, 2, 3], [[4 + i], [5], [6, 7], [8]]) for i in range(3)]
    with open(path, "wb") as f:
        write_eval(f, rows)
    return str(path)


def configs_into(t):
    """Each command's config, its outputs under t in directories that do not exist."""
    expected = t / "in" / "expected.json"
    expected.write_text(json.dumps({"losses": [5.0, 4.9]}))
    shard = small_shard(t / "in" / "s.bin")  # (the model's vocab, 300: not the shipped data's)
    return [TrainConfig(init=fixture("tiny_model.bin"), out=str(t / "o" / "run"), steps=1,
                        train_pattern=shard, val_pattern="",
                        batch=4, seq=32, trace=str(t / "tr" / "a" / "t.json"),
                        log_file=str(t / "logs" / "l.jsonl"), hellaswag=1,
                        hellaswag_file=an_eval_file(t / "in" / "h.bin")),
            TrainConfig(init=fixture("tiny_model.bin"), out=str(t / "o2"), steps=1,
                        train_pattern=shard, val_pattern=""),
            configs.EvalConfig(model=fixture("tiny_model.bin"),
                               hellaswag=an_eval_file(t / "in" / "h.bin")),
            configs.VerifyConfig(state=fixture("tiny_debug_state.bin"),
                                 expected=str(expected), trace=str(t / "vt" / "t.json")),
            configs.SampleConfig(model=fixture("tiny_model.bin"), tokenizer=""),
            configs.BenchConfig(trace=str(t / "bt" / "t.json"), out=str(t / "bo" / "b.json"))]


def flat(value):
    """A setting's value, not loaded data: a number, a string, None, or numbers in a row
    (Pipeline's layer counts)."""
    if dataclasses.is_dataclass(value):
        return all(flat(getattr(value, f.name)) for f in dataclasses.fields(value))
    if isinstance(value, tuple):
        return all(isinstance(v, int) for v in value)
    return value is None or isinstance(value, (bool, int, float, str))


def test_validate_makes_nothing_and_keeps_only_settings(tmp_path):
    (tmp_path / "in").mkdir()
    made = len(MADE)
    for cfg in configs_into(tmp_path):
        c, shape = cfg.validate(npb, 1)
        assert sorted(os.listdir(tmp_path)) == ["in"], (type(cfg).__name__,
                                                       os.listdir(tmp_path))
        assert len(MADE) == made and flat(c), c


def test_a_refused_output_directory_is_refused_by_validate_in_make_dirs_words(tmp_path):
    """The check validate makes without making anything says what making it would."""
    (tmp_path / "file").write_text("x")
    (tmp_path / "gone").symlink_to("nowhere")
    for out, words in ((tmp_path / "file" / "run", "cannot create this directory (Not a "
                                                   "directory)"),
                       (tmp_path / "file", "is a file, not a directory; give a directory"),
                       (tmp_path / "gone" / "run", f"{tmp_path / 'gone'} is a symbolic link "
                                                   f"to 'nowhere', which does not resolve")):
        with pytest.raises(CupyGPTError) as e:
            TrainConfig(init=fixture("tiny_model.bin"), out=str(out), steps=1).validate(npb, 1)
        assert e.value.option == "out" and e.value.args[0].startswith(words), e.value
        with pytest.raises(CupyGPTError) as made:
            make_parent("trace", str(out / "t.json"))
        assert made.value.args[0] == f"in {out}: {e.value.args[0]}"
    assert sorted(os.listdir(tmp_path)) == ["file", "gone"]


def test_make_parent_makes_what_validate_checked_and_a_failed_command_unmakes_it(tmp_path):
    trace = tmp_path / "a" / "b" / "t.json"
    sections.out_file("trace", str(trace), False)
    assert not (tmp_path / "a").exists()
    make_parent("trace", str(trace))
    assert (tmp_path / "a" / "b").is_dir() and MADE[-2:] == [str(tmp_path / "a"),
                                                             str(tmp_path / "a" / "b")]
    unmake_dirs()
    assert os.listdir(tmp_path) == [] and MADE == []


def test_trains_start_makes_o_and_a_refusal_there_removes_it(tmp_path):
    """train's claim makes -o (validate made none) and says it did; a claim refused (no
    room for the run) removes the -o it made."""
    from types import SimpleNamespace

    from cupygpt.train import rundir

    class One:  # one rank
        rank = 0

        def any(self, flag):
            return flag

        def bcast(self, obj, root=0):
            return obj
    out = tmp_path / "o" / "run"
    opts = SimpleNamespace(out=str(out), resume=None, overwrite=False, keep=2,
                           log_file=str(out / "log.jsonl"))
    fd, made, locked, log = rundir.claim(opts, One(), (0, 0, (0, "model.bin")))
    os.close(fd)
    assert made and out.is_dir() and log  # (the log made empty, to be held)
    os.unlink(out / "log.jsonl")
    os.rmdir(out)
    with pytest.raises(CupyGPTError, match="free some space"):
        rundir.claim(opts, One(), (0, 1 << 62, (0, "model.bin")))
    unmake_dirs()  # (the command's entry would, once the job's end is settled)
    assert os.listdir(tmp_path) == []
