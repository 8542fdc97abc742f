"""Files you can hold in your head: no function over 60 lines, no module over 320 unless
its docstring says why it is one module."""
import ast
import os

import cupygpt

PKG = os.path.dirname(cupygpt.__file__)
FUNCTION_LINES, MODULE_LINES = 60, 320
# modules allowed to be longer, each with the words in its docstring that say why
ONE_MODULE = {"train/loop.py": "One module, the training loop told as one story",
              "model/stage.py": "One module, a stage's forward and backward read in one place",
              "paths.py": "One module, the root layer's checks on files",
              "parallel/runner.py": "One module, the facade"}


def sources():
    for d, _, files in os.walk(PKG):
        for f in sorted(files):
            if f.endswith(".py"):
                path = os.path.join(d, f)
                yield os.path.relpath(path, PKG), open(path).read()


def test_no_function_is_over_sixty_lines():
    long = [f"{rel}:{n.lineno} {n.name} ({n.end_lineno - n.lineno + 1} lines)"
            for rel, src in sources() for n in ast.walk(ast.parse(src))
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
            and n.end_lineno - n.lineno + 1 > FUNCTION_LINES]
    assert not long, long


def test_long_modules_say_why():
    for rel, src in sources():
        if src.count("\n") > MODULE_LINES:
            assert ONE_MODULE.get(rel, "\0") in (ast.get_docstring(ast.parse(src)) or ""), \
                f"{rel}: {src.count(chr(10))} lines and no reason in its docstring"
