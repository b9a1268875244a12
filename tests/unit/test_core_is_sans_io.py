"""The sans-IO core (docs/DESIGN.md, "Architecture") must not import trio,
zmq or torch, directly or through another module (each core module runs in a
fresh interpreter and we look), and must not touch files: its source is read
with ``ast`` for file I/O calls and imports; file I/O belongs in
``prism/shell/runfolder.py``."""

import ast
import pathlib
import subprocess
import sys

import pytest

CORE = pathlib.Path(__file__).resolve().parents[2] / "prism" / "core"
SOURCES = sorted(CORE.rglob("*.py"))


def _module(path: pathlib.Path) -> str:
    parts = path.relative_to(CORE.parent.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = sorted(_module(p) for p in SOURCES if _module(p) != "prism.core")

#: Modules whose only use is files or directories.
FILE_MODULES = {"shutil", "tempfile", "glob"}
#: ``os`` functions that touch the file system.
OS_FILE_CALLS = {
    "makedirs", "mkdir", "remove", "unlink", "rmdir", "removedirs", "rename", "renames", "replace",
    "listdir", "scandir", "walk", "stat", "open", "fdopen", "truncate",
}
#: pathlib methods that touch the file system (a pure path's methods do not).
#: Matched by name on any object, so names that plain strings also have
#: (``replace``) stay out.
PATH_METHODS = {
    "write_text", "write_bytes", "read_text", "read_bytes", "mkdir", "touch", "unlink", "rename",
    "iterdir", "glob", "rglob", "exists", "is_file", "is_dir", "open", "stat",
}


def file_io(source: str, module: str) -> list[str]:
    """Every file I/O call and file-module import in ``source``, one message
    each, in line order."""
    out: list[tuple[int, str]] = []
    tree = ast.parse(source)
    # Names bound to os, io, shutil... by `import os` / `import os as o`.
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                top = a.name.split(".")[0]
                aliases[a.asname or top] = top
                if top in FILE_MODULES:
                    out.append((node.lineno, f"imports {a.name}"))
        elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
            top = node.module.split(".")[0]
            if top in FILE_MODULES:
                out.append((node.lineno, f"imports from {node.module}"))
            for a in node.names:
                if (top == "os" and a.name in OS_FILE_CALLS) or (top == "io" and a.name == "open"):
                    out.append((node.lineno, f"imports {node.module}.{a.name}"))
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        fn = node.func
        if isinstance(fn, ast.Name) and fn.id == "open":
            out.append((node.lineno, "calls open()"))
        elif isinstance(fn, ast.Attribute):
            owner = fn.value.id if isinstance(fn.value, ast.Name) else None
            top = aliases.get(owner) if owner else None
            if top == "os" and fn.attr in OS_FILE_CALLS:
                out.append((node.lineno, f"calls os.{fn.attr}()"))
            elif top == "io" and fn.attr == "open":
                out.append((node.lineno, "calls io.open()"))
            elif top in FILE_MODULES:
                out.append((node.lineno, f"calls {top}.{fn.attr}()"))
            elif top is None and fn.attr in PATH_METHODS:
                out.append((node.lineno, f"calls .{fn.attr}() (a pathlib file operation)"))
    return [f"{module}:{line}: {what}" for line, what in sorted(out)]


def test_core_has_modules():
    assert {"prism.core.trace", "prism.core.trace.codec", "prism.core.codec"} <= set(MODULES)


@pytest.mark.parametrize("module", MODULES)
def test_core_module_imports_no_io_layer(module):
    code = (
        "import sys, importlib\n"
        f"importlib.import_module({module!r})\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in ('trio', 'zmq', 'torch'))\n"
        "print(','.join(bad))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True,
        cwd=CORE.parent.parent,
    ).stdout.strip()
    assert out == "", f"{module} pulls in I/O layers: {out}"


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(CORE.parent.parent)))
def test_core_module_does_no_file_io(path):
    found = file_io(path.read_text(), str(path.relative_to(CORE.parent.parent)))
    assert not found, (
        "the sans-IO core touches files:\n  " + "\n  ".join(found)
        + "\nmove the file I/O to prism/shell/runfolder.py and pass the bytes (or text) in"
    )


PLANTED = """\
import os
import shutil
from pathlib import Path

def save(run, data):
    os.makedirs(run, exist_ok=True)
    with open(Path(run) / "x", "wb") as f:
        f.write(data)
    (Path(run) / "y").write_text("hi")
    return sorted(Path(run).iterdir())
"""


def test_the_checker_catches_planted_file_io():
    assert file_io(PLANTED, "prism/core/planted.py") == [
        "prism/core/planted.py:2: imports shutil",
        "prism/core/planted.py:6: calls os.makedirs()",
        "prism/core/planted.py:7: calls open()",
        "prism/core/planted.py:9: calls .write_text() (a pathlib file operation)",
        "prism/core/planted.py:10: calls .iterdir() (a pathlib file operation)",
    ]


def test_the_checker_leaves_pure_code_alone():
    assert file_io("import math\nx = math.prod((2, 3))\nname = 'a.b'.split('.')\n", "m") == []
