"""HellaSwag: llm.c's eval file (made here by a writer of its own, following llm.c's
data_common.py layout), scored by `eval` and train's -h 1 on 1 rank and on a dp x tp x pp
grid, equal to a float64 NumPy GPT-2 written here; `prepare --hellaswag` tokenizes as
llm.c's script does."""
import json
import os

import numpy as np
import pytest
from harness import DEVICES, cli, device_env, mpiexec, tiktokens

HEADER = 256


def write_llmc_eval(path, examples):
    """examples: (label, context ids, [4 completion ids]) -> llm.c's eval file."""
    stream, longest = [], 0
    for i, (label, ctx, ends) in enumerate(examples):
        ex = [65535, 0, i, label, len(ends), len(ctx), *ctx]
        for e in ends:
            ex += [len(e), *e]
        ex[1] = 2 * len(ex)
        longest = max(longest, ex[1])
        stream += ex
    header = np.zeros(HEADER, np.int32)
    header[:4] = 20240522, 1, len(examples), longest
    with open(path, "wb") as f:
        f.write(header.tobytes() + np.array(stream, np.uint16).tobytes())


def read_llmc_eval(path):
    """The test's own parse of an eval file: [(label, context, [4 completions])]."""
    raw = open(path, "rb").read()
    n = int(np.frombuffer(raw[:4 * HEADER], np.int32)[2])
    s, p, out = np.frombuffer(raw[4 * HEADER:], np.uint16).tolist(), 0, []
    for _ in range(n):
        label, k, q = s[p + 3], s[p + 4], p + 5
        fields = []
        for _ in range(1 + k):
            fields.append(s[q + 1:q + 1 + s[q]])
            q += 1 + s[q]
        out.append((label, fields[0], fields[1:]))
        p += s[p + 1] // 2
    return out


def gpt2_float64(cfg, flat, tokens):
    """Logits (T, V) of one row, llm.c's GPT-2 in float64 from its parameter file order."""
    C, L, V, Vp, maxT = cfg.C, cfg.L, cfg.V, cfg.Vp, cfg.maxT
    sizes = [("wte", (Vp, C)), ("wpe", (maxT, C)), ("ln1w", (L, C)), ("ln1b", (L, C)),
             ("qkvw", (L, 3 * C, C)), ("qkvb", (L, 3 * C)), ("attprojw", (L, C, C)),
             ("attprojb", (L, C)), ("ln2w", (L, C)), ("ln2b", (L, C)), ("fcw", (L, 4 * C, C)),
             ("fcb", (L, 4 * C)), ("fcprojw", (L, C, 4 * C)), ("fcprojb", (L, C)),
             ("lnfw", (C,)), ("lnfb", (C,))]
    p, at = {}, 0
    for name, shape in sizes:
        n = int(np.prod(shape))
        p[name] = flat[at:at + n].astype(np.float64).reshape(shape)
        at += n

    def ln(x, w, b):
        m, v = x.mean(-1, keepdims=True), x.var(-1, keepdims=True)
        return (x - m) / np.sqrt(v + 1e-5) * w + b
    T, H = len(tokens), cfg.NH
    x = p["wte"][tokens] + p["wpe"][:T]
    causal = np.triu(np.full((T, T), -np.inf), 1)
    for l in range(L):
        q, k, v = np.split(ln(x, p["ln1w"][l], p["ln1b"][l]) @ p["qkvw"][l].T + p["qkvb"][l],
                           3, -1)
        q, k, v = (a.reshape(T, H, C // H).transpose(1, 0, 2) for a in (q, k, v))
        att = q @ k.transpose(0, 2, 1) / np.sqrt(C // H) + causal
        att = np.exp(att - att.max(-1, keepdims=True))
        y = (att / att.sum(-1, keepdims=True) @ v).transpose(1, 0, 2).reshape(T, C)
        x = x + y @ p["attprojw"][l].T + p["attprojb"][l]
        h = ln(x, p["ln2w"][l], p["ln2b"][l]) @ p["fcw"][l].T + p["fcb"][l]
        h = 0.5 * h * (1 + np.tanh(np.sqrt(2 / np.pi) * (h + 0.044715 * h ** 3)))
        x = x + h @ p["fcprojw"][l].T + p["fcprojb"][l]
    return ln(x, p["lnfw"], p["lnfb"]) @ p["wte"][:V].T


def score_float64(model, path):
    """(accuracy, (n, 4) mean completion losses) of an eval file, llm.c's scoring."""
    from cupygpt.formats.llmc import read_model
    cfg, flat = read_model(model)
    losses = []
    for label, ctx, ends in read_llmc_eval(path):
        row = []
        for e in ends:
            toks = np.array(ctx + e)
            z = gpt2_float64(cfg, flat, toks)
            logp = z - z.max(-1, keepdims=True)
            logp -= np.log(np.exp(logp).sum(-1, keepdims=True))
            pos = np.arange(len(ctx) - 1, len(toks) - 1)
            row.append(-logp[pos, toks[pos + 1]].mean())
        losses.append(row)
    losses = np.array(losses)
    labels = np.array([ex[0] for ex in read_llmc_eval(path)])
    return float(np.mean(losses.argmin(1) == labels)), losses


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A 6-head 4-layer model (TP 2 splits its heads) and an eval file of 11 examples of
    random lengths: 5 batches of 2 examples and one of 1 at B = 8."""
    from cupygpt.formats.llmc import write_model
    from cupygpt.model.initialize import init_params
    from cupygpt.model.shape import GPT2Config
    d = tmp_path_factory.mktemp("hellaswag")
    cfg = GPT2Config(maxT=32, V=301, Vp=320, L=4, NH=6, C=48)
    write_model(d / "model.bin", cfg, init_params(cfg, 7))
    rng = np.random.default_rng(5)
    examples = [(int(rng.integers(4)), rng.integers(0, 301, rng.integers(1, 12)).tolist(),
                 [rng.integers(0, 301, rng.integers(1, 8)).tolist() for _ in range(4)])
                for _ in range(11)]
    write_llmc_eval(d / "hs.bin", examples)
    return d


@pytest.fixture(scope="module")
def reference(made):
    return score_float64(made / "model.bin", made / "hs.bin")


def run_eval(made, *extra, ranks=None):
    res = cli("eval", made / "model.bin", "--hellaswag", made / "hs.bin", "--json",
              "--backend", "numpy", *extra, ranks=ranks)
    assert res.returncode == 0, res.stdout + res.stderr
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("device", DEVICES)
def test_eval_on_cuda_equals_float64_numpy(made, reference, device):
    """The CUDA backend (cudasim, or the GPU) scores alike: fp32 with TF32 off."""
    acc, losses = reference
    res = cli("eval", made / "model.bin", "--hellaswag", made / "hs.bin", "--json",
              "--backend", "cuda", "-b", "8", "--dtype", "fp32", "--no-tf32",
              env=device_env(device))
    assert res.returncode == 0, res.stdout + res.stderr
    r = json.loads(res.stdout.strip().splitlines()[-1])
    assert r["examples"] == 11 and r["accuracy"] == acc
    assert np.abs(np.array(r["losses"]) - losses).max() <= 2e-5


@pytest.mark.parametrize("dtype,tol", [("fp64", 1e-10), ("fp32", 2e-5)])
def test_eval_equals_float64_numpy_on_one_rank(made, reference, dtype, tol):
    acc, losses = reference
    r = run_eval(made, "-b", "8", "--dtype", dtype)
    assert r["examples"] == 11 and r["accuracy"] == acc
    assert np.abs(np.array(r["losses"]) - losses).max() <= tol
    assert 0 < acc < 1  # the file's labels and the model's choices differ somewhere


@pytest.mark.mpi
@pytest.mark.skipif(mpiexec() is None and not os.environ.get("CI"),
                    reason="needs mpiexec (pip install mpich)")
def test_eval_on_an_8_rank_grid_equals_float64_numpy(made, reference):
    acc, losses = reference
    r = run_eval(made, "-b", "8", "--dtype", "fp64", "--dp", "2", "--tp", "2", "--pp", "2",
                 "--micro-batches", "2", ranks=8)
    assert r["ranks"] == 8 and r["accuracy"] == acc
    assert np.abs(np.array(r["losses"]) - losses).max() <= 1e-10


def test_train_h1_logs_the_final_models_accuracy(made, tmp_path):
    """-h 1: at every val step and at the end, in the val line and log.jsonl; the last
    equals `eval` of the model the run wrote."""
    from harness import ROOT
    data = os.path.join(ROOT, "cupygpt", "data")
    from cupygpt.formats.llmc import read_shard, write_shard
    write_shard(tmp_path / "toks.bin", read_shard(os.path.join(
        data, "tiny_shakespeare_val.bin"))[:8000] % 301)
    res = cli("train", "-e", made / "model.bin", "-i", tmp_path / "toks.bin", "-j",
              tmp_path / "toks.bin", "-b", "8", "-t", "24", "-n", "4", "-v", "2", "-m", "1",
              "-g", "0", "-l", "1e-2", "-o", tmp_path / "o", "-h", "1", "--hellaswag-file",
              made / "hs.bin", "--backend", "numpy")
    assert res.returncode == 0, res.stdout + res.stderr
    recs = [json.loads(x) for x in open(tmp_path / "o" / "log.jsonl")]
    hs = [(r["step"], r["hellaswag_acc"]) for r in recs if "hellaswag_acc" in r]
    assert [s for s, _ in hs] == [0, 2, 4]
    assert res.stdout.count("hellaswag acc") == 3
    r = json.loads(cli("eval", tmp_path / "o" / "model.bin", "--hellaswag", made / "hs.bin",
                       "-b", "8", "-t", "24", "--json", "--backend", "numpy").stdout)
    assert hs[-1][1] == r["accuracy"] == score_float64(tmp_path / "o" / "model.bin",
                                                       made / "hs.bin")[0]
    quiet = cli("train", "-e", made / "model.bin", "-i", tmp_path / "toks.bin", "-j",
                tmp_path / "toks.bin", "-b", "8",
                "-t", "24", "-n", "2", "-v", "0", "-g", "0", "-o", tmp_path / "q", "-h", "1",
                "--hellaswag-file", made / "hs.bin", "--backend", "numpy")
    assert quiet.returncode == 0, quiet.stderr  # -v 0: no val loss, HellaSwag at the end
    recs = [json.loads(x) for x in open(tmp_path / "q" / "log.jsonl")]
    assert [(r["step"], "val_loss" in r) for r in recs if "hellaswag_acc" in r] == [(2, False)]
    assert quiet.stdout.count("hellaswag acc") == 1 and "val loss" not in quiet.stdout


def test_prepare_tokenizes_as_llmc(tmp_path):
    """Context as it is, each ending after a space, GPT-2's tokens (tiktoken's encoding of
    the shipped tokenizer); two ids checked against GPT-2's published vocabulary."""
    recs = [{"ctx": "Hello", "endings": ["world", "there.", "a b", "x"], "label": 0},
            {"ctx": "A man is sitting on a roof. he", "endings": [
                "is using wrap to wrap a pair of skis.", "is ripping level tiles off.",
                "is holding a rubik's cube.", "starts pulling up roofing on a roof."],
             "label": 3, "ind": 24}]
    src = tmp_path / "hellaswag_val.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in recs))
    res = cli("prepare", src, "--hellaswag", "--out", tmp_path / "d")
    assert res.returncode == 0, res.stderr
    got = read_llmc_eval(tmp_path / "d" / "hellaswag_val.bin")
    assert got[0][1] == [15496] and got[0][2][0] == [995]  # "Hello", " world"
    ids = iter(tiktokens([x for r in recs for x in [r["ctx"]] + [" " + e for e in r["endings"]]],
                         eot=False))
    assert got == [(r["label"], next(ids), [next(ids) for _ in r["endings"]]) for r in recs]
    raw = open(tmp_path / "d" / "hellaswag_val.bin", "rb").read()
    longest = max(2 * (5 + 1 + len(c) + sum(1 + len(e) for e in es)) for _, c, es in got)
    assert np.frombuffer(raw[:16], np.int32).tolist() == [20240522, 1, 2, longest]
