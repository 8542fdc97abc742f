"""Data parallelism: replicas of the same stages on other batch rows. grad_sync.py sums
their gradients after (or overlapped with) the last backward, with GPT-2's tied wte;
zero.py shards AdamW's state across them (ZeRO-1, llm.c's -z 1)."""
