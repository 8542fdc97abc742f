"""The backends are one interface (backends/__init__.py): each public function of one is
the other's too, with the same signature, and both hold every capability the contract
names. The CUDA backend is read through cudasim's CuPy (loading it compiles nothing), so
this runs without a GPU."""
import inspect

import numpy as np
import pytest

from harness import load_cudasim
from cupygpt.backends import numpy_backend
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
    return {"numpy": numpy_backend, "cuda": load_cudasim()[1]}


def public_functions(mod):
    """{name: function} defined in mod (not imported into it) and not _private."""
    return {n: f for n, f in vars(mod).items()
            if not n.startswith("_") and inspect.isfunction(f) and f.__module__ == mod.__name__}


def test_each_has_the_others_public_functions(backends):
    fns = {b: set(public_functions(mod)) for b, mod in backends.items()}
    for b, mod in backends.items():
        graph_fns = GRAPH_ONLY & fns[b]
        assert graph_fns == (GRAPH_ONLY if mod.supports_graphs else set()), b
        assert CAPABILITY_FUNCTIONS <= fns[b], (b, CAPABILITY_FUNCTIONS - fns[b])
    only = fns["numpy"] ^ fns["cuda"]
    assert only <= GRAPH_ONLY, f"in one backend only: {sorted(only - GRAPH_ONLY)}"


def test_shared_functions_have_the_same_signatures(backends):
    a, b = (public_functions(backends[k]) for k in ("numpy", "cuda"))
    differ = {n: (str(inspect.signature(a[n])), str(inspect.signature(b[n])))
              for n in sorted(a.keys() & b.keys())
              if inspect.signature(a[n]) != inspect.signature(b[n])}
    assert not differ, "\n".join(f"{n}: numpy{s} cuda{t}" for n, (s, t) in differ.items())


def test_ops_take_keywords_as_their_signatures_say(backends):
    """The profiling wrapper around each op passes keywords on (its signature is the op's)."""
    be = backends["numpy"]
    out, inp = np.zeros((1, 2, 3), np.float32), np.ones((1, 2, 3), np.float32)
    be.residual_forward(out=out, a=inp, b=inp)
    assert (out == 2).all()


def test_each_holds_the_contracts_capabilities(backends):
    for b, mod in backends.items():
        for cap, kind in CAPABILITIES.items():
            assert isinstance(getattr(mod, cap, None), kind), (b, cap)
        assert mod.name == b
        assert mod.DTYPES and all(np.dtype(d) in DTYPES.values() for d in mod.DTYPES), b
        assert DTYPES[mod.DEFAULT_DTYPE] in mod.DTYPES, b
        assert mod.TRANSPORTS and len(mod.DEFAULT_RUN) == 2, b
