"""The backends keep nothing in their modules: all a backend keeps between calls (compiled
kernels, cuBLASLt plans and workspace, cuDNN graphs, the attention chosen, the profile,
the fallbacks, scratch arrays) is its object's, which the session makes once. Read from
the source (no `global`, no mutable value built at module or class level, nothing done at
import but defining) and from the modules as loaded (the CUDA backend's through cudasim:
every module attribute of an immutable kind)."""
import __future__

import ast
import glob
import os
import sys
import types

import numpy as np
import pytest
from harness import ROOT, SIM_BACKEND, load_cudasim

PACKAGES = ("cuda", "numpy", ".")  # backends/cuda/, backends/numpy/, backends/ itself
# calls that build a frozen value from whatever they are given
FROZEN = {"MappingProxyType", "frozenset", "tuple"}
# calls whose result is immutable when their arguments are
PURE = {"os.path.join", "os.path.dirname", "os.path.abspath", "np.dtype", "math.sqrt",
        "dataclass"}


def modules(package):
    return sorted(glob.glob(os.path.join(ROOT, "cupygpt", "backends", package, "*.py")))


def mutable(node):
    """What mutable thing evaluating node at import builds, or None."""
    if isinstance(node, (ast.List, ast.Dict, ast.Set, ast.ListComp, ast.DictComp,
                         ast.SetComp, ast.GeneratorExp)):
        return type(node).__name__
    if isinstance(node, ast.Call):
        name = ast.unparse(node.func)
        if name in FROZEN:
            return None
        if name not in PURE:
            return f"a call of {name}"
        return next(filter(None, map(mutable, [*node.args, *(k.value for k in node.keywords)])),
                    None)
    if isinstance(node, ast.Lambda):
        return None
    if isinstance(node, ast.Tuple):  # (a generator unpacked into a tuple: its items count)
        return next(filter(None, (mutable(e.value.elt if isinstance(e, ast.Starred) and
                                          isinstance(e.value, ast.GeneratorExp) else e)
                                  for e in node.elts)), None)
    return next(filter(None, map(mutable, ast.iter_child_nodes(node))), None)


def top_level(body):
    """The statements run at import in body (a module's or a class's): into if, try and
    with blocks, not into functions (a class's own body is read as a class body)."""
    for st in body:
        if isinstance(st, (ast.If, ast.Try, ast.With)):
            yield from top_level(st.body + getattr(st, "orelse", []) +
                                 getattr(st, "finalbody", []) +
                                 [s for h in getattr(st, "handlers", []) for s in h.body])
        else:
            yield st


def state_in(source, where):
    """Each place in source that keeps state outside an object, or does work at import."""
    tree, found = ast.parse(source), []
    found += [f"{where}:{n.lineno}: {type(n).__name__.lower()} statement"
              for n in ast.walk(tree) if isinstance(n, (ast.Global, ast.Nonlocal))]

    def read(body, scope):
        for st in top_level(body):
            at = f"{where}:{st.lineno} ({scope})"
            if isinstance(st, ast.ClassDef):
                read(st.body, f"class {st.name}")
            elif isinstance(st, ast.AugAssign):
                found.append(f"{at}: {ast.unparse(st)}")
            elif isinstance(st, (ast.Assign, ast.AnnAssign)):
                targets = st.targets if isinstance(st, ast.Assign) else [st.target]
                if any(not isinstance(t, (ast.Name, ast.Tuple)) for t in targets):
                    found.append(f"{at}: assigns into {ast.unparse(targets[0])}")
                why = st.value is not None and mutable(st.value)
                if why:
                    found.append(f"{at}: {ast.unparse(targets[0])} is {why}")
            elif isinstance(st, ast.Expr) and not isinstance(st.value, ast.Constant):
                found.append(f"{at}: runs {ast.unparse(st)}")
    read(tree.body, "module")
    return found


@pytest.mark.parametrize("package", PACKAGES)
def test_no_module_level_state_in_the_source(package):
    found = [f for path in modules(package)
             for f in state_in(open(path).read(), os.path.relpath(path, ROOT))]
    assert modules(package) and not found, "\n".join(found)


# One way each of keeping state outside the backend's object: each must be found
KEPT = {"a cache": "_plans = {}\n",
        "several": "_modules, _functions = {}, {}\n",
        "a global": "def f():\n    global _trace\n    _trace = None\n",
        "a list filled later": "_origin = []\n",
        "a host array": "_ONE = np.array(1.0, np.float32)\n",
        "a class's": "class K:\n    plans = {}\n",
        "an annotated one": "x: dict = dict()\n",
        "a mutation": "import os\nos.environ['X'] = '1'\n",
        "a call at import": "np.seterr(over='ignore')\n",
        "in a try": "try:\n    import cudnn\n    _handle = []\nexcept ImportError:\n    pass\n"}


@pytest.mark.parametrize("kind", KEPT)
def test_the_source_check_finds_state(kind):
    assert state_in(KEPT[kind], "m.py"), kind


def test_the_source_check_lets_constants_be():
    ok = ('"""doc"""\nimport os\nfrom types import MappingProxyType\nN_, T_ = 0, 1\n'
          'DIR = os.path.join(os.path.dirname(__file__), "k")\n'
          'G = MappingProxyType({"WARP": 32})\nOPTS = ("-a", *(f"-D{k}" for k in G))\n'
          'P = MappingProxyType({k: 2 * v for k, v in G.items()})\n'
          'class K:\n    name = "cuda"\n    DTYPES = (1, 2)\n'
          '    def __init__(self):\n        self.plans = {}\n')
    assert state_in(ok, "m.py") == []


def frozen(value):
    """Whether value cannot change: a constant, a tuple or frozen mapping of them, a
    module, class, function or type alias."""
    if isinstance(value, tuple):
        return all(map(frozen, value))
    if isinstance(value, types.MappingProxyType):
        return all(map(frozen, value)) and all(map(frozen, value.values()))
    return isinstance(value, (str, bytes, int, float, complex, bool, type(None), frozenset,
                              np.dtype, np.generic, type, types.ModuleType, types.FunctionType,
                              types.BuiltinFunctionType, __future__._Feature)) or \
        type(value).__module__ == "typing"


def unfrozen(mods):
    """Each non-dunder attribute of mods, and of the classes they define, that can change."""
    out = []
    for mod in mods:
        for name, value in vars(mod).items():
            if not name.startswith("__") and not frozen(value):
                out.append(f"{mod.__name__}.{name}: {type(value).__name__}")
            if isinstance(value, type) and value.__module__ == mod.__name__:
                out += [f"{mod.__name__}.{name}.{n}: {type(v).__name__}"
                        for n, v in vars(value).items()
                        if not n.startswith("__") and not frozen(v)
                        and not isinstance(v, (staticmethod, classmethod, property))]
    return out


def test_the_cuda_backends_modules_hold_only_constants():
    load_cudasim()
    mods = [m for n, m in sys.modules.items() if n.startswith(SIM_BACKEND + ".")]
    assert len(mods) == len(modules("cuda")) - 1  # (all but its __init__)
    assert not unfrozen(mods), unfrozen(mods)


def test_the_numpy_backends_modules_hold_only_constants():
    import cupygpt.backends.numpy.backend  # noqa: F401 (imports every module of it)
    mods = [m for n, m in sys.modules.items() if n.startswith("cupygpt.backends.numpy.")]
    assert len(mods) == len(modules("numpy")) - 1
    assert not unfrozen(mods), unfrozen(mods)


def test_the_attribute_check_finds_a_cache():
    mod = types.ModuleType("m")
    mod._plans, mod.K = {}, type("K", (), {"__module__": "m", "cache": []})
    assert unfrozen([mod]) == ["m._plans: dict", "m.K.cache: list"]
