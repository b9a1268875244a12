"""Transport overhead: Prism's sockets against bare pyzmq, side by side.

An echo server runs in its own process (as the coordinator does) and a client
in this one (as a rank). Each Prism component is swapped in alone:

  bare / bare      pyzmq DEALER (blocking)      -> pyzmq ROUTER (blocking)
  bare / trio      pyzmq DEALER (blocking)      -> Prism AsyncSocket ROUTER (trio)
  bare / nowait    pyzmq DEALER (blocking)      -> AsyncSocket, replies with
                                                   send_message_nowait (no yield)
  bare / floor     pyzmq DEALER (blocking)      -> bare trio loop on zmq.FD: what
                                                   trio itself costs (no Prism code)
  client / bare    Prism BlockingClient         -> pyzmq ROUTER (blocking)
  client / trio    Prism BlockingClient         -> Prism AsyncSocket ROUTER (trio)

The message is a CollectiveResult (echoed as is, so BlockingClient's routing
works against the bare server). Measured: small-message round trip p50/p99
and the throughput of a 64 MiB payload echoed (bytes moved both ways / time),
over ipc and loopback tcp. All four clients stay connected and take turns in
short blocks, so drift in the machine's load hits all of them alike; the
ratio to bare is the median over blocks of the block's p50 over bare's p50
in the same round (the interquartile range shows its spread). CPU time per
round trip (client process with all its threads, server process; clock-tick
resolution, summed over all blocks) is reported beside it: unlike latency it
hardly depends on what else this machine runs. Likewise the CPU time of
each large echo (client and server together) shows any extra payload copy.

Goals: trio server round trip <= 1.5x bare, BlockingClient <= 2x bare,
throughput >= 80% of bare.

    python bench/transport_throughput.py [--blocks N] [--block-iters N] [--transports ipc tcp]
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import os
import pathlib
import platform
import statistics
import sys
import tempfile
import time

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))

import orjson  # noqa: E402
import trio  # noqa: E402
import zmq  # noqa: E402

import prism  # noqa: E402
from prism.core.protocol import CollectiveResult, ProtocolError, encode  # noqa: E402
from transport import AsyncSocket, BlockingClient  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _results import result_path  # noqa: E402

STOP = [b"STOP"]  # not a valid message: the trio server stops on its ProtocolError


# --- servers (child processes) ---------------------------------------------


def bare_server(endpoint: str, conn) -> None:
    ctx = zmq.Context()
    sock = ctx.socket(zmq.ROUTER)
    sock.bind(endpoint)
    conn.send(sock.getsockopt_string(zmq.LAST_ENDPOINT))
    while True:
        frames = sock.recv_multipart(copy=False)
        if len(frames) == 2 and frames[1].bytes == STOP[0]:
            break
        sock.send_multipart(frames, copy=False)
    sock.close(linger=0)
    ctx.term()


def trio_server(endpoint: str, conn, nowait: bool = False) -> None:
    async def main() -> None:
        with AsyncSocket.create(zmq.ROUTER, context=zmq.Context()) as sock:
            conn.send(sock.bind(endpoint))
            while True:
                try:
                    ident, msg = await sock.recv_message()
                except ProtocolError:
                    break
                if nowait:
                    sock.send_message_nowait(msg, ident)
                else:
                    await sock.send_message(msg, ident)

    trio.run(main)


def trio_nowait_server(endpoint: str, conn) -> None:
    trio_server(endpoint, conn, nowait=True)


def trio_floor_server(endpoint: str, conn) -> None:
    """The least any trio integration pays: wait on the descriptor, echo raw
    frames; no codec, no ownership checks, no schedule point per send."""

    async def main() -> None:
        ctx = zmq.Context()
        sock = ctx.socket(zmq.ROUTER)
        sock.bind(endpoint)
        conn.send(sock.getsockopt_string(zmq.LAST_ENDPOINT))
        fd = sock.getsockopt(zmq.FD)
        while True:
            if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                await trio.lowlevel.wait_readable(fd)
                continue
            frames = sock.recv_multipart(zmq.NOBLOCK, copy=False)
            if len(frames) == 2 and frames[1].bytes == STOP[0]:
                break
            sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        sock.close(linger=0)
        ctx.term()

    trio.run(main)


# --- clients (this process) --------------------------------------------------


class BareClient:
    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)

    def round_trip(self, msg: CollectiveResult) -> CollectiveResult:
        self.sock.send_multipart(encode(msg), copy=False)
        return self.sock.recv_multipart(copy=False)

    def close(self) -> None:
        self.sock.send_multipart(STOP)
        self.sock.close(linger=1000)


class PrismClient:
    def __init__(self, endpoint: str) -> None:
        # No handshake: the echo servers would echo Hello, not Welcome.
        self.client = BlockingClient(endpoint)

    def round_trip(self, msg: CollectiveResult) -> CollectiveResult:
        fut = self.client.future(("coll", msg.gid, msg.seq))
        self.client.send(msg)
        return fut.result(60)

    def close(self) -> None:
        # The stop frame is not a message, so it goes through the raw socket
        # of a bare client.
        self.client.close(linger=1)


def stop_server(endpoint: str) -> None:
    c = BareClient(endpoint)
    c.close()


CONFIGS = [
    ("bare", "bare", BareClient, "bare"),
    ("bare", "trio", BareClient, "trio"),
    ("bare", "nowait", BareClient, "nowait"),
    ("bare", "floor", BareClient, "floor"),
    ("client", "bare", PrismClient, "bare"),
    ("client", "trio", PrismClient, "trio"),
]
SERVERS = {
    "bare": bare_server,
    "trio": trio_server,
    "nowait": trio_nowait_server,
    "floor": trio_floor_server,
}


def measure_small(client, iters: int, seq0: int) -> list[int]:
    payload = b"12345678"
    samples = []
    for i in range(iters):
        msg = CollectiveResult("g", seq0 + i, payloads=(payload,))
        t0 = time.perf_counter_ns()
        client.round_trip(msg)
        samples.append(time.perf_counter_ns() - t0)
    return samples


def measure_large(client, iters: int, payload: bytearray, seq0: int) -> list[int]:
    samples = []
    for i in range(iters):
        msg = CollectiveResult("g", seq0 + i, payloads=(payload,))
        t0 = time.perf_counter_ns()
        reply = client.round_trip(msg)
        samples.append(time.perf_counter_ns() - t0)
        del reply
    return samples


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid``, all threads (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def pct(xs: list[int], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] / 1000.0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--blocks", type=int, default=40, help="interleaved blocks per configuration")
    ap.add_argument("--block-iters", type=int, default=100, help="round trips per block")
    ap.add_argument("--large-every", type=int, default=4, help="one large echo every N blocks")
    ap.add_argument("--size-mib", type=int, default=64)
    ap.add_argument("--transports", nargs="+", default=["ipc", "tcp"])
    ap.add_argument("--out", default=str(result_path("transport_throughput")))
    args = ap.parse_args()

    load_before = os.getloadavg()
    mp = multiprocessing.get_context("spawn")
    payload = bytearray(os.urandom(args.size_mib << 20))
    results = []
    for transport in args.transports:
        servers = {}
        tmp = tempfile.mkdtemp(prefix="prism-bench-")
        for kind, target in SERVERS.items():
            ep = f"ipc://{tmp}/{kind}.sock" if transport == "ipc" else "tcp://127.0.0.1:*"
            parent, child = mp.Pipe()
            proc = mp.Process(target=target, args=(ep, child), daemon=True)
            proc.start()
            servers[kind] = (proc, parent.recv())
        clients = {(c, s): cls(servers[server][1]) for c, s, cls, server in CONFIGS}
        small: dict[tuple[str, str], list[int]] = {k: [] for k in clients}
        large: dict[tuple[str, str], list[int]] = {k: [] for k in clients}
        # Per block, the p50 of each configuration over bare's: paired in
        # time, so the load of this machine's other work cancels out.
        block_ratios: dict[tuple[str, str], list[float]] = {k: [] for k in clients}
        # CPU seconds spent on small round trips (client process, all its
        # threads; server process): unlike latency, barely moved by the load
        # of other programs on this machine.
        cpu_client = {k: 0.0 for k in clients}
        cpu_server = {k: 0.0 for k in clients}
        # CPU seconds (client + server) of the large echoes: an extra copy of
        # the payload shows here even when the machine's load hides it in
        # the throughput.
        cpu_large = {k: 0.0 for k in clients}
        seq = 0
        for client in clients.values():
            measure_small(client, 200, seq)  # warm-up: connections, caches
            seq += 200
        for block in range(args.blocks):
            p50 = {}
            for key, client in clients.items():
                server_pid = servers[key[1]][0].pid
                c0, s0 = time.process_time(), cpu_seconds(server_pid)
                samples = measure_small(client, args.block_iters, seq)
                cpu_client[key] += time.process_time() - c0
                cpu_server[key] += cpu_seconds(server_pid) - s0
                seq += args.block_iters
                small[key] += samples
                p50[key] = statistics.median(samples)
                if block % args.large_every == 0:
                    c0, s0 = time.process_time(), cpu_seconds(server_pid)
                    large[key] += measure_large(client, 1, payload, seq)
                    cpu_large[key] += time.process_time() - c0 + cpu_seconds(server_pid) - s0
                    seq += 1
            for key in clients:
                block_ratios[key].append(p50[key] / p50[("bare", "bare")])
        for key, client in clients.items():
            if isinstance(client, PrismClient):
                client.close()
            else:
                client.sock.close(linger=0)
        for proc, ep in servers.values():
            stop_server(ep)
            proc.join(10)
        base_tp = 2 * len(payload) / (statistics.median(large[("bare", "bare")]) / 1e9) / 1e9
        for cname, sname, _, _ in CONFIGS:
            s = small[(cname, sname)]
            tp = 2 * len(payload) / (statistics.median(large[(cname, sname)]) / 1e9) / 1e9
            ratios = sorted(block_ratios[(cname, sname)])
            n = len(s)
            cpu_c = cpu_client[(cname, sname)] / n * 1e6
            cpu_s = cpu_server[(cname, sname)] / n * 1e6
            results.append(
                {
                    "transport": transport,
                    "client": cname,
                    "server": sname,
                    "small_round_trips": len(s),
                    "rt_p50_us": round(pct(s, 0.5), 1),
                    "rt_p99_us": round(pct(s, 0.99), 1),
                    "rt_p50_ratio": round(statistics.median(ratios), 2),
                    "rt_p50_ratio_iqr": [round(ratios[len(ratios) // 4], 2), round(ratios[3 * len(ratios) // 4], 2)],
                    "client_cpu_us_per_rt": round(cpu_c, 1),
                    "server_cpu_us_per_rt": round(cpu_s, 1),
                    "large_echoes": len(large[(cname, sname)]),
                    "large_mib": args.size_mib,
                    "large_cpu_ms_per_echo": round(cpu_large[(cname, sname)] / len(large[(cname, sname)]) * 1e3, 1),
                    "throughput_gbps": round(tp, 2),
                    "throughput_ratio": round(tp / base_tp, 2),
                }
            )

    header = (
        f"{'tr':4} {'client':7} {'server':6} {'p50 us':>8} {'p99 us':>8} {'x bare':>7} "
        f"{'(IQR)':>11} {'cli cpu':>8} {'srv cpu':>8} {'GB/s':>7} {'of bare':>8} {'lg cpu ms':>9}"
    )
    print(header)
    print("-" * len(header))
    for r in results:
        print(
            f"{r['transport']:4} {r['client']:7} {r['server']:6} {r['rt_p50_us']:8.1f} "
            f"{r['rt_p99_us']:8.1f} {r['rt_p50_ratio']:7.2f} "
            f"{r['rt_p50_ratio_iqr'][0]:5.2f}-{r['rt_p50_ratio_iqr'][1]:<5.2f} "
            f"{r['client_cpu_us_per_rt']:8.1f} {r['server_cpu_us_per_rt']:8.1f} {r['throughput_gbps']:7.2f} "
            f"{r['throughput_ratio']:8.0%} {r['large_cpu_ms_per_echo']:9.1f}"
        )
    report = {
        "benchmark": "transport",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
        "machine": {
            "node": platform.node(),
            "platform": platform.platform(),
            "processor": platform.processor() or platform.machine(),
            "cpus": os.cpu_count(),
            "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
            # Other programs' load: latency ratios on a busy machine mix in
            # scheduling delays that hit the configurations unequally.
            "loadavg_1_5_15_before": [round(x, 2) for x in load_before],
            "loadavg_1_5_15_after": [round(x, 2) for x in os.getloadavg()],
        },
        "versions": {
            "python": platform.python_version(),
            "pyzmq": zmq.__version__,
            "libzmq": zmq.zmq_version(),
            "trio": trio.__version__,
            "orjson": orjson.__version__,
            "prism": prism.__version__,
        },
        "settings": vars(args),
        "goals": {"trio_rt_ratio_max": 1.5, "client_rt_ratio_max": 2.0, "throughput_ratio_min": 0.8},
        "results": results,
    }
    out = pathlib.Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
