"""Causal self-attention by blocks of ATT_ROWS queries, as flash attention goes (no (T, T)
tensor is kept; a block's scores against the keys it sees are the only temporary): forward
keeps each row's log-sum-exp, backward makes the probabilities again from it."""
from __future__ import annotations

import math

import numpy as np
from numpy.typing import DTypeLike

from .mixed import op

ATT_ROWS = 128


def _heads(x, B, T, NH):
    """(B, T, NH*HS) -> the (B, NH, T, HS) view."""
    return x.reshape(B, T, NH, -1).transpose(0, 2, 1, 3)


def _qkv(qkv, NH):
    B, T, C3 = qkv.shape
    return (_heads(qkv.reshape(B, T, 3, C3 // 3)[:, :, i], B, T, NH) for i in range(3))


def _scores(q, k, t0, t1, scale):
    """The scaled scores of queries [t0, t1) over keys [0, t1) (B, NH, t1 - t0, t1);
    causal: -inf after the query's own position."""
    s = q[:, :, t0:t1] @ k[:, :, :t1].transpose(0, 1, 3, 2)
    s *= scale
    s[..., np.triu(np.ones((t1 - t0, t1), bool), t0 + 1)] = -np.inf
    return s


def _probs(q, k, lse, t0, t1, scale):
    """Backward's probabilities of those queries made again: exp(score - lse)."""
    s = _scores(q, k, t0, t1, scale)
    s -= lse[:, :, t0:t1, None]
    return np.exp(s, out=s)


class Attention:
    def attention_refuses(self, head_size: int, dtype: DTypeLike | None = None) -> str | None:
        """Why this backend cannot run attention heads of head_size (in dtype), or None: it
        runs any."""
        return None

    def fused_attention_refuses(self, dtype: DTypeLike, head_size: int) -> str | None:
        """Why a fused library attention cannot run here: the CPU has none (cuDNN is a
        GPU's)."""
        return "the numpy backend has no cuDNN (a GPU library): it runs with --backend cuda"

    def use_attention(self, kind: str, backward: bool = True, replay: bool = False) -> None:
        """Which attention the model's attention ops take: this backend's own, the only one
        (backward, replay: what the run asks of it; the own ops need nothing prepared)."""
        if kind != "own":
            raise ValueError(f"attention {kind!r}: the numpy backend runs its own only")

    @op("out", "lse")
    def attention_forward(self, out, lse, qkv, NH: int) -> None:
        """Causal self-attention. qkv (B,T,3C), its bias in -> out (B,T,C); lse (B,NH,T)
        float: each query row's log of its sum of exp(scores), all backward keeps."""
        B, T, C3 = qkv.shape
        q, k, v = _qkv(qkv, NH)
        scale = 1.0 / math.sqrt(q.shape[-1])
        y = _heads(out, B, T, NH)
        for t0 in range(0, T, ATT_ROWS):
            t1 = min(T, t0 + ATT_ROWS)
            s = _scores(q, k, t0, t1, scale)
            m = s.max(-1, keepdims=True)
            p = np.exp(s - m, out=s)
            total = p.sum(-1, keepdims=True)
            lse[:, :, t0:t1] = (m + np.log(total))[..., 0]
            p /= total
            self._stored(p)  # the next matmul's input
            y[:, :, t0:t1] = p @ v[:, :, :t1]

    @op("out")
    def attention_decode(self, out, qkv, NH: int) -> None:
        """Generation's step: the attention of the last of n positions over all n. qkv
        (1,n,3C) holds every earlier position's q, k, v (the KV cache) and the new one's;
        out (1,1,C)."""
        _, n, C3 = qkv.shape
        HS = C3 // 3 // NH
        x = qkv.reshape(n, 3, NH, HS)
        q, k, v = x[-1, 0][:, None, :], x[:, 1].transpose(1, 2, 0), x[:, 2].transpose(1, 0, 2)
        s = (q @ k) * (1.0 / math.sqrt(HS))       # (NH, 1, n)
        p = np.exp(s - s.max(-1, keepdims=True))
        p /= p.sum(-1, keepdims=True)
        self._stored(p)                           # the next matmul's input
        out.reshape(NH, HS)[...] = (p @ v)[:, 0]  # (NH, 1, HS)

    @op("dqkv")
    def attention_backward(self, dqkv, dout, qkv, out, lse, NH: int) -> None:
        """dqkv (B,T,3C) from dout (B,T,C), with forward's out and lse: each block's
        probabilities made again, D = rowsum(dout * out) in place of the sum over keys."""
        B, T, C3 = qkv.shape
        q, k, v = _qkv(qkv, NH)
        dq, dk, dv = _qkv(dqkv, NH)
        scale = 1.0 / math.sqrt(q.shape[-1])
        do = _heads(dout, B, T, NH)
        D = (do * _heads(out, B, T, NH)).sum(-1)
        dk[...], dv[...] = 0, 0
        for t0 in range(0, T, ATT_ROWS):
            t1 = min(T, t0 + ATT_ROWS)
            p = _probs(q, k, lse, t0, t1, scale)
            ds = do[:, :, t0:t1] @ v[:, :, :t1].transpose(0, 1, 3, 2)
            ds -= D[:, :, t0:t1, None]
            ds *= p
            ds *= scale
            self._stored(ds)  # the next matmuls' input, as p is dv's
            self._stored(p)
            dv[:, :, :t1] += p.transpose(0, 1, 3, 2) @ do[:, :, t0:t1]
            dq[:, :, t0:t1] = ds @ k[:, :, :t1]
            dk[:, :, :t1] += ds.transpose(0, 1, 3, 2) @ q[:, :, t0:t1]
