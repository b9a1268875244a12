"""What a polling thread costs the thread that issues torch ops (the GIL).

    python bench/gil_poll.py [--device cpu|cuda] [--ops 20000] [--reps 5] [--out FILE.json]

A GPU sandbox's reach watcher (``prism.rank.devicepath._Watcher``) looks at
the wait kernels' stamps every ``PRISM_DEVICE_POLL_US`` (20 us) while a call
is in flight, which in a sandbox is nearly always. Each torch op of the
program's thread lets the GIL go and takes it back; where another thread
wakes that often to run Python, the op must wait for it. This benchmark times
the main thread's small ops (an add and an in-place multiply on 64 elements,
on ``--device``) side by side in one process:

- ``alone``: no other thread;
- ``python-poll``: a thread that checks a stamp in Python and sleeps 20 us,
  as the watcher did before 2026-12-07 (and does with
  ``PRISM_DEVICE_POLL_NATIVE=0``);
- ``python-poll-200``: the same every 200 us (``PRISM_DEVICE_POLL_US=200``);
- ``native``: a thread in cuda_ext's ``wait_stamps`` (the watcher's wait
  now: it polls every 20 us with the GIL released; needs the compiled
  extension, so a GPU), returning every 10 ms to Python.

Each mode's median time per op over ``--reps`` repetitions, and its ratio to
``alone`` measured in the same run, printed and written as JSON.
"""

from __future__ import annotations

import argparse
import pathlib
import platform
import statistics
import sys
import threading
import time

ROOT = pathlib.Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from _results import result_path, write_json  # noqa: E402  (bench/ is on sys.path)


def _python_poller(stop: threading.Event, period_s: float, stamps) -> None:
    view = stamps.numpy()
    while not stop.is_set():
        if int(view[0]):  # never set: the watcher's check of a reach not yet stamped
            break
        time.sleep(period_s)


def _native_poller(stop: threading.Event, wait, stamps, gen) -> None:
    while not stop.is_set():
        wait(stamps, 0, 1, gen, 0, 20_000, 10_000_000)


def time_ops(torch, device: str, ops: int) -> float:
    x = torch.ones(64, device=device)
    y = torch.ones(64, device=device)
    if device == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(ops):
        z = x.add(y)
        z.mul_(2)
    if device == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / (2 * ops) * 1e6


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    ap.add_argument("--ops", type=int, default=20000)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--out", default=str(result_path("gil_poll")))
    a = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    wait = None
    if a.device == "cuda" or torch.cuda.is_available():
        import cuda_ext

        mod = cuda_ext.kernels()
        wait = getattr(mod, "wait_stamps", None) if mod is not None else None
    stamps = torch.zeros(2, dtype=torch.int64)
    gen = torch.zeros(1, dtype=torch.int64)
    modes: dict[str, object] = {"alone": None, "python-poll": 20e-6, "python-poll-200": 200e-6}
    if wait is not None:
        modes["native"] = "native"
    time_ops(torch, a.device, 1000)  # warm-up
    per: dict[str, list[float]] = {m: [] for m in modes}
    for _ in range(a.reps):  # interleaved: each rep times every mode
        for m, how in modes.items():
            stop = threading.Event()
            th = None
            if how == "native":
                th = threading.Thread(target=_native_poller, args=(stop, wait, stamps, gen), daemon=True)
            elif how is not None:
                th = threading.Thread(target=_python_poller, args=(stop, how, stamps), daemon=True)
            if th is not None:
                th.start()
                time.sleep(0.01)
            per[m].append(time_ops(torch, a.device, a.ops))
            stop.set()
            if th is not None:
                th.join()
    base = statistics.median(per["alone"])
    rows = [{"mode": m, "us_per_op": statistics.median(v), "ratio_to_alone": statistics.median(v) / base,
             "reps_us": v} for m, v in per.items()]
    print(f"{'mode':<18} {'us per op':>10} {'x alone':>8}")
    for r in rows:
        print(f"{r['mode']:<18} {r['us_per_op']:>10.2f} {r['ratio_to_alone']:>8.2f}")
    if wait is None:
        print("(native: not timed, no compiled cuda_ext here)")
    write_json(a.out, {"benchmark": "gil_poll", "date_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                       "command": "python " + " ".join(sys.argv), "device": a.device,
                       "versions": {"python": platform.python_version(), "torch": torch.__version__},
                       "rows": rows})
    return 0


if __name__ == "__main__":
    sys.exit(main())
