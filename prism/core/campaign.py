"""Campaigns: what-if sweeps described in a TOML file (sans-IO).

``parse_campaign(data, text, source)`` turns a loaded TOML table (and the
file's text, for line numbers) into a validated ``Campaign``: its settings
and the grid of ``Point`` objects to run. ``prism.app.campaign`` runs them.

The convention is the one of NVIDIA CloudAI's test scenarios: **a list value
is a sweep dimension**. The grid is the product of every dimension. Keys that
take a list themselves (``capture.command``) sweep when given a list of lists.
Dimensions of ``[capture]`` come first (outermost), so the points of one
capture run one after another and each distinct capture is made once; the
rest keep the file's order. The file::

    [campaign]
    name = "straggler"            # required; names the output folder
    step = "predict"              # "predict" or "emulate" (a list sweeps both)
    warmup = 1                    # steps dropped from the mean iteration time

    [capture]                     # what to capture (or run = "DIR": an existing capture;
                                  # paths are relative to where prism campaign runs)
    command = ["-m", "prism.workloads.gpt", "--layers", "2"]
    layout = ["tp=2,pp=2,dp=2", "tp=2,pp=1,dp=2"]   # appended as --tp/--pp/--dp[/--ep]; world = tp*pp*dp
    world_size = 8                # only without a layout
    gpus = "0"                    # capture on GPUs (prism capture --gpus); absent: CPU

    [capture.flags]               # the workload's flags: key -> --key-with-dashes VALUE (true: bare flag)
    seq_len = [8, 16]

    [model]                       # how points are replayed (predict and emulate)
    net = ["h200_nvlink_ib400", "zero"]   # cost profile: bundled name, TOML path or "zero"
    scale_dp = [2, 4, 8]          # grow the capture to this DP size (prism.core.scaleout)
    calibration = "auto"          # the run's newest `prism calibrate` if it has one (off: as captured)

    [whatif]                      # prism.core.whatif; predict only (emulate: memory_limit_gib only)
    straggler_rank = 0
    straggler_pct = [0, 10, 20]
    throttle_ranks = "all"        # "all", "0-3", "0,5"
    throttle_pct = 0
    link_slowdown = 1.0
    link_tier = "all"             # all, intra, inter
    memory_limit_gib = 80
    memory_overhead_gib = 0.6

    [emulate]
    sandbox = "0"
    dormant = "auto"

    [plot]
    x = "scale_dp"                # a dimension's short name (default: the first numeric one)
    y = "iteration_ms"            # or "peak_memory_gib"
    series = ["net"]              # dimensions that make one line each (default: the other ones)

A point's ``key`` is a stable hash of every input it runs with (swept or
not), so a resumed campaign skips exactly the points that would give the
same row, and editing a fixed value reruns everything it touches. Errors
(``CampaignError``) name the file, the line, the key and what is expected.
"""

from __future__ import annotations

import hashlib
import itertools
import json
import math
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Campaign", "CampaignError", "Point", "parse_campaign", "line_of", "toml_error", "STEPS", "KEYS"]

STEPS = ("predict", "emulate")
LINK_TIERS = ("all", "intra", "inter")
_LAYOUT = re.compile(r"^\s*(tp|pp|dp|ep)\s*=\s*(\d+)\s*$")


class CampaignError(ValueError):
    """A campaign file is wrong; the text names the file, line and key."""


def _is_num(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


def _check_str(v: Any) -> str | None:
    return None if isinstance(v, str) and v else "a non-empty string"


def _check_pos_int(v: Any) -> str | None:
    return None if isinstance(v, int) and not isinstance(v, bool) and v >= 1 else "a positive integer"


def _check_nonneg_int(v: Any) -> str | None:
    return None if isinstance(v, int) and not isinstance(v, bool) and v >= 0 else "a non-negative integer"


def _check_pos(v: Any) -> str | None:
    return None if _is_num(v) and v > 0 else "a positive number"


def _check_nonneg(v: Any) -> str | None:
    return None if _is_num(v) and v >= 0 else "a number >= 0"


def _check_pct_clock(v: Any) -> str | None:
    return None if _is_num(v) and 0 <= v < 100 else "a percentage in [0, 100)"


def _one_of(*choices: str) -> Callable[[Any], str | None]:
    return lambda v: None if v in choices else "one of " + ", ".join(repr(c) for c in choices)


def _check_command(v: Any) -> str | None:
    ok = isinstance(v, list) and v and all(isinstance(x, str) for x in v)
    return None if ok else 'a non-empty list of strings (["-m", "module", "--flag", ...] or ["train.py", ...])'


def _check_layout(v: Any) -> str | None:
    msg = 'a layout such as "tp=2,pp=2,dp=4" (ep=N optional)'
    if not isinstance(v, str):
        return msg
    parts = [_LAYOUT.match(p) for p in v.split(",")]
    if not all(parts) or any(int(m.group(2)) < 1 for m in parts):
        return msg
    d = {m.group(1): int(m.group(2)) for m in parts}
    if d.get("dp", 1) % d.get("ep", 1):
        return msg + f"; dp ({d.get('dp', 1)}) must be a multiple of ep ({d['ep']})"
    return None


def _check_ranks(v: Any) -> str | None:
    ok = isinstance(v, str) and (v == "all" or re.fullmatch(r"\d+(-\d+)?(,\d+(-\d+)?)*", v.replace(" ", "")))
    return None if ok else 'ranks as "all", "0-3" or "0,5"'


def _check_flag(v: Any) -> str | None:
    ok = isinstance(v, (str, bool)) or _is_num(v)
    return None if ok else "a string, number or boolean (true: the bare flag, false: left out)"


#: table -> key -> (validator, takes a list itself, default)
KEYS: dict[str, dict[str, tuple[Callable[[Any], str | None], bool, Any]]] = {
    "campaign": {"name": (_check_str, False, None), "step": (_one_of(*STEPS), False, "predict"),
                 "warmup": (_check_nonneg_int, False, 1), "description": (_check_str, False, "")},
    "capture": {"command": (_check_command, True, None), "layout": (_check_layout, False, None),
                "world_size": (_check_pos_int, False, None), "run": (_check_str, False, None),
                "gpus": (_check_str, False, None), "quiet_s": (_check_pos, False, 30.0)},
    "model": {"net": (_check_str, False, None), "scale_dp": (_check_pos_int, False, None),
              "calibration": (_check_str, False, "auto")},
    "whatif": {"straggler_rank": (_check_nonneg_int, False, 0), "straggler_pct": (_check_nonneg, False, 0),
               "throttle_ranks": (_check_ranks, False, "all"), "throttle_pct": (_check_pct_clock, False, 0),
               "link_slowdown": (_check_pos, False, 1.0), "link_tier": (_one_of(*LINK_TIERS), False, "all"),
               "memory_limit_gib": (_check_pos, False, None), "memory_overhead_gib": (_check_nonneg, False, 0.6)},
    "emulate": {"sandbox": (_check_ranks, False, "0"), "dormant": (_one_of("auto", "simulate", "offline"), False,
                                                                    "auto")},
    "plot": {"x": (_check_str, False, None), "y": (_one_of("iteration_ms", "peak_memory_gib"), False, "iteration_ms"),
             "series": (None, False, None)},  # checked by hand: a name or a list of names, never a dimension
}
#: Free-form subtables: every key is allowed (the workload's own flags).
FREE_TABLES = {("capture", "flags"): _check_flag}
#: What-if keys that only ``predict`` applies.
PREDICT_ONLY = ("straggler_pct", "throttle_pct", "link_slowdown")


@dataclass(frozen=True)
class Point:
    """One run of the grid: ``values`` holds every input (dotted keys), ``dims`` the swept ones."""

    index: int
    key: str
    values: dict[str, Any]
    dims: dict[str, Any]
    #: the short names of ``dims`` (``"scale_dp"``; ``"flags.seq_len"`` when needed to be unique)
    labels: dict[str, str] = field(default_factory=dict)

    def get(self, dotted: str, default: Any = None) -> Any:
        return self.values.get(dotted, default)

    @property
    def label(self) -> str:
        """``layout=tp=2,pp=2,dp=2 scale_dp=4 net=zero``: the swept values."""
        return " ".join(f"{self.labels[k]}={_show(v)}" for k, v in self.dims.items()) or "(the only point)"

    def capture_inputs(self) -> dict[str, Any]:
        """The inputs that decide the capture (points sharing them share one)."""
        return {k: v for k, v in self.values.items() if k.startswith("capture.")}

    @property
    def capture_key(self) -> str:
        return stable_key(self.capture_inputs())


@dataclass(frozen=True)
class Campaign:
    name: str
    source: str
    points: tuple[Point, ...]
    #: dotted key -> short name, for each dimension in grid order
    dimensions: dict[str, str]
    plot_x: str | None
    plot_y: str
    plot_series: tuple[str, ...]
    description: str = ""

    def distinct_captures(self) -> int:
        return len({p.capture_key for p in self.points})


def _show(v: Any) -> str:
    if isinstance(v, list):
        return " ".join(map(str, v))
    return f"{v:g}" if isinstance(v, float) else str(v)


def stable_key(values: Mapping[str, Any]) -> str:
    """A short hash of ``values`` that does not depend on key order."""
    blob = json.dumps(values, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


def toml_error(e: Exception, source: str) -> CampaignError:
    """A ``tomllib.TOMLDecodeError`` as a ``CampaignError`` (its message has the line and column)."""
    return CampaignError(f"{source}: not valid TOML: {e}")


def line_of(text: str, table: str, key: str | None = None) -> int | None:
    """The 1-based line where ``key`` is set in ``[table]`` (or the table's
    header when ``key`` is None); None where it cannot be found (a key set
    through an inline table, say)."""
    current = ""
    header = re.compile(r"^\s*\[\[?\s*([^\]]+?)\s*\]\]?\s*(#.*)?$")
    want = [p.strip().strip('"').strip("'") for p in table.split(".")] if table else []
    for n, line in enumerate(text.splitlines(), 1):
        m = header.match(line)
        if m:
            current = ".".join(p.strip().strip('"').strip("'") for p in m.group(1).split("."))
            if key is None and current == ".".join(want):
                return n
            continue
        if key is None:
            continue
        m = re.match(r"^\s*([A-Za-z0-9_.\-\"' ]+?)\s*=", line)
        if not m:
            continue
        full = ".".join(x for x in (current, ".".join(p.strip().strip('"').strip("'")
                                                     for p in m.group(1).split("."))) if x)
        if full == ".".join([*want, key]):
            return n
    return None


class _Errors:
    def __init__(self, text: str, source: str) -> None:
        self.text, self.source = text, source

    def at(self, table: str, key: str | None, message: str) -> CampaignError:
        line = line_of(self.text, table, key)
        parts = table.split(".")
        while line is None and parts:  # set inline: the nearest table header that is there
            line = line_of(self.text, ".".join(parts))
            parts.pop()
        where = f"{self.source}:{line}" if line else self.source
        name = f"{table}.{key}" if key else f"[{table}]"
        return CampaignError(f"{where}: key '{name}': {message}")


def _value_error(err: _Errors, table: str, key: str, value: Any, expected: str, dim: bool) -> CampaignError:
    what = "each value of the sweep" if dim else "the value"
    return err.at(table, key, f"{what} must be {expected}, got {value!r}")


def _sweep(err: _Errors, table: str, key: str, value: Any, check: Callable[[Any], str | None],
           takes_list: bool) -> list[Any] | None:
    """The values of a dimension, or None for a fixed value; checks each."""
    is_dim = isinstance(value, list) and (not takes_list or (value and all(isinstance(x, list) for x in value)))
    values = value if is_dim else [value]
    if is_dim and not values:
        raise err.at(table, key, "an empty list sweeps nothing; give at least one value")
    if is_dim and len({json.dumps(v, sort_keys=True, default=str) for v in values}) != len(values):
        raise err.at(table, key, f"the sweep {value!r} repeats a value")
    for v in values:
        problem = check(v)
        if problem:
            raise _value_error(err, table, key, v, problem, is_dim)
    return list(values) if is_dim else None


def parse_campaign(data: Mapping[str, Any], text: str, source: str) -> Campaign:
    """Validate a loaded campaign file and expand its grid; raises ``CampaignError``."""
    err = _Errors(text, source)
    unknown = [t for t in data if t not in KEYS]
    if unknown:
        t = unknown[0]
        line = line_of(text, t) or line_of(text, "", t)
        raise CampaignError(f"{source}{':' + str(line) if line else ''}: unknown table or key {t!r} "
                            f"(allowed tables: {', '.join('[' + k + ']' for k in KEYS)})")
    fixed: dict[str, Any] = {}
    dims: dict[str, list[Any]] = {}
    order = [f"{t}.{k}.{f}" if f is not None else f"{t}.{k}"
             for t, tv in data.items() if isinstance(tv, dict) for k, kv in tv.items()
             for f in (list(kv) if isinstance(kv, dict) else [None])]
    for table, spec in KEYS.items():
        given = data.get(table, {})
        if not isinstance(given, dict):
            raise CampaignError(f"{source}:{line_of(text, '', table) or '?'}: '{table}' must be a table "
                                f"([{table}]), got {given!r}")
        for key, value in given.items():
            if (table, key) in FREE_TABLES:
                if not isinstance(value, dict):
                    raise err.at(table, key, f"must be a table ([{table}.{key}]) of the workload's flags")
                for flag, fv in value.items():
                    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_\-]*", flag):
                        raise err.at(f"{table}.{key}", flag, "a flag name is letters, digits, '_' and '-'")
                    vals = _sweep(err, f"{table}.{key}", flag, fv, FREE_TABLES[(table, key)], False)
                    _put(f"{table}.{key}.{flag}", fv, vals, fixed, dims)
                continue
            if key not in spec:
                raise err.at(table, key, f"unknown key (allowed in [{table}]: {', '.join(spec)})")
            check, takes_list, _ = spec[key]
            if table == "plot":
                continue  # checked once the dimensions are known
            vals = _sweep(err, table, key, value, check, takes_list)
            if vals is not None and table == "campaign" and key != "step":
                raise err.at(table, key, f"[campaign] settings are not swept (only step is); got {value!r}")
            _put(f"{table}.{key}", value, vals, fixed, dims)
        for key, (_, _, default) in spec.items():
            if table != "plot" and f"{table}.{key}" not in fixed and f"{table}.{key}" not in dims \
                    and default is not None:
                fixed[f"{table}.{key}"] = default
    camp = data.get("campaign", {})
    if "name" not in camp:
        raise CampaignError(f"{source}:{line_of(text, 'campaign') or 1}: key 'campaign.name': missing; "
                            'name the campaign (name = "my-study"): it names the output folder')
    if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.\-]*", camp["name"]):
        raise err.at("campaign", "name", f"letters, digits, '.', '_' and '-' only (a folder name), got {camp['name']!r}")
    _check_capture(err, data.get("capture", {}), dims)
    _check_steps(err, fixed, dims)
    ordered = sorted(dims, key=lambda k: (not k.startswith("capture."), list(dims).index(k)))
    labels = _short_names(ordered)
    points = []
    # every input in the file's order (a command's flags follow it), then the defaults
    file_order = [k for k in order if k in fixed or k in dims]
    for i, combo in enumerate(itertools.product(*(dims[k] for k in ordered))):
        chosen = dict(fixed)
        chosen.update(zip(ordered, combo))
        values = {k: chosen[k] for k in file_order}
        values.update((k, v) for k, v in chosen.items() if k not in values)
        points.append(Point(i, stable_key(values), values, dict(zip(ordered, combo)), labels))
    x, y, series = _plot(err, data.get("plot", {}), ordered, labels, dims)
    return Campaign(camp["name"], source, tuple(points), {k: labels[k] for k in ordered}, x, y, series,
                    camp.get("description", ""))


def _put(dotted: str, value: Any, sweep: list | None, fixed: dict, dims: dict) -> None:
    fixed.pop(dotted, None)
    if sweep is None:
        fixed[dotted] = value
    else:
        dims[dotted] = sweep


def _check_capture(err: _Errors, cap: Mapping[str, Any], dims: Mapping[str, list]) -> None:
    if "run" in cap:
        extra = [k for k in cap if k not in ("run",)]
        if extra:
            raise err.at("capture", extra[0], "with run = DIR the capture exists already; "
                                              "leave out the keys that describe a new capture")
        return
    if "command" not in cap:
        raise err.at("capture", None, 'missing key \'capture.command\' (e.g. ["-m", "prism.workloads.gpt"]), '
                                      "or run = DIR to use an existing capture")
    if "layout" in cap and "world_size" in cap:
        raise err.at("capture", "world_size", "the layout gives the world size (tp*pp*dp); leave world_size out")
    if "layout" not in cap and "world_size" not in cap:
        raise err.at("capture", None, 'give layout = "tp=T,pp=P,dp=D" or world_size = N')
    for cmd in dims.get("capture.command", [cap["command"]]):
        if "layout" in cap and any(a in ("--tp", "--pp", "--dp", "--ep") for a in cmd):
            raise err.at("capture", "command", "the layout appends --tp/--pp/--dp/--ep; leave them out of the command")


def _check_steps(err: _Errors, fixed: Mapping[str, Any], dims: Mapping[str, list]) -> None:
    steps = dims.get("campaign.step", [fixed.get("campaign.step", "predict")])
    if "emulate" not in steps:
        return
    for key in PREDICT_ONLY:
        dotted = f"whatif.{key}"
        default = KEYS["whatif"][key][2]
        if any(v != default for v in dims.get(dotted, [fixed.get(dotted, default)])):
            raise err.at("whatif", key, "the emulate step does not apply this knob (predict does): "
                                        "sweep step = \"predict\" for it, or run emulate without it")


def _short_names(ordered: list[str]) -> dict[str, str]:
    """The last part of each dotted key, or more of it where two would clash."""
    out = {}
    for k in ordered:
        parts = k.split(".")
        for n in range(1, len(parts) + 1):
            name = ".".join(parts[-n:])
            if sum(1 for o in ordered if o.split(".")[-n:] == parts[-n:]) == 1:
                break
        out[k] = name
    return out


def _plot(err: _Errors, plot: Mapping[str, Any], ordered: list[str], labels: dict[str, str],
          dims: Mapping[str, list]) -> tuple[str | None, str, tuple[str, ...]]:
    by_label = {labels[k]: k for k in ordered}
    for key in ("x", "y"):
        if key in plot:
            problem = KEYS["plot"][key][0](plot[key])
            if problem:
                raise _value_error(err, "plot", key, plot[key], problem, False)
    x = plot.get("x")
    if x is not None and x not in by_label:
        raise err.at("plot", "x", f"{x!r} is not a dimension of this campaign (dimensions: "
                                  f"{', '.join(by_label) or 'none'})")
    if x is None:
        numeric = [k for k in ordered if all(_is_num(v) for v in dims[k])]
        x = labels[numeric[0]] if numeric else (labels[ordered[0]] if ordered else None)
    series = plot.get("series")
    if series is None:
        series = [labels[k] for k in ordered if labels[k] != x]
    elif isinstance(series, str):
        series = [series]
    if not isinstance(series, list) or not all(isinstance(s, str) for s in series):
        raise _value_error(err, "plot", "series", plot.get("series"), "a dimension's name or a list of them", False)
    bad = [s for s in series if s not in by_label or s == x]
    if bad:
        raise err.at("plot", "series", f"{bad[0]!r} is not a dimension other than x (dimensions: "
                                       f"{', '.join(by_label) or 'none'})")
    return x, plot.get("y", "iteration_ms"), tuple(series)
