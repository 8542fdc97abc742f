"""Text generation through the runner (so it also works across pipeline stages)."""
import numpy as np

from . import CupyGPTError
from .files import read_model
from .tokenizer import Tokenizer


def next_token(logits, rng, temperature=1.0, top_k=None):
    """Samples from logits (V,) on the host; temperature 0 is greedy."""
    z = np.array(logits, dtype=np.float64)  # a copy: top-k edits it
    if temperature == 0:
        return int(z.argmax())
    if top_k:
        z[z < np.partition(z, -top_k)[-top_k]] = -np.inf
    # shifted first: a tiny temperature then scales to -inf (probability 0), never to inf
    p = np.exp((z - z.max()) / temperature)
    return int(rng.choice(z.size, p=p / p.sum()))


def generate(run, prompt, n, fill, rng, temperature=1.0, top_k=None, on_token=None,
             kv_cache=True):
    """Appends up to n tokens to prompt (ids), limited by the runner's T. Every rank returns
    the same ids; on_token(id) is called on each rank as tokens arrive. With kv_cache one
    pass over the prompt, then one position per token (Runner.decode); without, a whole
    pass per token (the reference the cache is tested against)."""
    T, tr, head = run.T, run.tr, run.head
    if not prompt:
        raise CupyGPTError("the prompt is empty: generation needs at least one token")
    if len(prompt) >= T:
        raise CupyGPTError(f"the prompt encodes to {len(prompt)} tokens, leaving no room in "
                           f"the model's context of {T}; shorten it")
    tokens = np.full((run.Bm * run.M, T), fill, np.int32)
    tokens[0, :len(prompt)] = prompt
    out, row = list(prompt), {}

    def at(t):  # on_logits keeping position t's logits of row 0 (this shard's tokens)
        def grab(mb, logits):
            if mb == 0:
                row["logits"] = run.be.to_host(logits[0, t, :head.valid])
        return grab

    def pick():  # the next token, on every rank
        if run.mesh.tp == 1:
            tok = next_token(row["logits"], rng, temperature, top_k) if run.last else None
            return tr.bcast(tok, root=run.loss_rank)
        # tensor parallel: each shard of the head holds its slice of the vocabulary, so
        # the whole row is put together on rank 0 (replicas send the same slices)
        slices = tr.gather((head.v0, row["logits"]) if run.last else None)
        tok = None
        if slices is not None:
            whole = dict(s for s in slices if s)
            tok = next_token(np.concatenate([whole[v0] for v0 in sorted(whole)]), rng,
                             temperature, top_k)
        return tr.bcast(tok, root=0)
    for t in range(len(prompt), min(len(prompt) + n, T)):
        if kv_cache and t > len(prompt):
            run.decode(tokens, t - 1, at(t - 1))
        else:
            run.forward_first(tokens, at(t - 1))
        tok = pick()
        tokens[0, t] = tok
        out.append(tok)
        if on_token:
            on_token(tok)
    return out


def sample_text(sess, on_start=None, on_token=None):
    """The `sample` command over a Session holding its validated SampleConfig: calls
    on_start(tokens it will generate), then on_token(text) as each token arrives, on
    every rank; returns the generated text."""
    o = sess.config
    cfg, params = read_model(o.model, mmap=True)
    tok = Tokenizer(o.tokenizer)
    tok.check_vocab(cfg.V)
    prompt = [tok.eot] + tok.encode(o.prompt)
    if len(prompt) >= cfg.maxT:
        raise CupyGPTError(f"encodes to {len(prompt)} tokens (with the start token), the "
                           f"model's context is {cfg.maxT}; shorten it", "prompt",
                           repr(o.prompt[:20] + "..." if len(o.prompt) > 20 else o.prompt))
    T = min(cfg.maxT, len(prompt) + max(o.max_new_tokens, 1))
    run = sess.runner(cfg, params, 1, T)
    if on_start:
        on_start(min(o.max_new_tokens, T - len(prompt)))
    ids = generate(run, prompt, o.max_new_tokens, tok.eot, np.random.default_rng(o.seed),
                   o.temperature, o.top_k, on_token and (lambda t: on_token(tok.decode([t]))),
                   o.kv_cache)
    return tok.decode(ids[len(prompt):])
