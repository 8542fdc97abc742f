"""The elementwise ops (kernels_cu/elementwise.cu): GELU and the residual add, 16 bytes of
the output per thread (matmul.py launches the same file's bias kernels)."""
from __future__ import annotations

from .profile import op


class Elementwise:
    @op
    def gelu_forward(self, out, inp) -> None:
        self.kernels.packed("gelu_forward", out, inp)

    @op
    def residual_forward(self, out, a, b) -> None:
        self.kernels.packed("residual_forward", out, a, b)

    @op
    def gelu_backward(self, dinp, inp, dout) -> None:
        self.kernels.packed("gelu_backward", dinp, inp, dout)
