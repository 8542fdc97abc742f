"""The commands that run in one process beside training: prepare (text to shards), convert
(to and from transformers' GPT-2 directories), schedule (a schedule's lists and
simulation), plot and timeline (pictures). cli.py adds them to the group."""
import math

import click

from .. import CupyGPTError
from ..commands.convert import convert as run_convert
from ..commands.plot import plot as run_plot
from ..commands.prepare import prepare as run_prepare
from ..commands.timeline import timeline as draw
from ..config.sections import out_file
from ..config.tools import (
    ConvertConfig,
    PlotConfig,
    PrepareConfig,
    ScheduleConfig,
    TimelineConfig,
    image_format,
)
from ..parallel.pipeline.schedule import SCHEDULES, chunks_per_rank, short, slot_plan
from ..parallel.pipeline.simulate import simulate
from ..paths import check_outputs, make_parent
from .flags import config, entry, one_process, options_of, progress


@click.command()
@options_of(PrepareConfig)
@entry
def prepare(**kw):
    """Tokenize text into llm.c shards. One text file: NAME_val.bin and NAME_train.bin, as
    llm.c's tinyshakespeare script does. Several inputs (text files, each a document; jsonl
    or parquet, each record's `text`) or --shard-size: shards of that many tokens,
    NAME_val_000000.bin then NAME_train_000001.bin..., an EOT before each document,
    tokenized on every core. --hellaswag: HellaSwag's jsonl to llm.c's eval file."""
    one_process("prepare")
    for line in run_prepare(config(PrepareConfig, kw), progress,
                            lambda note: click.echo(note, err=True)):
        click.echo(line)


@click.command()
@options_of(ConvertConfig)
@entry
def convert(**kw):
    """A transformers GPT-2 directory SRC to an llm.c model file DST, or an llm.c file SRC
    to a new directory DST that GPT2LMHeadModel.from_pretrained loads."""
    one_process("convert")
    c = config(ConvertConfig, kw)
    for line in run_convert(c.src, c.dst, c.dtype == "bf16", c.tokenizer, c.force):
        click.echo(line)


MAX_STAGES, MAX_CELLS = 512, 65536  # (-p 64 -m 1000: 3.4 s; -p 2000 -m 8: 18 s)


@click.command()
@options_of(ScheduleConfig)
@entry
def schedule(**kw):
    """Print each rank's actions (F3.1: micro-batch 3 on the rank's chunk 1), the simulated
    bubble and each rank's peak of live activations of a pipeline schedule."""
    one_process("schedule")
    c = config(ScheduleConfig, kw)
    p, m, cost = c.stages, c.micro_batches, c.backward_cost
    if p < 1 or m < 1:
        raise CupyGPTError("--stages and --micro-batches must be positive")
    if p > MAX_STAGES or p * m > MAX_CELLS:
        raise CupyGPTError(f"-p {p} -m {m}: at most {MAX_STAGES} stages and "
                           f"{MAX_CELLS:,} stages x micro-batches (the simulator runs in "
                           f"Python: that takes seconds already); give smaller ones")
    if not 0 < cost < float("inf"):
        raise CupyGPTError("must be a positive number (a backward's time in forwards)",
                           "backward_cost", cost)
    v = chunks_per_rank(c.schedule, c.virtual_stages)
    # each rank's list made once: the simulator and the printout read the same lists
    lists = [SCHEDULES[c.schedule](p, m, r, v) for r in range(p)]
    sim = simulate(p, m, lambda _p, _m, r, _v: lists[r], v, t_fwd=1.0, t_bwd=cost,
                   placed=c.schedule)
    if not (math.isfinite(sim["bubble"]) and math.isfinite(sim["makespan"])):
        raise CupyGPTError("the simulated times overflow (not finite); give a smaller "
                           "ratio", "backward_cost", cost)
    for r, acts in enumerate(lists):
        text = " ".join(map(short, acts))
        click.echo(f"rank {r} ({slot_plan(acts)[0]} activation slots): {text}")
    ideal = (p - 1) / (m + p - 1)
    peak = " ".join(f"{x:g}" for x in sim["peak"])
    click.echo(f"bubble {sim['bubble']:.4f} (1F1B's with equal stages: (p-1)/(m+p-1) = "
               f"{ideal:.4f}); "
               f"makespan {sim['makespan']:g} forward-times; peak live activations per rank "
               f"(whole stages) {peak}; deadlock-free")


def image_out(c, source):
    """plot's and timeline's --out, checked (its kind, not its source, not replaced unasked),
    its directory made and the file claimed, before source is read."""
    image_format(c.out)
    check_outputs([("out", c.out)], [source])
    out_file("out", c.out, c.overwrite)
    make_parent("out", c.out, overwrite=c.overwrite)


@click.command()
@options_of(PlotConfig)
@entry
def plot(**kw):
    """Plot train and val loss from a train log (OUT/log.jsonl) to an image (PNG)."""
    one_process("plot")
    c = config(PlotConfig, kw)
    image_out(c, c.log)
    n_train, n_val, left_out = run_plot(c.log, c.out)
    click.echo(f"wrote {c.out} ({n_train} train, {n_val} val points" + (
        f"; left out {left_out} whose step or loss is NaN, infinite or out of range"
        if left_out else "") + ")")


@click.command()
@options_of(TimelineConfig)
@entry
def timeline(**kw):
    """Draw a --trace file: every rank's forwards and backwards over time, the measured
    bubble, and beneath it the simulator's prediction from the measured mean op times."""
    one_process("timeline")
    c = config(TimelineConfig, kw)
    image_out(c, c.trace)
    measured, predicted, name = draw(c.trace, c.out, c.schedule)
    click.echo(f"wrote {c.out}: {name}, measured bubble {measured:.4f}, simulated from each "
               f"rank's op and transfer times {predicted:.4f}")


TOOLS = (prepare, convert, schedule, plot, timeline)
