"""A GPU sandbox's recorded delivery in isolation: the host time of
``RecordedFeed.deliver`` per call and the cost of each torch call it makes.

    python bench/recorded_feed.py [--out FILE.json] [--mib 8] [--calls 32] [--steps 6] [--pool-mib 256]
                                  [--variants native,torch] [--contend 0,1] [--stream busy,blocked]

primitives
    the host time of each CUDA call the delivery makes (a slice of the pool,
    entering the side stream, a non-blocking host-to-device copy, an event
    made and recorded, a stream waiting on it, a device-to-device copy, an
    event's query, ``current_stream``), microseconds per call, best of 3
    rounds, on an idle stream.
feed
    a synthetic recording (``--calls`` outputs of ``--mib`` MiB per step, the
    bundled GPT tp2's shape: 32 all-reduces of 8 MiB) delivered as a sandbox
    would: per call the stream is kept busy (``torch.cuda._sleep``, the
    compute between two collectives), then ``deliver`` queues the copy;
    the CPU waits for the GPU once per step. Per call: ``deliver``'s host time
    and its parts (``f_lock``, ``f_adv0``, ``f_copy``, ``f_adv1``: see
    ``RecordedFeed.deliver``), p50 and mean, steps after the first; the
    blocks staged per call. Every delivered output is checked against its
    recording at the end of each step. Once per ``--variants`` (``native``:
    the prefetch pool's copies and events as single calls into the compiled
    extension; ``torch``: through torch's Python API,
    ``PRISM_POOL_NATIVE=0``) and per ``--contend`` (1: a thread beside that
    wakes every 100 us and runs ~20 us of Python, as a sandbox's transport
    and completion threads do: each torch call that lets the GIL go may then
    wait for it) and per ``--stream`` (``blocked``: each call also queued behind a
    release flag flipped only at the step's end, as a sandbox's stream holds
    behind its releases), interleaved; the table gives each one's per-call
    host time.

Needs CUDA; prints a table and writes JSON (bench/README.md names the file).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from _results import per_call_us, result_path, write_json  # noqa: E402


def primitives(dev: torch.device) -> dict[str, float]:
    import cuda_ext

    pool = cuda_ext.DevicePool(64 << 20, dev)
    side = torch.cuda.Stream(device=dev)
    host = torch.empty(1 << 20, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
    src = pool.slab[:1 << 20]
    ev = torch.cuda.Event()
    ev.record()
    torch.cuda.synchronize()
    n = 2000

    def enter_side():
        with torch.cuda.stream(side):
            pass

    def h2d():
        with torch.cuda.stream(side):
            src.copy_(host, non_blocking=True)

    def event_record():
        e = torch.cuda.Event()
        e.record(side)

    out = {
        "slab slice": per_call_us(lambda: pool.slab[4096:8192], n),
        "enter side stream": per_call_us(enter_side, n),
        "h2d copy_ on side stream (1 MiB)": per_call_us(h2d, n // 4),
        "Event() + record": per_call_us(event_record, n),
        "current_stream()": per_call_us(lambda: torch.cuda.current_stream(dev), n),
        "current_stream().wait_event": per_call_us(lambda: torch.cuda.current_stream(dev).wait_event(ev), n),
        "d2d copy_ (1 MiB)": per_call_us(lambda: dst.copy_(src), n // 4),
        "event query": per_call_us(ev.query, n),
        "view(dtype).view(shape)": per_call_us(lambda: src.view(torch.uint8).view((1 << 20,)), n),
        "reshape(-1).view(uint8)": per_call_us(lambda: dst.reshape(-1).view(torch.uint8), n),
    }
    torch.cuda.synchronize()
    return out


def _recording(tmp: pathlib.Path, calls: int, steps: int, nbytes: int) -> tuple[pathlib.Path, list[str]]:
    """A run folder whose rank 0 recorded ``calls * steps`` outputs of
    ``nbytes`` (float32 ramps, each its own), as ``prism capture --record`` writes them."""
    from prism.core.payloads import digest
    from prism.core.trace.records import Payload
    from prism.shell.runfolder import PayloadWriter, payload_data_name, payload_index_path

    w = PayloadWriter(tmp, 0)
    off = 0
    refs = []
    base = torch.arange(nbytes // 4, dtype=torch.float32)
    for s in range(steps):
        for c in range(calls):
            ref = f"coll:1:{s * calls + c}:out"
            data = (base + (s * calls + c)).numpy().tobytes()
            rec = Payload(ref=ref, role="recv", dtype="float32", shape=(nbytes // 4,), nbytes=len(data),
                          digest=digest(data), step=s, file=payload_data_name(0), offset=off)
            w.received([(rec, memoryview(data))])
            off += len(data)
            refs.append(ref)
    w.close()
    return payload_index_path(tmp, 0), refs


class Contender:
    """A thread that wakes every ``period_s`` and runs ~20 us of Python (a
    message decoded, a dict looked up and updated), as a sandbox's transport
    and completion threads do per call; counts its wake-ups."""

    def __init__(self, period_s: float = 100e-6) -> None:
        import threading

        self.period_s = period_s
        self.wakes = 0
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, name="contender", daemon=True)

    def _run(self) -> None:
        import json

        msg = json.dumps({"kind": "result", "gid": 3, "seq": 17, "t_ns": 123456789, "shapes": [[1024, 1024]] * 4})
        table: dict = {}
        while not self._stop.is_set():
            time.sleep(self.period_s)
            for _ in range(8):
                d = json.loads(msg)
                table[(d["gid"], d["seq"])] = d
                table.pop((d["gid"], d["seq"]), None)
            self.wakes += 1

    def __enter__(self) -> "Contender":
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()


def feed_run(index: pathlib.Path, refs: list[str], calls: int, nbytes: int, pool_bytes: int, sleep_cycles: int,
             dev: torch.device, native: bool = True, blocked: bool = False) -> dict:
    import cuda_ext
    from prism.rank import devicepath

    os.environ[cuda_ext.POOL_NATIVE_ENV] = "1" if native else "0"  # read as the pool is made
    t_load = time.perf_counter()
    feed = devicepath.RecordedFeed(str(index), pool_bytes, dev)
    t_load = time.perf_counter() - t_load
    outs = [torch.empty(nbytes // 4, dtype=torch.float32, device=dev) for _ in range(calls)]
    base = torch.arange(nbytes // 4, dtype=torch.float32, device=dev)
    rows = []
    bad = 0
    flags = None
    if blocked and dev.type == "cuda":
        import cuda_ext

        flags = cuda_ext.ReleaseFlags(calls, dev)
        gen = 0
    for i, ref in enumerate(refs):
        c = i % calls
        if dev.type == "cuda":
            torch.cuda._sleep(sleep_cycles)  # the compute before the call
            if flags is not None:  # the stream holds at each call until the step's end, as behind a release
                if c == 0:
                    gen += 1
                flags.wait(c, gen)
        log: dict = {}
        t0 = time.perf_counter_ns()
        ok = feed.deliver(ref, outs[c], log)
        t1 = time.perf_counter_ns()
        if not ok:
            raise SystemExit(f"recorded_feed: {ref} was not delivered")
        rows.append({"step": i // calls, "total_us": (t1 - t0) / 1e3,
                     **{k: v for k, v in log.items() if k == "f_staged"},
                     **({"lock_us": (log["f_adv0"] - log["f_lock"]) / 1e3,
                         "copy_us": (log["f_copy"] - log["f_adv0"]) / 1e3,
                         "adv1_us": (log["f_adv1"] - log["f_copy"]) / 1e3} if "f_lock" in log else {})})
        if c == calls - 1:  # the step ends: the CPU waits for the GPU (the loss's .item())
            if flags is not None:
                for k in range(calls):
                    flags.release(k, gen)
            for k, o in enumerate(outs):
                want = base + (i - calls + 1 + k)
                bad += int(not torch.equal(o, want))
    if dev.type == "cuda":
        torch.cuda.synchronize()
    steady = [r for r in rows if r["step"] >= 1]
    agg = {}
    for k in ("total_us", "lock_us", "copy_us", "adv1_us"):
        v = [r[k] for r in steady if k in r]
        if v:
            agg[k] = {"p50": statistics.median(v), "mean": statistics.fmean(v), "max": max(v)}
    st = feed.stats()
    return {"load_s": t_load, "stats": st, "mismatched_outputs": bad, "per_call": agg,
            "staged_per_call": statistics.fmean(r.get("f_staged", 0) for r in steady), "rows": rows}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(result_path("recorded_feed")))
    ap.add_argument("--mib", type=float, default=8)
    ap.add_argument("--calls", type=int, default=32)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--pool-mib", type=int, default=256)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of the feed's logic (no primitives)")
    ap.add_argument("--sleep-cycles", type=int, default=1_500_000, help="GPU cycles of compute between two calls")
    ap.add_argument("--variants", default="native,torch", help="native, torch (the pool's path; see above)")
    ap.add_argument("--contend", default="0,1", help="0, 1: without and with a GIL-taking thread beside")
    ap.add_argument("--stream", default="busy,blocked",
                    help="busy: the stream computes between calls; blocked: each call also waits on a release "
                         "flag flipped only at the step's end (the GPU holds, the work queues up behind)")
    a = ap.parse_args()
    variants = [v for v in a.variants.split(",") if v]
    contend = [int(c) for c in a.contend.split(",") if c]
    streams = [m for m in a.stream.split(",") if m]
    if not streams or set(streams) - {"busy", "blocked"}:
        sys.exit(f"recorded_feed bench: --stream takes busy,blocked (got {a.stream!r})")
    if not variants or set(variants) - {"native", "torch"} or not contend or set(contend) - {0, 1}:
        sys.exit(f"recorded_feed bench: --variants takes native,torch and --contend 0,1 (got {a.variants!r}, "
                 f"{a.contend!r})")
    if a.device == "cuda" and not torch.cuda.is_available():
        sys.exit("recorded_feed bench: needs a CUDA device (--device cpu: a smoke run)")
    import cuda_ext

    dev = torch.device(a.device, 0) if a.device == "cuda" else torch.device("cpu")
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    res = {"benchmark": "recorded_feed", "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
           "command": "python " + " ".join(sys.argv),
           "gpu": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "cuda_ext": cuda_ext.info().path,
           "versions": {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.version.cuda}}
    res["primitives_us"] = primitives(dev) if dev.type == "cuda" else {}
    nbytes = int(a.mib * (1 << 20)) // 4 * 4
    res["feeds"] = {}
    with tempfile.TemporaryDirectory(prefix="prism-feed-") as tmp:
        index, refs = _recording(pathlib.Path(tmp), a.calls, a.steps, nbytes)
        for m, c, v in ((m, c, v) for m in streams for c in contend for v in variants):
            # interleaved: each stream mode and contention level runs both paths back to back
            name = f"{v}{'-contended' if c else ''}{'-blocked' if m == 'blocked' else ''}"
            run = (index, refs, a.calls, nbytes, a.pool_mib << 20, a.sleep_cycles, dev, v == "native",
                   m == "blocked")
            if c:
                with Contender() as con:
                    f = feed_run(*run)
                f["contender_wakes"] = con.wakes
            else:
                f = feed_run(*run)
            f.pop("rows", None)
            res["feeds"][name] = f
    print(f"recorded delivery on {res['gpu']}, torch {torch.__version__}, {res['date_utc']}, cuda_ext {res['cuda_ext']}")
    print(f"{'primitive':<40} {'us/call':>8}")
    for k, v in res["primitives_us"].items():
        print(f"  {k:<38} {v:>8.1f}")
    print(f"feed: {a.calls} calls x {a.steps} steps of {a.mib:g} MiB, pool {a.pool_mib} MiB; per call, steps after the first")
    print(f"  {'variant':<26} {'native':>6} {'total p50':>10} {'mean':>8} {'max':>9}  {'direct':>6} {'bad':>4}")
    bad = 0
    for name, f in res["feeds"].items():
        t = f["per_call"]["total_us"]
        bad += f["mismatched_outputs"]
        print(f"  {name:<26} {f['stats']['native']:>6} {t['p50']:>10.1f} {t['mean']:>8.1f} {t['max']:>9.1f}  "
              f"{f['stats']['direct']:>6} {f['mismatched_outputs']:>4}")
    res["torch_over_native_p50"] = {}
    for name, f in res["feeds"].items():
        twin = res["feeds"].get(name.replace("native", "torch", 1)) if name.startswith("native") else None
        if twin:
            rest = name[len("native"):] or " (quiet, busy stream)"
            r = twin["per_call"]["total_us"]["p50"] / f["per_call"]["total_us"]["p50"]
            res["torch_over_native_p50"][rest.lstrip("-")] = r
            print(f"  torch / native per-call p50{rest}: {r:.2f}x")
    write_json(a.out, res)
    return 0 if bad == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
