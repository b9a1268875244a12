"""The sans-IO core must not import trio, zmq or torch, directly or through
another module: run each core module in a fresh interpreter and look."""

import pathlib
import subprocess
import sys

import pytest

CORE = pathlib.Path(__file__).resolve().parents[2] / "prism" / "core"
MODULES = sorted(
    "prism.core." + p.stem for p in CORE.glob("*.py") if p.stem != "__init__"
)


def test_core_has_modules():
    assert "prism.core.trace" in MODULES


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
