"""A model is taken alike in every spelling of its path, by every command that takes one:
a transformers directory named bare (`hf`), `./hf`, `hf/` or absolute works where a model
file does; a name that is both a preset and a run's -o is the preset; a run's -o without
its model.bin names its checkpoints; a config.json at odds with its weights is blamed."""
import json
import os

import pytest
from harness import TINY, cli, one_line, small_shard

from cupygpt.formats.llmc import write_model
from cupygpt.model.initialize import init_params
from cupygpt.model.shape import GPT2Config

SPELLINGS = ["hf", "./hf", "hf/", "ABS"]


@pytest.fixture
def hf(tmp_path):
    """tmp_path/hf: a 2-layer model of GPT-2's vocab (the shipped tokenizer's) converted to a
    transformers directory; the test's commands run in tmp_path."""
    cfg = GPT2Config(maxT=64, V=50257, Vp=50304, L=2, NH=2, C=32)
    write_model(tmp_path / "m.bin", cfg, init_params(cfg, 3))
    made = cli("convert", tmp_path / "m.bin", tmp_path / "hf")
    assert made.returncode == 0, made.stderr
    os.chdir(tmp_path)
    return tmp_path


def spelt(spelling, root):
    return str(root / "hf") if spelling == "ABS" else spelling


def test_train_and_sample_take_a_directory_in_every_spelling(hf):
    shard = small_shard(hf / "s.bin")
    models, texts = [], []
    for i, spelling in enumerate(SPELLINGS):
        run = cli(*TINY, "-e", spelt(spelling, hf), "-n", "1", "-i", shard, "-j", "",
                  "-o", f"o{i}", cwd=hf)
        assert run.returncode == 0, (spelling, run.stderr)
        models.append((hf / f"o{i}" / "model.bin").read_bytes())
        said = cli("sample", "--model", spelt(spelling, hf), "--backend", "numpy",
                   "--max-new-tokens", "4", cwd=hf)
        assert said.returncode == 0, (spelling, said.stderr)
        texts.append(said.stdout)
    assert models == [models[0]] * len(SPELLINGS) and texts == [texts[0]] * len(SPELLINGS)


def test_eval_takes_a_directory_in_every_spelling(hf):
    from test_hellaswag import write_llmc_eval
    write_llmc_eval(hf / "hs.bin", [(1, [5, 6, 7], [[8], [9, 10], [11], [12, 13]]),
                                    (3, [1, 2], [[3], [4], [5, 6], [7]])])
    scores = []
    for spelling in SPELLINGS + [str(hf / "m.bin")]:
        run = cli("eval", spelt(spelling, hf), "--hellaswag", "hs.bin", "--json",
                  "--backend", "numpy", cwd=hf)
        assert run.returncode == 0, (spelling, run.stderr)
        scores.append(json.loads(run.stdout.splitlines()[-1])["losses"])
    assert scores == [scores[-1]] * len(scores)  # the file's own, the directory's alike


def test_a_preset_named_like_a_run_directory_is_the_preset(tmp_path):
    """`-e tiny -o tiny` run twice: the second found tiny/ (the first's -o) and read it
    as a transformers directory missing its config.json."""
    first = cli(*TINY, "-e", "tiny", "-n", "1", "-o", "tiny", cwd=tmp_path)
    assert first.returncode == 0, first.stderr
    again = cli(*TINY, "-e", "tiny", "-n", "1", "-o", "tiny", "--overwrite", cwd=tmp_path)
    assert again.returncode == 0, again.stderr
    assert (tmp_path / "tiny" / "model.bin").read_bytes()[:4] == (20240326).to_bytes(4, "little")


def test_a_run_without_its_model_names_its_newest_checkpoint(tmp_path):
    run = cli(*TINY, "-n", "3", "--checkpoint-every", "1", "--keep", "2", "-o", "run",
              cwd=tmp_path)
    assert run.returncode == 0, run.stderr
    os.remove(tmp_path / "run" / "model.bin")  # (as a run still under way has none yet)
    for command in (["sample", "--model", "run"], ["eval", "run", "--hellaswag", "x"]):
        one_line(cli(*command, cwd=tmp_path),
                 "run: a run's output without its model.bin yet (the run is under way, or "
                 "stopped early); its newest checkpoint's model is "
                 f"{os.path.join('run', 'ckpt_00000003', 'model.bin')}")


def test_a_config_whose_layer_count_is_not_its_weights_is_blamed(hf):
    config = json.loads((hf / "hf" / "config.json").read_text())
    (hf / "hf" / "config.json").write_text(json.dumps({**config, "n_layer": 3}))
    for command in (["sample", "--model", "hf"], [*TINY, "-e", "hf", "-o", "o"]):
        one_line(cli(*command, cwd=hf), f"{os.path.join('hf', 'config.json')}: n_layer is 3, "
                                        f"but model.safetensors holds 2 layers' tensors")


@pytest.mark.parametrize("spelling,said", [
    ("m.bin/", "m.bin/: m.bin is a file, and the trailing / names a directory"),
    ("~/nowhere/m.bin", "the shell leaves a ~ unexpanded when quoted or after --flag="),
    ("hf/config.json", "hf/config.json: one file of a transformers directory; give the "
                       "directory, hf"),
    ("hf/model.safetensors", "one file of a transformers directory; give the directory, hf"),
    ("log.jsonl", "log.jsonl: a JSON file (a log, or a config?), not an llm.c model"),
])
def test_a_misspelt_model_is_named_for_what_it_is(hf, spelling, said):
    """Each was "no such model" (the file exists), "cannot open model file" or "truncated
    model file (505 bytes ...)" (a config.json, a log), by every command that takes one."""
    (hf / "log.jsonl").write_text('{"step": 1, "train_loss": 5.0}\n')
    for command in (["sample", "--model", spelling], ["eval", spelling, "--hellaswag", "x"],
                    [*TINY, "-n", "1", "-e", spelling], ["convert", spelling, "dst"]):
        one_line(cli(*command, cwd=hf), said)


def test_a_missing_model_is_the_same_line_for_train(tmp_path):
    """train -e of a path that is gone (a checkpoint a live run's --keep removed) said
    "cannot open model file (No such file or directory)", sample and eval "no such model"."""
    for command in (["sample", "--model", "gone/model.bin"], [*TINY, "-e", "gone/model.bin"]):
        one_line(cli(*command, cwd=tmp_path), "gone/model.bin: no such model: give an llm.c "
                                              "model file")
