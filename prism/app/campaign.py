"""Run a campaign: a grid of captures, predictions and emulations from a TOML file.

``run_campaign(CampaignConfig(file="sweep.toml"))`` reads and checks the file
(``prism.core.campaign``: the grid, the point keys, errors with key and
line), then for each point in order:

* makes its capture once per distinct capture config, under
  ``OUT/captures/<capture key>/`` (``prism.app.capture``; a finished capture
  is marked by ``<capture key>.json`` beside it, so a capture cut short by a
  kill is made again), or uses ``capture.run``;
* predicts it (``prism.app.predict``, with the what-if knobs of
  ``prism.core.whatif``) or emulates it (``prism.app.emulate``);
* appends its row to ``OUT/points.jsonl`` and fsyncs it
  (``prism.shell.campaignstore``).

Points whose key is in the log already are skipped (``retry_failed``: except
failed ones), so a rerun after a kill resumes where it stopped. At the end the
rows of the campaign's points (in grid order) go to ``results.csv``,
``results.json`` and ``plot.png``. Nothing is printed: progress goes to
``on_event``. A point that fails (a capture that fails, a scale-out that
cannot be done) is a row with status "failed" and the reason, not an
exception; an OOM (the capture ran out of memory, or a rank's peak is over
``whatif.memory_limit_gib``) is status "oom". Bad files raise
``CampaignFileError`` (a ``UsageError``).

    from prism.app.campaign import CampaignConfig, run_campaign
    res = run_campaign(CampaignConfig(file="bench/campaigns/straggler.toml", out="runs/strag"))
    print(res.csv_path, [r["iteration_ms"] for r in res.rows])
"""

from __future__ import annotations

import json
import os
import shutil
import time
import tomllib
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from prism.app.errors import PrismError, UsageError
from prism.core.campaign import Campaign, CampaignError, Point, parse_campaign, toml_error
from prism.core.whatif import WhatIf, check_memory, parse_throttle
from prism.shell.campaignstore import ResultLog, write_plot, write_tables

__all__ = ["CampaignConfig", "CampaignEvent", "CampaignResult", "CampaignFileError", "load_campaign",
           "run_campaign", "capture_command", "whatif_of_point"]


class CampaignFileError(UsageError):
    """The campaign file cannot be read or is wrong (the text names file, line and key)."""


@dataclass(frozen=True)
class CampaignEvent:
    """Progress: ``kind`` is "capture" (making a capture; ``point`` is its
    first point), "captured", "start", "done" (``row`` set), "skipped"
    (``row``: the logged one) or "tables" (the end). ``n`` counts from 1."""

    kind: str
    n: int
    total: int
    point: Point | None = None
    row: dict | None = None
    message: str = ""


@dataclass(frozen=True)
class CampaignConfig:
    """What to run. ``out``: the output folder (None: ``runs/campaigns/NAME``).
    ``dry_run``: check the file and list the points, run nothing."""

    file: str | os.PathLike[str]
    out: str | os.PathLike[str] | None = None
    dry_run: bool = False
    #: Run again the points whose logged row says "failed".
    retry_failed: bool = False
    on_event: Callable[[CampaignEvent], None] | None = None


@dataclass
class CampaignResult:
    campaign: Campaign
    out_dir: Path
    #: the rows of the campaign's points, in grid order (those finished)
    rows: list[dict] = field(default_factory=list)
    ran: int = 0
    skipped: int = 0
    csv_path: Path | None = None
    json_path: Path | None = None
    plot_path: Path | None = None
    #: why there is no plot (matplotlib missing, say); "" when there is one
    plot_error: str = ""

    @property
    def failed(self) -> list[dict]:
        return [r for r in self.rows if r["status"] == "failed"]

    @property
    def oom(self) -> list[dict]:
        return [r for r in self.rows if r["status"] == "oom"]

    @property
    def exit_code(self) -> int:
        """1 when a point failed (an OOM is a result, not a failure), else 0."""
        return 1 if self.failed else 0


def load_campaign(path: str | os.PathLike[str]) -> Campaign:
    """Read and check a campaign file; raises ``CampaignFileError``."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise CampaignFileError(f"cannot read campaign file {p}: {e.strerror or e}") from None
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise CampaignFileError(str(toml_error(e, str(p)))) from None
    try:
        return parse_campaign(data, text, str(p))
    except CampaignError as e:
        raise CampaignFileError(str(e)) from None


def _utc() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _layout(point: Point) -> dict[str, int] | None:
    text = point.get("capture.layout")
    if text is None:
        return None
    return {k.strip(): int(v) for k, _, v in (part.partition("=") for part in text.split(","))}


def capture_command(point: Point) -> tuple[int, list[str]]:
    """The world size and command a point's capture runs: the command, the
    layout's flags, then ``[capture.flags]``."""
    cmd = list(point.get("capture.command"))
    lay = _layout(point)
    if lay is not None:
        for k in ("tp", "pp", "dp", "ep"):
            if k in lay:
                cmd += [f"--{k}", str(lay[k])]
        world = lay.get("tp", 1) * lay.get("pp", 1) * lay.get("dp", 1)
    else:
        world = point.get("capture.world_size")
    for dotted, v in point.values.items():
        if dotted.startswith("capture.flags."):
            flag = "--" + dotted.removeprefix("capture.flags.").replace("_", "-")
            if v is True:
                cmd.append(flag)
            elif v is not False:
                cmd += [flag, str(v)]
    return world, cmd


def whatif_of_point(point: Point) -> WhatIf:
    """The point's ``[whatif]`` knobs as ``prism.core.whatif.WhatIf``."""
    pct = point.get("whatif.straggler_pct", 0)
    ranks, tpct = parse_throttle(f"{point.get('whatif.throttle_ranks', 'all')}:{point.get('whatif.throttle_pct', 0)}")
    slow = point.get("whatif.link_slowdown", 1.0)
    return WhatIf(straggler=((point.get("whatif.straggler_rank", 0), float(pct)),) if pct else (),
                  throttle=(ranks, tpct) if tpct else None,
                  link=(float(slow), point.get("whatif.link_tier", "all")) if slow != 1 else None,
                  memory_limit_gib=point.get("whatif.memory_limit_gib"),
                  memory_overhead_gib=point.get("whatif.memory_overhead_gib", 0.6))


class _Runner:
    def __init__(self, campaign: Campaign, out: Path, emit: Callable[[CampaignEvent], None]) -> None:
        self.campaign, self.out, self.emit = campaign, out, emit
        #: capture key -> (run dir, or None with the failure row fields)
        self.captures: dict[str, tuple[Path | None, dict]] = {}

    def capture(self, point: Point, n: int, total: int) -> tuple[Path | None, dict]:
        if point.get("capture.run") is not None:
            return Path(point.get("capture.run")), {}
        ck = point.capture_key
        if ck in self.captures:
            return self.captures[ck]
        run_dir, marker = self.out / "captures" / ck, self.out / "captures" / f"{ck}.json"
        if marker.is_file():
            done = json.loads(marker.read_text())
            self.captures[ck] = (run_dir if done["ok"] else None, done.get("failure", {}))
            return self.captures[ck]
        from prism.app.capture import CaptureConfig, capture

        if run_dir.exists():  # cut short by a kill: make it again
            shutil.rmtree(run_dir)
        world, cmd = capture_command(point)
        self.emit(CampaignEvent("capture", n, total, point, message=f"world {world}: {' '.join(cmd)} -> {run_dir}"))
        t0 = time.monotonic()
        try:
            outcome = capture(CaptureConfig(world_size=world, command=cmd, out=run_dir, gpus=point.get("capture.gpus"),
                                            quiet_s=point.get("capture.quiet_s", 30.0), show_ranks="none",
                                            progress="off"))
            failure = {} if outcome.ok else {
                "status": "oom" if outcome.result is not None and outcome.result.status == "oom" else "failed",
                "message": "capture failed: " + outcome.text().strip().splitlines()[-1][:2000]}
        except PrismError as e:
            failure = {"status": "failed", "message": f"capture: {e}"}
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(json.dumps({"ok": not failure, "failure": failure, "world_size": world, "command": cmd,
                                      "wall_s": round(time.monotonic() - t0, 3), "finished_utc": _utc()}))
        self.emit(CampaignEvent("captured", n, total, point,
                                message=failure.get("message", f"captured in {time.monotonic() - t0:.1f} s")))
        self.captures[ck] = (None if failure else run_dir, failure)
        return self.captures[ck]

    def run_point(self, point: Point, n: int, total: int) -> dict:
        row: dict[str, Any] = {"key": point.key, "index": point.index, "campaign": self.campaign.name,
                               "step": point.get("campaign.step", "predict"), "status": "ok",
                               "dims": {point.labels[k]: v for k, v in point.dims.items()},
                               "inputs": point.values, "started_utc": _utc()}
        t0 = time.monotonic()
        try:
            run_dir, failure = self.capture(point, n, total)
            row["capture"] = str(run_dir) if run_dir else None
            if run_dir is None:
                row.update(failure)
            elif row["step"] == "predict":
                row.update(self._predict(point, run_dir))
            else:
                row.update(self._emulate(point, run_dir))
        except PrismError as e:
            row.update(status="failed", message=str(e))
        except Exception as e:  # noqa: BLE001 (one point's bug must not lose the campaign; the row says what)
            tb = traceback.format_exc().strip().splitlines()
            row.update(status="failed", message=f"internal error: {e!r} ({' | '.join(tb[-3:])})")
        row["finished_utc"] = _utc()
        row["wall_s"] = round(time.monotonic() - t0, 3)
        return row

    @staticmethod
    def _memory_fields(verdict) -> dict[str, Any]:
        return {"peak_memory_gib": verdict.peak_gib, "peak_memory_rank": verdict.worst_rank,
                "memory_status": verdict.status, "memory_over_gib": verdict.over_gib,
                "peak_memory_by_rank_gib": {str(r): b / 2**30 for r, b in verdict.peaks.items()}}

    def _predict(self, point: Point, run_dir: Path) -> dict[str, Any]:
        from prism.app.predict import PredictConfig, predict

        p = predict(PredictConfig(run=run_dir, net=point.get("model.net"), scale_dp=point.get("model.scale_dp"),
                                  warmup=point.get("campaign.warmup", 1),
                                  calibration=point.get("model.calibration", "auto"), whatif=whatif_of_point(point)))
        times = p.result.iteration_times.tolist()
        out: dict[str, Any] = {"world_size": p.result.graph.world_size,
                               "iteration_ms": p.mean_iteration_ns / 1e6 if len(times) > p.config.warmup else None,
                               "iteration_ms_by_step": [t / 1e6 for t in times],
                               "cost_model": p.result.costs.model.name, **self._memory_fields(p.memory)}
        if out["iteration_ms"] is None:
            out.update(status="failed", message=f"the run has {len(times)} step(s); warmup {p.config.warmup} "
                                                 "leaves none to average: lower [campaign] warmup")
        elif p.oom:
            out.update(status="oom", message=p.memory.text())
        return out

    def _emulate(self, point: Point, run_dir: Path) -> dict[str, Any]:
        from prism.app.emulate import EmulateConfig, emulate

        res = emulate(EmulateConfig(run=run_dir, sandbox=point.get("emulate.sandbox", "0"), net=point.get("model.net"),
                                    name=f"campaign-{point.key}-{int(time.time())}",
                                    dormant=point.get("emulate.dormant", "auto"),
                                    warmup=point.get("campaign.warmup", 1), scale_dp=point.get("model.scale_dp"),
                                    calibration=point.get("model.calibration", "auto")))
        s = res.summary
        peaks = {int(r): info["peak_allocated"] for r, info in s.get("ranks", {}).items()
                 if info.get("peak_allocated") is not None}
        w = whatif_of_point(point)
        verdict = check_memory(peaks, w.memory_limit_gib, w.memory_overhead_gib)
        mean = s.get("emulated_mean_ns")
        out: dict[str, Any] = {"world_size": s.get("world_size"),
                               "iteration_ms": mean / 1e6 if mean is not None else None,
                               "iteration_ms_by_step": [t / 1e6 for t in s.get("emulated_iteration_ns", [])],
                               "predicted_ms": (s["predicted_mean_ns"] / 1e6 if s.get("predicted_mean_ns") is not None
                                                else None),
                               "emulation": str(res.out_dir), **self._memory_fields(verdict)}
        if not res.ok:
            out.update(status="oom" if s.get("status") == "oom" else "failed",
                       message=f"emulation {s.get('status', 'failed')}: {res.message}"[:2000])
        elif verdict.status == "oom":
            out.update(status="oom", message=verdict.text())
        return out


def run_campaign(config: CampaignConfig) -> CampaignResult:
    """Run (or with ``dry_run`` list) the campaign of ``config.file``."""
    campaign = load_campaign(config.file)
    out = Path(config.out) if config.out is not None else Path("runs") / "campaigns" / campaign.name
    emit = config.on_event or (lambda ev: None)
    result = CampaignResult(campaign, out)
    total = len(campaign.points)
    if config.dry_run:
        done = ResultLog(out / "points.jsonl").read()
        for i, p in enumerate(campaign.points, 1):
            emit(CampaignEvent("skipped" if p.key in done else "start", i, total, p, done.get(p.key)))
        return result
    out.mkdir(parents=True, exist_ok=True)
    log = ResultLog(out / "points.jsonl")
    done = log.read()
    from prism.shell.launcher import warm_forkserver

    runner = _Runner(campaign, out, emit)
    with warm_forkserver():  # the points' launches fork their fork servers from it
        for i, p in enumerate(campaign.points, 1):
            prev = done.get(p.key)
            if prev is not None and not (config.retry_failed and prev.get("status") == "failed"):
                result.skipped += 1
                result.rows.append(prev)
                emit(CampaignEvent("skipped", i, total, p, prev))
                continue
            emit(CampaignEvent("start", i, total, p))
            row = runner.run_point(p, i, total)
            log.append(row)
            result.ran += 1
            result.rows.append(row)
            emit(CampaignEvent("done", i, total, p, row))
    result.csv_path, result.json_path = write_tables(result.rows, list(campaign.dimensions.values()), out)
    if campaign.plot_x is not None:
        try:
            result.plot_path = write_plot(result.rows, campaign.plot_x, campaign.plot_y, campaign.plot_series,
                                          f"campaign {campaign.name}", out / "plot.png")
        except ImportError as e:
            result.plot_error = f"no plot: matplotlib is not installed ({e})"
    else:
        result.plot_error = "no plot: the campaign has no dimension"
    emit(CampaignEvent("tables", total, total, message=str(out)))
    return result
