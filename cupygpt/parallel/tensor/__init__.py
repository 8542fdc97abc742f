"""Tensor parallelism, Megatron's split of GPT-2 across a group of ranks: which tensors each
shard holds (sharding.py) and the group's collectives the model runs (comm.py: the sums of
the row-parallel outputs and column-parallel input gradients, the vocab-parallel
cross-entropy). The model is written for one shard and never imports this: the plan gives
each Part its TensorShard and the runner each Stage its TensorGroup."""
