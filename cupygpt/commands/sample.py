"""The `sample` command: text generated from an llm.c model file after a prompt
(train/sample.py generates; this reads the files, checks the prompt and decodes)."""
import numpy as np

from .. import CupyGPTError
from ..formats.llmc import check_finite, read_model
from ..formats.tokenizer import Tokenizer
from ..train.sample import generate


def sample_text(sess, on_start=None, on_token=None):
    """The `sample` command over a Session holding its validated SampleConfig: calls
    on_start(tokens it will generate), then on_token(text) as each token arrives, on
    every rank; returns the generated text."""
    o = sess.config
    shape, params = read_model(o.model, mmap=True)
    check_finite(o.model, params)
    tok = Tokenizer(o.tokenizer)
    tok.check_vocab(shape.V)
    prompt = [tok.eot] + tok.encode(o.prompt)
    if len(prompt) >= shape.maxT:
        raise CupyGPTError(f"encodes to {len(prompt)} tokens (with the start token), the "
                           f"model's context is {shape.maxT}; shorten it", "prompt",
                           repr(o.prompt[:20] + "..." if len(o.prompt) > 20 else o.prompt))
    T = min(shape.maxT, len(prompt) + max(o.max_new_tokens, 1))
    run = sess.runner(shape, params, sess.step_settings(batch=1, seq=T))
    if on_start:
        on_start(min(o.max_new_tokens, T - len(prompt)))
    ids = generate(run, prompt, o.max_new_tokens, tok.eot, np.random.default_rng(o.seed),
                   o.temperature, o.top_k, on_token and (lambda t: on_token(tok.decode([t]))),
                   o.kv_cache)
    return tok.decode(ids[len(prompt):])
