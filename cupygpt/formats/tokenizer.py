"""llm.c's tokenizer file (magic 20240328, versions 1 and 2): decode, and encode offline.

GPT-2's BPE ranks equal its token ids, so the file's byte strings are exactly tiktoken's
mergeable ranks; with GPT-2's split pattern tiktoken encodes without downloading anything.
"""
import numpy as np

from .. import CupyGPTError
from .llmc import TOKENIZER_MAGIC, read_header

GPT2_EOT = 50256
GPT2_SPLIT = (r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+""")


class Tokenizer:
    def __init__(self, path):
        header, f = read_header(path, TOKENIZER_MAGIC, "tokenizer")
        version, n = int(header[1]), int(header[2])
        if version not in (1, 2):
            f.close()
            raise CupyGPTError(f"{path}: tokenizer version {version} is not supported (1, 2)")
        self.eot = int(header[3]) if version == 2 else GPT2_EOT
        body = f.read()
        f.close()
        self.tokens, pos = [], 0
        for i in range(n):
            if pos >= len(body) or pos + 1 + body[pos] > len(body):
                raise CupyGPTError(f"{path}: truncated tokenizer file (token {i} of {n})")
            length = body[pos]
            self.tokens.append(body[pos + 1: pos + 1 + length])
            pos += 1 + length
        if not 0 <= self.eot < n:  # (its row would be read past the embedding, or as zeros)
            raise CupyGPTError(f"{path}: its end-of-text id {self.eot} is outside its {n} "
                               f"tokens; the file is damaged or not llm.c's")
        self.path, self._encoding = path, None

    @property
    def vocab_size(self):
        return len(self.tokens)

    def decode(self, ids):
        return b"".join(self.tokens[int(i)] for i in ids).decode("utf-8", errors="replace")

    def byte_level(self):
        """Refuses a vocabulary that is not a byte-level BPE's as GPT-2's (distinct tokens,
        every single byte among them): tiktoken panics on one (a Rust backtrace), and
        transformers' vocab.json would hold only its distinct tokens. Returns the ranks."""
        ranks = {t: i for i, t in enumerate(self.tokens) if i != self.eot}
        missing = 256 - len({bytes([b]) for b in range(256)} & ranks.keys())
        if len(ranks) < len(self.tokens) - 1 or missing:
            raise CupyGPTError(f"{self.path}: not a byte-level BPE vocabulary as GPT-2's ("
                               + (f"{len(self.tokens) - 1 - len(ranks)} of its tokens repeat "
                                  f"others" if len(ranks) < len(self.tokens) - 1 else
                                  f"{missing} of the 256 single bytes are not tokens") +
                               "); it cannot encode text: give GPT-2's tokenizer file")
        return ranks

    def encode(self, text):
        """Ordinary BPE encoding (special tokens are not parsed)."""
        if self._encoding is None:
            import tiktoken
            self._encoding = tiktoken.Encoding(
                "gpt2-from-file", pat_str=GPT2_SPLIT, mergeable_ranks=self.byte_level(),
                special_tokens={"<|endoftext|>": self.eot})
        return self._encoding.encode_ordinary(text)

    def check_vocab(self, V):
        if self.vocab_size != V:
            raise CupyGPTError(f"{self.path}: tokenizer has {self.vocab_size} tokens but the "
                               f"model's vocab is {V}; use the model's own tokenizer")


def tokenize_tinyshakespeare(text, tok, val_tokens=32768, progress=None):
    """llm.c's preparation: EOT before each "\\n\\n"-separated section; first val_tokens are val."""
    sections = text.split("\n\n")
    out = []
    for i, s in enumerate(sections):
        out.append(tok.eot)
        out.extend(tok.encode(s + "\n\n" if i != len(sections) - 1 else s))
        if progress:
            progress(1)
    out = np.array(out, dtype=np.uint16)
    if out.size <= val_tokens:
        raise CupyGPTError(f"the text is {out.size:,} tokens, all of them the val shard's "
                           f"(its first {val_tokens:,}): nothing is left to train on; give a "
                           f"longer text")
    return out[val_tokens:], out[:val_tokens]
