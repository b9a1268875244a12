"""What PrismTrace's checked codec costs per record, next to bare orjson.

Encodes and decodes a typical collective record with ``encode_event`` /
``decode_event`` (type-checked both ways) and with bare ``orjson`` on the
same dict (no checks), and prints the per-record times and their ratio.
Writes ``bench/results/trace_codec-DATE[-MACHINE].json``.

    python bench/trace_codec.py [--n 50000]
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
from prism.core.trace import Collective, decode_event, encode_event  # noqa: E402

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))
from _results import per_call_us, result_path  # noqa: E402

EV = Collective(
    gid="g3-dfdbea34", seq=41, op="all_to_all_single", reduce_op="", dtype="bfloat16",
    in_shapes=((4096, 1024),), out_shapes=((4096, 1024),), bytes=8 * 1024 * 1024,
    in_splits=(1000, 1048, 1024, 1024), out_splits=(1024, 1024, 1000, 1048),
    async_op=True, issue_ns=1_000_000, wait_ns=1_200_000, end_ns=1_900_000, step=7,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--n", type=int, default=50_000)
    n = ap.parse_args().n
    line = encode_event(EV)
    obj = orjson.loads(line)
    rows = [
        ("encode", per_call_us(lambda: encode_event(EV), n), per_call_us(lambda: orjson.dumps(obj), n)),
        ("decode", per_call_us(lambda: decode_event(line), n), per_call_us(lambda: orjson.loads(line), n)),
    ]
    print(f"record: {len(line)} bytes; n={n}, best of 3; Python {platform.python_version()}, orjson {orjson.__version__}")
    print(f"{'op':<8}{'prism us':>10}{'orjson us':>11}{'ratio':>8}")
    for op, ours, bare in rows:
        print(f"{op:<8}{ours:>10.2f}{bare:>11.2f}{ours / bare:>8.1f}")
    out = result_path("trace_codec")
    out.parent.mkdir(exist_ok=True)
    out.write_text(
        json.dumps(
            {
                "date": time.strftime("%Y-%m-%d", time.gmtime()),
                "machine": platform.platform(),
                "python": platform.python_version(),
                "orjson": orjson.__version__,
                "record_bytes": len(line),
                "n": n,
                "rows": [{"op": op, "prism_us": ours, "orjson_us": bare, "ratio": ours / bare} for op, ours, bare in rows],
            },
            indent=2,
        )
        + "\n"
    )


if __name__ == "__main__":
    main()
