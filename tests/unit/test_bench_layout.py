"""bench/ is a benchmark suite, not a notebook: no file named after a work
session, no module that shadows a package, every benchmark script described
in bench/README.md, and ``transport`` importable from inside bench/."""

import os
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
SESSION = re.compile(r"first|second|third|fourth|fifth|sixth|seventh|eighth|ninth|session|call\d", re.I)
PACKAGES = {"prism", "transport", "cuda_ext", "torch", "trio", "zmq", "numpy", "orjson", "pytest", "hypothesis",
            "matplotlib", "tests", "bench", "pynvml", "typing", "json", "time", "test"}


def _files():
    traces = BENCH / "results" / "traces"
    for p in BENCH.rglob("*"):
        if p.is_file() and traces not in p.parents and "__pycache__" not in p.parts:
            yield p


def test_no_file_under_bench_is_named_after_a_session():
    bad = [str(p.relative_to(ROOT)) for p in _files() if SESSION.search(p.name)]
    traces = BENCH / "results" / "traces"
    bad += [str(p.relative_to(ROOT)) for p in traces.glob("*") if SESSION.search(p.name)]
    assert not bad, bad


def test_no_bench_module_shadows_a_package():
    importable = set(PACKAGES)
    importable |= {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    importable |= set(sys.stdlib_module_names)
    bad = [p.name for p in BENCH.glob("*.py") if p.stem in importable]
    assert not bad, bad


def test_the_readme_mentions_every_benchmark_script():
    readme = (BENCH / "README.md").read_text()
    missing = [p.name for p in sorted(BENCH.glob("*.py")) if not p.name.startswith("_") and p.name not in readme]
    assert not missing, missing


def test_transport_imports_from_inside_bench():
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = subprocess.run([sys.executable, "-c", "import transport.trio_socket, transport; print(transport.__file__)"],
                         cwd=BENCH, env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert pathlib.Path(out.stdout.strip()).parent == ROOT / "transport", out.stdout
