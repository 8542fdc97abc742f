"""What a model argument names (train -e, sample, eval, verify, convert): a model file, a
transformers directory or a preset; and the spellings whose reader's own words would
mislead (a file with a trailing /, a quoted ~, one file of a transformers directory, a
JSON file), refused with what they are instead."""
import os

from .. import CupyGPTError
from ..model.shape import preset
from ..paths import regular
from . import hf
from .llmc import is_model_file, read_model_header


def misnamed(spec):
    """Refuses the spellings whose reader's words mislead: a file named with a trailing /
    ("no such model", though it exists), a ~ the shell left unexpanded (quoted), and a
    file of a transformers directory or a JSON file ("truncated model file")."""
    if spec.endswith(os.sep) and os.path.isfile(spec.rstrip(os.sep)):
        raise CupyGPTError(f"{spec}: {spec.rstrip(os.sep)} is a file, and the trailing / "
                           f"names a directory; give the file without it")
    if spec.startswith("~") and not os.path.lexists(spec):
        raise CupyGPTError(f"{spec}: no such model; the shell leaves a ~ unexpanded when "
                           f"quoted or after --flag= (and cupygpt does not expand it): write "
                           f"{os.path.expanduser(spec)} or put the ~ first in a word of its own")
    if os.path.basename(spec) in (hf.CONFIG, hf.WEIGHTS, hf.TORCH_WEIGHTS):
        raise CupyGPTError(f"{spec}: one file of a transformers directory; give the directory, "
                           f"{os.path.dirname(spec) or '.'}")
    if not os.path.isfile(spec):  # (a FIFO would block the read below)
        return  # (the reader below says why)
    try:
        with open(spec, "rb") as f:
            head = f.read(1).strip()
    except OSError:
        return
    if head in (b"{", b"["):
        raise CupyGPTError(f"{spec}: a JSON file (a log, or a config?), not an llm.c model; "
                           f"give a model file (train writes OUT/model.bin) or a transformers "
                           f"GPT-2 directory")


def model_shape(spec, option=None):
    """The shape an -e names: a model file's header, a transformers directory's
    config.json, or a preset. option: the field of a command that reads a model (sample,
    eval, verify), which takes no preset: a missing one is named as a missing model."""
    if option is None and not is_model_file(spec):
        return preset(spec)
    if os.path.isdir(spec):
        return hf.model_shape(spec)
    misnamed(spec)
    if not os.path.lexists(spec):  # (train's -e said "cannot open model file")
        raise CupyGPTError("no such model: give an llm.c model file (train writes "
                           "OUT/model.bin) or a transformers GPT-2 directory", option or "init",
                           spec)
    regular(spec, "model")  # (a FIFO was "not a model file and not a descriptor")
    return read_model_header(spec)[0]
