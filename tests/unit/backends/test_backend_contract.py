"""The backends are one interface, written as code in backends/protocol.py: each backend has
every capability and method of protocol.Backend (and GraphBackend's where it captures
graphs) and no other public method, each with the protocol's signature (names, kinds,
defaults, and its annotations where the backend writes one); the two backends' shared
methods have the same signatures. The CUDA backend is read through cudasim's CuPy (loading
it compiles nothing), so this runs without a GPU."""
import inspect
import typing

import numpy as np
import pytest
from harness import load_cudasim

from cupygpt.backends import get_backend
from cupygpt.backends.numpy.backend import NumpyBackend
from cupygpt.backends.protocol import Backend, GraphBackend
from cupygpt.precision import DTYPES

# The one allowed difference: the contract ties these to supports_graphs (capturing a step
# and replaying it), so a backend without graphs has none of them.
GRAPH_ONLY = {"capture", "replay", "adamw_schedule"}
# The capabilities the contract names, and the type each is
CAPABILITIES = {"name": str, "DTYPES": tuple, "TRANSPORTS": tuple, "DEFAULT_RUN": tuple,
                "DEFAULT_DTYPE": str,
                "supports_graphs": bool, "asynchronous": bool, "memory_name": str}
CAPABILITY_FUNCTIONS = {"configure", "device_memory", "memory_domain", "memory_in_use",
                        "numerics", "peak_flops", "device_info", "device_name", "kernel_profile",
                        "workspace_bytes", "fallbacks", "fused_attention_refuses",
                        "use_attention"}


@pytest.fixture(scope="module")
def backends():
    return {"numpy": NumpyBackend(), "cuda": load_cudasim()[1]}


def declared(protocol):
    """{name: function} the protocol declares, its bases' included."""
    return {n: f for n, f in inspect.getmembers(protocol, inspect.isfunction)
            if not n.startswith("_")}


def public_methods(be):
    """{name: bound method} of be's class (its bases' included), not _private."""
    return {n: getattr(be, n) for n, _ in inspect.getmembers(type(be), inspect.isfunction)
            if not n.startswith("_")}


def owed(be):
    """The protocol a backend owes: GraphBackend where it captures graphs, else Backend."""
    return GraphBackend if be.supports_graphs else Backend


def differences(want, got):
    """How signature got (a bound method's) departs from the protocol's want (self
    dropped): parameter names, kinds and defaults must be the protocol's, and an annotation
    the backend writes must be the protocol's (both are source text: __future__
    annotations)."""
    want = want.replace(parameters=list(want.parameters.values())[1:])
    out = []
    if [(p.name, p.kind, p.default) for p in want.parameters.values()] != \
            [(p.name, p.kind, p.default) for p in got.parameters.values()]:
        out.append(f"parameters {want} != {got}")
    for p in got.parameters.values():
        if p.annotation is not p.empty and p.name in want.parameters and \
                p.annotation != want.parameters[p.name].annotation:
            out.append(f"{p.name}: {p.annotation} != {want.parameters[p.name].annotation}")
    if got.return_annotation is not got.empty and got.return_annotation != want.return_annotation:
        out.append(f"returns {got.return_annotation} != {want.return_annotation}")
    return out


def test_each_has_the_protocols_methods_and_no_other(backends):
    for b, be in backends.items():
        have, want = set(public_methods(be)), set(declared(owed(be)))
        assert have == want, (b, sorted(want - have), sorted(have - want))
        assert (GRAPH_ONLY <= have) == be.supports_graphs and (GRAPH_ONLY & have) in (
            set(), GRAPH_ONLY), b
        assert CAPABILITY_FUNCTIONS <= have, (b, CAPABILITY_FUNCTIONS - have)
    assert set(declared(GraphBackend)) - set(declared(Backend)) == GRAPH_ONLY


def test_each_methods_signature_is_the_protocols(backends):
    for b, be in backends.items():
        want = declared(owed(be))
        bad = {n: differences(inspect.signature(want[n]), inspect.signature(m))
               for n, m in public_methods(be).items()}
        bad = {n: d for n, d in bad.items() if d}
        assert not bad, "\n".join(f"{b}.{n}: {'; '.join(d)}" for n, d in bad.items())


def test_shared_methods_have_the_same_signatures(backends):
    a, b = (public_methods(backends[k]) for k in ("numpy", "cuda"))
    differ = {n: (str(inspect.signature(a[n])), str(inspect.signature(b[n])))
              for n in sorted(a.keys() & b.keys())
              if inspect.signature(a[n]) != inspect.signature(b[n])}
    assert not differ, "\n".join(f"{n}: numpy{s} cuda{t}" for n, (s, t) in differ.items())


def test_the_signature_check_finds_a_departure():
    """A backend whose op renamed a parameter, dropped a default or annotated a capability
    otherwise is reported (a runtime_checkable isinstance would check the names only)."""
    class Renamed(NumpyBackend):
        def gelu_forward(self, out, x) -> None: ...

        def sum_squares(self, acc, x, offset: int) -> None: ...

        def numerics(self) -> int: ...
    be, want = Renamed(), declared(Backend)
    for n in ("gelu_forward", "sum_squares", "numerics"):
        assert differences(inspect.signature(want[n]), inspect.signature(getattr(be, n))), n
    assert not differences(inspect.signature(want["gelu_backward"]),
                           inspect.signature(be.gelu_backward))


def test_ops_take_keywords_as_their_signatures_say(backends):
    """The profiling wrapper around each op passes keywords on (its signature is the op's)."""
    be = backends["numpy"]
    out, inp = np.zeros((1, 2, 3), np.float32), np.ones((1, 2, 3), np.float32)
    be.residual_forward(out=out, a=inp, b=inp)
    assert (out == 2).all()


def test_each_holds_the_contracts_capabilities(backends):
    assert typing.get_type_hints(Backend) == CAPABILITIES  # (the protocol names them all)
    for b, be in backends.items():
        for cap, kind in CAPABILITIES.items():
            assert isinstance(getattr(be, cap, None), kind), (b, cap)
        assert be.name == b
        assert be.DTYPES and all(np.dtype(d) in DTYPES.values() for d in be.DTYPES), b
        assert DTYPES[be.DEFAULT_DTYPE] in be.DTYPES, b
        assert be.TRANSPORTS and len(be.DEFAULT_RUN) == 2, b


def test_get_backend_makes_a_backend_of_its_own_each_call():
    """A backend is an object, its state its own: two sessions' backends share nothing."""
    (a, note), (b, _) = get_backend("numpy"), get_backend("numpy")
    assert isinstance(a, NumpyBackend) and a is not b and a.scratch is not b.scratch
    assert note == "backend numpy: as asked"
