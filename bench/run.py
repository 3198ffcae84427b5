"""Benchmark entry point.

    python -m bench.run                       # all three benchmarks, full windows (~15-20 min)
    python -m bench.run --quick               # short windows, one round (a few minutes)
    python -m bench.run --only identity --rounds 3
    python -m bench.run --only embedding,json --quick

Writes bench/results/<name>[-quick].md / .png / .json. Exit status 1 when a benchmark could not
run (a target that is missed is reported in the tables, not in the exit status).
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

from bench.common import Settings, log
from bench.report import finish

BENCHMARKS = ("embedding", "identity", "json")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(BENCHMARKS),
                   help=f"comma-separated subset of {', '.join(BENCHMARKS)} (default: all)")
    p.add_argument("--quick", action="store_true", help="short measurement windows and one round")
    p.add_argument("--rounds", type=int, default=None, help="interleaved rounds (default: 1 quick, 3 full)")
    args = p.parse_args(argv)
    chosen = [b.strip() for b in args.only.split(",") if b.strip()]
    unknown = [b for b in chosen if b not in BENCHMARKS]
    if unknown:
        p.error(f"unknown benchmark(s) {unknown}; choose from {BENCHMARKS}")
    settings = Settings.make(args.quick, args.rounds)
    log(settings.describe())
    failed = []
    written = []
    for name in BENCHMARKS:
        if name not in chosen:
            continue
        t0 = time.monotonic()
        log(f"=== {name} ===")
        try:
            if name == "embedding":
                from bench import text_embedding as mod
            elif name == "identity":
                from bench import identity as mod
            else:
                from bench import http_json as mod
            written.append(mod.run(settings))
        except KeyboardInterrupt:
            log("interrupted")
            return 130
        except Exception:
            traceback.print_exc()
            failed.append(name)
        log(f"=== {name} done in {time.monotonic() - t0:.0f} s ===")
    return finish(written, failed)


if __name__ == "__main__":
    sys.exit(main())
