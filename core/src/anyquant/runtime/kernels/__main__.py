"""``python -m anyquant.runtime.kernels build``: compile the optional kernel (``make install`` runs it)."""

from __future__ import annotations

import argparse
import time

from . import ISA_NAMES, available, build, build_dir, isa, threads


def main() -> int:
    parser = argparse.ArgumentParser(prog="python -m anyquant.runtime.kernels")
    parser.add_argument("command", choices=["build", "status"])
    parser.add_argument("-v", "--verbose", action="store_true")
    args = parser.parse_args()
    if args.command == "build":
        start = time.perf_counter()
        path = build(verbose=args.verbose)
        print(f"built {path} in {time.perf_counter() - start:.1f} s")
    ok = available()
    how = f"{ISA_NAMES[isa()]}, {threads()} threads" if ok else "-"
    print(f"kernels: {'loaded' if ok else 'not built'} ({build_dir()}); path: {how}")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
