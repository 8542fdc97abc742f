"""The package's import graph: every module imports alone, and no module reaches itself
through others, counting imports inside functions (which would otherwise hide a circle)."""
import ast
import importlib.util
import os
import subprocess
import sys

import cupygpt

PKG = os.path.dirname(cupygpt.__file__)


def modules():
    """{dotted name: path} of every module in the package."""
    out = {}
    for d, _, files in os.walk(PKG):
        for f in files:
            if f.endswith(".py"):
                rel = os.path.relpath(os.path.join(d, f), os.path.dirname(PKG))[:-3]
                out[rel.replace(os.sep, ".").removesuffix(".__init__")] = os.path.join(d, f)
    return out


def imports(name, path, known):
    """The package's modules that module `name` imports, anywhere in its body."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.ImportFrom) and node.level:
            base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
            base = f"{base}.{node.module}" if node.module else base
            for alias in node.names:  # `from . import x` may name a module
                found.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names if a.name in known)
        elif isinstance(node, ast.ImportFrom) and node.module in known:
            found.add(node.module)
    return found & set(known) - {name}


def test_no_circle_in_the_import_graph():
    known = modules()
    graph = {n: imports(n, p, known) for n, p in known.items()}
    # a package's __init__ is imported with each of its modules: those edges are implied
    state, path = {}, []

    def visit(n):
        state[n] = "open"
        path.append(n)
        for m in sorted(graph[n]):
            if state.get(m) == "open":
                raise AssertionError("import circle: " + " -> ".join(path[path.index(m):] + [m]))
            if m not in state:
                visit(m)
        path.pop()
        state[n] = "done"
    for n in sorted(graph):
        if n not in state:
            visit(n)


# the packages of the test-cuda extra that modules import at their top (the optional ones
# ARCHITECTURE names); where they are not installed (a CPU-only install of the test extra),
# a module stopping on one imports again with cudasim's stand-ins in their place
CUDA_PACKAGES = ("cupy", "cupy_backends", "cupyx", "nvmath", "nvshmem", "cuda", "cudnn")


def import_each(names, env=None):
    """{module: its last stderr line} of those that do not import alone."""
    procs = {n: subprocess.Popen([sys.executable, "-c", f"import {n}"], stderr=subprocess.PIPE,
                                 text=True, env=env) for n in names}
    return {n: p.communicate()[1].strip().splitlines()[-1:] for n, p in procs.items()
            if p.wait() != 0}


def test_every_module_imports_alone():
    from harness import SIM
    failed = import_each([n for n in modules() if n != "cupygpt.__main__"])  # (it runs the CLI)
    wanting = [n for n, line in failed.items() if importlib.util.find_spec("cupy") is None
               and any(f"No module named '{p}" in "".join(line) for p in CUDA_PACKAGES)]
    if wanting:
        path = os.pathsep.join([SIM, os.environ.get("PYTHONPATH", "")])
        failed = {n: line for n, line in failed.items() if n not in wanting}
        failed.update(import_each(wanting, {**os.environ, "PYTHONPATH": path}))
    assert not failed, failed


# The layers, top first: a module imports only from its own layer or those below it, so the
# tree reads as the architecture (ARCHITECTURE.md draws it). "" is the package's __init__.
# A dotted entry is a folder inside another that sits in a layer of its own.
LAYERS = (("__main__",), ("cli",), ("commands",), ("train",), ("session",), ("config",),
          ("parallel",), ("formats",), ("model",), ("comm",), ("backends",),
          ("log", "paths", "precision"), ("",))


def layer(name):
    """The index in LAYERS of the longest entry that name (a dotted module) lies in."""
    rel = name.removeprefix("cupygpt").lstrip(".")
    found = [(len(n), i) for i, names in enumerate(LAYERS) for n in names
             if n and (rel == n or rel.startswith(n + "."))] or [(0, len(LAYERS) - 1)]
    return max(found)[1]


def test_every_import_points_down_the_declared_layers():
    known = modules()
    up = [f"{n} -> {m}" for n, p in known.items() for m in imports(n, p, known)
          if layer(m) < layer(n)]
    assert not up, up


def test_the_package_root_holds_the_layers_and_at_most_six_modules():
    root = sorted(f for f in os.listdir(PKG) if f.endswith(".py"))
    assert len(root) <= 6, root
    tops = {name.removeprefix("cupygpt.").split(".")[0] for name in modules()} - {"cupygpt"}
    assert tops == {n.split(".")[0] for names in LAYERS for n in names if n}, tops
