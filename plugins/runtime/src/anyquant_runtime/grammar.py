"""Constrained decoding (structured output) through `xgrammar <https://github.com/mlc-ai/xgrammar>`_, the engine
vLLM and SGLang use: an :class:`OutputFormat` (any JSON object, a JSON schema, a regular expression, one of a list
of strings) is compiled once per tokenizer into a grammar (:class:`Grammars`, a bounded LRU cache; compiling runs
in a worker thread under a time limit), and each generation that asks for it gets a :class:`Constraint`: before
every sampling step it sets the logits of the tokens the grammar does not allow next to ``-inf`` (xgrammar's
token bitmask), then accepts the sampled token. Every sampling parameter (temperature, top-p/k, min-p, penalties,
logit bias, seed) then applies to the masked logits as usual, and the grammar allows the end-of-sequence tokens
only where the output is complete.

xgrammar is optional (a dependency of anyquant-serve, the server, which is what uses this module): importing this module does not import it;
:func:`unavailable` says why it cannot be used, and compiling without it is a :class:`GrammarUnavailable`.
"""

from __future__ import annotations

import collections
import concurrent.futures
import json
import re
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from anyquant.errors import ParameterError

__all__ = [
    "COMPILE_TIMEOUT",
    "MAX_FORMAT_BYTES",
    "Constraint",
    "GrammarError",
    "GrammarUnavailable",
    "Grammars",
    "OutputFormat",
    "hf_tokenizer",
    "unavailable",
]

#: the largest schema, regular expression or list of choices (as JSON text) a format may hold
MAX_FORMAT_BYTES = 64 << 10
#: the most choices a ``choice`` format may list
MAX_CHOICES = 1024
#: seconds one grammar may take to compile before the request is refused
COMPILE_TIMEOUT = 10.0
#: compiled grammars kept (least recently used dropped first)
CACHE_SIZE = 64

Kind = Literal["json_object", "json_schema", "regex", "choice", "tool_calls", "tagged", "xml_calls", "named_calls"]


class GrammarError(ParameterError):
    """A format that cannot be compiled: too large, not a schema xgrammar understands, a regular expression it
    cannot parse, or one that takes longer than the time limit."""


class GrammarUnavailable(GrammarError):
    """xgrammar is not installed."""


def unavailable() -> str | None:
    """``None`` when xgrammar can be imported, else why not (and how to install it)."""
    import importlib.util

    if importlib.util.find_spec("xgrammar") is None:
        return "structured output needs xgrammar, which is not installed: pip install anyquant-serve (or xgrammar)"
    return None


@dataclass(frozen=True)
class OutputFormat:
    """What the output must be: ``json_object`` (any JSON object), ``json_schema`` (``spec``: the schema as JSON
    text), ``regex`` (``spec``: the expression), ``choice`` (``spec``: a JSON list of the strings allowed),
    ``tool_calls`` or ``tagged`` (tool calls: :meth:`tool_calls`, :meth:`tagged`). Made through the class methods, which bound the size."""

    kind: Kind
    spec: str = ""

    @classmethod
    def json_object(cls) -> OutputFormat:
        return cls("json_object")

    @classmethod
    def json_schema(cls, schema: Mapping[str, Any] | bool | str) -> OutputFormat:
        """``schema`` as a mapping (or ``true``/``false``, JSON Schema's any/none), or JSON text. Its properties
        keep their order: the output writes them in it."""
        if isinstance(schema, str):
            _bounded(schema, "the JSON schema")
            try:
                schema = json.loads(schema)
            except ValueError:
                raise GrammarError("the JSON schema is not valid JSON") from None
            except RecursionError:
                raise GrammarError("the JSON schema nests too deeply") from None
        if not isinstance(schema, (Mapping, bool)):
            raise GrammarError(f"a JSON schema is an object (or true/false), not {type(schema).__name__}")
        try:
            text = json.dumps(schema, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
        except (TypeError, ValueError, RecursionError) as exc:
            raise GrammarError(f"the JSON schema is not JSON: {exc}") from None
        text = _bounded(text, "the JSON schema")
        _check_enforced(schema, "", 0)
        return cls("json_schema", text)

    @classmethod
    def tool_calls(
        cls, schema: Mapping[str, Any], begin: str = "", end: str = "", sep: str = "", max_calls: int = 1
    ) -> OutputFormat:
        """Tool calls: ``begin``, a JSON value of ``schema`` (one call), ``end``; then up to ``max_calls - 1`` more,
        each after ``sep`` (``spec``: those as JSON text)."""
        if not isinstance(schema, Mapping) or max_calls < 1:
            raise GrammarError("a tool call's schema is an object, and at least one call is allowed")
        _check_enforced(schema, "", 0)
        spec = {"schema": schema, "begin": begin, "end": end, "sep": sep, "max_calls": int(max_calls)}
        return cls("tool_calls", _tools_spec(spec))

    @classmethod
    def tagged(cls, options: Sequence[tuple[str, Mapping[str, Any]]]) -> OutputFormat:
        """One of ``options``: its text, then a JSON value of its schema (a harmony tool call: the header naming
        the function, then its arguments)."""
        if not options or not all(isinstance(s, Mapping) and isinstance(t, str) and t for t, s in options):
            raise GrammarError("each option is a non-empty text and an object schema")
        for _, schema in options:
            _check_enforced(schema, "", 0)
        spec = [{"begin": text, "schema": schema} for text, schema in options]
        return cls("tagged", _tools_spec(spec))

    @classmethod
    def named_calls(
        cls,
        options: Sequence[tuple[str, Mapping[str, Any], str]],
        begin: str = "",
        end: str = "",
        max_calls: int = 1,
        sep: str = "",
        first_index: int | None = None,
    ) -> OutputFormat:
        """Tool calls whose name is outside their JSON (DeepSeek's, Kimi's, Functionary's): ``begin``, then one to
        ``max_calls`` calls joined by ``sep``, each one of ``options`` (the text before a tool's arguments, their
        schema, the text after them), then ``end``. With ``first_index``, ``{index}`` in an option's texts is the
        call's number: ``first_index`` for the first call, one more for each after it (Kimi's ids)."""
        if not options or max_calls < 1:
            raise GrammarError("at least one tool, and at least one call allowed")
        if not all(isinstance(a, str) and a and isinstance(s, Mapping) and isinstance(b, str) for a, s, b in options):
            raise GrammarError("each option is a non-empty text, an object schema and a text")
        if first_index is not None and (isinstance(first_index, bool) or not 0 <= int(first_index) < 10**9):
            raise GrammarError("the first call's index is a number from 0 to 999999999")
        for _, schema, _ in options:
            _check_enforced(schema, "", 0)
        calls = [{"begin": a, "schema": schema, "end": b} for a, schema, b in options]
        spec = {"calls": calls, "begin": begin, "end": end, "max_calls": int(max_calls), "sep": sep}
        spec["index"] = None if first_index is None else int(first_index)
        return cls("named_calls", _tools_spec(spec))

    @classmethod
    def xml_calls(
        cls, tools: Sequence[Mapping[str, Any]], sep: str = "\n", max_calls: int = 1, style: str = "qwen3"
    ) -> OutputFormat:
        """Tool calls with a tag around each argument, one to ``max_calls`` joined by ``sep``; ``style`` ``qwen3``:
        Qwen3-Coder's XML (``<tool_call>\\n<function=NAME>\\n`` then ``<parameter=KEY>\\nVALUE\\n</parameter>\\n``
        for each given parameter, then ``</function>\\n</tool_call>``); ``glm``: GLM-4.5's (``<tool_call>NAME\\n``, then
        ``<arg_key>KEY</arg_key>\\n<arg_value>VALUE</arg_value>\\n`` each, then ``</tool_call>``); ``dsml``:
        DeepSeek-V3.2's (``<｜DSML｜function_calls>\\n`` around the calls, each ``<｜DSML｜invoke name="NAME">\\n``, its
        ``<｜DSML｜parameter name="KEY" string="true|false">VALUE</｜DSML｜parameter>`` joined by newlines, then
        ``\\n</｜DSML｜invoke>``; ``string="true"`` for a text value); ``pythonic``: ``[NAME(KEY=VALUE, ...), ...]``
        (each value its JSON; ``sep`` ``", "``). ``tools``: ``{"name": ..., "parameters": [[key,
        schema], ...]}`` each. A value of a string schema is text without ``<`` (its enum, ``minLength``/
        ``maxLength`` or ``pattern`` enforced); of any other schema, its JSON (as ``json_schema`` enforces it)."""
        if not tools or max_calls < 1:
            raise GrammarError("at least one tool, and at least one call allowed")
        if style not in XML_STYLES:
            raise GrammarError(f"xml_calls style {style!r} is not one of {list(XML_STYLES)}")
        for tool in tools:
            name = tool.get("name")
            if not isinstance(name, str) or not _XML_NAME.fullmatch(name):
                raise GrammarError(f"tool name {name!r} cannot be written as <function=...>")
            for key, schema in tool.get("parameters", ()):
                if not isinstance(key, str) or not _XML_NAME.fullmatch(key):
                    raise GrammarError(f"parameter {key!r} of {name} cannot be written as <parameter=...>")
                if isinstance(schema, Mapping) and schema.get("format") is not None and _xml_text(schema):
                    raise GrammarError(f"parameter {key!r} of {name}: 'format' is not supported (not enforced)")
                _check_enforced(schema, key, 0)
        spec = {"tools": [dict(t) for t in tools], "sep": sep, "max_calls": int(max_calls), "style": style}
        return cls("xml_calls", _tools_spec(spec))

    @classmethod
    def regex(cls, pattern: str) -> OutputFormat:
        if not isinstance(pattern, str) or not pattern:
            raise GrammarError("a regular expression is a non-empty string")
        return cls("regex", _bounded(pattern, "the regular expression"))

    @classmethod
    def choice(cls, choices: Sequence[str]) -> OutputFormat:
        items = list(choices)
        if not items or not all(isinstance(c, str) and c for c in items):
            raise GrammarError("choices are a non-empty list of non-empty strings")
        if len(items) > MAX_CHOICES:
            raise GrammarError(f"{len(items)} choices: at most {MAX_CHOICES}")
        return cls("choice", _bounded(json.dumps(items, ensure_ascii=False), "the choices"))


#: JSON Schema keywords xgrammar 0.2.9 accepts but does not enforce (an answer could break them): refused
UNENFORCED = ("not", "if", "then", "else", "contains", "dependentRequired", "dependentSchemas", "dependencies")
#: keywords whose value is a schema, a list of schemas, or a mapping of names to schemas
_ONE = ("items", "additionalProperties", "additionalItems", "propertyNames", "unevaluatedProperties",
        "unevaluatedItems")  # fmt: skip
_MANY = ("anyOf", "oneOf", "allOf", "prefixItems", "items")
_NAMED = ("properties", "patternProperties", "$defs", "definitions")


def _check_enforced(schema: Any, where: str, depth: int) -> None:
    """A :class:`GrammarError` naming the first keyword in ``schema`` that xgrammar would not enforce."""
    if not isinstance(schema, Mapping) or depth > 256:
        return
    for key in UNENFORCED:
        if key in schema:
            raise GrammarError(f"{where or 'the schema'}: {key!r} is not supported (it would not be enforced)")
    if schema.get("uniqueItems") is True:
        raise GrammarError(f"{where or 'the schema'}: 'uniqueItems' is not supported (it would not be enforced)")
    for key in _ONE:
        _check_enforced(schema.get(key), f"{where}.{key}" if where else key, depth + 1)
    for key in _MANY:
        value = schema.get(key)
        if isinstance(value, list):
            for i, sub in enumerate(value):
                _check_enforced(sub, f"{where}.{key}[{i}]" if where else f"{key}[{i}]", depth + 1)
    for key in _NAMED:
        value = schema.get(key)
        if isinstance(value, Mapping):
            for name, sub in value.items():
                _check_enforced(sub, f"{where}.{key}.{name}" if where else f"{key}.{name}", depth + 1)


def _tools_spec(spec: Any) -> str:
    """A tool-call format's spec as its JSON text (bounded), or a :class:`GrammarError` when it holds no JSON."""
    try:
        text = json.dumps(spec, ensure_ascii=False, allow_nan=False, separators=(",", ":"))
    except (TypeError, ValueError, RecursionError) as exc:
        raise GrammarError(f"the tools' parameters are not JSON: {exc}") from None
    return _bounded(text, "the tools' schema")


def _bounded(text: str, what: str) -> str:
    size = len(text.encode("utf-8", "surrogatepass"))
    if size > MAX_FORMAT_BYTES:
        raise GrammarError(f"{what} is {size} bytes: at most {MAX_FORMAT_BYTES}")
    return text


_LOCATION = re.compile(r"^\s*\[[0-9:]+\]\s+\S+:[0-9]+:\s*")


def _reason(exc: BaseException) -> str:
    """xgrammar's complaint without its C++ source location, on one line, short."""
    text = " ".join(_LOCATION.sub("", str(exc)).split())
    return text[:300] or type(exc).__name__


def hf_tokenizer(tokenizer: Any) -> Any:
    """transformers' tokenizer behind anyquant's (a :class:`~anyquant_runtime.tokenizer.LazyTokenizer` builds
    its wrapper; GGUF's tokenizers are ``PreTrainedTokenizerFast`` already)."""
    make = getattr(type(tokenizer), "as_transformers", None)
    return make(tokenizer) if make is not None else tokenizer


class Grammars:
    """Compiles :class:`OutputFormat` for one model's tokenizer (``vocab_size``: the width of its logits;
    ``stop_ids``: the end-of-sequence tokens the grammar allows once the output is complete). Thread-safe."""

    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        stop_ids: Iterable[int],
        *,
        cache_size: int = CACHE_SIZE,
        timeout: float = COMPILE_TIMEOUT,
        threads: int = 2,
    ) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = int(vocab_size)
        self.stop_ids = sorted(set(stop_ids))
        self.cache_size = cache_size
        self.timeout = timeout
        self._lock = threading.RLock()  # a done callback may run at once, in the thread holding it
        self._made = threading.Lock()
        self._compiler: Any = None
        self._cache: collections.OrderedDict[OutputFormat, Any] = collections.OrderedDict()
        self._pending: dict[OutputFormat, concurrent.futures.Future[Any]] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(threads, thread_name_prefix="anyquant-grammar")

    def compiler(self) -> Any:
        """xgrammar's compiler for this tokenizer (its vocabulary read on the first call: ~1 s for 50k tokens)."""
        reason = unavailable()
        if reason is not None:
            raise GrammarUnavailable(reason)
        with self._made:
            if self._compiler is None:
                import xgrammar as xg

                info = xg.TokenizerInfo.from_huggingface(
                    hf_tokenizer(self.tokenizer), vocab_size=self.vocab_size, stop_token_ids=self.stop_ids or None
                )
                # no cache of its own: this class keeps the compiled grammars (bounded by count)
                self._compiler = xg.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def compile(self, fmt: OutputFormat) -> Any:
        """``fmt``'s compiled grammar (cached), or :class:`GrammarError` saying why not; at most ``timeout``
        seconds (a compile that takes longer goes on in its thread, and is cached when it ends)."""
        compiler = self.compiler()
        with self._lock:
            if fmt in self._cache:
                self._cache.move_to_end(fmt)
                return self._cache[fmt]
            future = self._pending.get(fmt)
            if future is None:
                future = self._pending[fmt] = self._pool.submit(self._build, compiler, fmt)
                future.add_done_callback(lambda f: self._store(fmt, f))
        try:
            return future.result(self.timeout)
        except concurrent.futures.TimeoutError:
            future.cancel()  # still queued behind another compile: never started
            raise GrammarError(f"the {_what(fmt)} did not compile within {self.timeout:g} s") from None
        except concurrent.futures.CancelledError:
            raise GrammarError(f"the {_what(fmt)} did not compile within {self.timeout:g} s") from None

    def _store(self, fmt: OutputFormat, future: concurrent.futures.Future[Any]) -> None:
        with self._lock:
            self._pending.pop(fmt, None)
            if future.cancelled() or future.exception() is not None:
                return
            self._cache[fmt] = future.result()
            while len(self._cache) > self.cache_size:
                self._cache.popitem(last=False)

    @staticmethod
    def _build(compiler: Any, fmt: OutputFormat) -> Any:
        try:
            if fmt.kind == "json_object":
                return compiler.compile_json_schema('{"type":"object"}', any_whitespace=False, strict_mode=False)
            if fmt.kind == "json_schema":
                # one line, no optional whitespace: a model cannot pad forever; strict: no property or item the
                # schema does not name (what OpenAI's strict mode means), so the output validates either way
                return compiler.compile_json_schema(fmt.spec, any_whitespace=False, strict_mode=True)
            if fmt.kind == "regex":
                return compiler.compile_regex(fmt.spec)
            if fmt.kind == "tool_calls":
                return compiler.compile_grammar(_tool_calls_grammar(json.loads(fmt.spec)))
            if fmt.kind == "tagged":
                return compiler.compile_grammar(_tagged_grammar(json.loads(fmt.spec)))
            if fmt.kind == "xml_calls":
                return compiler.compile_grammar(_xml_calls_grammar(json.loads(fmt.spec)))
            if fmt.kind == "named_calls":
                return compiler.compile_grammar(_named_calls_grammar(json.loads(fmt.spec)))
            choices = json.loads(fmt.spec)
            return compiler.compile_grammar("root ::= " + " | ".join(json.dumps(c) for c in choices))
        except Exception as exc:  # xgrammar raises RuntimeError (and ValueError) with its parser's message
            raise GrammarError(f"the {_what(fmt)} cannot be compiled: {_reason(exc)}") from None

    def constraint(self, compiled: Any) -> Constraint:
        """A fresh matcher over ``compiled`` for one generation."""
        return Constraint(compiled, self.vocab_size)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def _literal(text: str) -> Any:
    import xgrammar as xg

    return xg.Grammar.from_ebnf("root ::= " + json.dumps(text, ensure_ascii=False))


def _value(schema: Any) -> Any:
    """A JSON value of ``schema``, on one line, strict: no property the schema does not name."""
    import xgrammar as xg

    return xg.Grammar.from_json_schema(json.dumps(schema), any_whitespace=False, strict_mode=True)


def _joined(call_at: Callable[[int], Any], max_calls: int, sep: str) -> Any:
    """One to ``max_calls`` calls joined by ``sep`` (``call_at(k)``: the grammar of the ``k``-th, from 0)."""
    import xgrammar as xg

    first = call_at(0)
    answers, calls = [first], first
    for k in range(1, max_calls):
        calls = xg.Grammar.concat(calls, _literal(sep), call_at(k)) if sep else xg.Grammar.concat(calls, call_at(k))
        answers.append(calls)
    return xg.Grammar.union(*answers) if len(answers) > 1 else first


def _around(begin: str, body: Any, end: str) -> Any:
    """``body`` between the texts ``begin`` and ``end`` (either may be empty)."""
    import xgrammar as xg

    parts = ([_literal(begin)] if begin else []) + [body] + ([_literal(end)] if end else [])
    return xg.Grammar.concat(*parts) if len(parts) > 1 else body


def _tagged_grammar(spec: Sequence[Mapping[str, Any]]) -> Any:
    """One of the options: its ``begin`` text, then a JSON value of its ``schema``."""
    import xgrammar as xg

    options = [xg.Grammar.concat(_literal(o["begin"]), _value(o["schema"])) for o in spec]
    return xg.Grammar.union(*options) if len(options) > 1 else options[0]


_XML_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
#: :meth:`OutputFormat.xml_calls`' styles
XML_STYLES = ("qwen3", "glm", "dsml", "pythonic")
#: where :meth:`OutputFormat.named_calls`' texts take a call's number
INDEX = "{index}"


def _xml_text(schema: Any) -> bool:
    """Whether a parameter's value is written as text (a string schema, or one without a type)."""
    if not isinstance(schema, Mapping):
        return True
    kind = schema.get("type")
    return kind is None or kind == "string" or (isinstance(kind, list) and "string" in kind)


def _xml_value(schema: Any) -> Any:
    """A ``<parameter=...>`` value's grammar (:meth:`OutputFormat.xml_calls`)."""
    import xgrammar as xg

    if isinstance(schema, Mapping) and isinstance(schema.get("enum"), list) and schema["enum"]:
        texts = [v if isinstance(v, str) else json.dumps(v) for v in schema["enum"]]
        return xg.Grammar.union(*[_literal(t) for t in texts]) if len(texts) > 1 else _literal(texts[0])
    if not _xml_text(schema):
        return _value(schema)
    s = schema if isinstance(schema, Mapping) else {}
    if isinstance(s.get("pattern"), str):
        return xg.Grammar.from_regex(s["pattern"])
    low, high = int(s.get("minLength", 0) or 0), s.get("maxLength")
    bounds = f"{{{low},{int(high)}}}" if isinstance(high, int) else f"{{{low},}}"
    return xg.Grammar.from_regex("[^<]" + bounds)


def _xml_call(name: str, parameters: Sequence[Sequence[Any]], style: str) -> list[Any]:
    """One call's grammar parts in ``style`` (:meth:`OutputFormat.xml_calls`)."""
    if style == "glm":
        parts = [_literal(f"<tool_call>{name}\n")]
        for key, schema in parameters:
            parts += [
                _literal(f"<arg_key>{key}</arg_key>\n<arg_value>"),
                _xml_value(schema),
                _literal("</arg_value>\n"),
            ]
        return [*parts, _literal("</tool_call>")]
    if style == "dsml":
        parts = [_literal(f'<｜DSML｜invoke name="{name}">\n')]
        for i, (key, schema) in enumerate(parameters):
            text = "true" if _xml_text(schema) and not _enum_of_others(schema) else "false"
            head = ("\n" if i else "") + f'<｜DSML｜parameter name="{key}" string="{text}">'
            parts += [_literal(head), _xml_value(schema), _literal("</｜DSML｜parameter>")]
        return [*parts, _literal("\n</｜DSML｜invoke>")]
    if style == "pythonic":  # each value its JSON (a JSON string, number, list or object is Python's literal too)
        parts = [_literal(f"{name}(")]
        for i, (key, schema) in enumerate(parameters):
            parts += [_literal((", " if i else "") + f"{key}="), _value(schema)]
        return [*parts, _literal(")")]
    parts = [_literal(f"<tool_call>\n<function={name}>\n")]
    for key, schema in parameters:
        parts += [_literal(f"<parameter={key}>\n"), _xml_value(schema), _literal("\n</parameter>\n")]
    return [*parts, _literal("</function>\n</tool_call>")]


def _enum_of_others(schema: Any) -> bool:
    """An ``enum`` with a value that is no string (written as JSON, so ``string="false"`` in DSML)."""
    enum = schema.get("enum") if isinstance(schema, Mapping) else None
    return isinstance(enum, list) and any(not isinstance(v, str) for v in enum)


def _xml_calls_grammar(spec: Mapping[str, Any]) -> Any:
    """Calls of one of the tools in the spec's style, one to ``max_calls`` joined by ``sep``."""
    import xgrammar as xg

    style = spec.get("style", "qwen3")
    options = [xg.Grammar.concat(*_xml_call(t["name"], t["parameters"], style)) for t in spec["tools"]]
    call = xg.Grammar.union(*options) if len(options) > 1 else options[0]
    body = _joined(lambda _: call, int(spec["max_calls"]), spec["sep"])
    if style == "dsml":
        return _around("<｜DSML｜function_calls>\n", body, "\n</｜DSML｜function_calls>")
    if style == "pythonic":
        return _around("[", body, "]")
    return body


def _named_calls_grammar(spec: Mapping[str, Any]) -> Any:
    """``begin``, one to ``max_calls`` of the calls (each its text, a JSON value of its schema, its end) joined by
    ``sep``, ``end``; ``{index}`` in a call's texts its number from ``index`` on, where that is given."""
    import xgrammar as xg

    index = spec.get("index")

    def call_at(k: int) -> Any:
        def text(t: str) -> str:
            return t if index is None else t.replace(INDEX, str(int(index) + k))

        options = [_around(text(c["begin"]), _value(c["schema"]), text(c["end"])) for c in spec["calls"]]
        return xg.Grammar.union(*options) if len(options) > 1 else options[0]

    body = _joined(call_at, int(spec["max_calls"]), spec.get("sep") or "")
    return _around(spec["begin"], body, spec["end"])


def _tool_calls_grammar(spec: Mapping[str, Any]) -> Any:
    """``begin schema end`` once, or up to ``max_calls`` times joined by ``sep``, as one xgrammar grammar (the
    JSON on one line, strict: no property the schema does not name)."""

    call = _around(spec["begin"], _value(spec["schema"]), spec["end"])
    return _joined(lambda _: call, int(spec["max_calls"]), spec["sep"])


def _what(fmt: OutputFormat) -> str:
    return {
        "json_object": "JSON grammar",
        "json_schema": "JSON schema",
        "regex": "regular expression",
        "tool_calls": "tools' call schema",
        "tagged": "tools' call schema",
        "xml_calls": "tools' call schema",
        "named_calls": "tools' call schema",
    }.get(fmt.kind, "list of choices")


class Constraint:
    """One generation's grammar state: :meth:`mask` the next token's logits, :meth:`accept` the token sampled."""

    def __init__(self, compiled: Any, vocab_size: int) -> None:
        import xgrammar as xg

        self._xg = xg
        self.matcher = xg.GrammarMatcher(compiled)
        self.bitmask = xg.allocate_token_bitmask(1, vocab_size)

    def mask(self, logits: Any) -> None:
        """Set, in place, the logits ``[1, vocab]`` (float32) of the tokens the grammar does not allow next to
        ``-inf``."""
        if self.matcher.fill_next_token_bitmask(self.bitmask, 0):
            bitmask = self.bitmask if logits.device.type == "cpu" else self.bitmask.to(logits.device)
            self._xg.apply_token_bitmask_inplace(logits, bitmask)

    def accept(self, token: int) -> bool:
        """Advance past ``token``; ``False`` when the grammar does not allow it (then the state is unchanged)."""
        return bool(self.matcher.accept_token(int(token)))

    @property
    def terminated(self) -> bool:
        """The output is complete and its end-of-sequence token accepted."""
        return bool(self.matcher.is_terminated())
