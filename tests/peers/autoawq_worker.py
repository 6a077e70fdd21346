"""Peer worker: pack and dequantize AWQ tensors with AutoAWQ 0.2.9, in a separate process.

Usage: ``python autoawq_worker.py --out DIR --params PARAMS.json`` (run through
``tests.peers.fixtures.build_peer_fixture``).  ``import awq`` calls
``warnings.simplefilter`` globally and pulls in transformers model code, so it
stays out of the test process.

For each case, random 4-bit codes, zero points and fp16 scales define an exact
fp32 weight; AutoAWQ's own ``WQLinear_GEMM.from_linear`` and
``WQLinear_GEMV.from_linear`` pack it, and AutoAWQ's
``awq.utils.packing_utils.dequantize_gemm`` dequantizes the GEMM tensors.
AutoAWQ has no CPU dequantizer for GEMV, so a GEMV case records the GEMM oracle
of the same linear: both layouts must decode to identical weights.

``zero_point=False`` cases pass zeros filled with 8: AutoAWQ's packers refuse
``zeros=None``, and 8 is what GPTQModel stores for ``sym=True`` AWQ files.

Exit code 77 (with a JSON line ``{"unavailable": reason}``) when awq cannot be imported.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import warnings
from pathlib import Path
from typing import Any

UNAVAILABLE_EXIT = 77


def _case_name(case: dict[str, Any]) -> str:
    if "name" in case:
        return str(case["name"])
    zp = "zp" if case["zero_point"] else "nozp"
    return f"{case['layout']}_g{case['group_size']}_{zp}"


def _random_tensors(case: dict[str, Any], in_f: int, out_f: int, seed: int) -> dict[str, Any]:
    import torch

    gen = torch.Generator().manual_seed(seed)
    group = in_f if case["group_size"] == -1 else case["group_size"]
    num_groups = in_f // group
    codes = torch.randint(0, 16, (in_f, out_f), generator=gen, dtype=torch.int32)  # [K, N]
    if case["zero_point"]:
        zeros = torch.randint(0, 16, (num_groups, out_f), generator=gen, dtype=torch.int32)
        zeros[0, :8] = 0
        zeros[-1, -8:] = 15
    else:
        zeros = torch.full((num_groups, out_f), 8, dtype=torch.int32)
    scales = (torch.rand(num_groups, out_f, generator=gen) * 0.02 + 1e-3).half()  # [G, N]
    bias = (torch.randn(out_f, generator=gen) * 0.1).half()
    return {"codes": codes, "zeros": zeros, "scales": scales, "bias": bias, "group": group}


def _linear(tensors: dict[str, Any]) -> Any:
    import torch

    index = torch.arange(tensors["codes"].shape[0]) // tensors["group"]
    diff = (tensors["codes"] - tensors["zeros"][index]).float()
    weight = (diff * tensors["scales"].float()[index]).t().contiguous()  # exact in fp32
    linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=True)
    linear.weight.data = weight
    linear.bias.data = tensors["bias"].float()
    return linear


def _pack_gemm(tensors: dict[str, Any]) -> Any:
    from awq.modules.linear.gemm import WQLinear_GEMM

    return WQLinear_GEMM.from_linear(
        _linear(tensors),
        4,
        tensors["group"],
        scales=tensors["scales"].float(),  # [G, N], as AutoAWQ's quantizer passes it
        zeros=tensors["zeros"].float(),
    )


def _pack_gemv(tensors: dict[str, Any]) -> Any:
    from awq.modules.linear.gemv import WQLinear_GEMV

    return WQLinear_GEMV.from_linear(
        _linear(tensors),
        4,
        tensors["group"],
        scales=tensors["scales"].float().t().contiguous(),  # [N, G] for GEMV
        zeros=tensors["zeros"].float().t().contiguous(),
    )


def _case(case: dict[str, Any], in_f: int, out_f: int, seed: int) -> dict[str, Any]:
    from awq.utils.packing_utils import dequantize_gemm

    tensors = _random_tensors(case, in_f, out_f, seed)
    gemm = _pack_gemm(tensors)
    oracle = dequantize_gemm(gemm.qweight, gemm.qzeros, gemm.scales, 4, tensors["group"])
    packed = gemm if case["layout"] == "gemm" else _pack_gemv(tensors)
    return {
        "codes": tensors["codes"],
        "zeros": tensors["zeros"],
        "qweight": packed.qweight.contiguous(),
        "qzeros": packed.qzeros.contiguous(),
        "scales": packed.scales.contiguous(),
        "bias": packed.bias.contiguous(),
        "autoawq_dequantize_gemm": oracle.contiguous(),
    }


def run(params: dict[str, Any], out: Path) -> dict[str, Any]:
    from safetensors.torch import save_file

    cases = {}
    for i, case in enumerate(params["cases"]):
        name = _case_name(case)
        tensors = _case(case, params["in_features"], params["out_features"], params["seed"] + i)
        save_file(tensors, str(out / f"{name}.safetensors"))
        cases[name] = case
    return {"cases": cases}


def _versions() -> dict[str, str]:
    from importlib import metadata

    result = {}
    for name in ("autoawq", "torch", "transformers"):
        try:
            result[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            result[name] = "absent"
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True, type=Path)
    parser.add_argument("--params", required=True, type=Path)
    args = parser.parse_args(argv)
    params = json.loads(args.params.read_text())
    try:
        import torch

        torch.set_num_threads(1)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            import awq.modules.linear.gemm
            import awq.modules.linear.gemv
            import awq.utils.packing_utils  # noqa: F401
    except Exception as exc:  # any import failure means "peer unavailable"
        print(json.dumps({"unavailable": f"cannot import torch + awq: {exc!r}"}))
        return UNAVAILABLE_EXIT
    args.out.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    manifest = run(params, args.out)
    manifest["versions"] = _versions()
    manifest["seconds"] = round(time.monotonic() - started, 2)
    (args.out / "manifest.json").write_text(json.dumps(manifest, indent=1, sort_keys=True))
    return 0


if __name__ == "__main__":
    sys.exit(main())
