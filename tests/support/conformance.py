"""The checker behind test_conformance.py.

read(): the library names a module's source uses, found with `ast`. Names are followed from
the imports (module level or in functions) through assignments (also tuple ones and
`self.X = ...`), calls (a class call gives an instance; what functions return comes from
RETURNS, CuPy's array convention or the real annotation) and indexing of CuPy arrays. A use
is a chain such as "cupy.cuda.get_current_stream().ptr", with its call's shape when called.
A method called on a receiver of unknown type (a parameter: the backend's arrays) is
"?.name", tried against the library classes the same module is seen to use.

check(): walks each chain in the installed real packages and binds each call's shape to the
real signature: inspect.signature, else the signature a (Cython) docstring starts with,
else the check is skipped, saying why.

standins(), offered(), check_offer(): what cudasim's stand-ins offer, against the real
packages.
"""
import ast
import dataclasses
import enum
import glob
import importlib
import inspect
import os
import re
import sys
import textwrap
import types

import numpy as np

LIBS = ("cupy", "cupy_backends", "cupyx", "nvshmem", "cuda", "nvmath", "cudnn")
OPTIONAL = ("cudnn",)  # an extra of its own (setup.cfg's cudnn): checked where installed
OTHER = "<other>"  # surely no library object: a literal, a non-library import, our own self.X
# What calls return where neither a class call, CuPy's convention (its functions and array
# methods give arrays) nor an annotation says; None: plain data, nothing in it to check.
RETURNS = {"cupy.cuda.get_current_stream": "cupy.cuda.Stream",
           "cupy.cuda.Stream.record": "cupy.cuda.Event",
           "cupy.cuda.Stream.end_capture": "cupy.cuda.Graph",
           "cupy.get_default_memory_pool": "cupy.cuda.MemoryPool",
           "cupy.RawModule.get_function": "cupy.RawKernel",
           "cupy.ndarray.get": None, "cupy.asnumpy": None,
           "cupy.cuda.runtime.getDeviceProperties": None, "cupy.cuda.runtime.memGetInfo": None,
           "cupy.cuda.nccl.get_unique_id": None, "cuda.bindings.driver.cuStreamWaitValue64": None}
P = inspect.Parameter


@dataclasses.dataclass(frozen=True)
class Use:
    where: str         # file:line
    chain: str         # "cupy.cuda.Stream().use", or "?.get" on a receiver of unknown type
    call: tuple = None  # (positional count, None for *args of unknown length; keyword names)


# --- reading cupygpt's source ------------------------------------------------------------

def _own(node):
    """node's descendants in source order, not entering nested functions or classes."""
    for child in ast.iter_child_nodes(node):
        yield child
        if not isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef,
                                  ast.Lambda)):
            yield from _own(child)


class _Reader(ast.NodeVisitor):
    """Types are chains (str), OTHER, or None (unknown). Flow-insensitive: a name has the
    type of its last assignment in its function (else in the module)."""

    def __init__(self, where):
        self.where, self.uses = where, []
        self.scopes, self.tuples = [{}], [{}]  # name -> type; name -> length of its tuple
        self.selfname, self.selfattrs = None, {}

    def type(self, node):
        if isinstance(node, ast.Name):
            if node.id == self.selfname:
                return OTHER
            scope = next((s for s in (self.scopes[-1], self.scopes[0]) if node.id in s), {})
            return scope.get(node.id)
        if isinstance(node, ast.Attribute):
            if isinstance(node.value, ast.Name) and node.value.id == self.selfname:
                return self.selfattrs.get(node.attr, OTHER)  # else a member of our own
            t = self.type(node.value)
            return f"{t}.{node.attr}" if t not in (None, OTHER) else t
        if isinstance(node, (ast.Call, ast.Subscript)):
            t = self.type(node.func if isinstance(node, ast.Call) else node.value)
            if t in (None, OTHER):
                return t if isinstance(node, ast.Call) else None  # what a container holds
            return t + ("()" if isinstance(node, ast.Call) else "[]")
        if isinstance(node, ast.IfExp):
            a, b = self.type(node.body), self.type(node.orelse)
            return a if a == b else None
        literal = (ast.Constant, ast.JoinedStr, ast.List, ast.Tuple, ast.Dict, ast.Set,
                   ast.ListComp, ast.DictComp, ast.SetComp, ast.GeneratorExp)
        return OTHER if isinstance(node, literal) else None

    def bind(self, body, selfattrs=None):
        """Binds the names (and, given selfattrs, the self.X) that body assigns, in order."""
        scope, tuples = self.scopes[-1], self.tuples[-1]
        for n in _own(body):
            if isinstance(n, ast.Import):
                for a in n.names:
                    root = a.name.split(".")[0]
                    scope[a.asname or root] = OTHER if root not in LIBS else (
                        a.name if a.asname else root)
            elif isinstance(n, ast.ImportFrom):
                lib = n.level == 0 and n.module.split(".")[0] in LIBS
                for a in n.names:
                    scope[a.asname or a.name] = f"{n.module}.{a.name}" if lib else OTHER
            elif isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                scope[n.name] = None  # ours: what calling it gives is unknown
            elif isinstance(n, (ast.For, ast.withitem)):
                for t in ast.walk(n.target if isinstance(n, ast.For) else n):
                    if isinstance(t, ast.Name) and isinstance(t.ctx, ast.Store):
                        scope[t.id] = None
            elif isinstance(n, ast.Assign):
                for target in n.targets:
                    pairs = [(target, n.value)]
                    if isinstance(target, ast.Tuple):
                        same = isinstance(n.value, ast.Tuple) and len(n.value.elts) == len(
                            target.elts)
                        pairs = zip(target.elts, n.value.elts if same else
                                    [None] * len(target.elts))
                    for t, v in pairs:
                        if isinstance(t, ast.Name):
                            scope[t.id] = v and self.type(v)
                            if isinstance(v, ast.Tuple):
                                tuples[t.id] = len(v.elts)
                        elif (selfattrs is not None and isinstance(t, ast.Attribute)
                              and isinstance(t.value, ast.Name) and t.value.id == self.selfname):
                            selfattrs[t.attr] = v and self.type(v)

    def enter(self, node, selfname, selfattrs=None):
        """Enters a function's scope and binds its names; returns what leave() restores.
        Arguments are unknown, but an annotated one is taken for no library object (the
        way to silence a wrong guess)."""
        saved = self.selfname
        self.scopes.append({a.arg: OTHER if a.annotation else None
                            for a in ast.walk(node.args) if isinstance(a, ast.arg)})
        self.tuples.append({})
        self.selfname = selfname
        self.bind(node, selfattrs)
        return saved

    def leave(self, saved):
        self.scopes.pop()
        self.tuples.pop()
        self.selfname = saved

    def visit_Module(self, node):
        self.bind(node)
        self.generic_visit(node)

    def visit_ClassDef(self, node):
        saved, self.selfattrs = self.selfattrs, {}
        methods = [m for m in node.body if isinstance(m, ast.FunctionDef) and m.args.args]
        for _ in range(2):  # twice: one self attribute may be made from another
            for m in methods:
                self.leave(self.enter(m, m.args.args[0].arg, self.selfattrs))
        for child in node.body:
            if child in methods:
                prev = self.enter(child, child.args.args[0].arg)
                self.generic_visit(child)
                self.leave(prev)
            else:
                self.visit(child)
        self.selfattrs = saved

    def visit_FunctionDef(self, node):  # also a function nested in a method: same self
        prev = self.enter(node, self.selfname)
        self.generic_visit(node)
        self.leave(prev)

    visit_AsyncFunctionDef = visit_Lambda = visit_FunctionDef

    def shape(self, call):
        npos = 0
        for a in call.args:
            n = 1
            if isinstance(a, ast.Starred):
                n = self.tuples[-1].get(getattr(a.value, "id", None))
                if n is None:
                    return None, tuple(k.arg for k in call.keywords if k.arg)
            npos += n
        return npos, tuple(k.arg for k in call.keywords if k.arg)  # a **kw: not checked

    def visit_Call(self, node):
        t, line = self.type(node.func), f"{self.where}:{node.lineno}"
        if t not in (None, OTHER):
            self.uses.append(Use(line, t, self.shape(node)))
        elif t is None and isinstance(node.func, ast.Attribute) and (
                self.type(node.func.value) is None):
            self.uses.append(Use(line, "?." + node.func.attr, self.shape(node)))
        for child in ast.iter_child_nodes(node):  # the called attribute is the call's use
            self.visit(child.value if child is node.func and isinstance(
                child, ast.Attribute) else child)

    def visit_Attribute(self, node):
        t = self.type(node)
        if isinstance(node.ctx, ast.Load) and t not in (None, OTHER):
            self.uses.append(Use(f"{self.where}:{node.lineno}", t))
        else:
            self.visit(node.value)

    def visit_Constant(self, node):
        """Python held in a string (gpucheck's sanitizer command) is read too."""
        if isinstance(node.value, str) and "import" in node.value:
            try:
                if imports_a_library(node.value):
                    self.uses += read(node.value, f"{self.where}:{node.lineno}: code in a string")
            except SyntaxError:
                pass


def read(source, where):
    """The library uses in a module's source; where names the module in reports."""
    reader = _Reader(where)
    reader.visit(ast.parse(source))
    # a chain that is also used longer (cp.cuda in cp.cuda.Stream()) adds nothing
    longer = {v.chain[:i] for v in reader.uses for i, ch in enumerate(v.chain) if ch in ".(["}
    return [u for u in reader.uses if u.call is not None or u.chain not in longer]


def imports_a_library(source):
    return any(
        (n.level == 0 and n.module.split(".")[0] in LIBS) if isinstance(n, ast.ImportFrom)
        else any(a.name.split(".")[0] in LIBS for a in n.names)
        for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.Import, ast.ImportFrom)))


# --- the real packages -------------------------------------------------------------------

class Mismatch(Exception):
    """The real package disagrees."""


class Unknown(Exception):
    """Cannot be checked; says why."""


class Plain(Exception):
    """A call gives plain data (RETURNS): nothing further to check."""


def _instance_attr(cls, name):
    """An attribute set per instance (CuPy's Stream.ptr) is not on the class; an instance the
    class itself holds (Stream.null) shows it."""
    for k in cls.__mro__:
        for v in list(vars(k).values()):
            if isinstance(v, cls) and hasattr(v, name):
                return getattr(v, name)
    raise AttributeError(name)


def attribute(obj, name, instance):
    """(obj.name, whether a call passes self); instance: read from an instance of class obj."""
    try:
        if instance and not hasattr(obj, name):
            return _instance_attr(obj, name), False
        if instance:
            static = inspect.getattr_static(obj, name)
            return getattr(obj, name), not isinstance(static, (staticmethod, classmethod))
        if inspect.ismodule(obj) and not hasattr(obj, name):  # a submodule not imported yet
            return importlib.import_module(f"{obj.__name__}.{name}"), False
        return getattr(obj, name), False
    except (AttributeError, ImportError):
        raise Mismatch(f"{getattr(obj, '__name__', obj)} has no attribute {name!r}") from None


def resolve(chain, seen=None):
    """(real object, whether it stands for an instance of that class, whether a call passes
    self) for a chain; the classes of the instances met on the way are added to seen."""
    import cupy
    steps = re.findall(r"\w+|\(\)|\[\]", chain)
    obj, path = importlib.import_module(steps[0]), steps[0]
    instance = bound = False
    owner = None  # the class whose instance the last attribute was read from
    for step in steps[1:]:
        if step == "[]":
            if not (instance and issubclass(obj, cupy.ndarray)):
                raise Unknown(f"what indexing {path} gives")
        elif step == "()":
            if not (inspect.isclass(obj) and not instance):
                obj = _returns(obj, path, owner, cupy)
            instance, bound, owner = True, False, None
            seen is None or seen.add(obj)
        else:
            owner = obj if instance else None
            obj, bound = attribute(obj, step, instance)
            instance, path = False, f"{path}.{step}"
    return obj, instance, bound


def _returns(fn, path, owner, cupy):
    """The class of what calling fn (reached by path) gives."""
    for name, gives in RETURNS.items():
        if resolve(name)[0] is fn:
            if gives is None:
                raise Plain()
            return resolve(gives)[0]
    if owner is cupy.ndarray or re.fullmatch(r"cupy\.\w+", path):
        return cupy.ndarray
    try:
        ann = inspect.signature(fn).return_annotation
    except (TypeError, ValueError):
        ann = None
    if isinstance(ann, str):  # postponed: a name in fn's module
        ann = getattr(sys.modules.get(getattr(fn, "__module__", "")), ann.split(".")[-1], None)
    if not inspect.isclass(ann):
        raise Unknown(f"what {path}() gives")
    return ann


def _split(params):
    """params split at the commas outside brackets and quotes."""
    out, depth, quote, cur = [], 0, None, ""
    for ch in params:
        if quote:
            quote = None if ch == quote else quote
        elif ch in "'\"":
            quote = ch
        elif ch in "([{" or ch in ")]}":
            depth += 1 if ch in "([{" else -1
        elif ch == "," and depth == 0:
            out, cur = out + [cur.strip()], ""
            continue
        cur += ch
    return [p for p in out + [cur.strip()] if p]


def doc_signature(obj, name):
    """The signature obj's docstring starts with (`[Class.]name(int a, b=1, *, c=None)`, C
    types dropped), or None."""
    doc = getattr(obj, "__doc__", None) or ""
    m = re.match(r"\s*(?:[\w.]+\.)?(\w+)\(", doc)
    if not m or m.group(1) != name:
        return None
    depth = 1
    for end in range(m.end(), len(doc)):
        depth += {"(": 1, ")": -1}.get(doc[end], 0)
        if depth == 0:
            break
    params, kind = [], P.POSITIONAL_OR_KEYWORD
    for p in _split(doc[m.end():end].replace("\\*", "*")):
        if p == "/":
            params = [q.replace(kind=P.POSITIONAL_ONLY) for q in params]
        elif p.startswith("**"):
            params.append(P(p[2:], P.VAR_KEYWORD))
        elif p.startswith("*"):
            params += [P(p[1:], P.VAR_POSITIONAL)] if p != "*" else []
            kind = P.KEYWORD_ONLY
        else:
            left, eq, _ = p.partition("=")
            params.append(P(left.split()[-1], kind, default=None if eq else P.empty))
    return inspect.Signature(params)


def signature(obj, name, bound):
    """obj's signature (without self when bound), from inspect or its docstring, or None."""
    try:
        sig = inspect.signature(obj)
    except (TypeError, ValueError):
        try:
            sig = doc_signature(obj, name)
        except ValueError:  # the docstring's parameters are in no valid order
            sig = None
    return sig.replace(parameters=list(sig.parameters.values())[1:]) if sig and bound else sig


def _data(obj):
    return isinstance(obj, (property, types.GetSetDescriptorType, types.MemberDescriptorType))


def check_call(obj, bound, call, name):
    """(what is wrong or None, why it was not checked or None) for calling obj."""
    if _data(obj):
        return f"{name} is an attribute, not a method", None
    sig = signature(obj, obj.__name__ if inspect.isclass(obj) else name, bound)
    if sig is None:
        return None, f"{name}: no signature, and its docstring does not start with one"
    npos, keywords = call
    try:
        if npos is None:
            sig.bind_partial(**dict.fromkeys(keywords))
        else:
            sig.bind(*range(npos), **dict.fromkeys(keywords))
    except TypeError as e:
        return str(e), None
    return None, None


@dataclasses.dataclass
class Report:
    checked: int = 0
    errors: list = dataclasses.field(default_factory=list)
    skipped: list = dataclasses.field(default_factory=list)  # not checked, and why
    partial: list = dataclasses.field(default_factory=list)  # checked in part, and why

    def add(self, where, problem, why):
        if problem:
            self.errors.append(f"{where}: {problem}")
        elif why:
            self.skipped.append(f"{where}: {why}")
        else:
            self.checked += 1


def check(uses):
    """One module's uses against the real packages."""
    rep, classes = Report(), set()
    for u in [u for u in uses if not u.chain.startswith("?.")]:
        where = f"{u.where}: {u.chain}"
        try:
            obj, instance, bound = resolve(u.chain, classes)
            if u.call is None:
                rep.add(where, None, None)
                continue
            if inspect.isclass(obj) and not instance:
                classes.add(obj)  # an instance made here
            rep.add(where, *check_call(obj, bound, u.call, u.chain.rsplit(".", 1)[-1]))
            if u.call[0] is None:
                rep.partial.append(f"{where}: *args of unknown length, keywords only")
        except (Mismatch, Unknown) as e:
            rep.add(where, *((e, None) if isinstance(e, Mismatch) else (None, e)))
        except Plain:
            rep.add(where, None, None)
    for u in uses:  # on receivers of unknown type: the classes seen above that have the method
        name = u.chain[2:]
        if not u.chain.startswith("?.") or name.startswith("__"):
            continue
        results = [(c.__qualname__, *check_call(*attribute(c, name, True), u.call, name))
                   for c in sorted(classes, key=lambda c: c.__qualname__)
                   if callable(getattr(c, name, None)) and not hasattr(object, name)]
        if not results or any(p is None and w is None for _, p, w in results):
            rep.checked += bool(results)  # none: no library class has it, not a library call
        elif all(w for _, _, w in results):
            rep.add(f"{u.where}: .{name}()", None, "; ".join(w for _, _, w in results))
        else:
            rep.add(f"{u.where}: .{name}(...)", "fits no library class that has it: " + "; ".join(
                f"{c}.{name}: {p or w}" for c, p, w in results), None)
    return rep


# --- what cudasim offers -----------------------------------------------------------------

def standins(sim_dir):
    """{module name: module} for every module cudasim's files make (cupy, nvshmem.core and
    the cupy_backends, cuda.core, cuda.bindings stand-ins they put in sys.modules), imported
    with sim_dir first on sys.path; sys.modules and sys.path are left as they were."""
    names = sorted(os.path.relpath(p, sim_dir)[:-3].replace(os.sep, ".").removesuffix(".__init__")
                   for p in glob.glob(os.path.join(sim_dir, "**", "*.py"), recursive=True))
    ours = lambda: [n for n in sys.modules if n.split(".")[0] in LIBS]  # noqa: E731
    saved = {n: sys.modules.pop(n) for n in ours()}
    sys.path.insert(0, sim_dir)
    try:
        for n in names:
            importlib.import_module(n)
        return {n: sys.modules[n] for n in ours()}
    finally:
        sys.path.remove(sim_dir)
        for n in ours():
            del sys.modules[n]
        sys.modules.update(saved)


INSTANCE_ATTR = "<set on instances>"


def _members(cls, mods):
    """A cudasim class's public attributes (its own and its cudasim bases'), __init__,
    __call__, and the public attributes its methods set on self."""
    out = {}
    for k in reversed([k for k in cls.__mro__ if k.__module__ in mods]):
        tree = ast.parse(open(mods[k.__module__].__file__).read())
        source = next(n for n in tree.body if isinstance(n, ast.ClassDef) and n.name == k.__name__)
        out.update((n.attr, INSTANCE_ATTR) for n in ast.walk(source)
                   if isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store)
                   and getattr(n.value, "id", None) == "self" and not n.attr.startswith("_"))
        out.update((n, v) for n, v in vars(k).items()
                   if not n.startswith("_") or n in ("__init__", "__call__"))
    return out


def _plain(obj):
    return isinstance(obj, (int, float, str, bytes, type(None)))


def offered(mods, stands_for):
    """([(real module, attribute chain, cudasim object, its class or None)], unplaced): what
    cudasim offers, each where the backend finds it. Public names only, and not the names
    cudasim's files import or their capitalized settings (MEMORY). A top-level name in a
    cudasim file whose object is also at another place (cupy.py's Stream, at cupy.cuda.Stream)
    is its own handle, not an offer. stands_for: {cudasim class: (real module, chain)} for
    classes no public name reaches (what get_function returns); unplaced: classes in neither."""
    found = []  # (module, chain, object)

    def collect(obj, mod, chain):
        found.append((mod, chain, obj))
        if isinstance(obj, types.SimpleNamespace):
            for n, v in vars(obj).items():
                if not n.startswith("_"):
                    collect(v, mod, f"{chain}.{n}")

    for name, mod in mods.items():
        for n, v in vars(mod).items():
            if not (n.startswith("_") or isinstance(v, types.ModuleType)
                    or getattr(v, "__module__", name) not in mods
                    or (hasattr(mod, "__file__") and n.isupper())):
                collect(v, name, n)
    own = lambda mod, chain: "." not in chain and hasattr(mods[mod], "__file__")  # noqa: E731
    elsewhere = {id(o) for m, c, o in found if not own(m, c) and not _plain(o)}
    handles = {(m, c) for m, c, o in found if own(m, c) and id(o) in elsewhere}
    out = [(m, c, o, None) for m, c, o in found if (m, c.split(".")[0]) not in handles]
    out += [(m, c, cls, None) for cls, (m, c) in stands_for.items()]
    for mod, chain, cls, _ in list(out):
        if inspect.isclass(cls) and cls.__module__ in mods:
            out += [(mod, f"{chain}.{n}", v, cls) for n, v in _members(cls, mods).items()
                    if n != "__init__" or cls not in stands_for]  # those only cudasim makes
    placed = {id(o) for _, _, o, _ in out}
    unplaced = sorted({v.__qualname__ for m in mods.values() if hasattr(m, "__file__")
                       for v in vars(m).values()
                       if inspect.isclass(v) and v.__module__ in mods and id(v) not in placed})
    return out, unplaced


def disagree(sim, real):
    """Where a call that cudasim's signature accepts binds otherwise, or not at all, on the
    real one: each positional parameter must have the real one's name at its place (unless
    the real one is positional-only), each keyword-only one a real parameter of its name."""
    params = list(real.parameters.values())
    positional = [p for p in params if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD)]
    kinds = {p.kind for p in params}
    named = {p.name for p in params if p.kind in (P.POSITIONAL_OR_KEYWORD, P.KEYWORD_ONLY)}
    out, i = [], 0
    for p in sim.parameters.values():
        if p.kind in (P.POSITIONAL_ONLY, P.POSITIONAL_OR_KEYWORD):
            if i < len(positional):
                r = positional[i]
                if r.kind is P.POSITIONAL_OR_KEYWORD and r.name != p.name:
                    out.append(f"parameter {i} is {p.name!r}, the real one's {r.name!r}")
            elif P.VAR_POSITIONAL not in kinds:
                out.append(f"{p.name!r} is positional parameter {i}; the real one takes "
                           f"{len(positional)}")
            i += 1
        elif p.kind is P.KEYWORD_ONLY and p.name not in named and P.VAR_KEYWORD not in kinds:
            out.append(f"keyword {p.name!r} is not a real parameter")
    return "; ".join(out) or None


def compare(mod, chain, obj, owner):
    """(what is wrong or None, why it was not checked or None) for one thing cudasim offers."""
    real = importlib.import_module(mod)
    *parents, name = chain.split(".")
    for step in parents:
        real, _ = attribute(real, step, False)
    cls = real  # for a constructor
    real, bound = attribute(real, name, owner is not None)  # raises Mismatch
    if isinstance(obj, enum.IntEnum):  # a library constant: the same number
        # (int() both: a pybind11 enum, cudnn's, equals no IntEnum of the same number)
        return (None if int(obj) == int(real) else f"{int(obj)}; the real package's is "
                f"{int(real)}"), None
    if isinstance(obj, np.dtype):  # a struct's layout (cuBLASLt's heuristic result): the same
        return (None if obj == real else f"the real package's is {real}"), None
    if obj is INSTANCE_ATTR or _plain(obj) or isinstance(obj, (type, types.SimpleNamespace,
                                                               types.ModuleType)):
        return None, None
    if isinstance(obj, property):
        return ("a method in the real package" if callable(real) and not _data(real)
                else None), None
    if not callable(obj):  # an instance at a class's name (Stream.null): of the real class
        return (None if type(obj).__name__ == type(real).__name__ else
                f"a {type(real).__name__} in the real package"), None
    if not callable(real) or _data(real):
        return "not callable in the real package", None
    sim = inspect.signature(obj.__func__ if isinstance(obj, staticmethod) else obj)
    if owner is not None and not isinstance(obj, staticmethod):
        sim = sim.replace(parameters=list(sim.parameters.values())[1:])
    real_sig = (signature(cls, cls.__name__, False) if name == "__init__"
                else signature(real, name, bound))
    if real_sig is None:
        return None, "the real one has neither a signature nor a docstring starting with one"
    return disagree(sim, real_sig), None


def unread(entries):
    """{"module.chain": [parameter, ...]} for each cudasim function or method offered whose
    body never reads some of its parameters: a meaning of the real call that cudasim drops
    (its NCCL once ran every call on the current stream, not the stream passed). Lambdas
    are not read."""
    out = {}
    for mod, chain, obj, owner in entries:
        fn = obj.__func__ if isinstance(obj, staticmethod) else obj
        if not inspect.isfunction(fn) or fn.__name__ == "<lambda>":
            continue
        node = ast.parse(textwrap.dedent(inspect.getsource(fn))).body[0]
        params = [a.arg for a in node.args.posonlyargs + node.args.args + node.args.kwonlyargs]
        if owner is not None and not isinstance(obj, staticmethod):
            params = params[1:]
        read = {n.id for n in ast.walk(node) if isinstance(n, ast.Name)}
        if [p for p in params if p not in read]:
            out[f"{mod}.{chain}"] = [p for p in params if p not in read]
    return out


def check_offer(entries):
    rep = Report()
    for mod, chain, obj, owner in entries:
        where = f"cudasim {mod}.{chain}" + (f" ({owner.__qualname__})" if owner else "")
        try:
            rep.add(where, *compare(mod, chain, obj, owner))
        except Mismatch as e:
            rep.add(where, f"the real package lacks it ({e})", None)
    return rep
