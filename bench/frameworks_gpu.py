"""Real frameworks captured on one GPU: Megatron-core (with context switching)
and Hugging Face transformers, against runs without Prism.

    python bench/frameworks_gpu.py --parts megatron-dense,megatron-moe,hf --out-dir DIR

``megatron-dense``: Megatron-core GPT tp2 pp2 dp2 (world 8, one GPU) captured
all ranks resident and with ``--resident 4 --gang tp`` (CUDA checkpoints swap
ranks out and in); the two captures' losses must be equal bit for bit; and a
tp1 pp1 dp1 run of the same model on the same global batch, without Prism,
which the captures track within fp32 reduction-order noise.
``megatron-moe``: the same with 4 experts, tp1 pp2 dp4 ep2 (Megatron trains MoE
with TP only under sequence parallelism, which its local spec does not have).
``hf``: ``hf_causal_lm.py`` under DDP at world 2 on one GPU, captured and run
for real with gloo on CUDA tensors (NCCL refuses two ranks on one GPU); the
losses must be equal; FSDP2 and the MoE model captured.

Prints a table and writes ``frameworks_gpu-DATE.json`` (commands, exit
codes, wall times, losses, per-rank peak memory from the traces, swaps) into
``--out-dir``. Needs a CUDA device and ``megatron-core`` / ``transformers``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from prism.core import trace as T  # noqa: E402

from prism.shell import runfolder  # noqa: E402

FW = ROOT / "prism" / "workloads" / "frameworks"
LOSS = re.compile(r"^step (\d+) loss (\S+)$", re.MULTILINE)
MEGATRON_STEPS = 3
#: Global batch of every Megatron layout (tp2 pp2 dp2: 2 ranks x 4 micro-batches x 2).
GLOBAL_BATCH = 16


def env() -> dict[str, str]:
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}


def losses(text: str) -> list[float]:
    return [float(v) for _, v in LOSS.findall(text)]


def capture(out: Path, name: str, world: int, script: list[str], *extra: str, timeout: int = 400) -> dict:
    run = out / name
    cmd = [sys.executable, "-m", "prism", "capture", "-n", str(world), "--gpus", "0", "--out", str(run),
           "--progress", "off", "--show-ranks", "all", "--quiet-period", "120", *extra, "--", *script]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env=env(), capture_output=True, text=True, timeout=timeout)
        code, stderr = p.returncode, p.stderr
    except subprocess.TimeoutExpired as e:
        code, stderr = "timeout", str(e.stderr or "")
    wall = time.monotonic() - t0
    logs = {r: runfolder.log_path(run, r).read_text() for r in range(world) if runfolder.log_path(run, r).exists()}
    got = next((losses(t) for t in logs.values() if losses(t)), [])
    peaks = {}
    try:
        for r, events in runfolder.read_run(run).ranks.items():
            mem = [e.peak_allocated for e in events if isinstance(e, T.Memory)]
            peaks[r] = max(mem) if mem else None
    except Exception as e:  # noqa: BLE001 (a failed capture still reports)
        peaks = {"error": str(e)}
    swaps = None
    if (run / "telemetry" / "swaps.json").is_file():
        swaps = json.loads((run / "telemetry" / "swaps.json").read_text())["summary"]
    return {"name": name, "command": cmd, "exit": code, "wall_s": round(wall, 1), "losses": got,
            "peak_allocated": peaks, "swaps": swaps, "stderr_tail": stderr[-3000:],
            "log_tail": {r: t[-1500:] for r, t in logs.items() if "Error" in t or "Traceback" in t}}


def plain(out: Path, name: str, world: int, script: list[str], timeout: int = 300, extra_env=None) -> dict:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(world), *script]
    t0 = time.monotonic()
    try:
        p = subprocess.run(cmd, cwd=ROOT, env={**env(), **(extra_env or {})}, capture_output=True, text=True,
                           timeout=timeout)
        code, text = p.returncode, p.stdout + p.stderr
    except subprocess.TimeoutExpired as e:
        code, text = "timeout", str(e.stdout or "") + str(e.stderr or "")
    return {"name": name, "command": cmd, "exit": code, "wall_s": round(time.monotonic() - t0, 1),
            "losses": losses(text), "tail": text[-3000:]}


def megatron(out: Path, moe: bool) -> list[dict]:
    script = [str(FW / "megatron_gpt.py"), "--steps", str(MEGATRON_STEPS), "--global-batch", str(GLOBAL_BATCH)]
    # MoE with TP needs sequence parallelism, which the local spec lacks: tp1 pp2 dp4 ep2
    layout = ["--pp", "2", "--experts", "4", "--ep", "2"] if moe else ["--tp", "2", "--pp", "2"]
    ref = ["--experts", "4"] if moe else []
    tag = "moe" if moe else "dense"
    gang = "1" if moe else "tp"
    rows = [capture(out, f"megatron-{tag}-resident", 8, script + layout, "--gang", gang),
            capture(out, f"megatron-{tag}-swapped", 8, script + layout, "--resident", "4", "--gang", gang,
                    timeout=520),
            plain(out, f"megatron-{tag}-tp1", 1, script + ref)]
    a, b, c = (r["losses"] for r in rows)
    rows[1]["equal_to_resident"] = bool(a) and a == b
    if a and c and len(a) == len(c):
        rows[2]["max_rel_diff_to_resident"] = max(abs(x - y) / abs(y) for x, y in zip(a, c))
    return rows


def hf(out: Path) -> list[dict]:
    script = str(FW / "hf_causal_lm.py")
    rows = []
    for model, par in (("llama", "ddp"), ("qwen3-moe", "ddp")):
        args = [script, "--model", model, "--parallel", par]
        cap = capture(out, f"hf-{model}-{par}", 2, args)
        truth = plain(out, f"hf-{model}-{par}-gloo", 2, args + ["--backend", "gloo"])
        cap["equal_to_truth"] = bool(cap["losses"]) and all(
            math.isclose(x, y, rel_tol=1e-5) for x, y in zip(cap["losses"], truth["losses"])) and \
            len(cap["losses"]) == len(truth["losses"])
        rows += [cap, truth]
    for model in ("llama", "qwen3-moe"):
        rows.append(capture(out, f"hf-{model}-fsdp2", 2, [script, "--model", model, "--parallel", "fsdp2"]))
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="megatron-dense,megatron-moe,hf")
    ap.add_argument("--out-dir", required=True)
    args = ap.parse_args()
    out = Path(args.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    for part in args.parts.split(","):
        rows += {"megatron-dense": lambda: megatron(out, False), "megatron-moe": lambda: megatron(out, True),
                 "hf": lambda: hf(out)}[part]()
        (out / f"frameworks_gpu-{time.strftime('%Y-%m-%d')}-{args.parts.replace(',', '_')}.json").write_text(
            json.dumps({"rows": rows}, indent=2, default=str))
    print(f"{'run':<28} {'exit':>7} {'wall s':>7}  losses / check")
    for r in rows:
        check = {k: r[k] for k in ("equal_to_resident", "equal_to_truth", "max_rel_diff_to_resident") if k in r}
        print(f"{r['name']:<28} {str(r['exit']):>7} {r['wall_s']:>7}  {r['losses']} {check}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
