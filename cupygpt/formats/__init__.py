"""The files cupygpt reads and writes: llm.c's (model, debug state, shards, tokenizer,
HellaSwag eval, checkpoints) and transformers' GPT-2 directory."""
