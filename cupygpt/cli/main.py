"""cupygpt's command line: each command builds its frozen config from the flags (config.py),
runs the library, and prints. Run any with --help."""
import json
import os
import sys
import time

import click

from ..commands.bench import ATTENTIONS, bench as run_bench, side_by_side
from ..commands.bench_comm import comm_bench, format_rows, sizes
from ..config.sections import RUN_DTYPES, VERIFY_DTYPES, out_file
from .flags import (TOKENIZER, HellaSwagH, device_options, entry,
                    grid_options, overwrite_option, pipeline_options, progress, session,
                    trace_option)
from .tools import TOOLS
from ..config.configs import BenchConfig, EvalConfig, SampleConfig, TrainConfig, VerifyConfig
from ..paths import DATA, REFERENCE, atomic_write
from ..train.evaluate import eval_command
from ..model.optim import LR_SCHEDULES
from ..paths import check_outputs
from ..train.sample import sample_text
from ..train.loop import train as run_train
from ..commands.verify import format_report, verify as run_verify


@click.group()
def cli():
    """GPT-2 training in llm.c's formats: NumPy on the CPU, CUDA kernels on the GPU,
    pipeline-parallel under mpiexec."""


@cli.command()
@click.option("--model", default=os.path.join(REFERENCE, "tiny_model.bin"), show_default=True,
              help="llm.c model file (default: the shipped one made by llm.c's PyTorch reference)")
@click.option("--state", default=None,
              help="llm.c debug state file for that model  [default: NAME_debug_state.bin "
                   "beside a NAME_model.bin]")
@click.option("--steps", default=10, show_default=True, help="AdamW steps on the state's batch")
@click.option("--lr", default=1e-4, show_default=True)
@click.option("--weight-decay", default=0.01, show_default=True, help="AdamW weight decay")
@click.option("--expected", default=None,
              help="JSON with a 'losses' list to check the steps  [default: NAME_expected.json "
                   "beside a NAME_model.bin, at the default --lr and --weight-decay]")
@click.option("--dtype", default="fp32", type=click.Choice(VERIFY_DTYPES), show_default=True,
              help="fp64: the gradients' exact reference; bf16: llm.c's mixed precision, "
                   "against the fp32 reference at bf16's tolerances")
@click.option("--json", "as_json", is_flag=True, help="print one JSON object")
@trace_option
@overwrite_option
@device_options
@grid_options
@pipeline_options
@entry
def verify(as_json, **kw):
    """Check logits, loss and every gradient against an llm.c debug state."""
    if kw["state"] is None:
        kw["state"] = beside(kw["model"], "_debug_state.bin")
    if kw["expected"] is None and (kw["lr"], kw["weight_decay"]) == (
            VerifyConfig.lr, VerifyConfig.weight_decay):
        kw["expected"] = beside(kw["model"], "_expected.json")
    sess = session(VerifyConfig, kw, tf32_default=False)
    with progress(sess.config.steps - 1, "AdamW steps") as bar:
        report = run_verify(sess, lambda: bar.update(1))
    if sess.mesh.rank == 0:
        click.echo(json.dumps(report) if as_json else format_report(report))
    ok = sess.tr.bcast(report["ok"] if sess.mesh.rank == 0 else None)
    sys.exit(0 if ok else 1)


def beside(model, suffix):
    """NAME + suffix beside a NAME_model.bin (the shipped references have a debug state and
    the losses of its steps at the default --lr and --weight-decay), or None."""
    stem = model.removesuffix("_model.bin")
    return stem + suffix if stem != model and os.path.isfile(stem + suffix) else None


@cli.command(cls=HellaSwagH)
@click.option("-i", "train_pattern", default=os.path.join(DATA, "tiny_shakespeare_train.bin"),
              show_default=True, help="train shards (glob)")
@click.option("-j", "val_pattern", default=os.path.join(DATA, "tiny_shakespeare_val.bin"),
              show_default=True, help="val shards (glob)")
@click.option("--shuffle/--no-shuffle", default=True, show_default=True,
              help="train shards and the batches in each in a seeded random order per epoch "
                   "(llm.c's); --no-shuffle: in file order")
@click.option("-e", "init", default=None,
              help="llm.c model file, or one of llm.c's descriptors for a fresh model: d6, "
                   "d12 .. d84 (GPT-2 by depth), gpt3:c768 .. (GPT-3 by channels, T 2048), "
                   "or tiny  [default: d12 on a GPU, tiny on the CPU]")
@click.option("-o", "out", default="out", show_default=True, help="output directory")
@click.option("-b", "batch", default=4, show_default=True, help="batch size B")
@click.option("-t", "seq", default=None, type=int,
              help="sequence length T  [default: 1024 on a GPU, 64 on the CPU]")
@click.option("-l", "lr", default=1e-3, show_default=True, help="learning rate")
@click.option("-u", "warmup", default=10, show_default=True, help="lr warm-up steps")
@click.option("-q", "final_lr_frac", default=0.1, show_default=True,
              help="final lr as a fraction of -l (where the schedule decays)")
@click.option("-k", "lr_schedule", default="cosine", show_default=True,
              type=click.Choice(LR_SCHEDULES), help="lr schedule after the warm-up (llm.c's)")
@click.option("-r", "recompute", default=0, show_default=True,
              help="activation recomputation: 1 GELU's output, 2 also the layernorms' "
                   "(backward makes them again; the same bits, less memory)")
@click.option("--dtype", default=None, type=click.Choice(RUN_DTYPES),
              help="bf16: llm.c's mixed precision (fp32 master weights)  [default: the "
                   "backend's: fp32 on the CPU]")
@click.option("-d", "total_batch", default=None, type=int,
              help="tokens per step: a multiple of B x T, the batches of a step adding into "
                   "its gradient (gradient accumulation)  [default: B x T]")
@click.option("-n", "steps", default=60, show_default=True, help="training steps")
@click.option("-v", "val_every", default=20, show_default=True, help="val loss every N steps")
@click.option("-m", "val_batches", default=4, show_default=True, help="val batches")
@click.option("-s", "sample_every", default=None, type=int,
              help="sample every N steps and at the end; 0: never  [default: at the end]")
@click.option("-g", "gen_tokens", default=48, show_default=True, help="tokens to generate")
@click.option("--weight-decay", default=0.0, show_default=True, help="AdamW weight decay")
@click.option("--grad-clip", default=1.0, show_default=True,
              help="clip the gradient at this global norm (0: off)")
@click.option("--seed", default=1337, show_default=True, help="initialisation and sampling seed")
@click.option("--tokenizer", default=TOKENIZER, show_default=True)
@click.option("--checkpoint-every", default=0, show_default=True,
              help="write OUT/ckpt_STEP every K steps and at the end (0: never)")
@click.option("--keep", default=2, show_default=True,
              help="checkpoints to keep (besides --checkpoint-major's)")
@click.option("-nm", "--checkpoint-major", "checkpoint_major", default=0, show_default=True,
              help="checkpoints at multiples of K steps are never removed by --keep (0: none)")
@click.option("-sl", "--skip-loss-z", "skip_loss", default=0.0, show_default=True,
              help="skip the update when the step's loss is more than Z standard deviations "
                   "above its last 128 steps' (llm.c's outlier detector; 0: off)")
@click.option("-sg", "--skip-norm-z", "skip_norm", default=0.0, show_default=True,
              help="the same for the gradient's global norm (0: off)")
@click.option("-a", "--overfit-single-batch", "overfit", default=0, show_default=True,
              help="1: every step trains on the first batch (llm.c's debugging check)")
@click.option("--resume", default=None, help="checkpoint dir (or a run's -o dir) to continue")
@click.option("--log-file", default=None, help="JSON lines per step (default OUT/log.jsonl)")
@click.option("-h", "hellaswag", default=0, show_default=True,
              help="1: HellaSwag accuracy at every val step and at the end (needs -b 4 or "
                   "more)")
@click.option("--hellaswag-file", default=os.path.join("data", "hellaswag_val.bin"),
              show_default=True, help="llm.c's eval file for -h 1 (`prepare --hellaswag`)")
@click.option("--overwrite", is_flag=True,
              help="a fresh run may replace what an earlier run left in -o (its model.bin, "
                   "log and checkpoints) and an existing --trace file")
@click.option("--graphs/--no-graphs", default=None,
              help="replay each step as a CUDA graph (a GPU alone, or over nvshmem without "
                   "the overlapped dp sum)  [default: on with --backend cuda]")
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
              help="descriptor to benchmark (as train's -e)  [default: d12 on a GPU, tiny on "
                   "the CPU]")
@click.option("-b", "batch", default=4, show_default=True)
@click.option("-t", "seq", default=None, type=int,
              help="sequence length  [default: 1024 on a GPU, 64 on the CPU]")
@click.option("--steps", default=20, show_default=True, help="timed steps (median reported)")
@click.option("--warmup", default=3, show_default=True, help="untimed steps first")
@click.option("--graphs/--no-graphs", default=None,
              help="as train's  [default: on with --backend cuda]")
@click.option("-r", "recompute", default=0, show_default=True,
              help="activation recomputation, as train's -r")
@click.option("--dtype", default=None, type=click.Choice(RUN_DTYPES + ("both",)),
              help="as train's; both: fp32 and bf16 side by side  [default: the backend's]")
@click.option("--grad-clip", default=1.0, show_default=True,
              help="the timed step clips at this global norm, as train's (0: off)")
@click.option("--profile", is_flag=True,
              help="add a time-per-op table (GPU: CUDA events, also per kernel, eager "
                   "steps; CPU: wall time per op)")
@click.option("--comm", is_flag=True,
              help="under mpiexec: time the transport's collectives and a stage handoff "
                   "from 1 KiB to 64 MiB and at this model's step sizes, instead")
@click.option("--out", default="bench.json", show_default=True, help="JSON to write")
@device_options
@trace_option
@overwrite_option
@grid_options
@pipeline_options
@entry
def bench(out, **kw):
    """Benchmark one training step: ms/step, tok/s, MFU, peak memory; writes JSON."""
    check_outputs([("out", out), ("trace", kw["trace"])],
                  [os.path.join(DATA, "tiny_shakespeare_train.bin")])
    out_file("out", out, kw["overwrite"])
    sess = session(BenchConfig, {**kw, "data": os.path.join(DATA, "tiny_shakespeare_train.bin")},
                   tf32_default=True)
    if sess.config.comm:
        with progress(len(sizes(sess.shape, sess.config.batch, sess.config.seq, sess.be)),
                      "timing transfers") as bar:
            rows = comm_bench(sess, lambda: bar.update(1))
        if rows is not None:
            with atomic_write(out) as f:
                f.write(json.dumps(rows, indent=1).encode())
            click.echo(format_rows(rows) + f"\nwrote {out}")
        return
    c = sess.config
    two = "both" in (c.dtype, c.device.attention)
    with progress((c.warmup + c.steps) * (2 if two else 1), "benchmarking") as bar:
        r = run_bench(sess, lambda: bar.update(1))
    if sess.mesh.rank != 0:
        return
    with atomic_write(out) as f:
        f.write(json.dumps(r, indent=1).encode())
    if c.dtype == "both":
        click.echo("\n".join([bench_line(r["fp32"], out), bench_line(r["bf16"], out),
                              f"bf16 is {r['bf16_speedup']:.2f}x fp32's speed"]))
    elif c.device.attention == "both":
        click.echo("\n".join([bench_line(r[k], out) for k in ATTENTIONS] + [side_by_side(r)]))
    else:
        click.echo(bench_line(r, out))
    if c.trace:
        click.echo(f"wrote the trace {c.trace} (draw it: timeline {c.trace})")


def bench_line(r, out):
    """bench's report of one run (a dtype, an attention): its step, then its per-op and
    per-kernel rows."""
    lines = [f"{r['device']}: {r['model']} {r['dtype']} B={r['B']} T={r['T']}, attention "
             f"{r['attention']}: "
             f"{r['ms_per_step_median']:.2f} ms/step, {r['tok_per_s']:.0f} tok/s"
             + (f", MFU {100 * r['mfu']:.1f}%" if r["mfu"] else "")
             + (f", host launch {100 * r['host_launch_fraction']:.1f}% of the step"
                if "host_launch_fraction" in r else "")
             + (f"; without overlapping the replicas' gradient sum "
                f"{r['ms_per_step_no_overlap']:.2f} ms" if "ms_per_step_no_overlap" in r
                else "") + f"; wrote {out}"]
    lines += [f"  fallback: {why}" for why in r["fallbacks"]]
    lines += [f"  {row['op']:<20}{row['ms_per_step']:>9.3f} ms {100 * row['share']:>5.1f}%"
              for row in r.get("per_op", [])]
    lines += [f"  {row['op'] + ': ' + row['kernel']:<48} x{row['calls_per_step']:<4}"
              f"{row['ms_per_step']:>9.3f} ms {100 * row['share']:>5.1f}%"
              for row in r.get("per_kernel", [])[:20]]
    return "\n".join(lines)


@cli.command()
@click.option("--model", default=os.path.join("out", "model.bin"), show_default=True)
@click.option("--prompt", default="", help="text to continue (default: start of text)")
@click.option("--max-new-tokens", default=64, show_default=True)
@click.option("--temperature", default=1.0, show_default=True)
@click.option("--top-k", default=None, type=int)
@click.option("--dtype", default=None, type=click.Choice(RUN_DTYPES),
              help="bf16: llm.c's mixed precision (fp32 master weights)  [default: the "
                   "backend's: fp32 on the CPU]")
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
        elif first:  # the prompt once it is checked (a refused one is not echoed)
            click.echo(prompt, nl=False)
        began.update(n=n, t=time.perf_counter())
    if sys.stdout.isatty() and first:  # a progress bar, then the text
        with progress(asked, "generating") as bar:
            text = sample_text(sess, lambda n: start(n, bar), lambda piece: bar.update(1))
        sess.log(prompt + text)
    else:  # the text as it comes, untagged (under mpiexec only the first rank prints it)
        echo = (lambda piece: click.echo(piece, nl=False)) if first else None
        sample_text(sess, start, echo)
        if echo:
            echo("\n")
    if first:
        dt = time.perf_counter() - began["t"]
        click.echo(f"{began['n']} tokens in {dt:.2f} s ({began['n'] / dt:.1f} tok/s, "
                   f"{'KV cache' if sess.config.kv_cache else 'whole passes'})", err=True)


@cli.command("eval")
@click.argument("model")
@click.option("--hellaswag", required=True, metavar="FILE",
              help="llm.c's eval file (hellaswag_val.bin; `prepare --hellaswag` makes it)")
@click.option("-b", "batch", default=16, show_default=True,
              help="rows per forward: B // 4 examples")
@click.option("-t", "seq", default=None, type=int,
              help="sequence length  [default: the file's longest context + completion]")
@click.option("--dtype", default=None, type=click.Choice(VERIFY_DTYPES),
              help="fp64: the exact reference  [default: the backend's]")
@click.option("--json", "as_json", is_flag=True,
              help="print one JSON object (with every example's 4 completion losses)")
@device_options
@grid_options
@pipeline_options
@entry
def evaluate(as_json, **kw):
    """HellaSwag accuracy of an llm.c model file, scored as llm.c does (each completion's
    mean loss over its tokens; the lowest is the model's choice)."""
    sess = session(EvalConfig, kw, tf32_default=True)
    r = eval_command(sess)
    if sess.mesh.rank == 0:
        click.echo(json.dumps(r) if as_json else
                   f"hellaswag: {r['correct']}/{r['examples']} = {r['accuracy']:.4f} "
                   f"({r['dtype']}, B={r['B']} T={r['T']}, {r['ranks']} rank(s), "
                   f"{r['seconds']:.2f} s)")


for command in TOOLS:
    cli.add_command(command)


def main():
    cli()
