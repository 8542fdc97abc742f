"""One source for each setting: every parameter of every command is made from a field of
that command's config (config/fields.py's flag, through cli/flags.py's options_of), its
spelling, default, help and choices the field's, and every field with flags is a parameter
of the command. A hand-written click.option or click.argument fails here."""
import dataclasses

import click
import pytest
from click.testing import CliRunner

from cupygpt.cli.flags import entry, options_of
from cupygpt.cli.main import cli
from cupygpt.config.tools import PlotConfig


def commands(group, path=()):
    """(the command's words, the command) of every command under group, into subgroups."""
    for name, cmd in group.commands.items():
        if isinstance(cmd, click.Group):
            yield from commands(cmd, path + (name,))
        else:
            yield " ".join(path + (name,)), cmd


def groups(group):
    yield group
    for cmd in group.commands.values():
        if isinstance(cmd, click.Group):
            yield from groups(cmd)


def flagged(cls):
    """{name: field} of cls's fields that declare flags, its sections' included."""
    out = {}
    for f in dataclasses.fields(cls):
        if f.metadata.get("section"):  # (a section without its flags is the command's own)
            out.update(flagged(f.default_factory))
        elif "decls" in f.metadata:
            out[f.name] = f
    return out


def expected_opts(decls):
    """click's opts and secondary_opts from the field's spellings ("--a/--no-a" is both)."""
    return [d.split("/")[0] for d in decls], [d.split("/")[1] for d in decls if "/" in d]


def mismatches(p, f):
    """How parameter p differs from what field f declares."""
    m, default = f.metadata, None if f.default is dataclasses.MISSING else f.default
    choices = list(p.type.choices) if isinstance(p.type, click.Choice) else None
    got = dict(argument=isinstance(p, click.Argument), default=p.to_info_dict()["default"],
               choices=choices,
               required=p.required, path=isinstance(p.type, click.Path),
               metavar=p.metavar, multiple=p.multiple)
    want = dict(argument=m["argument"], default=default,
                choices=list(m["choices"]) if m["choices"] else None, required=m["required"],
                path=m["path"], metavar=m["metavar"], multiple=m["multiple"])
    if m["argument"]:
        got.update(opts=p.opts, nargs=p.nargs)
        want.update(opts=[f.name], nargs=m["nargs"] or 1)
    else:
        got.update(opts=(p.opts, p.secondary_opts), help=p.help)
        want.update(opts=expected_opts(m["decls"]), help=m["help"])
    return {k: (got[k], want[k]) for k in got if got[k] != want[k]}


def problems(cmd):
    """What in cmd's parameters does not come from its config (empty: all of them do)."""
    cls = getattr(cmd.callback, "config", None)
    if cls is None:
        return ["no config class (make its parameters with @options_of(ItsConfig))"]
    fields = flagged(cls)
    names = [p.name for p in cmd.params]
    out = [f"{p.name}: no field of {cls.__name__} declares it" for p in cmd.params
           if p.name not in fields]
    out += [f"{n}: given {names.count(n)} times" for n in set(names) if names.count(n) > 1]
    out += [f"{n}: a field with flags of {cls.__name__}, not a parameter of the command"
            for n in fields if n not in names]
    out += [f"{p.name}: {diff} (parameter's, field's)" for p in cmd.params
            if p.name in fields for diff in [mismatches(p, fields[p.name])] if diff]
    return out


@pytest.mark.parametrize("name,cmd", list(commands(cli)), ids=lambda x: x if
                         isinstance(x, str) else "")
def test_every_parameter_of_a_command_is_a_field_of_its_config(name, cmd):
    assert not problems(cmd), (name, problems(cmd))


@pytest.mark.parametrize("name,cmd", [(n, c) for n, c in commands(cli)
                                      if any(p.required for p in c.params)],
                         ids=lambda x: x if isinstance(x, str) else "")
def test_a_required_parameter_left_out_is_a_usage_error(name, cmd):
    """(a default given to click, None too, would stand in for it: the command ran on None)"""
    res = CliRunner().invoke(cmd, [])
    assert res.exit_code == 2 and "Missing" in res.output, (name, res.output)


def test_no_group_takes_options():
    """A group's options would have no config (groups hold commands only)."""
    assert [g.name for g in groups(cli) if g.params] == []


def test_a_hand_written_option_is_found():
    """The check itself: a click.option beside a config's, one changed, one left out."""
    def command(*extra):
        fn = entry(lambda **kw: None)
        for opt in extra:
            fn = opt(fn)
        return click.command("plot")(options_of(PlotConfig)(fn))
    assert problems(command()) == []
    assert problems(command(click.option("--seed", default=1)))
    assert problems(command(click.option("--out", default="loss.png", show_default=True,
                                         help="PNG to write")))  # (twice: a second copy)
    dropped = command()
    dropped.params = [p for p in dropped.params if p.name != "overwrite"]
    assert problems(dropped) == ["overwrite: a field with flags of PlotConfig, not a "
                                 "parameter of the command"]
    changed = command()
    changed.params[1].help = "another help"
    assert problems(changed) and "help" in problems(changed)[0]
    assert problems(click.command("bare")(click.option("--x")(lambda x: None)))


def declared_twice(sources):
    """(spelling, default) pairs that flag(...) calls in sources write more than once: a
    default written twice, where a shared factory in config/fields.py should stand."""
    import ast
    seen = {}
    for text in sources:
        for node in ast.walk(ast.parse(text)):
            if (isinstance(node, ast.Call) and getattr(node.func, "id", None) == "flag"
                    and node.args and isinstance(node.args[0], ast.Constant)):
                default = [ast.unparse(k.value) for k in node.keywords if k.arg == "default"]
                key = (node.args[0].value, default[0] if default else None)
                seen[key] = seen.get(key, 0) + 1
    return sorted(k for k, n in seen.items() if n > 1)


def test_no_flag_and_default_are_written_twice():
    """Two commands sharing a flag with the same default take it from one factory."""
    import glob
    import os

    import cupygpt.config as package
    paths = glob.glob(os.path.join(os.path.dirname(package.__file__), "*.py"))
    assert paths and declared_twice(open(p).read() for p in paths) == []
    copy = ('a = flag("--seed", default=1)\nb = flag("--seed", default=1)\n'
            'c = flag("--seed", default=2)')
    assert declared_twice([copy]) == [("--seed", "1")]


def empty_paths():
    """(command words, the parameter, its field's advice) of every path whose '' is refused."""
    for name, cmd in commands(cli):
        fields = flagged(cmd.callback.config)
        for p in cmd.params:
            if fields[p.name].metadata.get("empty"):
                yield name, cmd, p, fields[p.name].metadata["empty"]


@pytest.mark.parametrize("name,cmd,param,advice", list(empty_paths()),
                         ids=lambda x: x if isinstance(x, str) and " " not in x else "")
@pytest.mark.parametrize("value,said", [("", "'': is empty"), ("  ", "'  ': is blank")])
def test_an_empty_path_is_refused_naming_its_flag(name, cmd, param, advice, value, said):
    """'' (a variable left unset: --resume "$CKPT") names nothing: one line naming the flag,
    before anything is read ("error: : cannot open ..." named neither); a name of blanks
    alone neither (-o "  " made a directory no listing shows)."""
    args = []
    for p in cmd.params:
        if p is param:
            args += ([] if isinstance(p, click.Argument) else [p.opts[0]]) + [value]
        elif p.required:
            args += ([] if isinstance(p, click.Argument) else [p.opts[0]]) + ["x"]
    res = CliRunner().invoke(cmd, args, prog_name=name)
    shown = param.human_readable_name if isinstance(param, click.Argument) else param.opts[0]
    assert res.exit_code == 1 and res.output.strip() == \
        f"error: {shown} {said}; give {advice}", (args, res.output)
    assert len(list(empty_paths())) >= 20
