"""``python -m anyquant_cpu.kernels``: whether the kernel built at install loads here, and which path it takes."""

from __future__ import annotations

from . import ISA_NAMES, available, isa, library, stale, threads


def main() -> int:
    ok = available()
    lib = library()
    if ok:
        print(f"kernels: loaded from {lib} ({ISA_NAMES[isa()]}, {threads()} threads)")
    elif lib is None:
        print("kernels: not built (anyquant-cpu was installed without its library: reinstall it)")
    else:
        print(f"kernels: {lib} not loaded ({stale() or 'see the warning above'})")
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
