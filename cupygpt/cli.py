"""cupygpt's command line: each command builds its frozen config from the flags (config.py),
runs the library, and prints. Run any with --help."""
import json
import os
import sys
import time

import click

from . import CupyGPTError
from .backends import gpu_available
from .bench import bench as run_bench
from .bench_comm import comm_bench, format_rows, sizes
from .cli_kit import (DATA, REFERENCE, TOKENIZER, device_options, entry,
                      grid_options, pipeline_options, progress, session, trace_option)
from .convert import convert as run_convert
from .config import BenchConfig, SampleConfig, TrainConfig, VerifyConfig, make_dir
from .files import atomic_write, write_shard
from .gpucheck import PARTS as GPUCHECK_PARTS, gpucheck as run_check, problems
from .parallel.pipeline.schedule import SCHEDULES, chunks_per_rank, short, slot_plan
from .parallel.pipeline.simulate import simulate
from .plot import plot as run_plot
from .sample import sample_text
from .timeline import timeline as draw
from .tokenizer import Tokenizer, tokenize_tinyshakespeare
from .train import train as run_train
from .verify import format_report, verify as run_verify


@click.group()
def cli():
    """GPT-2 training in llm.c's formats: NumPy on the CPU, CUDA kernels on the GPU,
    pipeline-parallel under mpiexec."""


@cli.command()
@click.option("--model", default=os.path.join(REFERENCE, "tiny_model.bin"), show_default=True,
              help="llm.c model file (default: the shipped one made by llm.c's PyTorch reference)")
@click.option("--state", default=os.path.join(REFERENCE, "tiny_debug_state.bin"),
              show_default=True, help="llm.c debug state file for that model")
@click.option("--steps", default=10, show_default=True, help="AdamW steps on the state's batch")
@click.option("--lr", default=1e-4, show_default=True)
@click.option("--weight-decay", default=0.01, show_default=True, help="AdamW weight decay")
@click.option("--expected", default=None, help="JSON with a 'losses' list to check the steps")
@click.option("--dtype", default="float32", type=click.Choice(["float32", "float64"]),
              show_default=True)
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@trace_option
@device_options
@grid_options
@pipeline_options
@entry
def verify(as_json, **kw):
    """Check logits, loss and every gradient against an llm.c debug state."""
    sess = session(VerifyConfig, kw, tf32_default=False)
    report = run_verify(sess)
    if sess.mesh.rank == 0:
        click.echo(json.dumps(report) if as_json else format_report(report))
    ok = sess.tr.bcast(report["ok"] if sess.mesh.rank == 0 else None)
    sys.exit(0 if ok else 1)


@cli.command()
@click.argument("text", type=click.Path(exists=True, dir_okay=False))
@click.option("--out", default="data", show_default=True, help="output directory")
@click.option("--tokenizer", default=TOKENIZER, show_default=True)
@click.option("--name", default="tiny_shakespeare", show_default=True, help="shard name prefix")
@entry
def prepare(text, out, tokenizer, name):
    """Tokenize a text file into llm.c shards (NAME_val.bin, NAME_train.bin), as llm.c's
    tinyshakespeare script does."""
    try:
        body = open(text, encoding="utf-8").read()
    except UnicodeDecodeError as e:
        raise CupyGPTError(f"{text}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    tok = Tokenizer(tokenizer)
    make_dir("out", out)
    with progress(body.count("\n\n") + 1, "tokenizing") as bar:
        try:
            train_tokens, val_tokens = tokenize_tinyshakespeare(body, tok, progress=bar.update)
        except CupyGPTError as e:
            raise CupyGPTError(f"{text}: {e}") from None
    for split, toks in (("val", val_tokens), ("train", train_tokens)):
        path = os.path.join(out, f"{name}_{split}.bin")
        write_shard(path, toks)
        click.echo(f"wrote {len(toks):,} tokens to {path}")


@cli.command()
@click.option("-i", "train_pattern", default=os.path.join(DATA, "tiny_shakespeare_train.bin"),
              show_default=True, help="train shards (glob)")
@click.option("-j", "val_pattern", default=os.path.join(DATA, "tiny_shakespeare_val.bin"),
              show_default=True, help="val shards (glob)")
@click.option("-e", "init", default=None,
              help="llm.c model file, or a preset: tiny, d12, d24, d36, d48  [default: d12 on "
                   "a GPU, tiny on the CPU]")
@click.option("-o", "out", default="out", show_default=True, help="output directory")
@click.option("-b", "batch", default=4, show_default=True, help="batch size B")
@click.option("-t", "seq", default=None, type=int,
              help="sequence length T  [default: 1024 on a GPU, 64 on the CPU]")
@click.option("-l", "lr", default=1e-3, show_default=True, help="learning rate")
@click.option("-u", "warmup", default=10, show_default=True, help="lr warm-up steps")
@click.option("-q", "final_lr_frac", default=0.1, show_default=True,
              help="final lr as a fraction of -l (cosine decay)")
@click.option("-n", "steps", default=60, show_default=True, help="training steps")
@click.option("-v", "val_every", default=20, show_default=True, help="val loss every N steps")
@click.option("-m", "val_batches", default=4, show_default=True, help="val batches")
@click.option("-s", "sample_every", default=None, type=int,
              help="sample every N steps and at the end; 0: never  [default: at the end]")
@click.option("-g", "gen_tokens", default=48, show_default=True, help="tokens to generate")
@click.option("--weight-decay", default=0.0, show_default=True, help="AdamW weight decay")
@click.option("--seed", default=1337, show_default=True, help="initialisation and sampling seed")
@click.option("--tokenizer", default=TOKENIZER, show_default=True)
@click.option("--checkpoint-every", default=0, show_default=True,
              help="write OUT/ckpt_STEP every K steps and at the end (0: never)")
@click.option("--keep", default=2, show_default=True, help="checkpoints to keep")
@click.option("--resume", default=None, help="checkpoint dir (or a run's -o dir) to continue")
@click.option("--log-file", default=None, help="JSON lines per step (default OUT/log.jsonl)")
@click.option("--graphs/--no-graphs", default=True, show_default=True,
              help="replay each step as a CUDA graph (a GPU alone, or over nvshmem without "
                   "the overlapped dp sum)")
@trace_option
@device_options
@grid_options
@pipeline_options
@entry
def train(**kw):
    """Train GPT-2 llm.c-style; writes OUT/model.bin in llm.c's format."""
    run_train(session(TrainConfig, kw, tf32_default=True))


@cli.command()
@click.option("-e", "init", default=None,
              help="preset to benchmark  [default: d12 on a GPU, tiny on the CPU]")
@click.option("-b", "batch", default=4, show_default=True)
@click.option("-t", "seq", default=None, type=int,
              help="sequence length  [default: 1024 on a GPU, 64 on the CPU]")
@click.option("--steps", default=20, show_default=True, help="timed steps (median reported)")
@click.option("--warmup", default=3, show_default=True, help="untimed steps first")
@click.option("--graphs/--no-graphs", default=True, show_default=True)
@click.option("--profile", is_flag=True,
              help="add a time-per-op table (GPU: CUDA events, also per kernel, eager "
                   "steps; CPU: wall time per op)")
@click.option("--comm", is_flag=True,
              help="under mpiexec: time the transport's collectives and a stage handoff "
                   "from 1 KiB to 64 MiB and at this model's step sizes, instead")
@click.option("--out", default="bench.json", show_default=True, help="JSON to write")
@device_options
@trace_option
@grid_options
@pipeline_options
@entry
def bench(out, **kw):
    """Benchmark one training step: ms/step, tok/s, MFU, peak memory; writes JSON."""
    sess = session(BenchConfig, {**kw, "data": os.path.join(DATA, "tiny_shakespeare_train.bin")},
                   tf32_default=True)
    if sess.config.comm:
        with progress(len(sizes(sess.shape, sess.config.batch, sess.config.seq)),
                      "timing transfers") as bar:
            rows = comm_bench(sess, lambda: bar.update(1))
        if rows is not None:
            with atomic_write(out) as f:
                f.write(json.dumps(rows, indent=1).encode())
            click.echo(format_rows(rows) + f"\nwrote {out}")
        return
    with progress(sess.config.warmup + sess.config.steps, "benchmarking") as bar:
        r = run_bench(sess, lambda: bar.update(1))
    if sess.mesh.rank != 0:
        return
    with atomic_write(out) as f:
        f.write(json.dumps(r, indent=1).encode())
    click.echo(f"{r['device']}: {r['model']} B={r['B']} T={r['T']}: "
               f"{r['ms_per_step_median']:.2f} ms/step, {r['tok_per_s']:.0f} tok/s"
               + (f", MFU {100 * r['mfu']:.1f}%" if r["mfu"] else "")
               + (f", host launch {100 * r['host_launch_fraction']:.1f}% of the step"
                  if "host_launch_fraction" in r else "")
               + (f"; without overlapping the replicas' gradient sum "
                  f"{r['ms_per_step_no_overlap']:.2f} ms" if "ms_per_step_no_overlap" in r
                  else "") + f"; wrote {out}")
    for row in r.get("per_op", []):
        click.echo(f"  {row['op']:<20}{row['ms_per_step']:>9.3f} ms {100 * row['share']:>5.1f}%")
    for row in r.get("per_kernel", [])[:20]:
        click.echo(f"  {row['op'] + ': ' + row['kernel']:<48} x{row['calls_per_step']:<4}"
                   f"{row['ms_per_step']:>9.3f} ms {100 * row['share']:>5.1f}%")


@cli.command()
@click.option("--model", default=os.path.join("out", "model.bin"), show_default=True)
@click.option("--prompt", default="", help="text to continue (default: start of text)")
@click.option("--max-new-tokens", default=64, show_default=True)
@click.option("--temperature", default=1.0, show_default=True)
@click.option("--top-k", default=None, type=int)
@click.option("--seed", default=1337, show_default=True, help="sampling seed")
@click.option("--tokenizer", default=TOKENIZER, show_default=True)
@click.option("--kv-cache/--no-kv-cache", default=True, show_default=True,
              help="one position per token on cached keys and values, or a whole pass")
@device_options
@entry
def sample(**kw):
    """Generate text from an llm.c model file."""
    sess = session(SampleConfig, kw, tf32_default=True)
    first, prompt, asked = sess.mesh.rank == 0, sess.config.prompt, sess.config.max_new_tokens
    began = {}

    def start(n, bar=None):
        if n < asked and first:
            click.echo(f"note: --max-new-tokens {asked}: the model's context leaves room for "
                       f"{n} after the prompt; generating {n}", err=True)
        if bar:
            bar.length = n
        began.update(n=n, t=time.perf_counter())
    if sys.stdout.isatty() and first:  # a progress bar, then the text
        with progress(asked, "generating") as bar:
            text = sample_text(sess, lambda n: start(n, bar), lambda piece: bar.update(1))
        sess.log(prompt + text)
    else:  # the text as it comes, untagged (under mpiexec only the first rank prints it)
        echo = (lambda piece: click.echo(piece, nl=False)) if first else None
        if echo:
            echo(prompt)
        sample_text(sess, start, echo)
        if echo:
            echo("\n")
    if first:
        dt = time.perf_counter() - began["t"]
        click.echo(f"{began['n']} tokens in {dt:.2f} s ({began['n'] / dt:.1f} tok/s, "
                   f"{'KV cache' if sess.config.kv_cache else 'whole passes'})", err=True)


@cli.command()
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
    if stages < 1 or micro_batches < 1:
        raise CupyGPTError("--stages and --micro-batches must be positive")
    v = chunks_per_rank(schedule, virtual_stages)
    fn = SCHEDULES[schedule]
    for r in range(stages):
        acts = fn(stages, micro_batches, r, v)
        text = " ".join(map(short, acts))
        click.echo(f"rank {r} ({slot_plan(acts)[0]} activation slots): {text}")
    sim = simulate(stages, micro_batches, schedule, v, t_fwd=1.0, t_bwd=backward_cost)
    ideal = (stages - 1) / (micro_batches + stages - 1)
    peak = " ".join(f"{x:g}" for x in sim["peak"])
    click.echo(f"bubble {sim['bubble']:.4f} (1F1B's with equal stages: (p-1)/(m+p-1) = "
               f"{ideal:.4f}); "
               f"makespan {sim['makespan']:g} forward-times; peak live activations per rank "
               f"(whole stages) {peak}; deadlock-free")


@cli.command()
@click.option("--out", default="gpu_report", show_default=True, help="report directory")
@click.option("--quick", is_flag=True, help="benchmark the tiny preset at short T (minutes)")
@click.option("--part", "parts", multiple=True, type=click.Choice(list(GPUCHECK_PARTS)),
              help="run only these parts, merged into the report in --out (default: all)")
@click.option("--mps", is_flag=True, help="also run the pipeline under a CUDA MPS server "
              "that the check starts and stops (NVSHMEM's full multi-PE-per-GPU mode)")
@entry
def gpucheck(out, quick, parts, mps):
    """The GPU check: all GPU tests, verify, compute-sanitizer, the benchmarks and a pipeline
    run, in one report; exit 0 only when every part has run and passed."""
    if not gpu_available():
        raise CupyGPTError("gpucheck: no GPU is visible (or CuPy is missing); run it on a "
                           "GPU machine after pip install -e '.[cuda13,test]'")
    report, md = run_check(out, "quick" if quick else "full", parts, mps)
    click.echo(md)
    sys.exit(1 if problems(report) else 0)


@cli.command()
@click.argument("src")
@click.argument("dst")
@click.option("--dtype", default="float32", show_default=True, help="the llm.c file's",
              type=click.Choice(["float32", "bfloat16"]))
@click.option("--tokenizer", default=TOKENIZER, show_default=True,
              help="its vocab.json, merges.txt go beside a model with its vocab")
@entry
def convert(src, dst, dtype, tokenizer):
    """A transformers GPT-2 directory SRC to an llm.c model file DST, or an llm.c file SRC
    to a new directory DST that GPT2LMHeadModel.from_pretrained loads."""
    for line in run_convert(src, dst, dtype == "bfloat16", tokenizer):
        click.echo(line)


@cli.command()
@click.argument("log", type=click.Path())
@click.option("--out", default="loss.png", show_default=True, help="PNG to write")
@entry
def plot(log, out):
    """Plot train and val loss from a train log (OUT/log.jsonl) to a PNG."""
    n_train, n_val = run_plot(log, out)
    click.echo(f"wrote {out} ({n_train} train, {n_val} val points)")


@cli.command()
@click.argument("trace", type=click.Path())
@click.option("--out", default="timeline.png", show_default=True, help="PNG to write")
@click.option("--schedule", default=None, type=click.Choice(list(SCHEDULES)),
              help="the run's schedule, for the prediction  [default: the trace's]")
@entry
def timeline(trace, out, schedule):
    """Draw a --trace file: every rank's forwards and backwards over time, the measured
    bubble, and beneath it the simulator's prediction from the measured mean op times."""
    measured, predicted, name = draw(trace, out, schedule)
    click.echo(f"wrote {out}: {name}, measured bubble {measured:.4f}, simulated from each "
               f"rank's op and transfer times {predicted:.4f}")


def main():
    cli()
