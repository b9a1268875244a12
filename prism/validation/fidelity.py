"""The kept GPU captures and their truths: the fidelity check of the replay.

Five archives under ``bench/results/traces/`` hold 69 real captures
(``prism capture`` of the accuracy bench's GPU workloads on H200s; world 2
unless said) with the truth measured beside each, in the same device call
(plain torch.distributed over NCCL, one process per GPU; mean iteration
after 3 warm-up steps). Four sets, each {folder in the archive: (workload,
truth ms)}:

``SHARE_CHOSEN`` (set ``share-chosen``)
    13 captures of 2026-11-29 (world 4 on ``nvidia-h200-x4``, world 2 on
    ``nvidia-h200-x2``), PrismTrace 1.1: the CPU-share estimator ``min`` of
    ``prism.core.graph.two_clock_columns`` was chosen on them.
``SHARE_CHECK`` (set ``share-check``)
    22 captures of 2026-11-30, PrismTrace 1.1, taken after that choice: its
    check.
``MODEL_FIT`` (set ``model-fit``)
    12 captures of 2026-11-30, PrismTrace 1.2 (free finishes and cold starts
    recorded): the two-clock model's choices (free finish, alignment of
    segments across steps, the largest calibrated GPU time a segment's wall
    allows) were made on them and the two 1.1 sets.
``HOLDOUT`` (set ``holdout``)
    22 captures of 2026-11-30, PrismTrace 1.2, taken with the model fixed:
    the out-of-sample check.

The folders inside the archives keep the names they were captured under
(``nccl-h200x2-fifth/``, ...); ``ARCHIVES`` maps each archive to its folder.
``extract`` unpacks archives, ``replay`` predicts a set's captures with a cost
model and returns per capture the truth, Prism's prediction and the error;
``load_model`` reads a network profile (``NET``, fitted on
``nvidia-h200-x2`` with GPU times and issue costs, is the default).
``tests/unit/test_fidelity_captures.py`` and ``bench/two_clock_check.py`` use
them; no GPU needed.
"""

from __future__ import annotations

import dataclasses
import pathlib
import tarfile

from prism.core import trace as T

from prism.shell import runfolder

ROOT = pathlib.Path(__file__).resolve().parent.parent.parent
RESULTS = ROOT / "bench" / "results"
TRACES = RESULTS / "traces"
#: the NCCL profile the 2026-11-30 captures are replayed with (nvidia-h200-x2)
NET = str(RESULTS / "netprofile-2026-11-29-h200x2-nccl-issue.toml")
#: the NCCL profile of the 4-GPU machine (what the 2026-11-29 captures were predicted with live)
NET_H200X4 = str(RESULTS / "netprofile-2026-11-29-h200x4-nccl.toml")

#: archive under TRACES -> the folder it unpacks to
ARCHIVES = {
    "nccl-captures-2026-11-29-h200x4.tgz": "traces",
    "nccl-captures-2026-11-29-h200x2.tgz": "nccl-h200x2",
    "nccl-captures-2026-11-30-h200x2-share-check.tgz": "nccl-h200x2-fifth",
    "nccl-captures-2026-11-30-h200x2-model-fit.tgz": "nccl-h200x2-sixth",
    "nccl-captures-2026-11-30-h200x2-holdout.tgz": "nccl-h200x2-seventh",
}

#: 2026-11-29, PrismTrace 1.1. ``c1-``/``c2-`` are two device calls on nvidia-h200-x2,
#: ``-0``/``-1`` the runs (told apart by the predictions the call printed);
#: ``c2-moe-1gpu-0`` (run 1's 1-GPU capture) lost its truth to the call's time
#: limit and is left out. ``traces/`` holds world-4 captures from nvidia-h200-x4.
SHARE_CHOSEN = {
    "nccl-h200x2/c1-gpt-1gpu-0": ("GPT tp2, world 2, 1 GPU", 43.61),
    "nccl-h200x2/c1-gpt-2gpu-0": ("GPT tp2, world 2, 2 GPUs", 43.61),
    "nccl-h200x2/c2-gpt-1gpu-0": ("GPT tp2, world 2, 1 GPU", 44.23),
    "nccl-h200x2/c2-gpt-1gpu-1": ("GPT tp2, world 2, 1 GPU", 44.03),
    "nccl-h200x2/c2-gpt-2gpu-0": ("GPT tp2, world 2, 2 GPUs", 44.23),
    "nccl-h200x2/c2-gpt-2gpu-1": ("GPT tp2, world 2, 2 GPUs", 44.03),
    "nccl-h200x2/c1-moe-1gpu-0": ("MoE dp2 ep2, world 2, 1 GPU", 114.76),
    "nccl-h200x2/c1-moe-2gpu-0": ("MoE dp2 ep2, world 2, 2 GPUs", 114.76),
    "nccl-h200x2/c2-moe-1gpu-1": ("MoE dp2 ep2, world 2, 1 GPU", 117.58),
    "nccl-h200x2/c2-moe-2gpu-0": ("MoE dp2 ep2, world 2, 2 GPUs", 117.58),
    "traces/gpt1F": ("GPT tp2 dp2, world 4, 1 GPU", 46.76),
    "traces/gpt2F": ("GPT tp2 dp2, world 4, 2 GPUs", 46.76),
    "traces/moeF": ("MoE tp2 dp2 ep2, world 4, 2 GPUs", 85.58),
}

#: 2026-11-30, PrismTrace 1.1: prefixes a-d are four device calls, ``-0``/``-1`` the
#: runs; the two FSDP2 captures taken before the calibration covered FSDP2's own
#: streams are left out.
SHARE_CHECK = {
    "nccl-h200x2-fifth/a-gpt-1gpu-0": ("GPT tp2, world 2, 1 GPU", 44.28),
    "nccl-h200x2-fifth/a-gpt-2gpu-0": ("GPT tp2, world 2, 2 GPUs", 44.28),
    "nccl-h200x2-fifth/a-gpt-1gpu-1": ("GPT tp2, world 2, 1 GPU", 43.99),
    "nccl-h200x2-fifth/a-gpt-2gpu-1": ("GPT tp2, world 2, 2 GPUs", 43.99),
    "nccl-h200x2-fifth/a-moe-1gpu-0": ("MoE dp2 ep2, world 2, 1 GPU", 114.79),
    "nccl-h200x2-fifth/a-moe-2gpu-0": ("MoE dp2 ep2, world 2, 2 GPUs", 114.79),
    "nccl-h200x2-fifth/b-pp2-1gpu-0": ("GPT pp2, world 2, 1 GPU", 52.86),
    "nccl-h200x2-fifth/b-pp2-2gpu-0": ("GPT pp2, world 2, 2 GPUs", 52.86),
    "nccl-h200x2-fifth/c-fsdp2-1gpu-0": ("FSDP2, world 2, 1 GPU", 122.82),
    "nccl-h200x2-fifth/c-fsdp2-2gpu-0": ("FSDP2, world 2, 2 GPUs", 122.82),
    "nccl-h200x2-fifth/c-fsdp2-1gpu-1": ("FSDP2, world 2, 1 GPU", 125.99),
    "nccl-h200x2-fifth/c-fsdp2-2gpu-1": ("FSDP2, world 2, 2 GPUs", 125.99),
    "nccl-h200x2-fifth/c-moe-1gpu-0": ("MoE dp2 ep2, world 2, 1 GPU", 114.22),
    "nccl-h200x2-fifth/c-moe-2gpu-0": ("MoE dp2 ep2, world 2, 2 GPUs", 114.22),
    "nccl-h200x2-fifth/c-pp2-1gpu-0": ("GPT pp2, world 2, 1 GPU", 52.80),
    "nccl-h200x2-fifth/c-pp2-2gpu-0": ("GPT pp2, world 2, 2 GPUs", 52.80),
    "nccl-h200x2-fifth/d-pp2-1gpu-0": ("GPT pp2, world 2, 1 GPU", 53.01),
    "nccl-h200x2-fifth/d-pp2-2gpu-0": ("GPT pp2, world 2, 2 GPUs", 53.01),
    "nccl-h200x2-fifth/d-pp2-1gpu-1": ("GPT pp2, world 2, 1 GPU", 53.18),
    "nccl-h200x2-fifth/d-pp2-2gpu-1": ("GPT pp2, world 2, 2 GPUs", 53.18),
    "nccl-h200x2-fifth/d-gpt-1gpu-0": ("GPT tp2, world 2, 1 GPU", 44.71),
    "nccl-h200x2-fifth/d-gpt-2gpu-0": ("GPT tp2, world 2, 2 GPUs", 44.71),
}

#: 2026-11-30, PrismTrace 1.2: prefixes a/b are two device calls; a-gpt-tp2-run1-1gpu
#: has no truth (the call's time limit cut that run).
MODEL_FIT = {
    "nccl-h200x2-sixth/a-gpt-pp2-run0-1gpu": ("GPT pp2, world 2, 1 GPU", 52.91),
    "nccl-h200x2-sixth/a-gpt-pp2-run0-2gpu": ("GPT pp2, world 2, 2 GPUs", 52.91),
    "nccl-h200x2-sixth/a-gpt-pp2-run1-1gpu": ("GPT pp2, world 2, 1 GPU", 52.87),
    "nccl-h200x2-sixth/a-gpt-pp2-run1-2gpu": ("GPT pp2, world 2, 2 GPUs", 52.87),
    "nccl-h200x2-sixth/a-gpt-tp2-run0-1gpu": ("GPT tp2, world 2, 1 GPU", 44.03),
    "nccl-h200x2-sixth/a-gpt-tp2-run0-2gpu": ("GPT tp2, world 2, 2 GPUs", 44.03),
    "nccl-h200x2-sixth/a-moe-dp2-ep2-run0-1gpu": ("MoE dp2 ep2, world 2, 1 GPU", 116.10),
    "nccl-h200x2-sixth/a-moe-dp2-ep2-run0-2gpu": ("MoE dp2 ep2, world 2, 2 GPUs", 116.10),
    "nccl-h200x2-sixth/b-fsdp2-run0-1gpu": ("FSDP2, world 2, 1 GPU", 139.23),
    "nccl-h200x2-sixth/b-fsdp2-run0-2gpu": ("FSDP2, world 2, 2 GPUs", 139.23),
    "nccl-h200x2-sixth/b-moe-dp2-ep2-run0-1gpu": ("MoE dp2 ep2, world 2, 1 GPU", 113.54),
    "nccl-h200x2-sixth/b-moe-dp2-ep2-run0-2gpu": ("MoE dp2 ep2, world 2, 2 GPUs", 113.54),
}

#: 2026-11-30, PrismTrace 1.2, taken with the model fixed: prefixes a-e are five
#: device calls; d's MoE run 1 lost its truth to the time limit.
HOLDOUT = {
    "nccl-h200x2-seventh/a-gpt-tp2-run0-1gpu": ("GPT tp2, world 2, 1 GPU", 43.24),
    "nccl-h200x2-seventh/a-gpt-tp2-run0-2gpu": ("GPT tp2, world 2, 2 GPUs", 43.24),
    "nccl-h200x2-seventh/a-gpt-tp2-run1-1gpu": ("GPT tp2, world 2, 1 GPU", 43.10),
    "nccl-h200x2-seventh/a-gpt-tp2-run1-2gpu": ("GPT tp2, world 2, 2 GPUs", 43.10),
    "nccl-h200x2-seventh/a-gpt-pp2-run0-1gpu": ("GPT pp2, world 2, 1 GPU", 51.66),
    "nccl-h200x2-seventh/a-gpt-pp2-run0-2gpu": ("GPT pp2, world 2, 2 GPUs", 51.66),
    "nccl-h200x2-seventh/a-gpt-pp2-run1-1gpu": ("GPT pp2, world 2, 1 GPU", 52.15),
    "nccl-h200x2-seventh/a-gpt-pp2-run1-2gpu": ("GPT pp2, world 2, 2 GPUs", 52.15),
    "nccl-h200x2-seventh/a-moe-dp2-ep2-run0-1gpu": ("MoE dp2 ep2, world 2, 1 GPU", 109.92),
    "nccl-h200x2-seventh/a-moe-dp2-ep2-run0-2gpu": ("MoE dp2 ep2, world 2, 2 GPUs", 109.92),
    "nccl-h200x2-seventh/b-fsdp2-run0-1gpu": ("FSDP2, world 2, 1 GPU", 162.35),
    "nccl-h200x2-seventh/b-fsdp2-run0-2gpu": ("FSDP2, world 2, 2 GPUs", 162.35),
    "nccl-h200x2-seventh/c-moe-dp2-ep2-run0-1gpu": ("MoE dp2 ep2, world 2, 1 GPU", 114.27),
    "nccl-h200x2-seventh/c-moe-dp2-ep2-run0-2gpu": ("MoE dp2 ep2, world 2, 2 GPUs", 114.27),
    "nccl-h200x2-seventh/d-fsdp2-run0-1gpu": ("FSDP2, world 2, 1 GPU", 137.03),
    "nccl-h200x2-seventh/d-fsdp2-run0-2gpu": ("FSDP2, world 2, 2 GPUs", 137.03),
    "nccl-h200x2-seventh/d-fsdp2-run1-1gpu": ("FSDP2, world 2, 1 GPU", 142.31),
    "nccl-h200x2-seventh/d-fsdp2-run1-2gpu": ("FSDP2, world 2, 2 GPUs", 142.31),
    "nccl-h200x2-seventh/d-moe-dp2-ep2-run0-1gpu": ("MoE dp2 ep2, world 2, 1 GPU", 115.30),
    "nccl-h200x2-seventh/d-moe-dp2-ep2-run0-2gpu": ("MoE dp2 ep2, world 2, 2 GPUs", 115.30),
    "nccl-h200x2-seventh/e-moe-dp2-ep2-run0-1gpu": ("MoE dp2 ep2, world 2, 1 GPU", 116.49),
    "nccl-h200x2-seventh/e-moe-dp2-ep2-run0-2gpu": ("MoE dp2 ep2, world 2, 2 GPUs", 116.49),
}


#: set name -> (its archives, its table)
SETS: dict[str, tuple[tuple[str, ...], dict[str, tuple[str, float]]]] = {
    "share-chosen": (("nccl-captures-2026-11-29-h200x4.tgz", "nccl-captures-2026-11-29-h200x2.tgz"), SHARE_CHOSEN),
    "share-check": (("nccl-captures-2026-11-30-h200x2-share-check.tgz",), SHARE_CHECK),
    "model-fit": (("nccl-captures-2026-11-30-h200x2-model-fit.tgz",), MODEL_FIT),
    "holdout": (("nccl-captures-2026-11-30-h200x2-holdout.tgz",), HOLDOUT),
}


def extract(dest: str | pathlib.Path, archives=None) -> pathlib.Path:
    """Unpack ``archives`` (names under TRACES; default all) into ``dest``."""
    dest = pathlib.Path(dest)
    for name in archives if archives is not None else ARCHIVES:
        with tarfile.open(TRACES / name) as tf:
            tf.extractall(dest, filter="data")
    return dest


def load_model(net: str = NET):
    """The cost model of a network profile (a TOML path or a profile name)."""
    from prism.app.predict import resolve_profile

    model, _ = resolve_profile(net, None)
    return model


def emulate_v12(ranks: dict, cold_ns: int) -> dict:
    """PrismTrace 1.1 events with the 1.2 fields filled in, as a 1.2 capture
    would have recorded them: ``free_ns`` = the segment's wall time on
    uncalibrated segments (exact on 2 GPUs; on 1 GPU it keeps the
    logical-device mode's cost, which a 1.2 capture takes off) and
    ``cold_ns`` on segments that follow a communication call."""
    out = {}
    for r, evs in ranks.items():
        new, prev = [], None
        for e in evs:
            if isinstance(e, T.Compute) and e.cpu_ns >= 0 and e.free_ns == -1 and e.cold_ns == 0:
                after_call = prev is not None and isinstance(prev, (T.Collective, T.P2P))
                e = dataclasses.replace(e, free_ns=(e.end_ns - e.start_ns) if e.gpu_ns == -1 else -1,
                                        cold_ns=cold_ns if after_call else 0)
            if isinstance(e, (T.Compute, T.Iteration, T.Collective, T.P2P)):
                prev = e
            new.append(e)
        out[r] = new
    return out


def replay(folder: str | pathlib.Path, table: dict[str, tuple[str, float]], model, warmup: int = 3,
           cpu_share: str = "min", cold_ns: int | None = None) -> list[dict]:
    """Each capture of ``table`` (unpacked under ``folder``) replayed with
    ``model``: rows of capture, workload, truth_ms, prism_ms, error_pct.
    ``cold_ns`` fills PrismTrace 1.1 captures in with ``emulate_v12``."""
    from prism.core.graph import ExecutionGraph
    from prism.core.replay import replay_batch

    rows = []
    for name, (what, truth) in table.items():
        ranks = runfolder.read_run(pathlib.Path(folder) / name).ranks
        if cold_ns is not None:
            ranks = emulate_v12(ranks, cold_ns)
        g = ExecutionGraph.from_events(ranks, cpu_share=cpu_share)
        ms = replay_batch(g, cost_model=model).mean_iteration_time(warmup) / 1e6
        rows.append({"capture": name, "workload": what, "truth_ms": truth, "prism_ms": round(ms, 3),
                     "error_pct": round(100 * (ms - truth) / truth, 2)})
    return rows
