"""cupygpt's command line: each command builds its frozen config from the flags (config/),
runs the library, and prints. Run any with --help."""
import json
import sys
import time

import click

from ..comm.launch import world_rank
from ..commands.bench import ATTENTIONS, claim_out, side_by_side, trace_failed
from ..commands.bench import bench as run_bench
from ..commands.bench_comm import comm_bench, format_report, sizes
from ..commands.eval import eval_command
from ..commands.sample import sample_text
from ..commands.verify import format_report as verify_report
from ..commands.verify import reference_defaults
from ..commands.verify import verify as run_verify
from ..config.configs import BenchConfig, EvalConfig, SampleConfig, VerifyConfig
from ..config.train import TrainConfig
from ..paths import atomic_write
from ..train.loop import train as run_train
from .flags import LlmcFlags, entry, options_of, progress, session
from .tools import TOOLS


@click.group()
def cli():
    """GPT-2 training in llm.c's formats: NumPy on the CPU, CUDA kernels on the GPU,
    pipeline-parallel under mpiexec."""


@cli.command()
@options_of(VerifyConfig)
@entry
def verify(**kw):
    """Check logits, loss and every gradient against an llm.c debug state."""
    sess = session(VerifyConfig, reference_defaults(kw), tf32_default=False)
    with progress(sess.config.steps - 1, "AdamW steps") as bar:
        report = run_verify(sess, lambda: bar.update(1))
    if sess.mesh.rank == 0:
        click.echo(json.dumps(report) if sess.config.as_json else verify_report(report))
    ok = sess.transport.bcast(report["ok"] if sess.mesh.rank == 0 else None)
    sys.exit(0 if ok else 1)


@cli.command(cls=LlmcFlags)
@options_of(TrainConfig)
@entry
def train(**kw):
    """Train GPT-2 llm.c-style; writes OUT/model.bin in llm.c's format."""
    run_train(session(TrainConfig, kw, tf32_default=True))


@cli.command()
@options_of(BenchConfig)
@entry
def bench(**kw):
    """Benchmark one training step: ms/step, tok/s, MFU, peak memory; writes JSON."""
    out = kw["out"]
    claim_out(out, kw["trace"], kw["overwrite"], world_rank() == 0)
    sess = session(BenchConfig, kw, tf32_default=True)
    if sess.config.comm:
        with progress(len(sizes(sess.shape, sess.config.batch, sess.config.seq, sess.be)),
                      "timing transfers") as bar:
            report = comm_bench(sess, lambda: bar.update(1))
        if report is not None:
            with atomic_write(out) as f:
                f.write(json.dumps(report, indent=1).encode())
            click.echo(format_report(report) + f"\nwrote {out}")
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
    trace_failed(r, c.trace, out)
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
@options_of(SampleConfig)
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
            click.echo(prompt, nl=False, color=True)  # (color: click strips ANSI escapes
            # from text a pipe or file gets, and the text is the model's, byte for byte)
        began.update(n=n, t=time.perf_counter())
    if sys.stdout.isatty() and first:  # a progress bar, then the text
        with progress(asked, "generating") as bar:
            text = sample_text(sess, lambda n: start(n, bar), lambda piece: bar.update(1))
        sess.log(prompt + text)
    else:  # the text as it comes, untagged (under mpiexec only the first rank prints it)
        echo = (lambda piece: click.echo(piece, nl=False, color=True)) if first else None
        sample_text(sess, start, echo)
        if echo:
            echo("\n")
    if first:
        dt = time.perf_counter() - began["t"]
        click.echo(f"{began['n']} tokens in {dt:.2f} s ({began['n'] / dt:.1f} tok/s, "
                   f"{'KV cache' if sess.config.kv_cache else 'whole passes'})", err=True)


@cli.command("eval")
@options_of(EvalConfig)
@entry
def evaluate(**kw):
    """HellaSwag accuracy of an llm.c model file, scored as llm.c does (each completion's
    mean loss over its tokens; the lowest is the model's choice)."""
    sess = session(EvalConfig, kw, tf32_default=True)
    r = eval_command(sess)
    if sess.mesh.rank == 0:
        click.echo(json.dumps(r) if sess.config.as_json else
                   f"hellaswag: {r['correct']}/{r['examples']} = {r['accuracy']:.4f} "
                   f"({r['dtype']}, B={r['B']} T={r['T']}, {r['ranks']} rank(s), "
                   f"{r['seconds']:.2f} s)")


for command in TOOLS:
    cli.add_command(command)


def main():
    cli()
