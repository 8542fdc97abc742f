"""llm.c's AdamW over a flat buffer, by chunks of ADAM_CHUNK elements (elementwise: chunks
change no bit), its temporaries in kept scratch arrays."""
from __future__ import annotations

import numpy as np

from ...precision import step_seed, stochastic_round, wide
from .mixed import op

ADAM_CHUNK = 1 << 20  # 4 MiB of fp32: two scratches this size instead of the model's size


def _grad_scale(norm_sq, clip, dtype):
    """The gradient's factor: clip / norm when the global norm is above clip (> 0), in
    dtype's wide type as the CUDA kernel computes it (norm_sq: float64); None for 1."""
    norm = wide(dtype).type(np.sqrt(norm_sq[0]))
    return norm.dtype.type(clip) / norm if clip and norm > clip else None


class Adamw:
    @op(mixed=False)
    def adamw(self, params, grads, m, v, sched: tuple, beta1: float, beta2: float, eps: float,
              weight_decay: float, norm_sq, clip: float, master=None, salt: int = 0,
              offset: int = 0) -> None:
        """llm.c's AdamW over a whole flat buffer: bias-corrected moments, decoupled decay;
        sched = (lr, 1 - beta1^t, 1 - beta2^t, t); the gradient clipped at global norm clip
        (norm_sq (1,): the norm squared; clip 0: never). With master (a bf16 run's fp32
        master weights of params) the update is made there and params[i] becomes it
        stochastically rounded with the noise of element offset + i and this step's seed
        (salt: the stage's)."""
        scale = _grad_scale(norm_sq, clip, params.dtype)
        seed = None if master is None else step_seed(int(sched[3]), salt)
        for a in range(0, params.size, ADAM_CHUNK):  # elementwise: chunks change no bit
            b = a + ADAM_CHUNK
            w = params[a:b] if master is None else master[a:b]
            self._adamw(w, grads[a:b], m[a:b], v[a:b], sched, beta1, beta2, eps, weight_decay,
                        scale)
            if master is not None:
                params[a:b] = stochastic_round(w, seed, offset + a)

    def _adamw(self, params, grads, m, v, sched, beta1, beta2, eps, weight_decay, scale):
        lr, bc1, bc2 = sched[:3]
        t = self._ws("adam_t", params.shape, params.dtype)
        u = self._ws("adam_u", params.shape, params.dtype)
        if scale is not None or grads.dtype != params.dtype:  # (bf16 gradients: widened)
            g = self._ws("adam_g", params.shape, params.dtype)
            g[...] = grads
            grads = g if scale is None else np.multiply(g, scale, out=g)
        m *= beta1
        np.multiply(grads, 1.0 - beta1, out=t)
        m += t
        v *= beta2
        np.multiply(grads, 1.0 - beta2, out=t)
        t *= grads
        v += t
        np.divide(v, bc2, out=t)
        np.sqrt(t, out=t)
        t += eps
        np.divide(m, bc1, out=u)
        u /= t                         # mhat / (sqrt(vhat) + eps)
        np.multiply(params, weight_decay, out=t)
        u += t
        u *= lr
        params -= u
