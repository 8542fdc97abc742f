"""`convert`: a transformers GPT-2 directory to an llm.c model file, and an llm.c model file
to a directory transformers' from_pretrained loads. Offline: everything comes from the
source and the shipped tokenizer.

Both sides are checked (source headers, destination writable and free) before a
parameter is read; the file is written through atomic_write, the directory under
DST.partial and renamed when complete.
"""
import json
import os
import shutil

from safetensors.numpy import save_file

from .. import CupyGPTError
from ..formats import hf
from ..formats.hf_tokenizer import write_tokenizer
from ..formats.llmc import read_model, write_model
from ..formats.model_spec import misnamed, model_shape
from ..formats.tokenizer import Tokenizer
from ..paths import UMASK, check_outputs, claim_file, disk_full, files_of, full


def convert(src, dst, bf16=False, tokenizer=None, force=False):
    """src -> dst in the other format; returns the lines to print (what was written). An
    existing llm.c file is replaced only with force."""
    to_llmc = os.path.isdir(src)
    if not to_llmc:  # (a trailing / or a quoted ~ would be "no such file" below)
        misnamed(src)
    if not to_llmc and not os.path.exists(src):
        raise CupyGPTError(f"{src}: no such file or directory (an llm.c .bin file or a "
                           f"transformers GPT-2 directory)")
    shape = model_shape(src)
    check_outputs([("dst", dst)], files_of(src))
    if to_llmc:
        if os.path.isdir(dst):
            raise CupyGPTError(f"{dst}: a directory; from a transformers directory convert "
                               f"writes an llm.c model file: name the file")
        writable_parent(dst)
        claim_file("dst", dst)
        if os.path.lexists(dst) and not force:
            raise CupyGPTError(f"{dst}: already exists; add --overwrite to replace it, or name "
                               f"another file")
        write_model(dst, shape, read_model(src)[1], bf16)
        return [f"wrote {dst}: llm.c model, {'bf16' if bf16 else 'fp32'}, {described(shape)}"]
    if bf16:
        raise CupyGPTError("is for the llm.c file written from a transformers directory; "
                           "model.safetensors is written in fp32", "dtype", "bf16")
    if os.path.splitext(dst)[1] in (".bin", ".safetensors"):
        raise CupyGPTError(f"{dst}: names a file, and from an llm.c file convert writes a "
                           f"transformers directory (config.json, model.safetensors); name a "
                           f"directory (an llm.c file is written from a directory SRC)")
    tok = Tokenizer(tokenizer) if tokenizer else None
    if tok:
        tok.byte_level()  # (vocab.json would hold only its distinct tokens)
    writable_parent(dst)
    claim_file("dst", dst)
    free_directory(dst)  # (claimed: no other convert makes it meanwhile)
    return write_hf(dst, shape, read_model(src, mmap=True)[1], tok)


def described(shape):
    return f"L={shape.L} NH={shape.NH} C={shape.C} maxT={shape.maxT} V={shape.V}"


def free_directory(dst):
    """dst can be made as a new directory: it does not exist and its parent is writable."""
    last = os.path.basename(dst.rstrip(os.sep))
    if last in (".", ".."):  # (hfout/. made hfout, then failed to write into it)
        raise CupyGPTError(f"{dst}: names no new directory (its last part is {last!r}); "
                           f"give the new directory's own name")
    if os.path.lexists(dst):
        raise CupyGPTError(f"{dst}: already exists; convert writes a new directory (never "
                           f"into one: --overwrite replaces only an llm.c file): remove it or "
                           f"name another")
    writable_parent(dst)


def writable_parent(dst):
    """dst's parent directory exists (made) and is writable."""
    parent = os.path.dirname(os.path.abspath(dst))
    if os.path.exists(parent) and not os.path.isdir(parent):
        raise CupyGPTError(f"{dst}: its parent {parent} is a file, not a directory")
    try:
        os.makedirs(parent, exist_ok=True)
    except OSError as e:
        raise CupyGPTError(f"{dst}: cannot create its parent directory ({e.strerror})") from None
    if not os.access(parent, os.W_OK):
        raise CupyGPTError(f"{dst}: its parent directory {parent} is not writable")


def write_hf(dst, shape, params, tok):
    """config.json, generation_config.json, model.safetensors and, when tok's vocab is the
    model's, tokenizer files; written under dst.partial, renamed to dst when complete (its
    name cut so that the suffix keeps a legal name legal)."""
    head, name = os.path.split(dst.rstrip(os.sep))
    partial = os.path.join(head, name[:200] + ".partial")
    shutil.rmtree(partial, ignore_errors=True)  # a crashed conversion's leftovers
    written = [hf.CONFIG, "generation_config.json", hf.WEIGHTS]
    try:
        os.makedirs(partial)
        config = hf.hf_config(shape)
        for name, body in ((hf.CONFIG, config), (written[1], {
                k: config[k] for k in ("bos_token_id", "eos_token_id") if k in config})):
            with open(os.path.join(partial, name), "w") as f:
                json.dump(body, f, indent=2)
        save_file(hf.hf_tensors(shape, params), os.path.join(partial, hf.WEIGHTS),
                  metadata={"format": "pt"})  # (made 0600 by the library: the umask's mode)
        os.chmod(os.path.join(partial, hf.WEIGHTS), 0o666 & ~UMASK)
        if tok and tok.vocab_size == shape.V:
            written += write_tokenizer(partial, tok, shape.maxT)
        os.rename(partial, dst)
    except BaseException as e:
        shutil.rmtree(partial, ignore_errors=True)
        if full(e):  # (as the other direction's atomic_write says it)
            raise disk_full(dst, e) from None
        if isinstance(e, OSError):
            raise CupyGPTError(f"{dst}: writing failed ({e.strerror or e}); nothing was "
                               f"left") from None
        raise
    lines = [f"wrote {dst}: {', '.join(written)} ({described(shape)})"]
    if tok and tok.vocab_size != shape.V:
        lines.append(f"note: no tokenizer files: {tok.path} has {tok.vocab_size} tokens, the "
                     f"model {shape.V}; add the model's own tokenizer files to {dst}")
    return lines
