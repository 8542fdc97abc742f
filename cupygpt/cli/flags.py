"""How the commands are built: the shipped files' paths, the one error line, a config from
the flags, the options several commands share, and progress bars."""
import dataclasses
import errno
import functools
import os
import resource
import sys
import traceback
import typing

import click

from .. import CupyGPTError
from ..backends.host_memory import address_limit, out_of_memory
from ..comm.launch import (
    Stopped,
    disagreement,
    fail,
    launched_ranks,
    on_signals,
    start_mpi,
    stop_job,
)
from ..config.fields import values
from ..config.sections import FLAG, Device, Grid, Pipeline
from ..log import FAILED, guard_streams
from ..paths import unmake_dirs
from ..session import Session


def flag_of(name):
    """The command's flag of a config field (the field's name where it has none)."""
    ctx = click.get_current_context(silent=True)
    params = {p.name: p.human_readable_name if isinstance(p, click.Argument) else p.opts[0]
              for p in (ctx.command.params if ctx else [])}
    return params.get(name, name)


def as_flag(e):
    """A library error names a config field (CupyGPTError.option): show it as its flag."""
    if e.option is None:
        return str(e)
    flag = flag_of(e.option)
    if e.value is FLAG:  # an on/off flag given: its name alone
        return f"{flag}: {e.args[0]}"
    shown = "''" if e.value == "" else e.value  # (an empty value, visibly)
    return f"{flag} {shown}: {e.args[0]}"


def entry(fn):
    """Bad input ends in one line and exit 1; under mpiexec a failure ends every rank; a
    reader closing stdout or stderr costs nothing (guard_streams); Ctrl-C and SIGTERM stop
    the command at once, quietly, with 128 + the signal (train's loop stops at its next
    batch instead)."""
    @functools.wraps(fn)
    def wrapper(**kw):
        guard_streams()
        on_signals()
        try:
            if launched_ranks() > 1:
                start_mpi(kw.get("peer_timeout", Device.peer_timeout))
            in_a_directory()
            fn(**kw)
        except SystemExit as e:  # (verify exits 0 on success: on to wrote)
            if e.code not in (0, None) or isinstance(e, Stopped):
                unmake_dirs()
                if isinstance(e, Stopped):
                    stop_job(e.code)
                raise
        except BaseException as e:
            # a failed or stopped command leaves no directory it made (fail removes them
            # once the other ranks are done with them)
            if isinstance(e, CupyGPTError):
                fail(f"error: {as_flag(e)}", unmake_dirs)
            line = short_of(e)
            if line:
                fail(f"error: {line}", unmake_dirs)
            if isinstance(e, Exception):
                fail(traceback.format_exc().rstrip(), unmake_dirs)
            unmake_dirs()
            raise
        wrote()
    return wrapper


# what to lower when memory runs out, by command (train's is checked at its start: another
# process took memory since, or a temporary outgrew the plan)
LOWER = {"train": "the batch size or sequence length", "bench": "the batch size or sequence "
         "length", "verify": "nothing: the reference's shapes are fixed; free memory",
         "eval": "the batch size", "sample": "--max-new-tokens", "prepare": "--workers or "
         "--shard-size", "convert": "nothing: convert holds the whole model; free memory"}


def short_of(e):
    """The line for a machine's limit the command met while running (memory, open files,
    processes), naming what to change; None for any other exception."""
    ctx = click.get_current_context(silent=True)
    command = ctx.info_name if ctx else ""
    if out_of_memory(e):
        return (f"out of memory while running;{address_limit() or ''} lower "
                f"{LOWER.get(command, 'what it holds')}"
                + (" (there was room at its start: another process took it, or a temporary "
                   "outgrew the plan)" if command == "train" else ""))
    if getattr(e, "errno", None) in (errno.EMFILE, errno.ENFILE):
        limit = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return (f"too many open files (ulimit -n {limit}); raise the limit (ulimit -n 4096)"
                + (", or give --workers 1" if command == "prepare" else ""))
    if isinstance(e, BlockingIOError) and e.errno == errno.EAGAIN:  # (fork past ulimit -u)
        return ("cannot start another process (ulimit -u, or the system's limit); raise it"
                + (", or give --workers 1" if command == "prepare" else ""))
    return None


def in_a_directory():
    """Every command resolves relative paths (its defaults too: out/, bench.json) against
    the current directory: one removed under the shell would fail at the first of them, in
    a traceback."""
    try:
        os.getcwd()
    except FileNotFoundError:
        raise CupyGPTError("the current directory no longer exists: cd to one that "
                           "does") from None


def wrote():
    """A command whose standard output failed (log.write_fd said so) ends in exit 1 once
    its work is done, as coreutils' `write error`."""
    sys.stdout.flush()
    if FAILED:
        sys.exit(1)


class LlmcFlags(click.Command):
    """train takes llm.c's flags: its -h is HellaSwag's, so `train -h` (asking for help, as
    most tools take it) lacks its value, and the error says where help is; its two-letter
    flags (-nm, -sl, -sg) take their value after a space, as llm.c's do: `-nm1` would be
    click's `-n m1` (a later -n then silently wins), so it is refused, spelled right."""

    def parse_args(self, ctx, args):
        opts = [p for p in self.params if isinstance(p, click.Option)]
        two = [o for p in opts for o in p.opts if len(o) > 2 and o[0] == "-" and o[1] != "-"]
        valued = {o for p in opts if not p.is_flag for o in p.opts}  # (their next word is data)
        for before, arg in zip([None, *args], args):
            if arg == "--":
                break
            flag = next((o for o in two if arg.startswith(o) and arg[len(o):len(o) + 1]
                         not in ("", "=")), None)
            if flag and before not in valued:
                raise click.UsageError(f"{arg}: llm.c's two-letter flags take their value "
                                       f"after a space: {flag} {arg[len(flag):]}", ctx)
        try:
            return super().parse_args(ctx, args)
        except click.BadOptionUsage as e:
            if e.option_name == "-h":
                e.message = ("-h takes a value: 1 for HellaSwag accuracy (llm.c's -h); for "
                             "help, give --help")
            raise


def one_process(command):
    """Commands with no ranks' work to share would run once per rank under mpiexec (each
    writing the same files)."""
    if launched_ranks() > 1:
        raise CupyGPTError(f"{command} runs in one process: run it without mpiexec")


def config(cls, kw):
    """cls (a config dataclass) from the flags: each field is the flag's parameter name;
    the device and pipeline parts are filled the same way."""
    named(cls, kw)
    args = {f.name: kw[f.name] for f in dataclasses.fields(cls) if f.name in kw}
    for name, part in SECTIONS.items():
        if name in {f.name for f in dataclasses.fields(cls)}:
            args[name] = part(**{f.name: kw[f.name] for f in dataclasses.fields(part)
                                 if f.name in kw})
    return agreed(cls(**args))


def named(cls, kw):
    """Refuses '' for a path (a variable left unset, --resume "$CKPT", names nothing; a
    reader would say only that '' cannot be opened), where '' means nothing else; and a
    name of blanks alone (`-o "  "` made a directory no listing shows)."""
    for f in dataclasses.fields(cls):
        if f.metadata.get("section") is not None:
            named(f.default_factory, kw)
        given, empty = kw.get(f.name), f.metadata.get("empty")
        for one in (given if isinstance(given, tuple) else (given,)) if empty else ():
            if isinstance(one, str) and not one.strip():
                raise CupyGPTError(f"is {'blank' if one else 'empty'}; give {empty}", f.name,
                                   repr(one) if one else "")


def agreed(config):
    """config, once every rank has the same (collective under mpiexec, before it is validated
    or anything allocated): an MPMD launch (`mpiexec -n 1 cupygpt train -b 4 : -n 1 cupygpt
    train -b 8`) gives each rank flags of its own, and ranks exchanging tensors of other
    shapes die inside MPI, at other learning rates or -o's train apart."""
    if launched_ranks() == 1:
        return config
    ctx = click.get_current_context(silent=True)
    found = disagreement({"command": repr(ctx.info_name if ctx else type(config).__name__),
                          **dict(values(config))})
    if found:
        raise CupyGPTError(f"ranks disagree on {flag_of(found[0])}: {found[1]}; give every "
                           f"rank the same flags and the same files")
    return config


def session(cls, kw, tf32_default):
    return Session(config(cls, kw), tf32_default)


def progress(length, label):
    """A progress bar on stderr when it is a terminal (elsewhere a bar's label would only be
    noise before the result or the one error line)."""
    return click.progressbar(length=length, label=label, file=sys.stderr,
                             hidden=not sys.stderr.isatty())


def options(*config):
    """A decorator adding click options, first listed first in --help."""
    def add(fn):
        for opt in reversed(config):
            fn = opt(fn)
        return fn
    return add


SECTIONS = {"device": Device, "pipeline": Pipeline, "grid": Grid}


def parameter(f):
    """The click option (or argument) a config field declares (config/fields.py's flag)."""
    m, default = f.metadata, (None if f.default is dataclasses.MISSING else f.default)
    kind = next((t for t in typing.get_args(f.type) if t is not type(None)), f.type)
    kw = dict(type=click.Choice(m["choices"]) if m["choices"] else
              click.Path() if m["path"] else kind)
    if not m["required"]:  # (click takes any default, None too, as a required one given)
        kw["default"] = default
    if m["argument"]:
        return click.argument(f.name, required=m["required"], nargs=m["nargs"], **kw)
    if kind is bool:
        kw.pop("type")
        kw["is_flag"] = "/" not in m["decls"][0] or None
    return click.option(*m["decls"], f.name, help=m["help"], metavar=m["metavar"],
                        required=m["required"], multiple=m["multiple"],
                        show_default=default is not None and default is not False
                        and default not in ("", ()), **kw)


def options_of(cls):
    """Every command-line parameter of a config class, its sections' in their place, in
    the order the fields are declared (their order in --help)."""
    params = []
    for f in dataclasses.fields(cls):
        if f.metadata.get("section"):
            params += [parameter(g) for g in dataclasses.fields(SECTIONS[f.name])
                       if "decls" in g.metadata]
        elif "decls" in f.metadata:
            params.append(parameter(f))
    def add(fn):
        fn.config = cls  # whose fields they are (unit/cli/test_options.py checks each against it)
        return options(*params)(fn)
    return add
