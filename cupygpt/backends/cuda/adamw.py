"""AdamW (kernels_cu/adamw.cu): one launch over a stage's flat buffer, 16 bytes of
parameters per thread, its schedule read from the device so a captured step replays it."""
from __future__ import annotations

import cupy as cp
import numpy as np

from .profile import op


class Adamw:
    def adamw_schedule(self, sched: tuple) -> None:
        """Uploads sched = (lr, 1 - beta1^t, 1 - beta2^t, t) to the device, where the adamw
        kernel reads it: a captured step reads the new values on each replay (t, the
        rounding seed's, is exact in float up to 2^24 steps)."""
        self.upload(self._ws("sched", 4), np.array(sched, np.float32))

    @op
    def adamw(self, params, grads, m, v, sched: tuple, beta1: float, beta2: float, eps: float,
              weight_decay: float, norm_sq, clip: float, master=None, salt: int = 0,
              offset: int = 0) -> None:
        if not cp.cuda.get_current_stream().is_capturing():
            self.adamw_schedule(sched)
        self.kernels.ew("adamw", params.size, params, params if master is None else master,
                        grads, m, v, np.int64(params.size), np.int64(offset),
                        self._ws("sched", 4), np.float32(beta1), np.float32(beta2),
                        np.float32(eps), np.float32(weight_decay), norm_sq, np.float32(clip),
                        np.uint32(salt), per_thread=16 // params.dtype.itemsize)
