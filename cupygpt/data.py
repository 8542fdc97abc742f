"""llm.c's sequential data loader over a glob of token shards: B*T+1 tokens per batch."""
import glob as globlib

import numpy as np

from . import CupyGPTError
from .files import read_shard


class DataLoader:
    def __init__(self, pattern, B, T, V, option="train_pattern"):
        self.files = sorted(globlib.glob(pattern))
        if not self.files:
            raise CupyGPTError("no token shard matches this pattern; run `prepare` or fix "
                               "the path", option, pattern)
        self.B, self.T = B, T
        self.shards = []
        for path in self.files:
            tokens = read_shard(path)
            if tokens.size < B * T + 1:
                raise CupyGPTError(f"{path}: shard holds {tokens.size} tokens, fewer than "
                                   f"B*T+1 = {B * T + 1}; lower the batch size or sequence length")
            if tokens.size and int(tokens.max()) >= V:
                raise CupyGPTError(f"{path}: token {int(tokens.max())} is outside the "
                                   f"model's vocab (V={V}); was it tokenized for this model?")
            self.shards.append(tokens)
        self.reset()

    def reset(self):
        self.shard, self.pos = 0, 0

    def state(self):
        return [self.shard, self.pos]

    def set_state(self, state):
        self.shard, self.pos = int(state[0]), int(state[1])

    def next_batch(self):
        """(x, y) int32 (B, T); advances like llm.c, moving to the next shard when one runs out."""
        n = self.B * self.T
        buf = np.asarray(self.shards[self.shard][self.pos: self.pos + n + 1], dtype=np.int32)
        self.pos += n
        if self.pos + n + 1 > self.shards[self.shard].size:
            self.shard, self.pos = (self.shard + 1) % len(self.shards), 0
        return buf[:-1].reshape(self.B, self.T), buf[1:].reshape(self.B, self.T)
