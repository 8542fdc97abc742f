"""cupygpt: llm.c's GPT-2 trainer driven from Python, NumPy or CUDA, pipeline-parallel."""

class CupyGPTError(Exception):
    """A user-facing error: the CLI prints its message as one line and exits non-zero."""
