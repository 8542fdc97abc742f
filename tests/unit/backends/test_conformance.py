"""Conformance: cupygpt's CUDA code, and cudasim, against the real CuPy, nvshmem4py,
cuda-python and nvmath-python (installed by the test-cuda extra; they install and import
without a GPU).

cudasim runs the CUDA backend on the CPU by imitating CuPy and nvshmem4py, so a call it
accepts and the real library rejects would pass CI and fail on a GPU. Here:

1. every cupygpt module that imports cupy, cupy_backends, cupyx, nvshmem, cuda.* or nvmath (found by
   glob and ast, so moved files are still found): each library attribute it uses exists in
   the real package, and each call's positional count and keyword names bind to the real
   signature (inspect.signature, else the signature a Cython docstring starts with);
2. cudasim offers nothing the real packages lack: each public name of its stand-ins (their
   functions, classes, methods, constants, the public attributes their methods set on self,
   and the members of the classes only calls return, placed by STANDS_FOR) exists at the
   same place in the real package; a function's parameters have the real names at the real
   places; a property is no method there, a function no attribute;
   and each parameter a stand-in takes is read by it, or named in UNREAD with why;
3. the checker reports a misspelt attribute, a wrong keyword and an extra positional
   argument made in the real source.

Covered: attributes reached from the imports (module level or in functions, through local
variables, tuple assignments and `self.cp = cp`), calls of them, methods of what they
return (a class call gives an instance; CuPy's array functions give arrays; the few others
are in conformance.RETURNS or the real return annotation), methods called on parameters of
unknown type (the backend's arrays, an NCCL communicator) tried against the library classes
the same module uses, `f(*args)` where args is a tuple literal in the same function, and
library code held in a string (dev/gpucheck's sanitizer command).
Not covered: kernel launches (cudasim checks their arguments against the C parameters and
test_kernels_compile compiles them), argument types and values, attributes read from
receivers of unknown type (arr.data.ptr), functions passed as values and called elsewhere.
Each check that cannot be made (a real callee with neither signature nor docstring one,
cuda.bindings' CUdeviceptr) or is made in part (*args of unknown length: keywords only) is
named in a warning, with why. A mismatch found in cupygpt and not yet fixed is in KNOWN,
and must stay found until it is taken out.

Measured (2 cores, Python 3.11, a fresh venv holding the rest of the test extras): the
packages added for this (cupy-cuda13x, nvshmem4py-cu13, cuda-core, nvidia-cublas,
nvidia-nccl-cu13 and their dependencies, ~1.5 GB unpacked) install in 41-47 s without a pip
cache and 32-34 s with a warm one; this file's tests run in about 2 s.
"""
import glob
import os
import re
import types
import warnings

import conformance as cf
import pytest
from harness import ROOT, SIM

# Known mismatches, reported and waiting for a fix in cupygpt (each must still be found, so
# the entry goes once the code is fixed): {real name: why it matters}
KNOWN = {}
# cudasim classes that no public name reaches, and the real class each stands for
STANDS_FOR = {("cupy", "_Pool"): ("cupy", "cuda.MemoryPool"),
              ("cupy", "_Kernel"): ("cupy", "RawKernel"),
              ("nvshmem.core", "_Symmetric"): ("cuda.core", "Buffer")}
# cudasim's own machinery, which the backend never reaches (CUDASIM_ORDER=random's device
# thread, its queued work, a stream wait's condition, a capture sequence): no real place
MACHINERY = {"_Device", "_Work", "_Reached", "_Capture", "_ThreadStreams"}


@pytest.fixture(scope="module")
def real():
    """The real packages are importable (a skip without them, a failure in CI)."""
    try:
        import cuda.bindings.driver  # noqa: F401
        import cuda.core  # noqa: F401
        import cupy  # noqa: F401
        import nvshmem.core  # noqa: F401
        from cupy.cuda import nccl
        from cupy_backends.cuda.libs import cublas  # noqa: F401
        from nvmath.bindings import cublasLt  # noqa: F401
        assert nccl.available, "CuPy finds no NCCL library (nvidia-nccl-cu13)"
    except Exception as e:
        why = f"the real CUDA packages are not installed (pip install -e '.[test-cuda]'): {e!r}"
        if os.environ.get("CI"):
            pytest.fail(why)
        pytest.skip(why)


def frontend_missing():
    """Why the real cuDNN frontend (the cudnn extra, not test-cuda) is not importable,
    or None: without it the checks leave out what uses or stands in for it."""
    try:
        import cudnn  # noqa: F401
        return None
    except Exception as e:
        return f"cuDNN's frontend is not installed (pip install -e '.[cudnn]'): {e!r}"


def installed(uses_or_entries, chain_of):
    """What can be checked here: all, or without cudnn's part where it is missing."""
    if not frontend_missing():
        return uses_or_entries
    warnings.warn(f"not checked: cudnn ({frontend_missing()})")
    return [u for u in uses_or_entries if chain_of(u).split(".")[0] not in cf.OPTIONAL]


def sources():
    """{file relative to the repository: text} for each module of cupygpt and of the
    developer tools (dev/) using a library."""
    out = {}
    for path in sorted(p for top in ("cupygpt", "dev")
                       for p in glob.glob(os.path.join(ROOT, top, "**", "*.py"), recursive=True)):
        text = open(path).read()
        if cf.imports_a_library(text):
            out[os.path.relpath(path, ROOT)] = text
    return out


def report(texts):
    """The check of several modules' sources, as one Report."""
    total = cf.Report()
    for where, text in texts.items():
        rep = cf.check(installed(cf.read(text, where), lambda u: u.chain))
        total.checked += rep.checked
        for field in ("errors", "skipped", "partial"):
            getattr(total, field).extend(getattr(rep, field))
    return total


def unknown_errors(rep):
    """rep's errors less the KNOWN ones, each of which must be among them."""
    for name in KNOWN:
        assert any(name in e for e in rep.errors), f"{name} is fixed: take it out of KNOWN"
    return [e for e in rep.errors if not any(name in e for name in KNOWN)]


def tell(title, rep):
    """Names, in a warning, each check that was not made or made in part, and why."""
    lines = [f"not checked: {s}" for s in rep.skipped] + [f"in part: {s}" for s in rep.partial]
    if lines:
        warnings.warn(f"{title}: {rep.checked} checked, and\n" + "\n".join(lines))


def test_cupygpt_uses_the_real_api(real):
    texts = sources()
    found = {lib for t in texts.values() for lib in cf.LIBS
             if re.search(rf"^\s*(import|from) {lib}\b", t, re.M)}
    assert {"cupy", "nvshmem", "cuda", "nvmath", "cudnn"} <= found, \
        f"the search found only {sorted(texts)}"
    rep = report(texts)
    assert not unknown_errors(rep), "\n".join(unknown_errors(rep))
    tell("cupygpt's library calls", rep)


def test_cudnn_uses_and_stand_in_hold_to_the_real_frontend(real):
    """The cudnn part of the two checks above, which must have been made: the frontend's
    calls the backend makes and what cudasim's cudnn offers, against the real package
    (skipped, saying so, where the cudnn extra is not installed)."""
    if frontend_missing():
        pytest.skip(frontend_missing())
    uses = [u for w, t in sources().items() for u in cf.read(t, w)
            if u.chain.startswith("cudnn.")]
    assert {"cudnn.pygraph", "cudnn.create_handle", "cudnn.set_stream"} <= {
        u.chain.split("(")[0] for u in uses}, uses
    rep = cf.check(uses)
    assert rep.checked and not rep.errors, rep.errors
    mods = cf.standins(SIM)
    entries = [e for e in cf.offered(mods, {})[0] if e[0] == "cudnn"]
    rep = cf.check_offer(entries)
    assert len(entries) > 20 and not rep.errors, rep.errors


def test_cudasim_offers_nothing_the_real_packages_lack(real):
    mods = cf.standins(SIM)
    stands_for = {getattr(mods[m], name): place for (m, name), place in STANDS_FOR.items()}
    entries, unplaced = cf.offered(mods, stands_for)
    unplaced = [c for c in unplaced if c not in MACHINERY]
    assert not unplaced, f"cudasim classes at no real place: {unplaced}; add them to STANDS_FOR"
    rep = cf.check_offer(installed(entries, lambda e: e[0]))
    assert not unknown_errors(rep), "\n".join(unknown_errors(rep))
    tell("cudasim's offer", rep)


# Parameters cudasim's stand-ins take and never read, each with why that loses nothing the
# backend relies on; any other unread parameter is a real call's meaning dropped (test below)
UNREAD = {
    "cupy_backends.cuda.libs.cublas.setStream": (["handle"], "one handle; only its refusal "
                                                 "of a capturing stream is modelled"),
    "cupy.array": (["copy"], "always a copy: the backend asks for one"),
    "cupy.from_dlpack": (["copy"], "a view, as the backend asks (copy=False)"),
    "nvshmem.core.init": (["device", "uid", "rank", "nranks"], "MPI-based init only: the "
                          "communicator gives rank and size, cupy.cuda.Device the device"),
    "nvshmem.core.buffer": (["release", "except_on_del"], "freed explicitly (free), as the "
                            "transport does"),
    "nvshmem.core.array": (["release", "morder", "except_on_del"], "C order, freed explicitly"),
    "cupy.cuda.memory.OutOfMemoryError.__init__": (["limit"], "CuPy's message names it only "
                                                   "when a pool limit is set; none is"),
    "cupy.cuda.nccl.NcclCommunicator.__init__": (["config"], "NCCL's tuning: no meaning on "
                                                 "the CPU"),
    "cuda.core.Buffer.from_handle": (["mr"], "no memory resource frees it: its owner keeps it"),
}


def test_cudasim_reads_every_parameter_it_takes(real):
    """A parameter a stand-in takes and never reads is a meaning of the real call it drops
    (cudasim's NCCL ran every call on the current stream, not the stream passed)."""
    mods = cf.standins(SIM)
    stands_for = {getattr(mods[m], name): place for (m, name), place in STANDS_FOR.items()}
    entries, _ = cf.offered(mods, stands_for)
    assert cf.unread(entries) == {k: params for k, (params, _) in UNREAD.items()}


def test_the_offer_check_reports_what_cudasim_must_not_offer(real):
    fake = types.ModuleType("cupy")
    fake.__file__ = __file__
    fake.cuda = types.SimpleNamespace(Stream=None, Strem=None,
                                      get_elapsed_time=lambda start, end: 0.0)
    entries, _ = cf.offered({"cupy": fake}, {})
    errors = "\n".join(cf.check_offer(entries).errors)
    assert "cupy.cuda.Strem: the real package lacks it" in errors
    assert "cupy.cuda.get_elapsed_time: parameter 0 is 'start'" in errors
    assert "cuda.Stream:" not in errors


# One mistake each, made in the real source (wherever it now lives): (what to change, into
# what, a word its report must contain)
MISTAKES = {
    "misspelt attribute": (r"\bmatmul_algo_get_heuristic\b", "matmul_algo_get_heuristc",
                           "matmul_algo_get_heuristc"),
    "wrong keyword, cuBLASLt": (r"rows, cols, ld\)", "rows, cols, ldd=ld)", "'ld'"),
    "wrong keyword": (r"(put_signal\([^)]*)\bremote_pe=", r"\1peer=", "'peer'"),
    "extra positional": (r"(\.signal_op\()", r"\g<1>0, ", "multiple values"),
    "extra positional via *args": (r"\bargs = \(self\.ready\(\), ",
                                   "args = (self.ready(), 0, ", "too many positional"),
    "extra positional, method of an untyped receiver": (r"(\.allReduce\()", r"\g<1>0, ",
                                                        "allReduce"),
    "wrong keyword, method of an array parameter": (r"\.get\(stream=", ".get(strm=", "'strm'"),
}


@pytest.mark.parametrize("mistake", MISTAKES)
def test_a_mistake_in_the_source_is_reported(real, mistake):
    pattern, replacement, said = MISTAKES[mistake]
    texts = sources()
    where = [w for w, t in texts.items() if re.search(pattern, t)]
    assert len(where) == 1, f"{pattern!r} is in {where}, not in exactly one module"
    before = set(report({where[0]: texts[where[0]]}).errors)
    wrong = re.sub(pattern, replacement, texts[where[0]], count=1)
    new = [e for e in report({where[0]: wrong}).errors if e not in before]
    assert any(said in e for e in new), f"{mistake} in {where[0]} not reported: {new}"
