"""The package's layers import one way (docs/DESIGN.md, "Architecture"):
core imports only core; the rank side and the shells never import the
library API or the CLI; nothing but the entry point imports a CLI module.
Read from the source with ``ast`` (no import runs)."""

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _module(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: pathlib.Path) -> set[str]:
    """Absolute names of every module ``path`` imports (at any depth, lazily or not)."""
    return _imports_of(path.read_text(), _module(path), path.name == "__init__.py")


def _imports_of(text: str, module: str, is_package: bool) -> set[str]:
    tree = ast.parse(text)
    here = module.split(".")
    if not is_package:
        here = here[:-1]
    out: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(here[: len(here) - node.level + 1] + ([base] if base else []))
            out.add(base)
            # `from prism import cli` imports the module prism.cli
            out.update(f"{base}.{a.name}" for a in node.names)
    return out


def _sources(*tops: str) -> list[pathlib.Path]:
    return sorted(p for top in tops for p in (ROOT / top).rglob("*.py") if ".venv" not in p.parts)


def _is_cli(name: str) -> bool:
    return name == "prism.cli" or name.startswith("prism.cli.")


#: package prefix -> prism packages it may import (besides itself); None: anything but the CLI.
RULES = {
    "prism.core": ("prism.core",),
    "prism.rank": ("prism.core", "prism.rank", "prism"),
    "prism.shell": ("prism.core", "prism.rank", "prism.shell", "prism"),
    "prism.app": None,
    "prism.cli": ("prism.app", "prism.core", "prism.cli", "prism"),
    "prism.validation": None,
    # the test harness: the real coordinator (shell) around fake ranks
    "prism.testing": ("prism.core", "prism.shell", "prism.testing", "prism"),
}


@pytest.mark.parametrize("path", _sources("prism"), ids=lambda p: str(p.relative_to(ROOT)))
def test_layers_import_one_way(path):
    mod = _module(path)
    names = _imports(path)
    if not (mod == "prism.cli" or mod.startswith("prism.cli.") or mod == "prism.__main__"):
        bad = sorted(n for n in names if _is_cli(n))
        assert not bad, f"{mod} imports the CLI ({', '.join(bad)}): move what it needs into prism.app"
    for prefix, allowed in RULES.items():
        if mod == prefix or mod.startswith(prefix + "."):
            if allowed is None:
                continue
            bad = sorted(n for n in names if (n == "prism" or n.startswith("prism.")) and
                         not any(n == a or n.startswith(a + ".") for a in allowed if a != "prism")
                         and not (n == "prism" and "prism" in allowed))
            assert not bad, f"{mod} may import only {', '.join(allowed)}; it imports {', '.join(bad)}"


@pytest.mark.parametrize("path", _sources("tests", "bench"), ids=lambda p: str(p.relative_to(ROOT)))
def test_tests_and_benchmarks_reach_the_cli_only_through_its_entry_point(path):
    bad = sorted(n for n in _imports(path) if _is_cli(n) and n != "prism.cli")
    assert not bad, f"{path.relative_to(ROOT)} imports {', '.join(bad)}; call prism.app (or prism.cli.main)"


def test_the_checker_sees_cli_imports_absolute_relative_and_lazy():
    text = ("from prism.cli import predict\n"
            "def f():\n    from ..cli import capture\n"
            "import prism.cli.report\n")
    names = _imports_of(text, "prism.app.x", False)
    assert {"prism.cli.predict", "prism.cli.capture", "prism.cli.report"} <= names
    assert _imports_of("from . import errors\n", "prism.app.x", False) >= {"prism.app.errors"}
