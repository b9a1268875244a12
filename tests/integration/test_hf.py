"""Hugging Face transformers models, unmodified, under DDP and FSDP2.

``prism/workloads/frameworks/hf_causal_lm.py`` builds a Llama-style or a
Qwen3-MoE model from a config (random init, no download) and trains it at
world 4, for real under gloo and under ``prism capture``: per-step losses and
the final checksum agree to a relative 1e-5, and the MoE's routing (tokens per
expert of the first layer, each step, over all ranks) is the same integers,
so the routing Prism captured is the one the real run made. Skipped without
``transformers`` (``pip install -e .[hf]``).
"""

from __future__ import annotations

import re
from collections import Counter

import pytest

from tests.integration.test_frameworks import WORLD, Runs, assert_same_outputs, collectives
from tests.support.full import FULL

pytest.importorskip("transformers")

SCRIPT = "hf_causal_lm.py"
ROUTING = re.compile(r"^step (\d+) routing ([\d,]+)$", re.MULTILINE)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return Runs(tmp_path_factory.mktemp("hf"))


def _routing(texts: dict[int, str]) -> dict[int, str]:
    return {int(s): c for text in texts.values() for s, c in ROUTING.findall(text)}


# One pair always (the suite's time: each is ~20 s on 2 cores, mostly four
# processes importing transformers twice): Qwen3-MoE under FSDP2, the routing
# checked too. Llama under FSDP2 and both models under DDP (which
# ddp_example.py covers under Prism in test_capture and test_emulate) are its
# variants.
@pytest.mark.slow
@pytest.mark.parametrize("model", [pytest.param("llama", marks=FULL), pytest.param("qwen3-moe", marks=FULL)])
def test_hf_ddp_matches_gloo(runs, model):
    args = ("--model", model, "--parallel", "ddp")
    _, run_dir, logs, _ = runs.prism(SCRIPT, *args)
    truth = runs.gloo(SCRIPT, *args)
    assert_same_outputs(logs, truth)
    if model == "qwen3-moe":
        got, want = _routing(logs), _routing(truth)
        assert sorted(want) == [0, 1, 2] and got == want
        assert len(set(want.values())) > 1, f"routing should change from step to step: {want}"
    # DDP: gradient buckets all-reduced every step (SUM, then divided), plus the loss report.
    seen = Counter(c.op for c in collectives(run_dir))
    assert seen["all_reduce"] >= 2 * 3 * WORLD


@pytest.mark.slow
@pytest.mark.parametrize("model", ["qwen3-moe", pytest.param("llama", marks=FULL)])
def test_hf_fsdp2_matches_gloo(runs, model):
    args = ("--model", model, "--parallel", "fsdp2")
    _, run_dir, logs, _ = runs.prism(SCRIPT, *args)
    truth = runs.gloo(SCRIPT, *args)
    assert_same_outputs(logs, truth)
    if model == "qwen3-moe":
        got, want = _routing(logs), _routing(truth)
        assert sorted(want) == [0, 1, 2] and got == want
        assert len(set(want.values())) > 1, f"routing should change from step to step: {want}"
    # 2 decoder layers + the root: one AVG reduce-scatter per FSDP module per step per rank.
    rs = [c for c in collectives(run_dir) if c.op == "reduce_scatter_tensor"]
    assert len(rs) == 3 * 3 * WORLD and {c.reduce_op for c in rs} == {"AVG"}
