"""The step plan: how the model's layers are cut into chunks (balanced by counted cost).
"""
from ... import CupyGPTError


def costs(cfg, T):
    """(a block's, the head's) forward FLOPs per token, the counted cost a split balances
    (backward is about twice forward everywhere, so it balances alike): a block's matmuls
    24 C^2 and its attention 4 T C; the head's logits 2 C Vp and its softmax (~4 per logit).
    The embedding is a lookup: nothing."""
    return 24 * cfg.C ** 2 + 4 * T * cfg.C, 2 * cfg.C * cfg.Vp + 4 * cfg.Vp


def stage_shares(cfg, T, counts):
    """Each stage's share of the step's counted cost (the last one carries the head)."""
    block, head = costs(cfg, T)
    c = [n * block + (head if i == len(counts) - 1 else 0) for i, n in enumerate(counts)]
    return [x / sum(c) for x in c]


def plan_split(cfg, T, p, split=None, ranks=None):
    """Layer counts per stage: `split` ("6,6"), or balanced by counted cost: the last stage
    carries the LM head (on GPT-2's vocab as much as several blocks), so it takes fewer
    blocks; the others share the rest evenly, earlier ones taking the remainder."""
    L = cfg.L
    if p > L:
        raise CupyGPTError(f"{p} pipeline stages but the model has {L} layers; use at most "
                           f"{L} ranks")
    if split:
        try:
            counts = [int(s) for s in split.split(",")]
        except ValueError:
            raise CupyGPTError("not a comma-separated list of layer counts, e.g. 6,6",
                               "split", split) from None
        if len(counts) != p:
            n = len(counts)
            raise CupyGPTError(
                f"{n} stages but {p} ranks; give one layer count per rank"
                if ranks in (None, p) else f"{n} counts but {p} model chunks ({ranks} ranks "
                f"x {p // ranks}); give one layer count per chunk", "split", split)
        if sum(counts) != L or min(counts) < 1:
            raise CupyGPTError(f"counts must be positive and sum to the model's {L} layers",
                               "split", split)
        return counts
    if p == 1:
        return [L]

    def even(n, k):
        return [n // k + (1 if r < n % k else 0) for r in range(k)]
    best = min(range(1, L - p + 2),
               key=lambda n: (max(stage_shares(cfg, T, even(L - n, p - 1) + [n])), -n))
    return even(L - best, p - 1) + [best]
