"""Text generation through the runner (so it also works across pipeline stages)."""
import numpy as np

from .. import CupyGPTError


def next_token(logits, rng, temperature=1.0, top_k=None):
    """Samples from logits (V,) on the host; temperature 0 is greedy."""
    z = np.array(logits, dtype=np.float64)  # a copy: top-k edits it
    if not np.isfinite(z).all():
        raise CupyGPTError("the model's logits are not finite (weights that, though finite, "
                           "overflow float32 in its forward): it cannot be sampled from")
    if temperature == 0:
        return int(z.argmax())
    if top_k:
        z[z < np.partition(z, -top_k)[-top_k]] = -np.inf
    # shifted first: a tiny temperature then scales to -inf (probability 0), never to inf
    p = np.exp((z - z.max()) / temperature)
    return int(rng.choice(z.size, p=p / p.sum()))


def generate(run, prompt, n, fill, rng, temperature=1.0, top_k=None, on_token=None,
             kv_cache=True, stop=None):
    """Appends up to n tokens to prompt (ids), limited by the runner's T. Every rank returns
    the same ids; on_token(id) is called on each rank as tokens arrive. With kv_cache one
    pass over the prompt, then one position per token (Runner.next_token); without, a
    whole pass per token (the reference the cache is tested against). stop (collective,
    asked before each token) ends it early."""
    T = run.plan.seq
    if not prompt:
        raise CupyGPTError("the prompt is empty: generation needs at least one token")
    if len(prompt) >= T:
        raise CupyGPTError(f"the prompt encodes to {len(prompt)} tokens, leaving no room in "
                           f"the model's context of {T}; shorten it")
    # every row holds the text, so each replica's row 0 (the one decoded) is the same
    tokens = np.full((run.plan.batch, T), fill, np.int32)
    tokens[:, :len(prompt)] = prompt
    out = list(prompt)

    def choose(logits):
        return next_token(logits, rng, temperature, top_k)
    for t in range(len(prompt), min(len(prompt) + n, T)):
        if stop and stop():
            break
        tok = run.next_token(tokens, t - 1, choose, cached=kv_cache and t > len(prompt))
        tokens[:, t] = tok
        out.append(tok)
        if on_token:
            on_token(tok)
    return out
