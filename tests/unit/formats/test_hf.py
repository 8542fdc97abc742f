"""transformers interop: a random GPT2LMHeadModel (built once, saved with save_pretrained)
read by cupygpt gives transformers' logits, gradients and greedy tokens; llm.c -> HF ->
llm.c is byte-identical; a model cupygpt trained gives transformers the same val loss.
torch and transformers are test-only (the `test-hf` extra); without them these tests skip
here and fail in CI."""
import importlib.util
import json
import os
import shutil
import subprocess
import sys

import numpy as np
import pytest
from harness import ROOT, cli, fixture
from safetensors.numpy import load_file, save_file
from statefile import write_state

from cupygpt.formats import hf
from cupygpt.formats.llmc import read_shard, to_bf16
from cupygpt.formats.tokenizer import Tokenizer

MISSING = [m for m in ("torch", "transformers") if importlib.util.find_spec(m) is None]
needs_hf = pytest.mark.skipif(bool(MISSING) and not os.environ.get("CI"),
                              reason=f"{' and '.join(MISSING)} not installed "
                                     f"(pip install -e '.[test-hf]')")
TOK_PATH = os.path.join(ROOT, "cupygpt", "data", "gpt2_tokenizer.bin")
TOK = Tokenizer(TOK_PATH)
VAL = os.path.join(ROOT, "cupygpt", "data", "tiny_shakespeare_val.bin")


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """(directory, model): 3 layers, C=96, 3 heads, GPT-2's vocab (not a multiple of 64),
    n_positions 64; every parameter perturbed, so a bias or a norm mapped wrongly shows."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(vocab_size=50257, n_positions=64, n_embd=96,
                                       n_layer=3, n_head=3)).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    d = tmp_path_factory.mktemp("hf") / "gpt2"
    model.save_pretrained(d)
    return d, model


def ok_run(*args):
    res = cli(*args, "--backend", "numpy") if args[0] != "convert" else cli(*args)
    assert res.returncode == 0, res.stderr
    return res


@needs_hf
def test_logits_and_gradients_equal_transformers(hf_dir, tmp_path):
    """verify, reading the directory itself, against a debug state transformers wrote."""
    import torch
    d, model = hf_dir
    xy = torch.from_numpy(np.random.default_rng(1).integers(0, 50257, (2, 33)))
    x, y = xy[:, :-1], xy[:, 1:]
    logits = model(x).logits
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, 50257), y.reshape(-1))
    model.zero_grad()
    loss.backward()
    g = tmp_path / "grads"  # the gradients as a model: read into llm.c's order as one is
    g.mkdir()
    shutil.copy(d / hf.CONFIG, g)
    save_file({n: p.grad.numpy() for n, p in model.named_parameters()}, g / hf.WEIGHTS)
    write_state(tmp_path / "state.bin", x.numpy(), y.numpy(), logits.detach().numpy(),
                loss.item(), hf.read_model(str(g))[1])
    res = cli("verify", "--model", d, "--state", tmp_path / "state.bin", "--steps", "1",
              "--json", "--backend", "numpy")
    report = json.loads(res.stdout.strip().splitlines()[-1])
    assert report["ok"] and res.returncode == 0, res.stdout
    assert report["logits"]["max_abs_diff"] <= 1e-5


@needs_hf
def test_greedy_sample_equals_generate(hf_dir):
    import torch
    d, model = hf_dir
    prompt = "First Citizen:"
    ids = [TOK.eot] + TOK.encode(prompt)
    model.generation_config.eos_token_id = None  # 32 tokens, an end token or not
    with torch.no_grad():
        x = torch.tensor([ids])  # (a mask: else the start token, also the pad, is masked)
        out = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False,
                             max_new_tokens=32, pad_token_id=TOK.eot)[0, len(ids):].tolist()
    assert len(out) == 32
    res = ok_run("sample", "--model", d, "--prompt", prompt, "--temperature", "0",
                 "--max-new-tokens", "32")
    assert res.stdout == prompt + TOK.decode(out) + "\n"


@needs_hf
def test_llmc_hf_llmc_is_byte_identical(tmp_path):
    for name, dtype in (("tiny_model.bin", "fp32"), ("odd_model.bin", "fp32"),
                        ("gpt2v_model_bf16.bin", "bf16")):
        d, back = tmp_path / name[:-4], tmp_path / f"back_{name}"
        res = ok_run("convert", fixture(name), d)
        assert ("tokenizer_config.json" in res.stdout) == (name.startswith("gpt2v")), res.stdout
        assert ("no tokenizer files" in res.stdout) != (name.startswith("gpt2v"))
        ok_run("convert", d, back, "--dtype", dtype)
        assert back.read_bytes() == open(fixture(name), "rb").read(), name


@needs_hf
def test_exported_model_and_tokenizer_load_in_transformers(hf_dir, tmp_path):
    """HF -> llm.c -> HF: the same tensors, and from_pretrained gives the same logits;
    the tokenizer files written from the shipped tokenizer encode as cupygpt does."""
    import torch
    from transformers import GPT2LMHeadModel
    d, model = hf_dir
    ok_run("convert", d, tmp_path / "m.bin")
    ok_run("convert", tmp_path / "m.bin", tmp_path / "again")
    a, b = load_file(d / hf.WEIGHTS), load_file(tmp_path / "again" / hf.WEIGHTS)
    assert a.keys() == b.keys() and all(np.array_equal(a[k], b[k]) for k in a)
    x = torch.tensor([list(range(100, 140))])
    with torch.no_grad():
        assert torch.equal(GPT2LMHeadModel.from_pretrained(tmp_path / "again")(x).logits,
                           model(x).logits)
    # both tokenizers in a process of their own: in this one, once NVRTC is loaded (the
    # kernel tests), the Rust tokenizers panic ("no entry found for key")
    text = open(os.path.join(ROOT, "data", "tinyshakespeare.txt")).read()[:5000]
    text += " héllo wörld 日本語 🙂\n\n  it'll\tdo's   "
    script = ("import json, sys; from transformers import AutoTokenizer; "
              "from cupygpt.formats.tokenizer import Tokenizer; t = sys.stdin.read(); "
              f"print(json.dumps([AutoTokenizer.from_pretrained({str(tmp_path / 'again')!r})"
              f".encode(t), Tokenizer({TOK_PATH!r}).encode(t)]))")
    res = subprocess.run([sys.executable, "-c", script], input=text, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    theirs, ours = json.loads(res.stdout)
    assert theirs == ours and len(ours) > 1000


@needs_hf
def test_legacy_pytorch_bin_reads_without_torch(hf_dir, tmp_path):
    """torch.save's state dict (lm_head.weight tied in it) gives the same llm.c file."""
    import torch
    d, model = hf_dir
    legacy = tmp_path / "legacy"
    legacy.mkdir()
    shutil.copy(d / hf.CONFIG, legacy)
    torch.save(model.state_dict(), legacy / hf.TORCH_WEIGHTS)
    ok_run("convert", d, tmp_path / "a.bin")
    ok_run("convert", legacy, tmp_path / "b.bin")
    assert (tmp_path / "a.bin").read_bytes() == (tmp_path / "b.bin").read_bytes()


@needs_hf
def test_trained_model_gives_transformers_the_same_val_loss(hf_dir, tmp_path):
    """20 steps from the directory, exported: transformers' loss on the shipped val shard's
    batches (llm.c's loader: B*T+1 tokens each, advancing B*T) equals the run's last one."""
    import torch
    from transformers import GPT2LMHeadModel
    out = tmp_path / "run"
    ok_run("train", "-e", hf_dir[0], "-o", out, "-n", "20", "-b", "4", "-t", "64", "-v", "20",
           "-m", "4", "-s", "0")
    ours = [json.loads(line) for line in open(out / "log.jsonl") if "val_loss" in line][-1]
    ok_run("convert", out / "model.bin", tmp_path / "exported")
    model = GPT2LMHeadModel.from_pretrained(tmp_path / "exported").eval()
    val, n = np.asarray(read_shard(VAL), np.int64), 4 * 64
    losses = []
    with torch.no_grad():
        for i in range(4):
            buf = torch.from_numpy(val[i * n: i * n + n + 1])
            logits = model(buf[:-1].reshape(4, 64)).logits
            losses.append(torch.nn.functional.cross_entropy(
                logits.reshape(-1, 50257), buf[1:].reshape(-1)).item())
    assert ours["step"] == 20 and abs(np.mean(losses) - ours["val_loss"]) <= 1e-5


@needs_hf
def test_bf16_rounds_as_torch_casts():
    import torch
    x = np.random.default_rng(0).standard_normal(1 << 16).astype(np.float32) * 100
    x[:6] = [np.inf, -np.inf, 3.4e38, 1.00390625, 1.01171875, 0.0]  # (two ties: to even)
    want = torch.from_numpy(x).to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    assert np.array_equal(to_bf16(x), want)
    assert np.isnan((to_bf16(np.float32([np.nan])).astype(np.uint32) << 16).view(np.float32))


def broken(tmp_path, hf_dir, config=None, drop=(), reshape=(), extra=None):
    """A copy of the directory with config.json's fields replaced (None: removed), tensors
    dropped, reshaped, or added."""
    d = tmp_path / "bad"
    d.mkdir()
    c = json.loads((hf_dir / hf.CONFIG).read_text())
    c.update(config or {})
    (d / hf.CONFIG).write_text(json.dumps({k: v for k, v in c.items() if v is not None}))
    t = load_file(hf_dir / hf.WEIGHTS)
    t = {k: v[:-1] if k in reshape else v for k, v in t.items() if k not in drop}
    save_file({**t, **(extra(t) if extra else {})}, d / hf.WEIGHTS)
    return d


H0 = "transformer.h.0."
BAD = [  # (id, directory changes, what the one line says)
    ("model_type", dict(config={"model_type": "llama"}), "model_type 'llama' is not GPT-2's"),
    ("architecture", dict(config={"architectures": ["GPT2ForSequenceClassification"]}),
     "architectures GPT2ForSequenceClassification"),
    ("activation", dict(config={"activation_function": "relu"}), "activation_function 'relu'"),
    ("untied config", dict(config={"tie_word_embeddings": False}), "tie_word_embeddings False"),
    ("scale by layer", dict(config={"scale_attn_by_inverse_layer_idx": True}),
     "scale_attn_by_inverse_layer_idx True"),
    ("no scale", dict(config={"scale_attn_weights": False}), "scale_attn_weights False"),
    ("epsilon", dict(config={"layer_norm_epsilon": 1e-6}), "layer_norm_epsilon 1e-06"),
    ("n_inner", dict(config={"n_inner": 128}), "n_inner 128 differs"),
    ("n_ctx", dict(config={"n_ctx": 1024}), "n_ctx 1024 differs"),
    ("no n_head", dict(config={"n_head": None}), "not a valid GPT-2 shape"),
    ("bias absent", dict(drop=[H0 + "attn.c_attn.bias"]), "tensor h.0.attn.c_attn.bias is missing"),
    ("misshapen", dict(reshape=[H0 + "mlp.c_fc.weight"]),
     f"tensor {H0}mlp.c_fc.weight has shape (95, 384)"),
    ("other part", dict(extra=lambda t: {"score.weight": t["transformer.ln_f.bias"]}),
     "tensor score.weight is not GPT-2's"),
    ("untied head", dict(extra=lambda t: {"lm_head.weight": t["transformer.wte.weight"] + 1}),
     "lm_head.weight differs from wte.weight"),
]


@needs_hf
@pytest.mark.parametrize("changes,says", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_a_model_that_is_not_gpt2_is_refused(hf_dir, tmp_path, changes, says):
    d = broken(tmp_path, hf_dir[0], **changes)
    res = cli("convert", d, tmp_path / "out.bin")
    assert res.returncode == 1 and res.stderr.count("\n") == 1, res.stderr
    assert says in res.stderr and str(d) in res.stderr
    assert os.listdir(tmp_path) == ["bad"]  # nothing written


@needs_hf
def test_bad_paths_are_refused_before_anything_is_written(hf_dir, tmp_path):
    (tmp_path / "empty").mkdir()
    (tmp_path / "a_file").write_text("")
    cases = [(["convert", tmp_path / "empty", tmp_path / "o.bin"], "no config.json in it"),
             (["convert", fixture("tiny_model.bin"), tmp_path / "empty"], "already exists"),
             (["convert", fixture("tiny_model.bin"), tmp_path / "a_file" / "x"],
              "a_file is a file, not a directory"),
             (["convert", hf_dir[0], tmp_path / "a_file" / "x.bin"], "is a file, not a"),
             (["convert", hf_dir[0], tmp_path / "empty"], "a directory; from a transformers"),
             (["train", "-e", tmp_path / "empty", "-o", tmp_path / "run"], "no config.json")]
    for args, says in cases:
        res = cli(*args)
        assert res.returncode == 1 and res.stderr.count("\n") == 1, res.stderr
        assert says in res.stderr, res.stderr
    assert sorted(os.listdir(tmp_path)) == ["a_file", "empty"]
    assert not os.listdir(tmp_path / "empty")


def test_a_write_that_fails_leaves_nothing(tmp_path, monkeypatch):
    """A disk that fills while the directory is written: one error, no DST, no DST.partial."""
    from cupygpt import CupyGPTError
    from cupygpt.commands import convert

    def full(*args, **kw):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(convert, "save_file", full)
    with pytest.raises(CupyGPTError,
                       match=r"hf: disk full \(or over quota\) while writing it; nothing was"):
        convert.convert(fixture("tiny_model.bin"), str(tmp_path / "hf"))
    assert os.listdir(tmp_path) == []


def a_torch_zip(path, offset, shape, stride):
    """A torch.save zip of one float32 tensor "w" over a 12-element storage, its pickle
    written by hand (any strides, as a crafted file has them)."""
    import struct
    import zipfile

    def ints(xs):
        return b"(" + b"".join(b"J" + struct.pack("<i", x) for x in xs) + b"t"

    def text(s):
        return b"X" + struct.pack("<I", len(s)) + s.encode()
    storage = b"(" + text("storage") + b"ctorch\nFloatStorage\n" + text("0") + text("cpu") + \
        b"K\x0ctQ"
    pkl = (b"\x80\x02}(" + text("w") + b"ctorch._utils\n_rebuild_tensor_v2\n(" + storage +
           b"J" + struct.pack("<i", offset) + ints(shape) + ints(stride) + b"\x89" +
           b"ccollections\nOrderedDict\n)RtRu.")
    with zipfile.ZipFile(path, "w") as z:
        z.writestr("archive/data.pkl", pkl)
        z.writestr("archive/data/0", np.arange(12, dtype="<f4").tobytes())


def test_a_tensor_reaching_outside_its_storage_is_refused(tmp_path):
    """Strides torch never writes (negative: memory before the storage, read by as_strided
    into the converted model), an offset or last element past the storage."""
    from cupygpt import CupyGPTError
    from cupygpt.formats.torchbin import torch_weights
    a_torch_zip(tmp_path / "ok.bin", 1, [2, 3], [4, 1])
    shapes, read = torch_weights(tmp_path / "ok.bin")
    assert shapes == {"w": ((2, 3), "F32")}
    assert read("w").tolist() == [[1, 2, 3], [5, 6, 7]]
    for offset, stride in ((0, [4, -1]), (2, [-2, 1]), (-1, [3, 1]), (3, [8, 1])):
        a_torch_zip(tmp_path / "bad.bin", offset, [2, 3], stride)
        with pytest.raises(CupyGPTError, match="tensor w lies outside its storage"):
            torch_weights(tmp_path / "bad.bin")[1]("w")
