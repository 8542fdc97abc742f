"""Tensor parallelism, Megatron's split of GPT-2 across a group of ranks: which tensors each
shard holds (sharding.py) and the group's collectives the model runs (comm.py: the sums of
the row-parallel outputs and column-parallel input gradients, the vocab-parallel
cross-entropy). It sits below the model: the flat buffers are sized per shard, so the
layouts ask these rules for a shard's shapes."""
