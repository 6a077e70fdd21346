"""Tool calls on ``anyquant serve``'s chat route (issue #43 §2): which tool-call format a checkpoint's chat template
writes, the model's tool-call text parsed back into OpenAI's ``tool_calls``, and the grammar that makes
``tool_choice: "required"`` (or a named function) write a well-formed call.

The tools are rendered by the checkpoint's own chat template (``apply_chat_template(tools=...)``); a template that
never reads ``tools`` has no tool support. The format is chosen from the template's text, as vLLM's tool parsers
and llama.cpp's chat formats do:

* ``hermes``: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``, one block per call (Qwen2.5, Qwen3,
  Hermes, and the ChatML templates that copy them);
* ``llama3_json``: the answer is ``{"name": ..., "parameters": {...}}`` (calls separated by ``;``, optionally after
  ``<|python_tag|>``) — Llama 3.1/3.2/3.3;
* ``mistral``: ``[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`` (and the newer
  ``[TOOL_CALLS]name[ARGS]{...}``);
* ``qwen3_xml``: ``<tool_call>\n<function=name>\n<parameter=key>\nvalue\n</parameter>\n...</function>\n</tool_call>``
  (Qwen3-Coder and the Qwen templates after it): each value text, read as its parameter's schema type says (a
  string as written; a number, boolean, object or array as JSON), so that ``arguments`` is JSON text serialized here;
* ``deepseek_v31``: ``<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>name<｜tool▁sep｜>{...}<｜tool▁call▁end｜>...
  <｜tool▁calls▁end｜>`` (DeepSeek-V3.1 and later), and ``deepseek_v3``, its calls written
  ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>name\n```json\n{...}\n```<｜tool▁call▁end｜>`` (DeepSeek-V3, R1 and
  its distills): the markers are special tokens of DeepSeek's tokenizer, so such answers are decoded with them;
* ``deepseek_v32``: DeepSeek-V3.2's DSML, ``<｜DSML｜function_calls>`` around ``<｜DSML｜invoke name="...">`` blocks
  of ``<｜DSML｜parameter name="key" string="true|false">value</｜DSML｜parameter>`` (a ``string="true"`` value is text;
  ``"false"``, JSON: DeepSeek's own ``encoding_dsv32.py``);
* ``kimi_k2``: ``<|tool_calls_section_begin|><|tool_call_begin|>functions.name:0<|tool_call_argument_begin|>{...}
  <|tool_call_end|>...<|tool_calls_section_end|>`` (Kimi K2); a call's id is the model's own ``functions.name:N``
  (vLLM's reading: Kimi's template writes the ids of the history back into the prompt);
* ``glm45``: ``<tool_call>name\n<arg_key>key</arg_key>\n<arg_value>value</arg_value>\n...</tool_call>`` (GLM-4.5,
  4.6), each value read as ``qwen3_xml``'s are;
* ``granite``: ``<|tool_call|>[{"name": ..., "arguments": {...}}, ...]`` (Granite 3.x); ``phi4_mini_json``:
  ``functools[{...}, ...]`` (Phi-4-mini's tool template in vLLM, Firefunction v2);
* ``functionary_v31``: ``<function=name>{...}</function>`` (Functionary v3.1, on Llama 3.1's template); and
  ``functionary_v32``: after the generation prompt's ``>>>``, ``all\ntext`` for content or ``name\n{...}`` for a
  call, the next recipient after another ``>>>`` (Functionary v3.2; llama.cpp's reading);
* ``pythonic``: the answer is ``[name(key=value, ...), ...]`` (Llama 3.2's and Llama 4's pythonic templates, vLLM's
  ``pythonic`` parser), read with :mod:`ast` (literals only: nothing is evaluated).

A call's ``arguments`` are the model's own text of its arguments object, as OpenAI's are, so that streamed
(:class:`ToolStream`: piece by piece as they are generated) they join into the same text as unstreamed.

Standard library only, with :mod:`anyquant_runtime.harmony`'s call ids (the grammar itself is
:mod:`anyquant_runtime.grammar`'s; gpt-oss's harmony calls are parsed there).
"""

from __future__ import annotations

import functools
import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from anyquant_runtime.chat import template_source
from anyquant_runtime.grammar import INDEX
from anyquant_runtime.harmony import new_call_id
from anyquant_runtime.stops import held_back

__all__ = [
    "DEEPSEEK_V3",
    "DEEPSEEK_V31",
    "DEEPSEEK_V32",
    "FORMATS",
    "FUNCTIONARY_V31",
    "FUNCTIONARY_V32",
    "FUNCTOOLS",
    "GLM45",
    "GRANITE",
    "KIMI_K2",
    "NamedCalls",
    "PYTHONIC",
    "HARMONY",
    "QWEN3_XML",
    "ToolFormat",
    "ToolStream",
    "XML_STYLES",
    "call_schema",
    "deepseek_calls",
    "detect_format",
    "functions",
    "named_calls",
    "new_call_id",
    "parse_tool_calls",
    "supports_tools",
    "template_reads",
    "template_source",
    "xml_calls",
]


@dataclass(frozen=True)
class ToolFormat:
    """How a template's model writes tool calls: ``begin`` opens a call (``""``: a JSON object at the start of
    the answer), ``end`` closes it, ``sep`` goes between two calls, ``arguments`` is the key holding the arguments
    and ``array`` whether the calls are one JSON array (Mistral) rather than one object per call."""

    name: str
    begin: str
    end: str
    sep: str
    arguments: str
    array: bool = False
    #: its markers are special tokens (DeepSeek's): answers are decoded with the special tokens' text
    special: bool = False
    #: what an answer that is content begins with, dropped (Functionary v3.2's ``all\n``; ``""``: nothing)
    lead: str = ""


HERMES = ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>", "\n", "arguments")
LLAMA3_JSON = ToolFormat("llama3_json", "", "", "; ", "parameters")
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "", "", "arguments", array=True)
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}
#: gpt-oss's harmony format: a call is a message to ``functions.<name>`` (parsed by :mod:`.harmony`, not here)
HARMONY = ToolFormat("harmony", "", "", "", "arguments")
QWEN3_XML = ToolFormat("qwen3_xml", "<tool_call>\n", "\n</tool_call>", "\n", "arguments")
FORMATS[QWEN3_XML.name] = QWEN3_XML
#: DeepSeek's markers (fullwidth bars and U+2581 as in its tokenizer)
DS_CALLS, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL, DS_CALL_END, DS_SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
DEEPSEEK_V31 = ToolFormat("deepseek_v31", DS_CALLS, DS_CALLS_END, "", "arguments", special=True)
DEEPSEEK_V3 = ToolFormat("deepseek_v3", DS_CALLS, DS_CALLS_END, "", "arguments", special=True)
FORMATS.update({f.name: f for f in (DEEPSEEK_V31, DEEPSEEK_V3)})
#: DeepSeek-V3.2's DSML tags (fullwidth bars, as its encoder writes them)
DSML = "｜DSML｜"
DSML_CALLS, DSML_CALLS_END = f"<{DSML}function_calls>", f"</{DSML}function_calls>"
DSML_INVOKE, DSML_INVOKE_END = f"<{DSML}invoke", f"</{DSML}invoke>"
DSML_PARAM, DSML_PARAM_END = f"<{DSML}parameter", f"</{DSML}parameter>"
DEEPSEEK_V32 = ToolFormat("deepseek_v32", DSML_CALLS, DSML_CALLS_END, "\n", "arguments", special=True)
#: Kimi K2's markers (special tokens of its tokenizer)
KIMI_CALLS, KIMI_CALLS_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL, KIMI_ARGS, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"
KIMI_K2 = ToolFormat("kimi_k2", KIMI_CALLS, KIMI_CALLS_END, "", "arguments", special=True)
GLM45 = ToolFormat("glm45", "<tool_call>", "</tool_call>", "\n", "arguments", special=True)
GRANITE = ToolFormat("granite", "<|tool_call|>", "", "", "arguments", array=True, special=True)
FUNCTOOLS = ToolFormat("phi4_mini_json", "functools", "", "", "arguments", array=True)
FUNCTIONARY_V31 = ToolFormat("functionary_v31", "<function=", "</function>", "", "arguments")
FUNCTIONARY_V32 = ToolFormat("functionary_v32", ">>>", "", "", "arguments", lead="all\n")
#: the answer is a Python list of calls, ``[name(key=value, ...), ...]`` (Llama 3.2's and Llama 4's pythonic
#: templates; Llama 4 may wrap it in ``<|python_start|>`` and ``<|python_end|>``)
PYTHONIC = ToolFormat("pythonic", "", "", ", ", "arguments")
PYTHON_START, PYTHON_END = "<|python_start|>", "<|python_end|>"
FORMATS.update(
    {f.name: f for f in (DEEPSEEK_V32, KIMI_K2, GLM45, GRANITE, FUNCTOOLS, FUNCTIONARY_V31, FUNCTIONARY_V32, PYTHONIC)}
)
#: the formats whose calls are XML-like tags around each argument, and the shape of their grammar
#: (:meth:`~anyquant_runtime.grammar.OutputFormat.xml_calls`)
XML_STYLES = {"qwen3_xml": "qwen3", "glm45": "glm", "deepseek_v32": "dsml", "pythonic": "pythonic"}

#: the most calls one constrained answer may hold when ``parallel_tool_calls`` is on
MAX_PARALLEL_CALLS = 4


@functools.lru_cache(maxsize=32)
def template_reads(source: str, name: str) -> bool:
    """Whether the template reads the variable ``name`` (jinja2's own analysis; a plain search where it cannot
    parse the template). Remembered per template and name: parsing a real template takes milliseconds, and every
    request with tools or ``reasoning_effort`` asks about the same one."""
    try:
        import jinja2
        import jinja2.meta

        return name in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(source))
    except Exception:  # an extension transformers' environment has and a bare one does not: search the text
        return re.search(rf"\b{re.escape(name)}\b", source) is not None


def supports_tools(source: str) -> bool:
    """Whether the template reads a ``tools`` variable."""
    return template_reads(source, "tools")


def detect_format(source: str) -> ToolFormat | None:
    """The tool-call format the template teaches its model, from its text; ``None`` when none is recognised."""
    if DS_CALL in source and DS_SEP in source:  # V3 and R1 write each call's type and a ```json fence
        return DEEPSEEK_V3 if "```json" in source else DEEPSEEK_V31
    if DSML in source:
        return DEEPSEEK_V32
    if KIMI_CALL in source and KIMI_ARGS in source:
        return KIMI_K2
    if "<arg_key>" in source and "<arg_value>" in source:  # before Hermes: GLM's calls open with <tool_call> too
        return GLM45
    if "<function=" in source and "<parameter=" in source:
        return QWEN3_XML
    if "<|tool_call|>" in source and "<|start_of_role|>" in source:
        return GRANITE
    if ">>>all" in source:
        return FUNCTIONARY_V32
    if "<function=" in source and "<|start_header_id|>" in source:  # before Llama 3's <|python_tag|>
        return FUNCTIONARY_V31
    if "<tool_call>" in source:
        return HERMES
    if "[TOOL_CALLS]" in source:
        return MISTRAL
    if "functools[" in source:
        return FUNCTOOLS
    if "[func_name1(" in source:  # the pythonic templates' instruction: [func_name1(params_name1=params_value1, ...)]
        return PYTHONIC
    if "<|python_tag|>" in source or '"parameters": dictionary' in source or "ipython" in source:
        return LLAMA3_JSON
    return None


#: the keys a call object may hold its arguments under (Llama 3's ``parameters``, everyone else's ``arguments``)
ARGUMENT_KEYS = ("arguments", "parameters")
_WS = " \t\n\r"  # JSON's whitespace
_DECODER = json.JSONDecoder()


def _skip(text: str, at: int, chars: str = _WS) -> int:
    while at < len(text) and text[at] in chars:
        at += 1
    return at


def _members(text: str, at: int) -> tuple[list[tuple[str, Any, int, int]], int]:
    """The JSON object at ``text[at]``: each member's key, value and the span of the value's text, and where the
    object ends; a ``ValueError`` when it is not a well-formed object."""
    if text[at : at + 1] != "{":
        raise ValueError("not an object")
    members: list[tuple[str, Any, int, int]] = []
    at = _skip(text, at + 1)
    if text[at : at + 1] == "}":
        return members, at + 1
    while True:
        if text[at : at + 1] != '"':
            raise ValueError("not a key")
        key, at = _DECODER.raw_decode(text, at)
        at = _skip(text, at)
        if text[at : at + 1] != ":":
            raise ValueError("no colon")
        start = _skip(text, at + 1)
        value, at = _DECODER.raw_decode(text, start)
        members.append((key, value, start, at))
        at = _skip(text, at)
        if text[at : at + 1] == "}":
            return members, at + 1
        if text[at : at + 1] != ",":
            raise ValueError("no comma")
        at = _skip(text, at + 1)


def _call(name: Any, arguments: Any, raw: str) -> dict[str, Any] | None:
    """One OpenAI tool call from a parsed name and arguments, else ``None``. The arguments are the model's own
    text, as OpenAI's are (and as they stream): ``raw``, the arguments object's text as written; the string when
    the model wrote the object as JSON text in a string; ``{}`` when it wrote none (or ``null``)."""
    if not isinstance(name, str) or not name:
        return None
    if arguments is None:
        return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": "{}"}}
    if isinstance(arguments, str):
        try:
            parsed = json.loads(arguments)
        except ValueError:
            return None
        if not isinstance(parsed, Mapping):
            return None
        raw = arguments
    elif not isinstance(arguments, Mapping):
        return None
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": raw}}


def _object_call(text: str, at: int) -> tuple[dict[str, Any] | None, int]:
    """The call written as the JSON object at ``text[at]`` (``None`` when it is an object but no call: one
    ``name``, at most one of :data:`ARGUMENT_KEYS`), and where the object ends; a ``ValueError`` when it is no
    well-formed object."""
    members, end = _members(text, at)
    names = [m for m in members if m[0] == "name"]
    args = [m for m in members if m[0] in ARGUMENT_KEYS]
    if len(names) != 1 or len(args) > 1:
        return None, end
    if not args:
        return _call(names[0][1], None, ""), end
    _, value, start, stop = args[0]
    return _call(names[0][1], value, text[start:stop]), end


_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.DOTALL)
_MISTRAL_NAMED = re.compile(r"\s*([A-Za-z0-9_.-]{1,64})\[ARGS\]")
_NAME = re.compile(r"[A-Za-z0-9_.-]{1,64}")


def _hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    calls: list[dict[str, Any]] = []
    for match in _HERMES_CALL.finditer(text):
        inner = match.group(1)
        try:
            call, end = _object_call(inner, 0)
        except ValueError:
            return text, []
        if call is None or end != len(inner):
            return text, []
        calls.append(call)
    content = _HERMES_CALL.sub("", text).strip() if calls else text
    return content or None, calls


def _llama3(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    rest = text.strip()
    if rest.startswith("<|python_tag|>"):
        rest = rest[len("<|python_tag|>") :].lstrip()
    if not rest.startswith("{"):
        return text, []
    calls: list[dict[str, Any]] = []
    at = 0
    while at < len(rest):
        try:
            call, at = _object_call(rest, at)
        except ValueError:
            return text, []
        if call is None:
            return text, []
        calls.append(call)
        at = _skip(rest, at, _WS + ";")
    return None, calls


def _mistral_part(part: str) -> list[dict[str, Any] | None]:
    """The calls of the text after one ``[TOOL_CALLS]``: a JSON array of call objects, one call object, or
    ``name[ARGS]{...}``; a ``ValueError`` when it holds none of those."""
    named = _MISTRAL_NAMED.match(part)
    if named is not None:  # [TOOL_CALLS]name[ARGS]{...}: the newer tokenizers' format
        start = _skip(part, named.end())
        value, end = _DECODER.raw_decode(part, start)
        return [_call(named.group(1), value, part[start:end])]
    at = len(part) - len(part.lstrip())
    if part[at : at + 1] == "{":
        return [_object_call(part, at)[0]]
    if part[at : at + 1] != "[":
        raise ValueError("no call")
    calls: list[dict[str, Any] | None] = []
    at = _skip(part, at + 1)
    while True:  # text after the array's end is left, as before
        call, at = _object_call(part, at)
        calls.append(call)
        at = _skip(part, at)
        if part[at : at + 1] == "]":
            return calls
        if part[at : at + 1] != ",":
            raise ValueError("no comma")
        at = _skip(part, at + 1)


def _mistral(text: str, marker: str = "[TOOL_CALLS]") -> tuple[str | None, list[dict[str, Any]]]:
    """Calls after ``marker``, each a JSON array of call objects (or one object, or Mistral's ``name[ARGS]{...}``):
    Mistral's ``[TOOL_CALLS]``, Granite's ``<|tool_call|>``, Phi-4-mini's ``functools``."""
    start = text.find(marker)
    if start < 0:
        return text, []
    content = text[:start].strip() or None
    calls: list[dict[str, Any]] = []
    for part in text[start:].split(marker)[1:]:
        try:
            objs = _mistral_part(part)
        except ValueError:
            return text, []
        if not objs or any(c is None for c in objs):
            return text, []
        calls.extend(c for c in objs if c is not None)
    return content, calls


_XML_HEAD = re.compile(r"<tool_call>\s*<function=([^>\n]{1,64})>")
_XML_KEY = re.compile(r"<parameter=([^>\n]{1,256})>")
_XML_TYPES: dict[str, tuple[type, ...]] = {
    "integer": (int,),
    "number": (int, float),
    "boolean": (bool,),
    "object": (dict,),
    "array": (list,),
}


def _xml_value(text: str, schema: Any) -> Any:
    """A ``<parameter=...>`` value: the text between the newlines around it, read as the parameter's schema type
    says (vLLM's and llama.cpp's reading): a string (or no type, or an unknown parameter) as written; ``null`` as
    JSON's null where the schema allows it; another type as JSON when the text parses to it, else as written."""
    if text.startswith("\n"):
        text = text[1:]
    if text.endswith("\n"):
        text = text[:-1]
    kinds = schema.get("type") if isinstance(schema, Mapping) else None
    kinds = [kinds] if isinstance(kinds, str) else list(kinds) if isinstance(kinds, list) else []
    if "null" in kinds and text.strip() == "null":
        return None
    wanted = tuple(t for k in kinds for t in _XML_TYPES.get(k, ()))
    if not wanted or "string" in kinds:
        return text
    try:
        value = json.loads(text)
    except ValueError:
        return text
    if isinstance(value, bool) and bool not in wanted:
        return text
    return value if isinstance(value, wanted) else text


def _qwen3_xml(text: str, tools: Sequence[Mapping[str, Any]] = ()) -> tuple[str | None, list[dict[str, Any]]]:
    params = {name: schema.get("properties") or {} for name, schema in functions(tools)}
    calls: list[dict[str, Any]] = []
    outside: list[str] = []
    at = 0
    while (start := text.find("<tool_call>", at)) >= 0:  # each search goes on from the last: linear in the text
        head = _XML_HEAD.match(text, start)
        end = text.find("</function>", head.end()) if head is not None else -1
        if head is None or end < 0:  # <tool_call> not followed by a well-formed <function=...>...</function>
            return text, []
        name = head.group(1).strip()
        properties = params.get(name, {})
        arguments = {key: _xml_value(v, properties.get(key)) for key, v in _xml_parameters(text[head.end() : end])}
        function = {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}
        calls.append({"id": new_call_id(), "type": "function", "function": function})
        outside.append(text[at:start])
        at = _skip(text, end + len("</function>"))
        if text.startswith("</tool_call>", at):
            at += len("</tool_call>")
    if not calls:
        return text, []
    content = ("".join(outside) + text[at:]).strip()
    return content or None, calls


def _xml_parameters(body: str) -> list[tuple[str, str]]:
    """The ``<parameter=key>value</parameter>`` pairs of a call's body, in order (a key without its closing tag
    ends the list); linear in the body."""
    out: list[tuple[str, str]] = []
    at = 0
    while (key := _XML_KEY.search(body, at)) is not None:
        close = body.find("</parameter>", key.end())
        if close < 0:
            break
        out.append((key.group(1).strip(), body[key.end() : close]))
        at = close + len("</parameter>")
    return out


def _json_call(name: str, raw: str) -> dict[str, Any] | None:
    """The call named ``name`` whose arguments are ``raw``, where ``raw`` is one JSON object and nothing else (the
    formats that write the name outside the arguments); else ``None``."""
    try:
        value, end = _DECODER.raw_decode(raw)
    except ValueError:
        return None
    return _call(name, value, raw) if end == len(raw) and isinstance(value, Mapping) else None


def _deepseek_call(body: str) -> dict[str, Any] | None:
    """One call from the text between ``<｜tool▁call▁begin｜>`` and ``<｜tool▁call▁end｜>``: V3.1's ``name<｜tool▁sep｜>
    {...}`` or V3's ``function<｜tool▁sep｜>name\n```json\n{...}\n```` (either is read whichever the template
    writes, as vLLM's two parsers read them); ``None`` when it is neither."""
    left, sep, right = body.partition(DS_SEP)
    if not sep:
        return None
    name, raw = left.strip(), right.strip()
    if name == "function" and "\n```json" in right:  # V3: the call's type, then the name and a fenced object
        head, _, fenced = right.partition("\n```json")
        name, raw = head.strip(), fenced.strip()
        if raw.endswith("```"):
            raw = raw[:-3].rstrip()
    return _json_call(name, raw) if _NAME.fullmatch(name) else None


def _sectioned(
    text: str, section: tuple[str, str], call: tuple[str, str], read: Callable[[str], dict[str, Any] | None]
) -> tuple[str | None, list[dict[str, Any]]]:
    """Calls each between ``call``'s two markers (read by ``read`` from the text between them), after ``section``'s
    first marker (or the first call's, where the model left it out) and up to its second; the text outside is the
    content. A call cut off or not read gives the whole text back, with no calls. Linear in the text."""
    (section_begin, section_end), (call_begin, call_end) = section, call
    first = text.find(call_begin)
    if first < 0:
        return text, []
    start = text.find(section_begin)
    start = first if start < 0 or start > first else start
    calls: list[dict[str, Any]] = []
    at = first
    while (begin := text.find(call_begin, at)) >= 0:  # each search goes on from the last: linear in the text
        close = text.find(call_end, begin)
        if close < 0:  # a call cut off
            return text, []
        found = read(text[begin + len(call_begin) : close])
        if found is None:
            return text, []
        calls.append(found)
        at = close + len(call_end)
    rest = text[at:]
    rest = rest.split(section_end, 1)[1] if section_end in rest else rest
    content = (text[:start] + rest).strip()
    return content or None, calls


def _deepseek(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    return _sectioned(text, (DS_CALLS, DS_CALLS_END), (DS_CALL, DS_CALL_END), _deepseek_call)


def _kimi_call(body: str) -> dict[str, Any] | None:
    """Kimi K2's ``ID<|tool_call_argument_begin|>{...}``, ID the model's ``functions.name:N``: the call with that id
    (the name without ``functions.`` and ``:N``, as llama.cpp reads it)."""
    ident, sep, raw = body.partition(KIMI_ARGS)
    ident, raw = ident.strip(), raw.strip()
    named = _KIMI_ID.fullmatch(ident)
    call = _json_call(named.group(1), raw) if sep and named is not None else None
    if call is not None:
        call["id"] = ident
    return call


def _kimi(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    return _sectioned(text, (KIMI_CALLS, KIMI_CALLS_END), (KIMI_CALL, KIMI_CALL_END), _kimi_call)


_KIMI_ID = re.compile(r"(?:functions\.)?([A-Za-z0-9_.-]{1,64}):[0-9]{1,9}")


#: a tagged call's reader: ``(its body, each tool's parameter schemas)`` -> ``(name, arguments)``, ``None``: no call
_Read = Callable[[str, Mapping[str, Mapping[str, Any]]], tuple[str, dict[str, Any]] | None]


def _tagged_calls(
    text: str, tools: Sequence[Mapping[str, Any]], open_tag: str, close_tag: str, read: _Read
) -> tuple[str | None, list[dict[str, Any]]]:
    """Calls each between ``open_tag`` and ``close_tag``, the text between read by ``read(body, properties)`` into
    ``(name, arguments)`` (``None``: not a call); the text outside them is the content. Any call that does not read
    gives the whole text back, with no calls. Linear in the text."""
    params = {name: schema.get("properties") or {} for name, schema in functions(tools)}
    calls: list[dict[str, Any]] = []
    outside: list[str] = []
    at = 0
    while (start := text.find(open_tag, at)) >= 0:
        end = text.find(close_tag, start + len(open_tag))
        if end < 0:
            return text, []
        read_call = read(text[start + len(open_tag) : end], params)
        if read_call is None:
            return text, []
        name, arguments = read_call
        function = {"name": name, "arguments": json.dumps(arguments, ensure_ascii=False)}
        calls.append({"id": new_call_id(), "type": "function", "function": function})
        outside.append(text[at:start])
        at = end + len(close_tag)
    if not calls:
        return text, []
    content = ("".join(outside) + text[at:]).strip()
    return content or None, calls


def _glm_pairs(body: str) -> list[tuple[str, str]] | None:
    """GLM's ``<arg_key>k</arg_key>`` + ``<arg_value>v</arg_value>`` pairs of a call's body, in order; ``None`` when
    the body holds anything else. Linear in the body."""
    key_open, key_close, value_open, value_close = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"
    out: list[tuple[str, str]] = []
    at = _skip(body, 0)
    while at < len(body):
        if not body.startswith(key_open, at):
            return None
        key_end = body.find(key_close, at)
        value_at = _skip(body, key_end + len(key_close)) if key_end >= 0 else -1
        if value_at < 0 or not body.startswith(value_open, value_at):
            return None
        value_end = body.find(value_close, value_at)
        if value_end < 0:
            return None
        out.append((body[at + len(key_open) : key_end].strip(), body[value_at + len(value_open) : value_end]))
        at = _skip(body, value_end + len(value_close))
    return out


def _glm_call(body: str, params: Mapping[str, Mapping[str, Any]]) -> tuple[str, dict[str, Any]] | None:
    """``name\n<arg_key>...`` (GLM-4.5's): the name to the first newline or tag, then the pairs; each value
    stripped and read by its parameter's schema type as ``qwen3_xml``'s are."""
    cut = min((i for i in (body.find("\n"), body.find("<")) if i >= 0), default=len(body))
    name = body[:cut].strip()
    pairs = _glm_pairs(body[cut:])
    if not _NAME.fullmatch(name) or pairs is None:
        return None
    properties = params.get(name, {})
    return name, {key: _xml_value(value.strip(), properties.get(key)) for key, value in pairs}


_DSML_NAME = re.compile(r'\s+name="([^"\n]{1,64})">\n?')
_DSML_PARAM = re.compile(r'\s+name="([^"\n]{1,256})"\s+string="(true|false)">')


def _dsml_call(body: str, params: Mapping[str, Mapping[str, Any]]) -> tuple[str, dict[str, Any]] | None:
    """`` name="NAME">`` then ``<｜DSML｜parameter name="key" string="true|false">value</｜DSML｜parameter>`` blocks
    (DeepSeek-V3.2's ``decode_dsml_to_arguments``: ``string="true"`` the value as text; ``"false"``, its JSON, or
    the text where it is none)."""
    head = _DSML_NAME.match(body)
    if head is None:
        return None
    arguments: dict[str, Any] = {}
    at = _skip(body, head.end())
    while at < len(body):
        if not body.startswith(DSML_PARAM, at):
            return None
        attrs = _DSML_PARAM.match(body, at + len(DSML_PARAM))
        end = body.find(DSML_PARAM_END, attrs.end()) if attrs is not None else -1
        if attrs is None or end < 0:
            return None
        raw = body[attrs.end() : end]
        value: Any = raw
        if attrs.group(2) == "false":
            try:
                value = json.loads(raw)
            except ValueError:
                value = raw
        arguments[attrs.group(1)] = value
        at = _skip(body, end + len(DSML_PARAM_END))
    return head.group(1), arguments


def _dsml(text: str, tools: Sequence[Mapping[str, Any]] = ()) -> tuple[str | None, list[dict[str, Any]]]:
    start = text.find(DSML_CALLS)
    if start < 0:
        return text, []
    end = text.find(DSML_CALLS_END, start)
    block = text[start + len(DSML_CALLS) : end if end >= 0 else len(text)]
    if end < 0 or block.strip() == "":
        return text, []
    inner, calls = _tagged_calls(block, tools, DSML_INVOKE, DSML_INVOKE_END, _dsml_call)
    if not calls or (inner or "").strip():
        return text, []
    content = (text[:start] + text[end + len(DSML_CALLS_END) :]).strip()
    return content or None, calls


def _function_call(body: str, params: Mapping[str, Mapping[str, Any]]) -> tuple[str, dict[str, Any]] | None:
    """Functionary v3.1's ``NAME>{...}`` (the text after ``<function=``): the name and its JSON object."""
    name, sep, raw = body.partition(">")
    try:
        value = json.loads(raw) if sep else None
    except ValueError:
        return None
    if not _NAME.fullmatch(name.strip()) or not isinstance(value, dict):
        return None
    return name.strip(), value


def _functionary_v32(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Functionary v3.2's answer (its generation prompt ends with ``>>>``): segments ``recipient\nbody`` after each
    ``>>>``; ``all``'s body is content, any other recipient a call with its body's JSON object."""
    segments = (text if text.startswith(">>>") else ">>>" + text).split(">>>")[1:]
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    for segment in segments:
        recipient, sep, body = segment.partition("\n")
        if recipient.strip() == "all" and sep:
            content.append(body)
            continue
        name = recipient.strip()
        call = _json_call(name, body.strip()) if sep and _NAME.fullmatch(name) else None
        if call is None:
            return text, []
        calls.append(call)
    joined = "".join(content).strip()
    return joined or None, calls


def _python_value(node: Any) -> Any:
    """A pythonic call's argument: a literal (numbers, strings, booleans, ``None``, lists, tuples, dicts with string
    keys, a negated number), JSON's ``true``/``false``/``null`` read as Python's; a ``ValueError`` for anything else
    (a name, a call, an expression)."""
    import ast

    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, (bool, int, float, str))):
        return node.value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub):
        value = _python_value(node.operand)
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return -value
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_python_value(e) for e in node.elts]
    if isinstance(node, ast.Dict) and all(k is not None for k in node.keys):
        keys = [_python_value(k) for k in node.keys]
        if all(isinstance(k, str) for k in keys):
            return dict(zip(keys, [_python_value(v) for v in node.values], strict=True))
    raise ValueError("not a literal")


_JSON_NAMES = {"true": True, "false": False, "null": None}


def _pythonic(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """The whole answer a Python list of calls with keyword arguments (vLLM's ``pythonic`` parser's reading; Llama 4's
    ``<|python_start|>``/``<|python_end|>`` around it dropped), read with :mod:`ast` (literals only, nothing
    evaluated): each call's arguments serialized as JSON."""
    import ast

    body = text.strip()
    if body.startswith(PYTHON_START):
        body = body[len(PYTHON_START) :].replace(PYTHON_END, "").strip()
    if not body.startswith("["):
        return text, []
    try:
        tree = ast.parse(body, mode="eval").body
        if not isinstance(tree, ast.List) or not tree.elts:
            return text, []
        calls = []
        for node in tree.elts:
            if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
                return text, []
            if not _NAME.fullmatch(node.func.id) or any(k.arg is None for k in node.keywords):
                return text, []
            arguments = {k.arg: _python_value(k.value) for k in node.keywords}
            function = {"name": node.func.id, "arguments": json.dumps(arguments, ensure_ascii=False)}
            calls.append({"id": new_call_id(), "type": "function", "function": function})
    except (SyntaxError, ValueError, RecursionError, MemoryError):  # not Python, or nested past the parser's limit
        return text, []
    return None, calls


#: each format's parser of an answer; its arguments: the text, and the request's tools (the formats that read their
#: values by the parameters' types take them)
_PARSERS: dict[str, Callable[[str, Sequence[Mapping[str, Any]]], tuple[str | None, list[dict[str, Any]]]]] = {
    "hermes": lambda text, _: _hermes(text),
    "llama3_json": lambda text, _: _llama3(text),
    "mistral": lambda text, _: _mistral(text),
    "granite": lambda text, _: _mistral(text, GRANITE.begin),
    "phi4_mini_json": lambda text, _: _mistral(text, FUNCTOOLS.begin),
    "qwen3_xml": _qwen3_xml,
    "glm45": lambda text, tools: _tagged_calls(text, tools, "<tool_call>", "</tool_call>", _glm_call),
    "functionary_v31": lambda text, tools: _tagged_calls(text, tools, "<function=", "</function>", _function_call),
    "functionary_v32": lambda text, _: _functionary_v32(text),
    "deepseek_v31": lambda text, _: _deepseek(text),
    "deepseek_v3": lambda text, _: _deepseek(text),
    "deepseek_v32": _dsml,
    "kimi_k2": lambda text, _: _kimi(text),
    "pythonic": lambda text, _: _pythonic(text),
}


def parse_tool_calls(
    text: str, fmt: ToolFormat, tools: Sequence[Mapping[str, Any]] = ()
) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` from a model's answer: the OpenAI tool calls it writes in ``fmt`` (each with a
    fresh ``call_...`` id and its arguments as the model wrote them: :func:`_call`; ``qwen3_xml``'s serialized
    from its values, read by the types of ``tools``' parameters) and the text outside them (``None`` when empty).
    Text that does not hold well-formed calls comes back whole, with no calls."""
    return _PARSERS[fmt.name](text, tools)


def functions(tools: Sequence[Mapping[str, Any]], name: str | None = None) -> list[tuple[str, Mapping[str, Any]]]:
    """``(name, parameters schema)`` of each of ``tools`` (OpenAI's ``{"type": "function", "function": {...}}``), or
    of the one named ``name``; a tool without ``parameters`` takes ``{}``'s schema."""
    out: list[tuple[str, Mapping[str, Any]]] = []
    for tool in tools:
        function = tool["function"]
        if name is not None and function["name"] != name:
            continue
        params = function.get("parameters")
        if not isinstance(params, Mapping) or not params:
            params = {"type": "object", "properties": {}}
        out.append((function["name"], params))
    return out


def xml_calls(tools: Sequence[Mapping[str, Any]], name: str | None = None) -> list[dict[str, Any]]:
    """``tool_choice: "required"`` (or the function ``name``) in ``qwen3_xml``: for each tool (the named one), its
    name and its required parameters in the schema's order, each with its schema
    (:meth:`~anyquant_runtime.grammar.OutputFormat.xml_calls`)."""
    out = []
    for function, params in functions(tools, name):
        properties = params.get("properties") or {}
        required = [k for k in properties if k in (params.get("required") or ())]
        out.append({"name": function, "parameters": [[k, properties[k]] for k in required]})
    return out


def deepseek_calls(
    tools: Sequence[Mapping[str, Any]], fmt: ToolFormat, name: str | None = None
) -> list[tuple[str, Mapping[str, Any], str]]:
    """``tool_choice: "required"`` (or the function ``name``) in DeepSeek's format ``fmt``: for each tool (the named
    one), the text before its arguments, their schema and the text after them
    (:meth:`~anyquant_runtime.grammar.OutputFormat.named_calls`)."""
    if fmt.name == "deepseek_v3":
        return [
            (f"{DS_CALL}function{DS_SEP}{n}\n```json\n", p, f"\n```{DS_CALL_END}") for n, p in functions(tools, name)
        ]
    return [(f"{DS_CALL}{n}{DS_SEP}", p, DS_CALL_END) for n, p in functions(tools, name)]


#: the text before each call's arguments in the formats that write the name outside them, and the text after
_NAMED = {
    "kimi_k2": (KIMI_CALL + "functions.{name}:" + INDEX + KIMI_ARGS, KIMI_CALL_END),
    "functionary_v31": ("<function={name}>", "</function>"),
    "functionary_v32": ("{name}\n", ""),
}


@dataclass(frozen=True)
class NamedCalls:
    """``tool_choice: "required"`` (or a named function) in a format whose calls write the name outside their JSON
    arguments (:meth:`~anyquant_runtime.grammar.OutputFormat.named_calls`' arguments): each tool's text before its
    arguments, their schema and the text after them; the text before the calls and after them; the text between
    two calls; the index of the first call where the texts hold :data:`INDEX` (else ``None``)."""

    options: list[tuple[str, Mapping[str, Any], str]]
    begin: str
    end: str
    sep: str
    first: int | None


def named_calls(
    tools: Sequence[Mapping[str, Any]], fmt: ToolFormat, name: str | None = None, history: int = 0
) -> NamedCalls | None:
    """:class:`NamedCalls` for ``tools`` (the one named ``name``) in ``fmt``, ``None`` for a format that writes the name
    inside the JSON. Kimi's ids ``functions.name:N`` count the calls of the whole conversation: ``history`` of them
    came before this answer."""
    if fmt in (DEEPSEEK_V3, DEEPSEEK_V31):
        return NamedCalls(deepseek_calls(tools, fmt, name), fmt.begin, fmt.end, "", None)
    if fmt.name not in _NAMED:
        return None
    before, after = _NAMED[fmt.name]
    options = [(before.replace("{name}", n), p, after) for n, p in functions(tools, name)]
    if fmt.name == "kimi_k2":
        return NamedCalls(options, fmt.begin, fmt.end, "", history)
    return NamedCalls(options, "", "", ">>>" if fmt.name == "functionary_v32" else "", None)


def call_schema(tools: Sequence[Mapping[str, Any]], fmt: ToolFormat, name: str | None = None) -> dict[str, Any]:
    """The JSON schema of one call in ``fmt``: ``{"name": <a tool's name>, <arguments key>: <its parameters>}``
    over ``tools`` (OpenAI's ``{"type": "function", "function": {...}}``), or over the one named ``name``."""
    options = [
        {
            "type": "object",
            "properties": {"name": {"enum": [function]}, fmt.arguments: params},
            "required": ["name", fmt.arguments],
            "additionalProperties": False,
        }
        for function, params in functions(tools, name)
    ]
    return options[0] if len(options) == 1 else {"anyOf": options}


class _Object:
    """A JSON object read a character at a time as it is generated, without checking it (the parse at the end
    does): where each of its members' values starts and ends, and where the object ends."""

    def __init__(self, start: int) -> None:
        self.start = start  # the opening brace
        self.pos = start  # the next character to read
        self.depth = 0
        self.string = False
        self.escape = False
        self.expect = "key"  # at depth 1: key, key-string, colon, value, string, scalar, container, next
        self.key_at = 0
        self.members: list[list[Any]] = []  # [key, value start, value end (-1 while it is read)]
        self.end = -1  # after the closing brace, once read

    def _close(self, end: int) -> None:
        self.members[-1][2] = end
        self.expect = "next"

    def read(self, text: str) -> None:
        """Read ``text`` (the stream's whole text) from where the last call stopped, up to the object's end."""
        i = self.pos
        while i < len(text) and self.end < 0:
            c = text[i]
            i += 1
            if self.string:
                if self.escape:
                    self.escape = False
                elif c == "\\":
                    self.escape = True
                elif c == '"':
                    self.string = False
                    if self.depth == 1 and self.expect == "key-string":
                        try:
                            key = json.loads(text[self.key_at : i])
                        except ValueError:
                            key = None
                        self.members.append([key, -1, -1])
                        self.expect = "colon"
                    elif self.depth == 1 and self.expect == "string":
                        self._close(i)
                continue
            if self.depth == 1 and self.expect == "scalar" and (c in ",}" or c.isspace()):
                self._close(i - 1)
            if c == '"':
                self.string = True
                if self.depth == 1 and self.expect == "key":
                    self.key_at, self.expect = i - 1, "key-string"
                elif self.depth == 1 and self.expect == "value":
                    self.members[-1][1], self.expect = i - 1, "string"
            elif c in "{[":
                if self.depth == 1 and self.expect == "value":
                    self.members[-1][1], self.expect = i - 1, "container"
                self.depth += 1
            elif c in "}]":
                self.depth -= 1
                if self.depth == 1 and self.expect == "container":
                    self._close(i)
                elif self.depth <= 0:
                    self.end = i
            elif self.depth == 1:
                if c == ":" and self.expect == "colon":
                    self.expect = "value"
                elif c == "," and self.expect == "next":
                    self.expect = "key"
                elif self.expect == "value" and not c.isspace():
                    self.members[-1][1], self.expect = i - 1, "scalar"
        self.pos = i

    def member(self, keys: Sequence[str]) -> tuple[int, int] | None:
        """The first member under one of ``keys`` once its value has begun: its start and end (-1: not yet)."""
        for key, start, end in self.members:
            if key in keys and start >= 0:
                return start, end
        return None


@dataclass
class _Streamed:
    """A call whose name has been sent: its id, name and the arguments text sent so far."""

    id: str
    name: str
    sent: str = ""
    whole: bool = False  # its arguments were JSON text in a string: sent whole once read


class ToolStream:
    """A streamed answer's text, split into what can be sent as ``content`` now and the tool calls, streamed as
    OpenAI streams them: :meth:`feed` each piece (it returns the content safe to send and the ``delta.tool_calls``
    entries to send), :meth:`finish` at the end (the rest), :meth:`reason` the choice's ``finish_reason``.

    A call's entry with its ``index``, ``id``, ``type`` and ``function.name`` (``arguments: ""``) goes out as soon
    as its name is read; its arguments' text then goes out as it is generated, the model's own text, so that the
    pieces join into the ``arguments`` the answer has unstreamed (:func:`parse_tool_calls`). Arguments written as
    JSON text in a string go out whole once read. Anything else the text holds waits for the end, where the text
    is parsed as an unstreamed answer is: the rest of each call's arguments and any call not streamed yet go out
    then. When calls were streamed and the text then does not parse (a call cut off by ``max_tokens``, a broken
    call in ``auto``), what was sent stands, as in vLLM: nothing more goes out, and the answer ends ``tool_calls``
    (``length`` when cut off)."""

    def __init__(self, fmt: ToolFormat, tools: Sequence[Mapping[str, Any]] = ()) -> None:
        self.fmt = fmt
        self.tools = tools  # the request's tools (qwen3_xml reads its values by their parameters' types)
        self.marker = fmt.begin.strip()
        self.text = ""
        self.sent = 0  # characters of text already sent as content
        self.holding = False  # a call has started: everything from self.sent on is held to the end
        self.called = False  # finish found calls that agree with those streamed
        self.calls: list[dict[str, Any]] = []  # finish's calls (their ids those streamed)
        self.streamed: list[_Streamed] = []  # the calls whose names have been sent
        self.at = 0  # where the reading of the held text stands, between calls
        self.mode = "stop"  # what it expects there: seek, open, array, array-next, first, next; stop: no more
        self.after = "stop"  # the mode after the current call's object
        self.obj: _Object | None = None  # the call object being read
        self.named: str | None = None  # Mistral's name[ARGS]: the object read is the arguments of this name
        self.count = 0  # call objects begun
        self.led = not fmt.lead  # the format's lead is settled (dropped, or the answer does not begin with it)

    def feed(self, piece: str) -> tuple[str, list[dict[str, Any]]]:
        self.text += piece
        if self.holding:
            return "", self._advance()
        if not self.led:  # Functionary v3.2: "all\n" begins content (dropped); a name, a call (held to the end)
            lead = self.fmt.lead
            if len(self.text) < len(lead) and lead.startswith(self.text):
                return "", []
            self.led = True
            if not self.text.startswith(lead):
                return "", self._hold(0, "stop")
            self.sent = len(lead)
        if not self.marker:  # llama3_json, pythonic: the calls are the whole answer, from its start
            if self.sent == 0:
                head = self.text.lstrip()
                opening, tag = ("[", PYTHON_START) if self.fmt.name == "pythonic" else ("{", "<|python_tag|>")
                if head.startswith((opening, tag)):
                    return "", self._hold(0, "stop" if self.fmt.name == "pythonic" else "first")
                if not head or tag.startswith(head):  # not known yet
                    return "", []
            out = self.text[self.sent :]
            self.sent = len(self.text)
            return out, []
        at = self.text.find(self.marker, self.sent)
        if at >= 0:
            out = self.text[self.sent : at]
            self.sent = at
            return out, self._hold(at, "seek")
        keep = held_back(self.text[self.sent :], (self.marker,))  # what could begin the marker waits until known
        out = self.text[self.sent : len(self.text) - keep]
        self.sent = len(self.text) - keep
        return out, []

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The content not sent yet and the ``delta.tool_calls`` entries not sent yet: the held text's content and
        the rest of its calls when it parses as calls that agree with those streamed; the held text as content
        when it holds no well-formed call and none was streamed; nothing when a call was streamed and the text
        does not parse (what was sent stands)."""
        rest = self.text[self.sent :]
        self.sent = len(self.text)
        content, calls = parse_tool_calls(rest, self.fmt, self.tools)
        if calls and self._agrees(calls):
            self.called, self.calls = True, calls
            deltas: list[dict[str, Any]] = []
            for i, call in enumerate(calls):
                function = call["function"]
                if i < len(self.streamed):
                    call["id"] = self.streamed[i].id
                    more = function["arguments"][len(self.streamed[i].sent) :]
                else:
                    deltas.append(self._head(i, call["id"], function["name"]))
                    more = function["arguments"]
                if more:
                    deltas.append(self._arguments(i, more))
            return content or "", deltas
        if self.streamed:
            return "", []
        return rest, []

    def reason(self, reason: str) -> str:
        """The choice's ``finish_reason`` from the model's (``stop`` or ``length``): ``tool_calls`` when its calls
        parsed, or when calls were streamed and the model stopped (vLLM's rule)."""
        if self.called or (self.streamed and reason == "stop"):
            return "tool_calls"
        return reason

    def _agrees(self, calls: Sequence[Mapping[str, Any]]) -> bool:
        """Whether ``calls`` begin with those streamed: the same names, the arguments sent a start of theirs."""
        if len(calls) < len(self.streamed):
            return False
        for call, done in zip(calls, self.streamed, strict=False):
            function = call["function"]
            if function["name"] != done.name or not function["arguments"].startswith(done.sent):
                return False
        return True

    @staticmethod
    def _head(index: int, call_id: str, name: str) -> dict[str, Any]:
        return {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}

    @staticmethod
    def _arguments(index: int, text: str) -> dict[str, Any]:
        return {"index": index, "function": {"arguments": text}}

    def _hold(self, at: int, mode: str) -> list[dict[str, Any]]:
        self.holding, self.at, self.mode = True, at, mode
        return self._advance()

    def _advance(self) -> list[dict[str, Any]]:
        """The entries the text read since the last call lets out."""
        out: list[dict[str, Any]] = []
        while self.mode != "stop":
            if self.obj is None:
                if not self._between():
                    break
                continue
            self.obj.read(self.text)
            out.extend(self._stream())
            if self.obj is None or self.obj.end < 0:
                break
            if len(self.streamed) < self.count:  # it ended without a name: no call, or not one to stream
                self.mode = "stop"
                break
            self.at, self.obj, self.named, self.mode = self.obj.end, None, None, self.after
        return out

    def _stream(self) -> list[dict[str, Any]]:
        """The entries the current call object's text read so far lets out: its name once read, then its
        arguments' new text."""
        obj, text, index = self.obj, self.text, self.count - 1
        assert obj is not None
        out: list[dict[str, Any]] = []
        if len(self.streamed) == index:  # its name is not sent yet
            if self.named is not None:
                name: Any = self.named
            else:
                span = obj.member(("name",))
                if span is None or span[1] < 0:
                    return out
                try:
                    name = json.loads(text[span[0] : span[1]])
                except ValueError:
                    name = None
                if not isinstance(name, str) or not name:  # not a call: left to the end's parse
                    self.obj, self.mode = None, "stop"
                    return out
            self.streamed.append(_Streamed(new_call_id(), name))
            out.append(self._head(index, self.streamed[-1].id, name))
        call = self.streamed[index]
        if self.named is not None:
            start, end = obj.start, obj.end
        else:
            span = obj.member(ARGUMENT_KEYS)
            if span is None:
                return out
            start, end = span
        if text[start] == "{":  # the object's text as it comes
            upto = end if end >= 0 else len(text)
            more = text[start + len(call.sent) : upto]
            if more:
                call.sent += more
                out.append(self._arguments(index, more))
        elif text[start] == '"' and end >= 0 and not call.whole:  # JSON text in a string: whole, once read
            call.whole = True
            try:
                value = json.loads(text[start:end])
                ok = isinstance(value, str) and isinstance(json.loads(value), Mapping)
            except ValueError:
                ok = False
            if ok:
                call.sent = value
                out.append(self._arguments(index, value))
        return out

    def _between(self) -> bool:
        """Read the text between calls at ``self.at``: ``False`` when it must wait for more text."""
        text, at, mode = self.text, self.at, self.mode
        if mode == "seek":  # the next call marker
            found = text.find(self.marker, at)
            if found < 0:
                self.at = max(at, len(text) - len(self.marker) + 1)
                return False
            self.at, self.mode = found + len(self.marker), "open"
            return True
        if mode == "next":  # Llama 3: calls joined by ';'
            at = _skip(text, at, _WS + ";")
        elif mode in ("array", "array-next"):
            at = _skip(text, at)
        else:
            while at < len(text) and text[at].isspace():
                at += 1
        self.at = at
        if at >= len(text):
            return False
        c = text[at]
        if mode == "first":  # Llama 3: the answer may begin with <|python_tag|>
            tag = "<|python_tag|>"
            if text.startswith(tag, at):
                self.at, self.mode = at + len(tag), "next"
            elif tag.startswith(text[at:]):
                return False
            else:
                self.mode = "next"
            return True
        if c == "{" and mode in ("open", "array", "next"):
            self.obj, self.count = _Object(at), self.count + 1
            self.after = {"open": "seek", "array": "array-next", "next": "next"}[mode]
            return True
        if mode == "open" and self.fmt.array and c == "[":
            self.at, self.mode = at + 1, "array"
            return True
        if mode == "open" and self.fmt.array and _NAME.match(c):  # Mistral's name[ARGS]{...}
            name = _NAME.match(text, at)
            assert name is not None
            tail = text[name.end() : name.end() + len("[ARGS]")]
            if name.end() == len(text) or (len(tail) < len("[ARGS]") and "[ARGS]".startswith(tail)):
                return False  # not known yet
            if tail == "[ARGS]":
                start = _skip(text, name.end() + len(tail))
                if start >= len(text):
                    return False
                if text[start] == "{":
                    self.obj, self.count, self.named = _Object(start), self.count + 1, name.group()
                    self.after = "seek"
                    return True
        if mode == "array-next" and c in ",]":
            self.at, self.mode = at + 1, ("array" if c == "," else "seek")
            return True
        self.mode = "stop"  # not what a call looks like here: left to the end's parse
        return False
