"""The backend interface as code: Backend, what every backend offers, GraphBackend, what a
backend that captures a step as a CUDA graph adds, and StageShape, the sizes a stage's ops
run at. tests/unit/backends/test_backend_contract.py holds each backend to them, signature
by signature.

Conventions every backend keeps (the model relies on them):
- arrays are the backend's own (numpy.ndarray / cupy.ndarray), C-contiguous views into
  the flat buffers; shapes are written next to each op;
- forward ops overwrite their outputs; a bias is added by the matmul that makes the
  product (matmul_forward's bias, rounded once with it), never by the op that reads it;
- backward ops overwrite the input gradient of a matmul, GELU, attention, and accumulate
  (+=) into every parameter gradient and into layernorm's and the encoder's input
  gradients, so the residual stream's gradient and micro-batch gradients add up.

Nothing outside backends asks which backend runs; it asks a capability instead.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
from numpy.typing import DTypeLike

Array = Any  # the backend's own array: numpy.ndarray or cupy.ndarray


@dataclass(frozen=True)
class StageShape:
    """What one pipeline stage's ops run at, which a backend sizes its kept workspaces by
    (model.layout.stage_shape makes it): micro-batches of batch x seq; the model's width C
    and heads NH, split over tp shards; whether the stage holds transformer blocks and the
    embedding; the elements of one chunk of the head's logits (0: no head)."""
    batch: int
    seq: int
    C: int
    NH: int
    tp: int = 1
    blocks: bool = True
    embed: bool = True
    logits: int = 0


class Backend(Protocol):
    """One backend, made once per process (backends.get_backend): its capabilities, its
    memory, and the ops the model calls."""

    name: str               # for messages only
    DTYPES: tuple           # the float types it computes in (precision.py)
    DEFAULT_DTYPE: str      # the name of the one a run takes when --dtype is not given
    TRANSPORTS: tuple       # the transports its arrays can travel by, preferred first
    DEFAULT_RUN: tuple      # (-e, -t) when the user gives none
    supports_graphs: bool   # a step can be captured and replayed (GraphBackend)
    asynchronous: bool      # calls return before the device is done (host launch time counts)
    memory_name: str        # where it allocates, in words

    # --- capabilities ----------------------------------------------------------------

    def configure(self, tf32: bool = False, device_of: Callable | None = None,
                  ranks_here: int = 1) -> None:
        """Before any work: TF32 matmuls or not, the device device_of(visible devices)
        picks, ranks_here ranks sharing this host."""

    def device_memory(self) -> int | None:
        """Free bytes where it allocates (the GPU's, or the host's)."""

    def memory_domain(self) -> Hashable:
        """Ranks with equal answers share one memory (memory_name)."""

    def workspace_bytes(self, stage: StageShape, dtype: DTypeLike) -> int:
        """The most its kept workspaces reach for such a stage in dtype."""

    def memory_in_use(self) -> int:
        """Bytes it holds now."""

    def numerics(self) -> str:
        """verify's tolerance row in fp32."""

    def peak_flops(self, dtype: str = "fp32") -> float | None:
        """A run dtype's dense peak FLOP/s; None: no MFU."""

    def device_info(self) -> dict:
        """The run table's rows about the device."""

    def device_name(self) -> str:
        """The run table's name of this rank's device."""

    def kernel_profile(self, step: Callable, steps: int) -> tuple[list, list] | None:
        """Per-op and per-kernel time of `steps` calls of step(); None: none."""

    def attention_refuses(self, head_size: int, dtype: DTypeLike | None = None) -> str | None:
        """Why it cannot run such attention heads (in dtype, when given), or None."""

    def fused_attention_refuses(self, dtype: DTypeLike, head_size: int) -> str | None:
        """Why a library's fused attention (cuDNN's) cannot run such a run here, or None."""

    def use_attention(self, kind: str, backward: bool = True, replay: bool = False) -> None:
        """Which attention the attention ops take from now on ("cudnn" or "own";
        --attention resolves it) and what the run asks of it (a backward, a captured step
        replayed): the memory plan prepares that much, and raises
        FusedAttentionUnsupported where the library will not run it."""

    def fallbacks(self) -> list:
        """What it ran a slower way than planned, and why: one line each."""

    # --- memory ----------------------------------------------------------------------

    def zeros(self, n: int, dtype: DTypeLike = np.float32) -> Array:
        """A new zeroed array of n elements."""

    def to_host(self, a: Array) -> np.ndarray:
        """A host copy of a, once the work before it is done."""

    def upload(self, dst: Array, host: np.ndarray) -> None:
        """Copies host into the existing array dst (in dst's dtype)."""

    def synchronize(self) -> None:
        """Returns once the work queued so far is done."""

    def bound_host_waits(self, wait: Callable) -> None:
        """Every host wait goes through wait(stream) from now on (a transport's bound)."""

    def all_finite(self, a: Array) -> bool:
        """Whether every element of a is finite."""

    def stamp(self) -> Any:
        """A mark of this moment in the work's order (--trace)."""

    def stamp_seconds(self, marks: list) -> list[float]:
        """Host-clock seconds of marks."""

    # --- forward ---------------------------------------------------------------------

    def encoder_forward(self, out: Array, inp: Array, wte: Array, wpe: Array | None,
                        v0: int = 0) -> None:
        """out (B,T,C) = wte[inp - v0] (zeros for tokens wte's shard lacks) + wpe[:T]."""

    def layernorm_forward(self, out: Array, mean: Array, rstd: Array, inp: Array, w: Array,
                          b: Array) -> None:
        """out (B,T,C); mean, rstd (B,T) kept for backward."""

    def matmul_forward(self, out: Array, inp: Array, w: Array, bias: Array | None = None
                       ) -> None:
        """out (B,T,OC) = inp (B,T,C) @ w (OC,C)^T (+ bias (OC)), rounded once."""

    def attention_forward(self, out: Array, lse: Array, qkv: Array, NH: int) -> None:
        """Causal attention of qkv (B,T,3C) -> out (B,T,C); lse (B,NH,T) float."""

    def attention_decode(self, out: Array, qkv: Array, NH: int) -> None:
        """The last of n positions' attention over all n: qkv (1,n,3C) -> out (1,1,C)."""

    def gelu_forward(self, out: Array, inp: Array) -> None:
        """out = GELU(inp), tanh approximation."""

    def residual_forward(self, out: Array, a: Array, b: Array) -> None:
        """out = a + b."""

    def residual_layernorm_forward(self, res: Array, a: Array, b: Array, out: Array,
                                   mean: Array, rstd: Array, w: Array, lnb: Array) -> None:
        """res = a + b, then out, mean, rstd: the layernorm of res as stored."""

    def classifier_stats(self, stats: Array, logits: Array, targets: Array, v0: int,
                         valid: int) -> None:
        """stats (B,T,3): this vocab shard's max, sum of exp and target logit."""

    def classifier(self, logits: Array, losses: Array, stats: Array, targets: Array, v0: int,
                   valid: int, dloss: float | None = None) -> None:
        """losses (B,T) from every shard's stats (tp,B,T,3); with dloss, dlogits in place."""

    def cross_entropy(self, logits: Array, losses: Array, targets: Array, valid: int,
                      dloss: float | None = None) -> None:
        """classifier_stats and classifier for a head holding the whole vocab."""

    def loss_accumulate(self, acc: Array, losses: Array) -> None:
        """acc (1,) float64 += sum of losses."""

    # --- backward --------------------------------------------------------------------

    def encoder_backward(self, dwte: Array, dwpe: Array, dout: Array, inp: Array,
                         v0: int = 0) -> None:
        """dwte[inp - v0] += dout (tokens the shard holds); dwpe[:T] += dout summed over B."""

    def layernorm_backward(self, dinp: Array, dw: Array, db: Array, dout: Array, inp: Array,
                           w: Array, mean: Array, rstd: Array) -> None:
        """dinp, dw, db += layernorm's gradients."""

    def matmul_backward_input(self, dinp: Array, dout: Array, w: Array) -> None:
        """dinp (B,T,C) = dout (B,T,OC) @ w (OC,C)."""

    def matmul_backward_weight(self, dw: Array, db: Array | None, dout: Array, inp: Array
                               ) -> None:
        """dw (OC,C) += dout^T @ inp; db (OC) += dout's column sums."""

    def attention_backward(self, dqkv: Array, dout: Array, qkv: Array, out: Array, lse: Array,
                           NH: int) -> None:
        """dqkv (B,T,3C) from dout (B,T,C), with forward's out and lse."""

    def gelu_backward(self, dinp: Array, inp: Array, dout: Array) -> None:
        """dinp = dout * GELU'(inp)."""

    # --- optimizer -------------------------------------------------------------------

    def sum_squares(self, acc: Array, x: Array, offset: int = 0) -> None:
        """acc (1,) float64 += the sum of x's squares (x[0]: element offset of its buffer),
        float within each 16-byte group of that buffer, float64 across them."""

    def adamw(self, params: Array, grads: Array, m: Array, v: Array, sched: tuple,
              beta1: float, beta2: float, eps: float, weight_decay: float, norm_sq: Array,
              clip: float, master: Array | None = None, salt: int = 0, offset: int = 0
              ) -> None:
        """llm.c's AdamW over a flat buffer, clipped at global norm clip; sched = (lr,
        1 - beta1^t, 1 - beta2^t, t); with master, bf16 params stochastically rounded."""


class GraphBackend(Backend, Protocol):
    """A backend whose supports_graphs is True: a step captured once and replayed."""

    def capture(self, fn: Callable) -> Any:
        """Records fn's work as a graph (nothing runs yet)."""

    def replay(self, graph: Any) -> None:
        """Runs a captured graph."""

    def adamw_schedule(self, sched: tuple) -> None:
        """Uploads adamw's sched where a replayed step reads it."""
