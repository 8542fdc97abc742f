"""Comments and docs name only what is there: every `name.py` or `folder/name.py` and every
`cupygpt.dotted.module` written in the package, the developer tools, the tests or the
Markdown pages is a file of the repository."""
import os
import re

from harness import ROOT

SKIP_DIRS = {".git", "__pycache__", ".pytest_cache", ".ruff_cache", "build", "out", "gpu_report",
             ".whl"}
# files a text may name that are not the repository's own: llm.c's and other projects'
FOREIGN = {"train_gpt2.py", "train_gpt2.cu", "train_gpt2.c", "train_gpt2_fp32.cu",
           "setup.py", "conftest.py", "hellaswag.py", "fineweb.py", "tinyshakespeare.py",
           "modeling_gpt2.py", "__main__.py", "prepro_tinyshakespeare.py", "data_common.py",
           "nvshmem_types.py", "rma.py",
           "m.py"}  # (a made-up module a test of the backends' state parses)
FILE = re.compile(r"(?<![\w./-])((?:[\w.-]+/)*[A-Za-z_]\w*\.py)\b")
MODULE = re.compile(r"\bcupygpt(?:\.[a-z]\w*)+")  # (not cupygpt.__file__)
# names that are no module of the tree on purpose: one the wheel's test checks is gone, the
# name harness.py gives the CUDA backend's copy it loads on cudasim
ABSENT = {"cupygpt.commands.gpucheck", "cupygpt.backends.cuda_on_cudasim"}


def texts():
    for d, dirs, files in os.walk(ROOT):
        dirs[:] = [x for x in dirs if x not in SKIP_DIRS and not x.endswith(".egg-info")]
        for f in files:
            if f.endswith((".py", ".md", ".cfg", ".cu", ".cuh", ".txt")) and \
                    "cupygpt/data" not in os.path.join(d, f) and f != "test_references.py":
                path = os.path.join(d, f)
                yield os.path.relpath(path, ROOT), open(path, encoding="utf-8").read()


def repository_files():
    out = set()
    for d, dirs, files in os.walk(ROOT):
        dirs[:] = [x for x in dirs if x not in SKIP_DIRS]
        out.update(os.path.relpath(os.path.join(d, f), ROOT) for f in files)
    return out


def exists(ref, here, files):
    """ref names a repository file: by its path from the root, from the package, from the
    naming file's folder, or as the tail of one file's path."""
    ref = ref.lstrip("./")
    candidates = (ref, os.path.join("cupygpt", ref), os.path.normpath(os.path.join(here, ref)))
    return any(c in files for c in candidates) or any(f.endswith("/" + ref) for f in files)


def module_exists(dotted, files):
    """dotted is a module of the package, or a name defined in one (cupygpt.paths.claim)."""
    parts = dotted.split(".")
    for n in range(len(parts), 0, -1):
        path = "/".join(parts[:n])
        found = next((f for f in (f"{path}.py", f"{path}/__init__.py") if f in files), None)
        if found or n == 1:
            rest = parts[n:]
            return not rest or (len(rest) == 1 and found is not None and re.search(
                rf"\b{rest[0]}\b", open(os.path.join(ROOT, found)).read()) is not None)
    return False


def test_every_named_file_and_module_exists():
    files, missing = repository_files(), []
    for rel, text in texts():
        here = os.path.dirname(rel)
        for m in FILE.finditer(text):
            if os.path.basename(m.group(1)) not in FOREIGN and not exists(m.group(1), here, files):
                missing.append(f"{rel}: {m.group(1)}")
        for m in MODULE.finditer(text):
            if m.group(0) not in ABSENT and not module_exists(m.group(0), files):
                missing.append(f"{rel}: {m.group(0)}")
    assert not missing, "\n".join(sorted(set(missing)))


def test_the_check_finds_a_missing_module():
    files = repository_files()
    assert exists("model/stage.py", "cupygpt", files) and exists("stage.py", "x", files)
    assert not exists("gpucheck_parts.py", "cupygpt", files)
    assert module_exists("cupygpt.paths.claim", files)
    assert not module_exists("cupygpt.commands.gpucheck.check", files)
    assert not module_exists("cupygpt.commands.gpucheck", files)
    assert not module_exists("cupygpt.paths.no_such_name", files)
