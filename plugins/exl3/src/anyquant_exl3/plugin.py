"""anyquant hooks for EXL3 and EXL2: format registration and header-only detection."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass

from anyquant.plugin import BackendSpec, Claim, FormatSpec, Probe, hookimpl

#: the codebook markers' int32 values (uint32 0xCBAC1FED / 0x83DCD12D viewed as int32).
CODEBOOK_MARKERS = {"mcg": "mcg", "mul1": "mul1"}
EXL2_SUFFIXES = ("q_weight", "q_scale", "q_scale_max", "q_groups")
#: columns per ring of a ring-coded token embedding (exllamav3 1.6 ``--embed_bits``; see :mod:`anyquant_exl3.ring`)
RING_GROUP = 256
_SHARD = re.compile(r"^(.*)\.shard_(\d+)$")


def ring_bits(row_words: int, groups: int) -> int:
    """``K`` of a ring table whose rows hold ``groups`` rings of ``1 + 16 K`` words (``ValueError`` if none fits)."""
    if groups < 1 or row_words % groups:
        raise ValueError(f"{row_words} words per row do not split into {groups} rings")
    per = row_words // groups
    k, rest = divmod(per - 1, RING_GROUP // 16)
    if rest or not 1 <= k <= 8:
        raise ValueError(f"a ring of {per} words is not 1 + 16*K words for K in 1..8")
    return k


@dataclass(frozen=True)
class RingTableInfo:
    """A 2-D ``.trellis`` table as the headers describe it (exllamav3 1.5/1.6.x)."""

    key: str  # the module, e.g. ``model.embed_tokens``
    shards: tuple[str, ...]  # the ``.trellis`` tensors in row order
    rows: int
    row_words: int
    signs: str | None  # ``<key>.signs``: a token embedding; ``None``: a hashed n-gram table
    groups: int = 0
    k: int = 0
    nbytes: int = 0


def ring_tables(probe: Probe) -> tuple[dict[str, RingTableInfo], list[str]]:
    """The checkpoint's 2-D trellis tables by module key (row shards ``<key>.shard_N.trellis`` joined), and
    what is wrong with them. An n-gram table (no ``.signs``) is listed with ``signs=None`` and ``k=0``."""
    t = probe.tensors
    parts: dict[str, dict[int | None, str]] = {}
    for prefix in probe.modules_with("trellis"):
        if len(t[f"{prefix}.trellis"].shape) != 2:
            continue
        m = _SHARD.match(prefix)
        key, shard = (m.group(1), int(m.group(2))) if m else (prefix, None)
        parts.setdefault(key, {})[shard] = f"{prefix}.trellis"
    tables: dict[str, RingTableInfo] = {}
    problems: list[str] = []
    for key, found in sorted(parts.items()):
        numbered = sorted(s for s in found if s is not None)
        if None in found and numbered:
            problems.append(f"{key}: both a whole .trellis table and .shard_N pieces")
            continue
        if numbered and numbered != list(range(len(numbered))):
            problems.append(f"{key}: table shards {numbered} are not numbered 0..{len(numbered) - 1}")
            continue
        names = tuple(found[s] for s in ([None] if None in found else numbered))
        infos = [t[n] for n in names]
        widths = {i.shape[1] for i in infos}
        if any(i.dtype != "I16" for i in infos) or len(widths) != 1:
            problems.append(f"{key}: table pieces are not int16 [rows, words] of one width")
            continue
        if any(i.shape[0] != infos[0].shape[0] for i in infos[:-1]) or infos[-1].shape[0] > infos[0].shape[0]:
            problems.append(f"{key}: table shards must hold equal row counts (the last may be shorter)")
            continue
        rows, width = sum(i.shape[0] for i in infos), widths.pop()
        nbytes = sum(i.nbytes for i in infos)
        signs = t.get(f"{key}.signs")
        if signs is None:
            tables[key] = RingTableInfo(key, names, rows, width, None, nbytes=nbytes)
            continue
        if signs.dtype != "F16" or len(signs.shape) != 2 or signs.shape[1] != RING_GROUP:
            problems.append(f"{key}.signs is {signs.dtype}{list(signs.shape)}, expected F16 [groups, {RING_GROUP}]")
            continue
        try:
            k = ring_bits(width, signs.shape[0])
        except ValueError as exc:
            problems.append(f"{key}: {exc}")
            continue
        tables[key] = RingTableInfo(key, names, rows, width, signs.name, signs.shape[0], k, nbytes + signs.nbytes)
    return tables, problems


@hookimpl
def anyquant_register_backends(register: Callable[[BackendSpec], None]) -> None:
    register(
        BackendSpec(
            name="exllamav3",
            description="exllamav3's CUDA kernels and generator (EXL3 checkpoints, one GPU or tensor-parallel)",
            devices=("cuda",),
            layouts=("exl3-trellis",),
            status="anyquant_exl3.exllamav3_kernels:backend_status",
            requires=("exllamav3",),
        )
    )


@hookimpl
def anyquant_register_formats(register: Callable[[FormatSpec], None]) -> None:
    register(
        FormatSpec(
            name="exl3",
            loader="anyquant_exl3.loader:EXL3Loader",
            quantizer="anyquant_exl3.quantize:EXL3Quantizer",
            requires=("torch>=2.4", "transformers>=4.56", "safetensors>=0.4"),
            description="EXL3 (ExLlamaV3, QTIP trellis), 1-8 bpw, mixed per tensor",
            install_hint="pip install anyquant-exl3",
        )
    )
    register(
        FormatSpec(
            name="exl2",
            loader="anyquant_exl3.exl2.loader:EXL2Loader",
            requires=("torch>=2.4", "transformers>=4.56", "safetensors>=0.4"),
            description="EXL2 (ExLlamaV2): q_weight/q_scale/q_groups/q_invperm",
            install_hint="pip install anyquant-exl3",
        )
    )


def _exl3_claim(probe: Probe) -> Claim | None:
    t = probe.tensors
    ks: dict[float, int] = {}
    codebooks: dict[str, int] = {}
    legacy = 0
    tables, problems = ring_tables(probe)
    modules = 0
    for prefix in probe.modules_with("trellis"):
        tr = t[f"{prefix}.trellis"]
        if len(tr.shape) == 2:
            continue
        has_h = f"{prefix}.suh" in t and f"{prefix}.svh" in t
        has_l = f"{prefix}.su" in t and f"{prefix}.sv" in t
        if len(tr.shape) != 3 or tr.dtype != "I16" or not (has_h or has_l):
            problems.append(f"{prefix}: trellis {tr.dtype}{list(tr.shape)} without suh/svh (or su/sv)")
            continue
        if tr.shape[2] % 8:
            problems.append(f"{prefix}: trellis last dim {tr.shape[2]} is not a multiple of 8")
            continue
        modules += 1
        k = tr.shape[2] / 16
        ks[k] = ks.get(k, 0) + 1
        cb = next((c for c in ("mcg", "mul1") if f"{prefix}.{c}" in t), "3inst")
        codebooks[cb] = codebooks.get(cb, 0) + 1
        legacy += 0 if has_h else 1
    if not modules and not tables and not problems:
        return None
    qc = probe.quantization_config or probe.quantization_config_file or {}
    evidence = [
        f"{modules} modules with a 3-D int16 .trellis + suh/svh (K per tensor: "
        + ", ".join(f"{k:g}x{n}" for k, n in sorted(ks.items()))
        + ")",
        f"codebooks from markers: {codebooks}",
    ]
    for table in tables.values():
        if table.signs is not None:
            evidence.append(
                f"{table.key}: a ring-coded token embedding (2-D .trellis + .signs, K={table.k}, {table.rows} rows"
                + (f" in {len(table.shards)} shards" if len(table.shards) > 1 else "")
                + ")"
            )
        else:
            evidence.append(f"{table.key}: a 2-D .trellis table without .signs (an exllamav3 hashed n-gram table)")
    if legacy:
        evidence.append(f"{legacy} modules with legacy su/sv sign tensors")
    if probe.quant_method:
        evidence.append(f"config quant_method={probe.quant_method!r}, version={qc.get('version')!r}")
    orig = qc.get("original_quantization_config") if hasattr(qc, "get") else None
    if orig is not None:
        evidence.append(
            f"original_quantization_config ({orig.get('quant_method')!r}) is the source's format, not this one"
        )
    total_w = sum(k * n for k, n in ks.items())
    variant = next(iter(codebooks)) if len(codebooks) == 1 else "mixed"
    details = {
        "k_histogram": {str(k): n for k, n in sorted(ks.items())},
        "codebooks": codebooks,
        "modules": modules,
        "tables": {
            key: {"k": x.k, "rows": x.rows, "groups": x.groups, "kind": "embedding" if x.signs else "n-gram"}
            for key, x in tables.items()
        },
        "legacy_signs": legacy,
        "bits": qc.get("bits"),
        "head_bits": qc.get("head_bits"),
        "version": qc.get("version"),
        "mean_k_unweighted": round(total_w / modules, 3) if modules else None,
        "problems": problems,
    }
    return Claim("exl3", evidence=tuple(evidence + problems), variant=variant, details=details)


def _exl2_claim(probe: Probe) -> Claim | None:
    t = probe.tensors
    prefixes = [
        p
        for p in probe.modules_with("q_weight")
        if all(f"{p}.{s}" in t for s in EXL2_SUFFIXES) and (f"{p}.q_invperm" in t or f"{p}.q_perm" in t)
    ]
    if not prefixes:
        return None
    evidence = [f"{len(prefixes)} modules with q_weight + q_scale + q_scale_max + q_groups + q_invperm"]
    if any(s.file.startswith("output") for s in probe.safetensors):
        evidence.append("exllamav2's output*.safetensors file naming")
    if probe.quant_method:
        evidence.append(f"config quant_method={probe.quant_method!r}")
    qc = probe.quantization_config or {}
    return Claim(
        "exl2",
        evidence=tuple(evidence),
        details={"modules": len(prefixes), "bits": qc.get("bits"), "head_bits": qc.get("head_bits")},
    )


@hookimpl
def anyquant_detect(probe: Probe) -> Claim | None:
    exl3 = _exl3_claim(probe)
    exl2 = _exl2_claim(probe)
    if exl3 and exl2:
        return Claim(
            "exl3",
            evidence=("both EXL3 trellis and EXL2 q_weight tensors in one checkpoint",),
            variant="mixed",
            details={"problems": ["EXL3 and EXL2 tensors mixed in one checkpoint"]},
        )
    return exl3 or exl2
