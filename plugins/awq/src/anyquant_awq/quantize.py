"""AWQ quantization: anyquant's own pure-torch AWQ in process (``quantizer_backend="anyquant"``),
GPTQModel's AWQ (maintained) in the shared GPTQModel worker (``quantizer_backend="gptqmodel"``), or
AutoAWQ 0.2.9's own quantizer (deprecated upstream) in ``anyquant_awq.autoawq_worker``
(``quantizer_backend="autoawq"``, never chosen by ``"auto"``).

``"auto"`` (the default) picks GPTQModel where a CUDA GPU is visible (its AWQ runs its GPU
kernels) and anyquant's own everywhere else: on 2 CPU cores it quantized SmolLM2-135M several
times faster than GPTQModel's AWQ (docs/benchmarks.md).

AutoAWQ fails late, or silently drops data, on what :meth:`AWQQuantizer.validate` checks first:
``group_size=-1`` (its scale search reshapes by group), linear outputs that are not a multiple of
64 (its clipping search asserts it) or of 8 (its packer), and calibration texts longer than
``calibration_seq_len`` tokens (dropped) or too few tokens for one ``calibration_seq_len`` block.
"""

from __future__ import annotations

import importlib.util
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from types import MappingProxyType
from typing import Any, ClassVar

from anyquant.plugin import ParameterError, Probe, QuantizeError, QuantizeFlag, QuantizeSpec
from anyquant_tools import GPTQModelQuantizer, calibration_texts

__all__ = ["AUTOAWQ_REQUIREMENT", "QUANTIZER_BACKENDS", "AWQQuantizer", "autoawq_calibration", "autoawq_shape_errors"]

log = logging.getLogger(__name__)

#: the AutoAWQ that ``quantizer_backend="autoawq"`` runs (its last release; deprecated upstream).
AUTOAWQ_REQUIREMENT = "autoawq==0.2.9"

#: AutoAWQ's ``_search_best_clip`` skips linears whose name contains one of these (q/k: hard to clip).
_AUTOAWQ_NO_CLIP = ("q_", "k_", "query", "key", "Wqkv")


def _cuda_visible() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def autoawq_shape_errors(probe: Probe, *, apply_clip: bool = True) -> list[str]:
    """The decoder-layer linears AutoAWQ 0.2.9 would assert on, from the probe's tensor shapes.

    Its clipping search (``_compute_best_clip``, every linear but q/k) cuts the outputs into batches of
    256 or else 64 and asserts they divide ``out_features``; its GEMM packer (``WQLinear_GEMM``) packs 8
    outputs per int32 and asserts ``out_features % 8 == 0``.
    """
    bad = []
    for name, t in probe.tensors.items():
        if not (name.endswith(".weight") and len(t.shape) == 2 and ".layers." in name):
            continue
        module = name.removesuffix(".weight")
        local = module.split(".layers.", 1)[1].split(".", 1)[-1]  # the name AutoAWQ sees, inside the layer
        clipped = apply_clip and not any(part in local for part in _AUTOAWQ_NO_CLIP)
        out_features, need = int(t.shape[0]), 64 if clipped else 8
        if out_features % need:
            why = "its clipping search asserts it" if clipped else "its GEMM packer asserts it"
            bad.append(f"{module} has out_features={out_features}, not a multiple of {need} ({why})")
    return bad


def autoawq_calibration(tokenizer: Any, texts: Sequence[str], *, seq_len: int, n_samples: int, trim: bool) -> list[str]:
    """The calibration texts AutoAWQ 0.2.9 will use, checked against what its ``get_calib_dataset`` does.

    It encodes each ``text.strip()`` (with special tokens), silently skips a text longer than ``seq_len``
    tokens, stops after ``n_samples`` texts, concatenates them and cuts blocks of ``seq_len`` tokens (the
    remainder is dropped; no block at all fails in ``torch.cat``). A text that is too long raises
    :class:`QuantizeError`, or with ``trim`` (texts anyquant sampled, cut at arbitrary places anyway) is cut
    at a token boundary to fit. Fewer than ``seq_len`` tokens in all raises.
    """
    kept: list[str] = []
    too_long: list[tuple[int, int]] = []
    total = 0
    for i, text in enumerate(texts):
        n = len(tokenizer.encode(text.strip()))
        if n > seq_len:
            if not trim:
                too_long.append((i, n))
                continue
            text = _cut(tokenizer, text, seq_len)
            n = len(tokenizer.encode(text.strip()))
        if n == 0:
            continue
        kept.append(text)
        total += n
        if len(kept) == n_samples:
            break
    if too_long:
        i, n = max(too_long, key=lambda item: item[1])
        raise QuantizeError(
            f"{len(too_long)} calibration text(s) are longer than calibration_seq_len={seq_len} tokens "
            f"(the longest, text {i}, has {n}); AutoAWQ would silently drop them. "
            f"Pass calibration_seq_len={n} (or more) or shorter texts"
        )
    if total < seq_len:
        raise QuantizeError(
            f"the calibration texts have {total} tokens in all; AutoAWQ concatenates them into blocks of "
            f"calibration_seq_len={seq_len} tokens and needs at least one. Pass more text or "
            f"calibration_seq_len={max(total, 1)} (or less)"
        )
    if total % seq_len:
        log.info(
            "AutoAWQ will use %d of the %d calibration tokens (%d-token blocks)",
            total - total % seq_len,
            total,
            seq_len,
        )
    return kept


def _cut(tokenizer: Any, text: str, seq_len: int) -> str:
    """``text`` cut at a token boundary so that it encodes to at most ``seq_len`` tokens (special included)."""
    text = text.strip()
    ids = tokenizer.encode(text, add_special_tokens=False)
    budget = seq_len - (len(tokenizer.encode(text)) - len(ids))
    while budget > 0:
        cut: str = tokenizer.decode(ids[:budget])
        if len(tokenizer.encode(cut.strip())) <= seq_len:
            return cut
        budget -= max(1, budget // 64)
    return ""


def _tokenizer(path: Path) -> Any:
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path)
    except Exception as exc:
        raise QuantizeError(
            f"cannot load the tokenizer of {path} (AutoAWQ tokenizes the calibration texts with it): "
            f"{type(exc).__name__}: {exc}"
        ) from exc


#: the options only some AWQ quantizers read (the others are read by all three)
BACKEND_OPTIONS: Mapping[str, frozenset[str]] = MappingProxyType(
    {
        "anyquant": frozenset({"n_grid", "duo_scaling", "apply_clip"}),
        "gptqmodel": frozenset(),
        "autoawq": frozenset({"duo_scaling", "apply_clip"}),
    }
)
#: what ``quantizer_backend`` accepts (:func:`anyquant_tools.quantize.route_backend` checks it)
QUANTIZER_BACKENDS = ("auto", *BACKEND_OPTIONS)


class AWQQuantizer(GPTQModelQuantizer):
    method = "awq"
    formats = ("gemm",)
    bits_allowed = (4,)
    quantize_options: ClassVar[Mapping[str, str]] = MappingProxyType(
        {
            **GPTQModelQuantizer.quantize_options,
            "dynamic": "refused: GPTQ's per-module overrides, which no AWQ quantizer here applies",
            "format": "the checkpoint layout: 'gemm' (the only one anyquant writes)",
            "dtype": "'float16' (default; AWQ GEMM stores float16 scales)",
            "quantizer_backend": f"one of {QUANTIZER_BACKENDS} (default 'auto': GPTQModel with a GPU, anyquant's own on CPU)",
            "version": "'gemm' (the only one anyquant writes)",
            "zero_point": "asymmetric (AWQ's default, True) or symmetric; overrides sym",
            "apply_clip": "AWQ's weight clipping search (default True; anyquant's and AutoAWQ's quantizers)",
            "n_grid": "scale search grid points (anyquant's quantizer only; default 20)",
            "duo_scaling": "scale by activations and weights (default True; anyquant's and AutoAWQ's quantizers)",
            "batch_size": "calibration batch size",
        }
    )

    #: ``anyquant quantize``'s AWQ flags (``--format`` too, which GPTQ declares as well)
    quantize_flags: ClassVar[Sequence[QuantizeFlag]] = (
        QuantizeFlag("zero_point", "AWQ: zero points on/off (true/false)", "bool"),
        QuantizeFlag("format", "the checkpoint layout: 'gemm' (the only one anyquant writes)", "str"),
    )

    @staticmethod
    def check_flags(given: Mapping[str, Any]) -> None:
        """``--asym`` with ``--zero-point false`` asks for two opposite things."""
        if given.get("sym") is False and given.get("zero_point") is False:
            raise ParameterError("--asym asks for zero points and --zero-point false for none: pass one of them")

    def backend(self, spec: QuantizeSpec) -> str:
        """The quantizer that runs: ``quantizer_backend`` resolved (see the module docstring). An option that only
        some quantizers read (:data:`BACKEND_OPTIONS`) is never dropped: under ``"auto"`` it picks one that reads
        it (``n_grid`` on CUDA: anyquant's own), and naming a quantizer that does not is a QuantizeError."""
        from anyquant_tools import route_backend

        # "auto" never picks AutoAWQ (deprecated upstream); anyquant's own reads every option
        return route_backend(
            spec.options,
            BACKEND_OPTIONS,
            lambda: "gptqmodel" if _cuda_visible() else "anyquant",
            auto_picks=("anyquant", "gptqmodel"),
        )

    def validate(self, probe: Probe, spec: QuantizeSpec) -> None:
        super().validate(probe, spec)
        if spec.desc_act:
            raise QuantizeError("AWQ has no act-order (desc_act=True is GPTQ's): no AWQ quantizer would apply it")
        if "dynamic" in spec.options:
            raise QuantizeError(
                "dynamic= is GPTQ's per-module override (bits, group size, skipped modules); no AWQ quantizer here "
                "applies it, so it would be dropped: quantize those modules with method='gptq', or drop it"
            )
        dtype = spec.options.get("dtype", "float16")
        if dtype not in ("float16", "bfloat16"):
            raise QuantizeError("AWQ GEMM stores float16 scales; pass dtype='float16'")
        if dtype == "bfloat16" and self.backend(spec) == "anyquant":  # it was silently dropped
            raise QuantizeError(
                "dtype='bfloat16': anyquant's AWQ quantizer writes float16 scales whatever it is told; drop the option "
                "(GPTQModel's AWQ, quantizer_backend='gptqmodel', quantizes in bfloat16)"
            )
        for name in ("zero_point", "apply_clip", "duo_scaling"):
            value = spec.options.get(name)
            if value is not None and not isinstance(value, bool):
                raise QuantizeError(f"{name}={value!r}: expected True or False (the string 'false' is truthy)")
        n_grid = spec.options.get("n_grid", 20)
        if isinstance(n_grid, bool) or not isinstance(n_grid, int) or n_grid < 1:
            raise QuantizeError(f"n_grid={n_grid!r}: expected an integer >= 1 (scale search grid points)")
        version = spec.options.get("version", "gemm")
        if version != "gemm":
            raise QuantizeError(f"AWQ version {version!r}: anyquant writes GEMM (loadable by every AWQ runtime)")
        if self.backend(spec) == "autoawq":
            self.validate_autoawq(probe, spec)

    def validate_autoawq(self, probe: Probe, spec: QuantizeSpec) -> None:
        """What AutoAWQ 0.2.9 would fail on late (or silently drop), checked before any work."""
        if spec.group_size <= 0:
            raise QuantizeError(
                f"quantizer_backend='autoawq' needs a positive group_size (got {spec.group_size}): AutoAWQ "
                "reshapes weights by group and fails on -1. Pass e.g. group_size=128, or use quantizer_backend='anyquant'"
            )
        if spec.options.get("dtype", "float16") != "float16":
            raise QuantizeError("quantizer_backend='autoawq' runs AutoAWQ in float16 only; pass dtype='float16'")
        apply_clip = bool(spec.options.get("apply_clip", True))
        bad = autoawq_shape_errors(probe, apply_clip=apply_clip)
        if bad:
            more = f" ({len(bad)} modules in all)" if len(bad) > 1 else ""
            hint = " or apply_clip=False" if apply_clip and "clipping" in bad[0] else ""
            raise QuantizeError(
                f"AutoAWQ cannot quantize this model: {bad[0]}{more}. "
                f"Use quantizer_backend='anyquant' or 'gptqmodel'{hint}"
            )
        if importlib.util.find_spec("awq") is None:  # not imported here: `import awq` resets warning filters
            raise QuantizeError(
                f"quantizer_backend='autoawq' needs AutoAWQ, which is not installed: pip install {AUTOAWQ_REQUIREMENT} "
                "(deprecated upstream; the default quantizer_backend='auto' needs no extra package on CPU)"
            )
        if spec.options.get("texts"):  # the caller's own texts; sampled ones are cut to fit in quantize()
            autoawq_calibration(
                _tokenizer(probe.root),
                calibration_texts(spec),
                seq_len=spec.calibration_seq_len,
                n_samples=spec.calibration_samples,
                trim=False,
            )

    def job(self, src, dst, spec, calibration_file):  # type: ignore[no-untyped-def]
        job = super().job(src, dst, spec, calibration_file)
        job["sym"] = not self.zero_point(spec)
        return job

    @staticmethod
    def zero_point(spec: QuantizeSpec) -> bool:
        """``zero_point`` (AWQ's name for asymmetric), else ``not sym``; by default True, as in AutoAWQ."""
        if "zero_point" in spec.options:
            return bool(spec.options["zero_point"])
        return True if spec.sym is None else not spec.sym

    def quantize(
        self, src: Path, dst: Path, spec: QuantizeSpec, progress: Callable[[str, float], None] | None = None
    ) -> Path:
        backend = self.backend(spec)
        if backend == "gptqmodel":
            return super().quantize(src, dst, spec, progress)
        if backend == "autoawq":
            return self.quantize_autoawq(src, dst, spec, progress)
        from .native import AWQOptions, quantize_checkpoint

        texts = calibration_texts(spec)
        if not texts:
            raise QuantizeError("no calibration samples")
        zero_point = self.zero_point(spec)
        opts = AWQOptions(
            bits=int(spec.bits),
            group_size=spec.group_size,
            zero_point=zero_point,
            n_grid=int(spec.options.get("n_grid", 20)),
            duo_scaling=bool(spec.options.get("duo_scaling", True)),
            clip=bool(spec.options.get("apply_clip", True)),
            batch=int(spec.options.get("batch_size", 8)),
        )
        return quantize_checkpoint(
            src, dst / "model", texts, opts=opts, seq_len=spec.calibration_seq_len, progress=progress
        )

    def quantize_autoawq(
        self, src: Path, dst: Path, spec: QuantizeSpec, progress: Callable[[str, float], None] | None = None
    ) -> Path:
        """AutoAWQ's own quantizer in ``anyquant_awq.autoawq_worker``; writes ``dst / "model"``."""
        from anyquant_tools import run_worker

        log.warning(
            "quantizer_backend='autoawq': AutoAWQ is deprecated upstream (0.2.9 is its last release, tested "
            "with transformers 4.51); anyquant's default AWQ quantizer is its own on CPU and GPTQModel's on CUDA"
        )
        texts = calibration_texts(spec)
        if not texts:
            raise QuantizeError("no calibration samples")
        texts = autoawq_calibration(
            _tokenizer(src),
            texts,
            seq_len=spec.calibration_seq_len,
            n_samples=spec.calibration_samples,
            trim=not spec.options.get("texts"),
        )
        scratch = dst / ".scratch"
        scratch.mkdir(parents=True, exist_ok=True)
        cal = scratch / "calibration.json"
        cal.write_text(json.dumps(texts))
        out = dst / "model"
        job = {
            "src": str(src.resolve()),
            "dst": str(out.resolve()),
            "calibration_file": str(cal.resolve()),
            "bits": int(spec.bits),
            "group_size": spec.group_size,
            "zero_point": self.zero_point(spec),
            "max_calib_samples": spec.calibration_samples,
            "max_calib_seq_len": spec.calibration_seq_len,
            "n_parallel_calib_samples": spec.options.get("batch_size"),
            "duo_scaling": bool(spec.options.get("duo_scaling", True)),
            "apply_clip": bool(spec.options.get("apply_clip", True)),
            "seed": int(spec.options.get("seed", 0)),
        }
        run_worker("anyquant_awq.autoawq_worker", job, scratch=scratch, progress=progress)
        return out
