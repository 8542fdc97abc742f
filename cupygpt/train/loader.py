"""llm.c's data loader over a glob of token shards (each batch read with pread and its
length checked: only the batch is held in memory, and a shard that shrinks under a run is
named, never a SIGBUS as from a memory map). A sample is one step's batch, B*T+1 tokens
starting at a multiple of B*T; a shard of n tokens holds (n - 1) // (B*T) of them. Every
rank reads the whole batch and its replica computes its own rows of it (the executor's
split), so each row of an epoch goes to exactly one replica and every grid sees the
one-rank run's data.

Shuffled (llm.c's training default), each epoch visits the shards in a seeded random order
and each shard's samples in a seeded random order; sequential, both are the identity.
The permutations follow from (seed, epoch, shard), so the state is four numbers and a
resume continues the exact order."""

import numpy as np

from .. import CupyGPTError
from ..formats.llmc import Shard, shard_files, shard_order


def sample_order(n, seed, epoch, shard, shuffle):
    """The order in which an epoch visits shard's n samples (shard: its index in the glob)."""
    return (np.random.default_rng([seed, epoch, 1 + shard]).permutation(n) if shuffle
            else np.arange(n))


class DataLoader:
    def __init__(self, pattern, B, T, V, option="train_pattern", shuffle=False, seed=0):
        self.files = shard_files(pattern, option)
        self.B, self.T, self.V, self.shuffle, self.seed = B, T, V, shuffle, seed
        self.shards = []
        for path in self.files:
            tokens = Shard(path)
            if tokens.size < B * T + 1:
                raise CupyGPTError(f"{path}: shard holds {tokens.size} tokens, fewer than "
                                   f"B*T+1 = {B * T + 1}; lower the batch size or sequence length")
            self.shards.append(tokens)
        self.reset()
        self._tokens(int(self.order[0]), int(self.samples[0]) * B * T)  # before any allocation

    @property
    def batches(self):
        """The distinct batches an epoch visits."""
        return sum((t.size - 1) // (self.B * self.T) for t in self.shards)

    def _tokens(self, f, at):
        """Shard f's B*T+1 tokens from token `at`, int32, checked against the vocab batch by
        batch: a FineWeb-sized set is never read whole before its first step."""
        buf = self.shards[f].read(at, self.B * self.T + 1).astype(np.int32)
        if int(buf.max()) >= self.V:
            raise CupyGPTError(f"{self.files[f]}: token {int(buf.max())} (in tokens {at}.."
                               f"{at + buf.size - 1}) is outside the model's vocab "
                               f"(V={self.V}); was it tokenized for this model?")
        return buf

    def reset(self):
        self.epoch, self.shard, self.sample = 0, 0, 0
        self._orders()

    def _orders(self):
        self.order = shard_order(len(self.files), self.seed, self.epoch, self.shuffle)
        self._enter()

    def _enter(self):
        """The samples of the shard the epoch is at, in this epoch's order."""
        f = int(self.order[self.shard])
        n = (self.shards[f].size - 1) // (self.B * self.T)
        self.samples = sample_order(n, self.seed, self.epoch, f, self.shuffle)

    def state(self):
        """[shard, pos, epoch, seed, shuffle]: the next sample is at token pos (B*T times
        its index in the shard's order) of the epoch's shard-th shard."""
        return [self.shard, self.sample * self.B * self.T, self.epoch, self.seed,
                self.shuffle]

    def set_state(self, state):
        """A checkpoint's state (llm.c-style [shard, pos] from before shuffling: sequential,
        epoch 0); its seed and order rule replace this loader's."""
        shard, pos, *rest = state
        self.epoch, self.seed, self.shuffle = ((int(rest[0]), int(rest[1]), bool(rest[2]))
                                               if rest else (0, self.seed, False))
        self.shard, self.sample = int(shard), int(pos) // (self.B * self.T)
        self._orders()

    def next_batch(self):
        """(x, y) int32 (B, T); moves to the next shard when one runs out, and to the next
        epoch (new orders) after the last."""
        buf = self._tokens(int(self.order[self.shard]),
                           int(self.samples[self.sample]) * self.B * self.T)
        self.sample += 1
        if self.sample == len(self.samples):
            self.shard, self.sample = self.shard + 1, 0
            if self.shard == len(self.files):
                self.epoch, self.shard = self.epoch + 1, 0
                self._orders()
            else:
                self._enter()
        return buf[:-1].reshape(self.B, self.T), buf[1:].reshape(self.B, self.T)
