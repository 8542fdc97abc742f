"""The commands that run in one process beside training: prepare (text to shards), convert
(to and from transformers' GPT-2 directories), schedule (a schedule's lists and
simulation), gpucheck, plot and timeline (pictures). cli.py adds them to the group."""
import glob
import math
import os
import sys
import time

import click

from .. import CupyGPTError
from ..backends import gpu_available, host_memory
from ..paths import TOKENIZER
from .flags import entry, one_process, overwrite_option, progress
from ..comm.launch import Stopped
from ..config.sections import RUN_DTYPES, at_most_a_year, out_file
from ..commands.convert import convert as run_convert
from ..paths import atomic_write, make_dir, make_parent
from ..formats.llmc import write_shard
from ..paths import TEXT_CAP, check_outputs, claim, json_object, not_compressed, read_bounded
from ..formats.hellaswag import from_jsonl, write_eval
from ..commands.gpucheck.check import (PARTS as GPUCHECK_PARTS, REPORT as GPUCHECK_REPORT,
                                       gpucheck as run_check, verdict)
from ..parallel.pipeline.schedule import SCHEDULES, chunks_per_rank, short, slot_plan
from ..parallel.pipeline.simulate import simulate
from ..commands.plot import plot as run_plot
from ..commands.prepare import check_inputs, write_shards
from ..commands.timeline import timeline as draw
from ..formats.tokenizer import Tokenizer, tokenize_tinyshakespeare


@click.command()
@click.argument("inputs", nargs=-1, required=True)
@click.option("--out", default="data", show_default=True, help="output directory")
@click.option("--tokenizer", default=TOKENIZER, show_default=True)
@click.option("--name", default=None, help="shard name prefix  [default: the first input's "
                                           "file name without its extension]")
@click.option("--shard-size", type=int, default=None,
              help="tokens per shard: the corpus mode, llm.c's FineWeb script (its default "
                   "with several inputs or jsonl/parquet: 100,000,000)")
@click.option("--overwrite", "--force", "force", is_flag=True,
              help="replace shards already there (--force: its older name)")
@click.option("--workers", type=int, default=None,
              help="tokenizing processes in the corpus mode  [default: one per core]")
@click.option("--hellaswag", is_flag=True,
              help="the one input is HellaSwag's jsonl (ctx, endings, label): write llm.c's "
                   "eval file OUT/NAME.bin for `eval` and train's -h 1, tokenized as llm.c's "
                   "script")
@entry
def prepare(inputs, out, tokenizer, name, shard_size, force, workers, hellaswag):
    """Tokenize text into llm.c shards. One text file: NAME_val.bin and NAME_train.bin, as
    llm.c's tinyshakespeare script does. Several inputs (text files, each a document; jsonl
    or parquet, each record's `text`) or --shard-size: shards of that many tokens,
    NAME_val_000000.bin then NAME_train_000001.bin..., an EOT before each document,
    tokenized on every core. --hellaswag: HellaSwag's jsonl to llm.c's eval file."""
    one_process("prepare")
    check_inputs(inputs)
    name = os.path.splitext(os.path.basename(inputs[0]))[0] if name is None else name
    if not name or name in (".", "..") or "/" in name or os.sep in name:
        raise CupyGPTError("must be a plain file-name prefix (no directory); put the "
                           "directory in --out", "name", repr(name))
    if hellaswag:  # (before the corpus mode, which takes a .jsonl too)
        if len(inputs) != 1:
            raise CupyGPTError(f"prepare --hellaswag takes one input, HellaSwag's jsonl, "
                               f"not {len(inputs)}")
        return prepare_hellaswag(inputs[0], os.path.join(out, f"{name}.bin"), tokenizer, force)
    if shard_size is not None or len(inputs) > 1 or inputs[0].endswith((".jsonl", ".parquet")):
        return prepare_corpus(inputs, out, tokenizer, name,
                              10 ** 8 if shard_size is None else shard_size, force, workers)
    text = inputs[0]
    paths = {split: os.path.join(out, f"{name}_{split}.bin") for split in ("val", "train")}
    # through a link too (a clone's ./data is the package's): resolved paths are compared
    check_outputs([("out", out), *(("out", p) for p in paths.values())], [text, tokenizer])
    claim_out(out, existing_of(*paths.values()), force)
    body = text_of(text)
    tok = Tokenizer(tokenizer)
    with progress(body.count("\n\n") + 1, "tokenizing") as bar:
        try:
            train_tokens, val_tokens = tokenize_tinyshakespeare(body, tok, progress=bar.update)
        except CupyGPTError as e:
            raise CupyGPTError(f"{text}: {e}") from None
    # both written before either is renamed: a failure leaves neither
    with atomic_write(paths["val"]) as fv, atomic_write(paths["train"]) as ft:
        write_shard(paths["val"], val_tokens, fv)
        write_shard(paths["train"], train_tokens, ft)
    for split, toks in (("val", val_tokens), ("train", train_tokens)):
        click.echo(f"wrote {len(toks):,} tokens to {paths[split]}")


def claim_out(out, replaced, force):
    """prepare's --out made and claimed (one command writing there at a time); then what
    it would replace there (replaced(): the paths, looked at once claimed) only with
    --overwrite. Returns those paths."""
    make_dir("out", out)
    claim("out", out)
    there = replaced()
    if there and not force:
        raise CupyGPTError(f"{there[0]} exists; add --overwrite to replace "
                           f"{'it' if len(there) == 1 else 'them'}, or another --out or "
                           f"--name", "out", out)
    return there


def existing_of(*paths):
    return lambda: [p for p in paths if os.path.exists(p)]


def text_of(path, kind="text"):
    """A text input, decoded (a compressed file named as such)."""
    data = read_bounded(path, kind, TEXT_CAP)
    not_compressed(path, data)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise CupyGPTError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None


def prepare_hellaswag(jsonl, path, tokenizer, force):
    """prepare --hellaswag: the jsonl's examples to llm.c's eval file at path."""
    check_outputs([("out", path)], [jsonl, tokenizer])
    claim_out(os.path.dirname(path) or ".", existing_of(path), force)
    examples = from_jsonl(text_of(jsonl, "jsonl"), Tokenizer(tokenizer).encode, jsonl)
    with atomic_write(path) as f:
        write_eval(f, examples)
    click.echo(f"wrote {len(examples):,} examples to {path}")


def prepare_corpus(inputs, out, tokenizer, name, shard_size, force, workers):
    if shard_size < 1:
        raise CupyGPTError("must be a positive number of tokens per shard (llm.c's FineWeb "
                           "script: 100000000)", "shard_size", shard_size)
    cores = len(os.sched_getaffinity(0))
    if workers is not None and workers < 1:
        raise CupyGPTError("must be at least 1 (leave it out for one per core)", "workers",
                           workers)
    if workers is not None and workers > cores:  # more processes than cores only contend
        click.echo(f"note: --workers {workers}: this process may run on {cores} core(s); "
                   f"using {cores}", err=True)
    workers = cores if workers is None else min(workers, cores)
    free = host_memory.available()
    if 2 * shard_size > free:  # the shard filling, uint16 tokens (numpy would raise later)
        raise CupyGPTError(f"a shard is held in memory as it fills (2 bytes a token: "
                           f"{2 * shard_size / 2**30:,.1f} GiB), more than the "
                           f"{free / 2**30:,.1f} GiB free; give a smaller one (llm.c's "
                           f"FineWeb script: 100000000)", "shard_size", shard_size)
    check_outputs([("out", out)], [*inputs, tokenizer])
    Tokenizer(tokenizer)  # (a damaged tokenizer: its one line here, not from every worker)
    before = claim_out(out, lambda: sorted(
        glob.glob(os.path.join(glob.escape(out), f"{glob.escape(name)}_val_*.bin"))
        + glob.glob(os.path.join(glob.escape(out), f"{glob.escape(name)}_train_*.bin"))), force)
    t0 = time.perf_counter()
    try:
        with progress(sum(os.path.getsize(p) for p in inputs), "tokenizing") as bar:
            paths, total, docs = write_shards(inputs, out, name, shard_size, tokenizer,
                                               bar.update, workers)
        if total == docs:  # (each document's EOT alone: no text at all)
            for p in paths:
                os.unlink(p)
            raise CupyGPTError(f"{inputs[0]}{' ...' if len(inputs) > 1 else ''}: no "
                               f"text in the input(s) (empty documents only); nothing "
                               f"written: give a non-empty corpus")
    except Stopped:
        click.echo("interrupted: the shards written so far are whole; no shard is half "
                   "written", err=True)
        raise
    for stale in sorted(set(before) - set(paths)):  # --force: an earlier, longer set's rest
        os.unlink(stale)
    dt = time.perf_counter() - t0
    click.echo(f"wrote {total:,} tokens in {len(paths)} shard(s) ({paths[0]} is val) to "
               f"{out} in {dt:.1f} s ({total / dt:,.0f} tokens/s, {workers} worker(s) on "
               f"{cores} cores)")
    if len(paths) == 1:
        click.echo(f"no train shard: the corpus fits in one --shard-size ({shard_size:,} "
                   f"tokens); give a smaller one for train's -i")


@click.command()
@click.argument("src")
@click.argument("dst")
@click.option("--dtype", default="fp32", show_default=True, help="the llm.c file's",
              type=click.Choice(RUN_DTYPES))
@click.option("--tokenizer", default=TOKENIZER, show_default=True,
              help="its vocab.json, merges.txt go beside a model with its vocab")
@click.option("--overwrite", "--force", "force", is_flag=True,
              help="replace an existing llm.c model file DST (--force: its older name)")
@entry
def convert(src, dst, dtype, tokenizer, force):
    """A transformers GPT-2 directory SRC to an llm.c model file DST, or an llm.c file SRC
    to a new directory DST that GPT2LMHeadModel.from_pretrained loads."""
    one_process("convert")
    for line in run_convert(src, dst, dtype == "bf16", tokenizer, force):
        click.echo(line)


MAX_STAGES, MAX_CELLS = 512, 65536  # (-p 64 -m 1000: 3.4 s; -p 2000 -m 8: 18 s)


@click.command()
@click.option("--stages", "-p", default=4, show_default=True)
@click.option("--micro-batches", "-m", default=8, show_default=True)
@click.option("--schedule", default="1f1b", show_default=True, type=click.Choice(list(SCHEDULES)))
@click.option("--virtual-stages", "-v", type=int, default=None,
              help="model chunks per rank (interleaved; zbv holds 2)  [default: 2 with "
                   "interleaved, else 1]")
@click.option("--backward-cost", default=2.0, show_default=True,
              help="time of a backward relative to a forward (split: half B, half W)")
@entry
def schedule(stages, micro_batches, schedule, virtual_stages, backward_cost):
    """Print each rank's actions (F3.1: micro-batch 3 on the rank's chunk 1), the simulated
    bubble and each rank's peak of live activations of a pipeline schedule."""
    one_process("schedule")
    if stages < 1 or micro_batches < 1:
        raise CupyGPTError("--stages and --micro-batches must be positive")
    if stages > MAX_STAGES or stages * micro_batches > MAX_CELLS:
        raise CupyGPTError(f"-p {stages} -m {micro_batches}: at most {MAX_STAGES} stages and "
                           f"{MAX_CELLS:,} stages x micro-batches (the simulator runs in "
                           f"Python: that takes seconds already); give smaller ones")
    if not 0 < backward_cost < float("inf"):
        raise CupyGPTError("must be a positive number (a backward's time in forwards)",
                           "backward_cost", backward_cost)
    v = chunks_per_rank(schedule, virtual_stages)
    # each rank's list made once: the simulator and the printout read the same lists
    lists = [SCHEDULES[schedule](stages, micro_batches, r, v) for r in range(stages)]
    sim = simulate(stages, micro_batches, lambda _p, _m, r, _v: lists[r], v, t_fwd=1.0,
                   t_bwd=backward_cost, placed=schedule)
    if not (math.isfinite(sim["bubble"]) and math.isfinite(sim["makespan"])):
        raise CupyGPTError("the simulated times overflow (not finite); give a smaller "
                           "ratio", "backward_cost", backward_cost)
    for r, acts in enumerate(lists):
        text = " ".join(map(short, acts))
        click.echo(f"rank {r} ({slot_plan(acts)[0]} activation slots): {text}")
    ideal = (stages - 1) / (micro_batches + stages - 1)
    peak = " ".join(f"{x:g}" for x in sim["peak"])
    click.echo(f"bubble {sim['bubble']:.4f} (1F1B's with equal stages: (p-1)/(m+p-1) = "
               f"{ideal:.4f}); "
               f"makespan {sim['makespan']:g} forward-times; peak live activations per rank "
               f"(whole stages) {peak}; deadlock-free")


@click.command()
@click.option("--out", default="gpu_report", show_default=True, help="report directory")
@click.option("--budget", default=420.0, show_default=True,
              help="seconds the whole check may take: each run gets what is left, and a "
                   "part that cannot fit is skipped, the report saying why")
@click.option("--peers", "peers_dir", default=None,
              help="a copy of shared/peers: llm.c's build starts at once, in the background, "
                   "and the peers (llm.c, PyTorch) run after bench at its B and T, for ratios "
                   "measured side by side")
@click.option("--quick", is_flag=True, help="benchmark the tiny preset at short T (minutes)")
@click.option("--part", "parts", multiple=True, type=click.Choice(list(GPUCHECK_PARTS)),
              help="run only these parts, merged into the report in --out (default: all)")
@entry
def gpucheck(out, budget, peers_dir, quick, parts):
    """The GPU check: verify, README's training commands, all GPU tests, the benchmarks and
    their peers, a pipeline run (also under MPS) and compute-sanitizer, the most valuable
    first, within --budget seconds, in one report; exit 0 only when every part has run and
    passed."""
    one_process("gpucheck")
    if not budget > 0 or math.isinf(budget):  # nan too
        raise CupyGPTError("must be a positive number of seconds", "budget", budget)
    at_most_a_year(budget, "budget")
    if peers_dir is not None and not os.path.isfile(os.path.join(peers_dir, "run-peers.sh")):
        raise CupyGPTError("must be a copy of shared/peers (it has no run-peers.sh)",
                           "peers_dir", peers_dir)
    check_outputs([("out", out)], [])  # (not into the package, as train's -o)
    make_dir("out", out)
    claim("out", out)
    if os.path.lexists(os.path.join(out, "report.json")):  # (refused before the check)
        json_object(os.path.join(out, "report.json"), GPUCHECK_REPORT)
    if not gpu_available():
        raise CupyGPTError("gpucheck: no GPU is visible (or CuPy is missing); run it on a "
                           "GPU machine after pip install -e '.[cuda13,test]'")
    report, md = run_check(out, "quick" if quick else "full", parts, budget, peers_dir)
    click.echo(md)
    sys.exit(0 if verdict(report) == "PASS" else 1)


@click.command()
@click.argument("log", type=click.Path())
@click.option("--out", default="loss.png", show_default=True, help="PNG to write")
@overwrite_option
@entry
def plot(log, out, overwrite):
    """Plot train and val loss from a train log (OUT/log.jsonl) to a PNG."""
    one_process("plot")
    check_outputs([("out", out)], [log])
    out_file("out", out, overwrite)
    make_parent("out", out)
    n_train, n_val, left_out = run_plot(log, out)
    click.echo(f"wrote {out} ({n_train} train, {n_val} val points" + (
        f"; left out {left_out} NaN, infinite or out-of-range loss(es)" if left_out else "")
        + ")")


@click.command()
@click.argument("trace", type=click.Path())
@click.option("--out", default="timeline.png", show_default=True, help="PNG to write")
@click.option("--schedule", default=None, type=click.Choice(list(SCHEDULES)),
              help="the run's schedule, for the prediction  [default: the trace's]")
@overwrite_option
@entry
def timeline(trace, out, schedule, overwrite):
    """Draw a --trace file: every rank's forwards and backwards over time, the measured
    bubble, and beneath it the simulator's prediction from the measured mean op times."""
    one_process("timeline")
    check_outputs([("out", out)], [trace])
    out_file("out", out, overwrite)
    make_parent("out", out)
    measured, predicted, name = draw(trace, out, schedule)
    click.echo(f"wrote {out}: {name}, measured bubble {measured:.4f}, simulated from each "
               f"rank's op and transfer times {predicted:.4f}")


TOOLS = (prepare, convert, schedule, gpucheck, plot, timeline)
