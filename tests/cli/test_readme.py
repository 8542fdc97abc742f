"""Every command in the indented code blocks of README.md and of each page of docs/ runs as
written, in order, in a copy of the repository per page (nothing lands in this one); a
`train` that names no -n gets -n 4, as docs/testing.md says. README is the front door: short,
its first lines saying how to install, train and test, and linking every page."""
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest
from harness import ROOT, cudasim_missing, mpiexec

COMMANDS = ("python", "pip", "mpirun", "mpiexec")
PAGES = ["README.md"] + sorted(f"docs/{f}" for f in os.listdir(os.path.join(ROOT, "docs"))
                               if f.endswith(".md"))
# the developer tools (python -m dev.X) that are not run here, and why
DEV_SKIPS = {
    "dev.gpucheck": "the GPU check needs a GPU (and runs for minutes)",
    "dev.vs_llmc": "needs llm.c's C trainer built (`make train_gpt2` in a checkout of llm.c)",
    "dev.bubbles": "runs on a CPU, but for minutes (4 schedules, 3 runs each, under mpiexec)",
    "dev.pipeline_speedup": "runs on a CPU, but for tens of minutes (one rank and 4 "
                            "schedules per model and length, each rank on a core of its own)",
}


def commands(page="README.md"):
    """A page's commands: the lines of its indented code blocks (continuations joined)
    whose program, after any VAR=value, is one of COMMANDS; `a && b` gives both."""
    found, lines = [], open(os.path.join(ROOT, page), encoding="utf-8").read().split("\n")
    for prev, line in zip([""] + lines, lines):
        if line.startswith("    ") and (not prev.strip() or prev.startswith("    ")):
            if found and found[-1].endswith("\\"):
                found[-1] = found[-1][:-1] + line.strip()
            else:
                found.append(line.strip())
    cmds = []
    for line in found:
        for part in line.split(" && "):
            words = shlex.split(part)
            program = next((w for w in words if "=" not in w), "")
            if program in COMMANDS:
                cmds.append(part)
    return cmds


def dev_module(words):
    """X of `python -m X` where X is one of the repository's developer tools (dev/), or
    None."""
    for w, nxt in zip(words, words[1:]):
        if w == "-m":
            return nxt if nxt.split(".")[0] == "dev" else None
    return None


def skipped(cmd):
    """Why a command is not run here, or None."""
    if cmd.startswith("pip "):
        return "installs: the tests run in the environment it makes"
    if "pytest" in cmd:
        return "the test suite itself"
    if "gpucheck" in cmd:
        return DEV_SKIPS["dev.gpucheck"]
    module = dev_module(shlex.split(cmd))
    for tool, why in DEV_SKIPS.items():
        if module and (module == tool or module.startswith(tool + ".")):
            return why
    if "tests/support/cudasim" in cmd:
        return cudasim_missing()
    return None


def page_commands():
    return [pytest.param(page, c, id=f"{page}: {c}", marks=pytest.mark.skipif(
        bool(skipped(c)), reason=skipped(c) or "")) for page in PAGES for c in commands(page)]


@pytest.fixture(scope="module")
def clones(tmp_path_factory):
    """A copy of the repository per page, made at the page's first command."""
    made = {}

    def clone(page):
        if page not in made:
            dest = tmp_path_factory.mktemp("docs") / "cupygpt"
            shutil.copytree(ROOT, dest, symlinks=True, ignore=shutil.ignore_patterns(
                ".git", "__pycache__", ".pytest_cache", "*.egg-info", "out", "gpu_report"))
            made[page] = dest
        return made[page]
    return clone


def test_readme_has_its_commands():
    cmds = commands()
    assert len(cmds) >= 10 and any(c.startswith("mpirun -np 3") for c in cmds), cmds
    assert "python cli.py train" in cmds


def test_every_page_has_commands():
    assert len(PAGES) > 1
    for page in PAGES:
        assert commands(page), page


def test_readme_is_the_front_door():
    """At most 200 lines; within the first 40 how to install, the one command that trains
    on the shipped data and the one that runs the tests; every docs page linked."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    lines = text.split("\n")
    head = "\n".join(lines[:40])
    assert len(lines) <= 200, len(lines)
    for needed in ("pip install -e .", ".[cuda12]", ".[cuda13]", "cudnn",
                   "pip install -e . && python cli.py train",
                   "python -m pytest -q", 'python -m pytest -q -m "not slow"'):
        assert needed in head, needed
    for page in PAGES[1:]:
        assert f"]({page})" in text, page


def heading_anchors(page):
    """The anchors of a page's headings, as GitHub makes them."""
    text = open(os.path.join(ROOT, page), encoding="utf-8").read()
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
            for h in re.findall(r"^#+ (.*)$", text, re.M)}


@pytest.mark.parametrize("page", PAGES)
def test_links_lead_somewhere(page):
    """Every relative link of a page names a file of the repository (and a heading of it)."""
    text = open(os.path.join(ROOT, page), encoding="utf-8").read()
    for target in re.findall(r"\]\(([^)\s]+)\)", text):
        if re.match(r"[a-z]+:", target):
            continue
        path, _, anchor = target.partition("#")
        full = os.path.normpath(os.path.join(os.path.dirname(page), path)) if path else page
        assert os.path.exists(os.path.join(ROOT, full)), (page, target)
        if anchor:
            assert anchor in heading_anchors(full), (page, target)


def test_pages_write_only_where_git_ignores():
    """What the pages' commands write into a checkout (their -o, --out, --trace and the
    commands' default outputs) is ignored by git."""
    defaults = {"train": "out/model.bin", "plot": "loss.png", "timeline": "timeline.png",
                "bench": "bench.json"}
    written = set()
    for page in PAGES:
        for cmd in commands(page):
            words = shlex.split(cmd)
            written |= {words[i + 1] for i, w in enumerate(words[:-1])
                        if w in ("--out", "--trace", "-o") and not words[i + 1].startswith("$")}
            written |= {v for k, v in defaults.items() if k in words}
    res = subprocess.run(["git", "check-ignore", "--no-index", *sorted(written)], cwd=ROOT,
                         capture_output=True, text=True)
    if res.returncode == 128:
        pytest.skip(f"not a git checkout: {res.stderr.strip()}")
    assert sorted(res.stdout.split()) == sorted(written)


@pytest.mark.parametrize("page,cmd", page_commands())
def test_readme_command_runs(clones, page, cmd):
    words = shlex.split(cmd)
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    while "=" in words[0]:
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    launcher = {"python": [sys.executable], "mpirun": [mpiexec()], "mpiexec": [mpiexec()]}
    words = launcher[words[0]] + words[1:]
    if "train" in words and "-n" not in words[words.index("train") + 1:]:
        words += ["-n", "4"]
    res = subprocess.run(words, cwd=clones(page), env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode == 0 and "Traceback" not in res.stderr, (res.stdout, res.stderr)


def test_the_cpu_test_extra_is_apart_and_ci_installs_every_test_extra():
    """`test` held CuPy, cuBLAS, NCCL and torch (3 GB) for a CPU-only contributor; they are
    test-cuda's and test-hf's now, and CI's command, README's, installs every test extra."""
    import configparser
    cfg = configparser.ConfigParser()
    cfg.read(os.path.join(ROOT, "setup.cfg"))
    extras = {name: [r.strip() for r in reqs.splitlines() if r.strip()]
              for name, reqs in cfg["options.extras_require"].items()}
    heavy = [r for r in extras["test"] if r.startswith(("cupy", "nvidia-", "nvmath", "nvshmem",
                                                        "cuda-", "torch", "transformers"))]
    assert not heavy, heavy
    ci = next(ln for ln in open(os.path.join(ROOT, ".ci", "run")) if ln.startswith("pip "))
    assert ci.strip() in open(os.path.join(ROOT, "README.md")).read()
    installed = set(re.search(r"'\.\[([^\]]*)\]'", ci).group(1).split(","))
    assert {name for name in extras if name.startswith("test")} <= installed, installed
