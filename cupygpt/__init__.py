"""cupygpt: llm.c's GPT-2 trainer driven from Python, NumPy or CUDA, pipeline-parallel."""


class CupyGPTError(Exception):
    """A user-facing error: the CLI prints it as one line and exits non-zero.

    `option` names the run-config field at fault (config/) and `value` what it was
    given; the CLI puts the matching flag in front, so the library never names flags."""

    def __init__(self, message, option=None, value=None):
        super().__init__(message)
        self.option, self.value = option, value

    def __str__(self):
        msg = super().__str__()
        return msg if self.option is None else f"{self.option} {self.value}: {msg}"
