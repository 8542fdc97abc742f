"""The elementwise ops: GELU (tanh approximation, as GPT-2) and the residual add, GELU's
temporaries in kept scratch arrays."""
from __future__ import annotations

import math

import numpy as np

from .mixed import op

GELU_SCALE = math.sqrt(2.0 / math.pi)


class Elementwise:
    @op("out")
    def gelu_forward(self, out, inp) -> None:
        """0.5 x (1 + tanh(s (x + 0.044715 x^3))), s = sqrt(2/pi). x^3 is x*x*x: NumPy's
        float32 power is ~250x slower than two multiplies."""
        t = self._gelu_tanh(inp)
        t += 1.0
        np.multiply(inp, 0.5, out=out)
        out *= t

    def _gelu_tanh(self, inp):
        """tanh(s (x + 0.044715 x^3)) in the scratch "gelu_t"."""
        t = self._ws("gelu_t", inp.shape, inp.dtype)
        np.multiply(inp, inp, out=t)
        t *= inp
        t *= 0.044715
        t += inp
        t *= GELU_SCALE
        return np.tanh(t, out=t)

    @op("out")
    def residual_forward(self, out, a, b) -> None:
        """out = a + b."""
        np.add(a, b, out=out)

    @op("dinp")
    def gelu_backward(self, dinp, inp, dout) -> None:
        """dinp = dout * d/dx gelu(x), with th = tanh(s (x + 0.044715 x^3)):
        0.5 (1 + th) + 0.5 x (1 - th^2) s (1 + 3 * 0.044715 x^2); in place in two
        scratches."""
        t, a = self._gelu_tanh(inp), self._ws("gelu_a", inp.shape, inp.dtype)
        np.add(t, 1.0, out=a)
        a *= 0.5                       # 0.5 (1 + th)
        t *= t
        np.subtract(1.0, t, out=t)     # 1 - th^2
        np.multiply(inp, 0.5, out=dinp)
        dinp *= t
        dinp *= GELU_SCALE
        np.multiply(inp, 3 * 0.044715, out=t)
        t *= inp
        t += 1.0
        dinp *= t
        dinp += a
        dinp *= dout
