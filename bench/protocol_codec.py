"""What the wire protocol's checked codec costs per message, next to bare orjson.

Encodes and decodes three typical messages (a collective arrival with shapes
and splits, a slot request, a collective result with a payload) with
``protocol.encode`` / ``protocol.decode`` (type-checked) and with bare
``orjson`` on the same header dict (no checks), and prints the per-message
times and their ratio. Writes ``bench/results/protocol_codec-DATE[-MACHINE].json``
(``--label`` replaces the date).

    python bench/protocol_codec.py [--n 50000] [--label before]
"""

from __future__ import annotations

import argparse
import json
import pathlib
import platform
import sys
import time

import orjson

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent.parent))
from prism.core import protocol as P  # noqa: E402
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _results import per_call_us, result_path  # noqa: E402

MESSAGES = {
    "coll": P.CollectiveArrive(
        rank=3, gid="g3-dfdbea34", seq=41, op="all_to_all_single", reduce_op="", dtype="bfloat16",
        in_shapes=((4096, 1024),), out_shapes=((4096, 1024),),
        in_splits=(1000, 1048, 1024, 1024), out_splits=(1024, 1024, 1000, 1048),
        async_op=True, issue_ns=1_000_000, payloads=(b"x" * 64,),
    ),
    "slot_req": P.SlotRequest(rank=7),
    "coll_res": P.CollectiveResult(gid="world", seq=9, payloads=(b"x" * 64,)),
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=50_000)
    ap.add_argument("--json", default=None, help="where to write the JSON (default: bench/results/protocol_codec-"
                    "DATE[-$BENCH_MACHINE].json)")
    args = ap.parse_args()
    n = args.n
    rows = []
    for name, msg in MESSAGES.items():
        frames = P.encode(msg)
        head = bytes(frames[0])
        obj = orjson.loads(head)
        rows.append((f"encode {name}", per_call_us(lambda: P.encode(msg), n), per_call_us(lambda: orjson.dumps(obj), n)))
        rows.append((f"decode {name}", per_call_us(lambda: P.decode(frames), n), per_call_us(lambda: orjson.loads(head), n)))
    print(f"n={n}, best of 3; Python {platform.python_version()}, orjson {orjson.__version__}")
    print(f"{'op':<18}{'prism us':>10}{'orjson us':>11}{'ratio':>8}")
    for op, ours, bare in rows:
        print(f"{op:<18}{ours:>10.2f}{bare:>11.2f}{ours / bare:>8.1f}")
    out = pathlib.Path(args.json) if args.json else result_path("protocol_codec")
    out.parent.mkdir(exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d", time.gmtime()),
                "machine": platform.platform(),
                "python": platform.python_version(),
                "orjson": orjson.__version__,
                "n": n,
                "rows": [{"op": op, "prism_us": ours, "orjson_us": bare, "ratio": ours / bare} for op, ours, bare in rows],
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
