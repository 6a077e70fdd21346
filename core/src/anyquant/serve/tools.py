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
  ``[TOOL_CALLS]name[ARGS]{...}``).

Standard library only (the grammar itself is :mod:`anyquant.runtime.grammar`'s).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FORMATS",
    "ToolFormat",
    "ToolStream",
    "call_schema",
    "detect_format",
    "new_call_id",
    "parse_tool_calls",
    "supports_tools",
    "template_source",
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


HERMES = ToolFormat("hermes", "<tool_call>\n", "\n</tool_call>", "\n", "arguments")
LLAMA3_JSON = ToolFormat("llama3_json", "", "", "; ", "parameters")
MISTRAL = ToolFormat("mistral", "[TOOL_CALLS]", "", "", "arguments", array=True)
FORMATS = {f.name: f for f in (HERMES, LLAMA3_JSON, MISTRAL)}

#: the most calls one constrained answer may hold when ``parallel_tool_calls`` is on
MAX_PARALLEL_CALLS = 4


def template_source(tokenizer: Any, with_tools: bool = True) -> str | None:
    """The chat template's source text transformers would render (the ``tool_use`` one of a set, when there is
    one and tools are passed), or ``None`` when the tokenizer has none."""
    source = getattr(tokenizer, "chat_template", None)
    if isinstance(source, list):  # [{"name": ..., "template": ...}] as tokenizer_config.json stores a set
        source = {t.get("name"): t.get("template") for t in source if isinstance(t, Mapping)}
    if isinstance(source, Mapping):
        source = (source.get("tool_use") if with_tools else None) or source.get("default")
    return source if isinstance(source, str) and source else None


def supports_tools(source: str) -> bool:
    """Whether the template reads a ``tools`` variable (jinja2's own analysis; a plain search where it cannot
    parse the template)."""
    try:
        import jinja2
        import jinja2.meta

        return "tools" in jinja2.meta.find_undeclared_variables(jinja2.Environment().parse(source))
    except Exception:  # an extension transformers' environment has and a bare one does not: search the text
        return re.search(r"\btools\b", source) is not None


def detect_format(source: str) -> ToolFormat | None:
    """The tool-call format the template teaches its model, from its text; ``None`` when none is recognised."""
    if "<tool_call>" in source:
        return HERMES
    if "[TOOL_CALLS]" in source:
        return MISTRAL
    if "<|python_tag|>" in source or '"parameters": dictionary' in source or "ipython" in source:
        return LLAMA3_JSON
    return None


def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


def _call(name: Any, arguments: Any) -> dict[str, Any] | None:
    """One OpenAI tool call from a parsed name and arguments (a mapping, or JSON text of one), else ``None``."""
    if not isinstance(name, str) or not name:
        return None
    if arguments is None:
        arguments = {}
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if not isinstance(arguments, Mapping):
        return None
    text = json.dumps(arguments, ensure_ascii=False)
    return {"id": new_call_id(), "type": "function", "function": {"name": name, "arguments": text}}


def _from_object(obj: Any, fmt: ToolFormat) -> dict[str, Any] | None:
    if not isinstance(obj, Mapping) or "name" not in obj:
        return None
    args = obj.get(fmt.arguments, obj.get("arguments", obj.get("parameters")))
    return _call(obj.get("name"), args)


_HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|\Z)", re.DOTALL)
_MISTRAL_NAMED = re.compile(r"\s*([A-Za-z0-9_.-]{1,64})\[ARGS\]")
_DECODER = json.JSONDecoder()


def _hermes(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    calls: list[dict[str, Any]] = []
    for match in _HERMES_CALL.finditer(text):
        try:
            obj = json.loads(match.group(1))
        except ValueError:
            return text, []
        call = _from_object(obj, HERMES)
        if call is None:
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
            obj, at = _DECODER.raw_decode(rest, at)
        except ValueError:
            return text, []
        call = _from_object(obj, LLAMA3_JSON)
        if call is None:
            return text, []
        calls.append(call)
        while at < len(rest) and rest[at] in " \t\r\n;":
            at += 1
    return None, calls


def _mistral(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    start = text.find("[TOOL_CALLS]")
    if start < 0:
        return text, []
    content = text[:start].strip() or None
    calls: list[dict[str, Any]] = []
    for part in text[start:].split("[TOOL_CALLS]")[1:]:
        named = _MISTRAL_NAMED.match(part)
        try:
            if named is not None:  # [TOOL_CALLS]name[ARGS]{...}: the newer tokenizers' format
                args, _ = _DECODER.raw_decode(part, named.end())
                call = _call(named.group(1), args)
                objs: list[dict[str, Any] | None] = [call]
            else:
                value, _ = _DECODER.raw_decode(part.strip())
                items = value if isinstance(value, list) else [value]
                objs = [_from_object(obj, MISTRAL) for obj in items]
        except ValueError:
            return text, []
        if not objs or any(c is None for c in objs):
            return text, []
        calls.extend(c for c in objs if c is not None)
    return content, calls


_PARSERS = {"hermes": _hermes, "llama3_json": _llama3, "mistral": _mistral}


def parse_tool_calls(text: str, fmt: ToolFormat) -> tuple[str | None, list[dict[str, Any]]]:
    """``(content, tool_calls)`` from a model's answer: the OpenAI tool calls it writes in ``fmt`` (each with a
    fresh ``call_...`` id and its arguments as JSON text) and the text outside them (``None`` when empty). Text
    that does not hold well-formed calls comes back whole, with no calls."""
    return _PARSERS[fmt.name](text)


def call_schema(tools: Sequence[Mapping[str, Any]], fmt: ToolFormat, name: str | None = None) -> dict[str, Any]:
    """The JSON schema of one call in ``fmt``: ``{"name": <a tool's name>, <arguments key>: <its parameters>}``
    over ``tools`` (OpenAI's ``{"type": "function", "function": {...}}``), or over the one named ``name``."""
    options = []
    for tool in tools:
        function = tool["function"]
        if name is not None and function["name"] != name:
            continue
        params = function.get("parameters")
        if not isinstance(params, Mapping) or not params:
            params = {"type": "object", "properties": {}}
        options.append(
            {
                "type": "object",
                "properties": {"name": {"enum": [function["name"]]}, fmt.arguments: params},
                "required": ["name", fmt.arguments],
                "additionalProperties": False,
            }
        )
    return options[0] if len(options) == 1 else {"anyOf": options}


class ToolStream:
    """A streamed answer's text, split into what can be sent as ``content`` now and what may be a tool call:
    :meth:`feed` each piece (it returns the text safe to send), :meth:`finish` at the end (the rest of the
    content, and the calls)."""

    def __init__(self, fmt: ToolFormat) -> None:
        self.fmt = fmt
        self.marker = fmt.begin.strip()
        self.text = ""
        self.sent = 0  # characters of text already sent as content
        self.holding = False  # a call has started: everything from self.sent on is held to the end
        self.called = False  # finish found calls

    def feed(self, piece: str) -> str:
        self.text += piece
        if self.holding:
            return ""
        if not self.marker:  # llama3_json: a call is the whole answer, from its start
            if self.sent == 0:
                head = self.text.lstrip()
                if head.startswith(("{", "<|python_tag|>")):
                    self.holding = True
                    return ""
                if not head or "<|python_tag|>".startswith(head):  # not known yet
                    return ""
            out = self.text[self.sent :]
            self.sent = len(self.text)
            return out
        at = self.text.find(self.marker, self.sent)
        if at >= 0:
            out = self.text[self.sent : at]
            self.sent, self.holding = at, True
            return out
        keep = 0  # the longest end of the text that could begin the marker: held back until it is known
        for k in range(min(len(self.marker) - 1, len(self.text) - self.sent), 0, -1):
            if self.marker.startswith(self.text[len(self.text) - k :]):
                keep = k
                break
        out = self.text[self.sent : len(self.text) - keep]
        self.sent = len(self.text) - keep
        return out

    def finish(self) -> tuple[str, list[dict[str, Any]]]:
        """The content not sent yet and the calls (empty when the held text holds no well-formed call)."""
        rest = self.text[self.sent :]
        self.sent = len(self.text)
        content, calls = parse_tool_calls(rest, self.fmt)
        if not calls:
            return rest, []
        self.called = True
        return (content or ""), calls
