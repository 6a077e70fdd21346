"""gpt-oss's answers: OpenAI's harmony format parsed into reasoning, content and tool calls (the generator's
``complete``, ``stream`` and ``generate`` on chat prompts; ``anyquant serve``'s ``reasoning_content``, ``content`` and
``tool_calls``).

A harmony chat template ends its prompt with ``<|start|>assistant``; the model then writes one or more messages,
each a header, ``<|message|>``, a body and an end marker::

    <|channel|>analysis<|message|>The user asks ...<|end|>
    <|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

    <|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>

The header names the message's channel (``analysis``: the model's reasoning, ``final``: the answer,
``commentary``: tool calls and preambles) and, for a tool call, its recipient (``to=functions.<name>``). A body
ends at ``<|end|>`` (another message follows), ``<|return|>`` (the answer is done) or ``<|call|>`` (a tool call
is done); the last two end the generation. What the channels become, as llama-server and vLLM report them:

* ``analysis`` without a recipient: ``reasoning_content`` (DeepSeek's API field, which llama-server and vLLM use);
* a message to ``functions.<name>``: a tool call of ``<name>`` whose ``arguments`` are the body, as written
  (when the request offers tools; otherwise, like any other message to a recipient, ``reasoning_content``);
* ``final``, ``commentary`` without a recipient (a preamble meant for the user) and any other channel: ``content``.

The markers are special tokens in gpt-oss's tokenizer: the answer is decoded with them. Text that holds no
``<|message|>`` at all is ``content`` as it is. Standard library only (and :mod:`.stops`, itself torch-free).
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from .stops import held_back

__all__ = [
    "ENDS",
    "HarmonyAnswer",
    "HarmonyStream",
    "call_header",
    "call_options",
    "is_harmony",
    "new_call_id",
    "parse_harmony",
]

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
#: the markers that end a body (``<|start|>`` too: a model that omits ``<|end|>`` before its next message)
_BODY_ENDS = (END, CALL, RETURN, START)
#: the markers that end the generation: stop strings of every harmony request
ENDS = (CALL, RETURN)
_CHANNEL = re.compile(r"<\|channel\|>\s*([A-Za-z0-9_.-]+)")
_RECIPIENT = re.compile(r"(?:^|\s)to=([^\s<]+)")
_FUNCTIONS = "functions."


def is_harmony(source: str) -> bool:
    """Whether a chat template writes OpenAI's harmony format (gpt-oss's: ``<|start|>role<|channel|>...
    <|message|>...``)."""
    return START in source and CHANNEL in source and MESSAGE in source


def new_call_id() -> str:
    """A fresh OpenAI tool-call id."""
    return "call_" + uuid.uuid4().hex[:24]


def call_header(name: str) -> str:
    """The header gpt-oss writes before a call of function ``name`` (after the prompt's ``<|start|>assistant``)."""
    return f"{CHANNEL}commentary to={_FUNCTIONS}{name} {CONSTRAIN}json{MESSAGE}"


def call_options(functions: Sequence[tuple[str, Mapping[str, Any]]]) -> list[tuple[str, Mapping[str, Any]]]:
    """``tool_choice: "required"`` (or a named function) as a harmony answer: for each function offered (``(name,
    parameters schema)``), its call's header and the schema of its arguments
    (:meth:`~anyquant_runtime.grammar.OutputFormat.tagged`). The call comes first: the constrained answer has no
    analysis message before it."""
    return [(call_header(name), params) for name, params in functions]


@dataclass(frozen=True)
class _Header:
    channel: str
    recipient: str | None

    @classmethod
    def parse(cls, text: str) -> _Header:
        """A message's header (what comes before ``<|message|>``, after ``<|start|>`` when there is one)."""
        channel = _CHANNEL.search(text)
        recipient = _RECIPIENT.search(text.replace(CHANNEL, " ").replace(CONSTRAIN, " "))
        return cls(channel.group(1) if channel else "", recipient.group(1) if recipient else None)

    def kind(self, tools: bool) -> str:
        """``call``, ``reasoning`` or ``content``: where the message's body goes."""
        if self.recipient is not None:
            return "call" if tools and self.recipient.startswith(_FUNCTIONS) else "reasoning"
        return "reasoning" if self.channel == "analysis" else "content"

    def function(self) -> str:
        assert self.recipient is not None
        return self.recipient[len(_FUNCTIONS) :]


@dataclass
class HarmonyAnswer:
    """An answer split by channel: its reasoning, its content (``None`` when empty), its tool calls."""

    reasoning: str | None = None
    content: str | None = None
    calls: list[dict[str, Any]] = field(default_factory=list)

    def message(self) -> dict[str, Any]:
        """The chat message OpenAI's clients read (``reasoning_content`` only when there is reasoning)."""
        out: dict[str, Any] = {"role": "assistant", "content": self.content}
        if self.content is None and not self.calls:
            out["content"] = ""
        if self.reasoning is not None:
            out["reasoning_content"] = self.reasoning
        if self.calls:
            out["tool_calls"] = self.calls
        return out


def _arguments_ok(text: str) -> bool:
    try:
        return isinstance(json.loads(text), Mapping)
    except ValueError:
        return False


def _messages(text: str) -> list[tuple[str, str]] | None:
    """Each complete-headed message of ``text``: its header and its body; ``None`` when the text holds no
    ``<|message|>`` (no harmony at all)."""
    if MESSAGE not in text:
        return None
    out: list[tuple[str, str]] = []
    at = 0
    ahead = _Ahead(text)
    while at < len(text):
        if text.startswith(START, at):
            at += len(START)
        opened = text.find(MESSAGE, at)
        if opened < 0:  # a header the generation cut off: it holds nothing to report
            break
        header, body_at = text[at:opened], opened + len(MESSAGE)
        stop, marker = ahead.first(body_at)
        if stop < 0:
            out.append((header, text[body_at:]))
            break
        out.append((header, text[body_at:stop]))
        at = stop + (0 if marker == START else len(marker))
    return out


class _Ahead:
    """The first body end at or after a position, each marker's next place remembered (found again only once the
    reading passes it), so that reading a whole answer is linear in its length."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.next = {m: -2 for m in _BODY_ENDS}  # -2: not searched yet; -1: none ahead

    def first(self, at: int) -> tuple[int, str]:
        best, which = -1, ""
        for m in _BODY_ENDS:
            i = self.next[m]
            if i == -2 or (i != -1 and i < at):
                i = self.next[m] = self.text.find(m, at)
            if i >= 0 and (best < 0 or i < best):
                best, which = i, m
        return best, which


def parse_harmony(text: str, tools: bool) -> HarmonyAnswer:
    """The answer ``text`` (decoded with the harmony markers) by channel; ``tools``: the request offered tools, so
    that messages to ``functions.<name>`` are its tool calls. A call whose body is no JSON object is reasoning."""
    messages = _messages(text)
    if messages is None:
        return HarmonyAnswer(content=text or None)
    reasoning: list[str] = []
    content: list[str] = []
    calls: list[dict[str, Any]] = []
    for raw, body in messages:
        header = _Header.parse(raw)
        kind = header.kind(tools)
        if kind == "call" and _arguments_ok(body):
            function = {"name": header.function(), "arguments": body}
            calls.append({"id": new_call_id(), "type": "function", "function": function})
        elif kind == "content":
            content.append(body)
        else:
            reasoning.append(body)
    return HarmonyAnswer("".join(reasoning) or None, "".join(content) or None, calls)


class HarmonyStream:
    """A streamed harmony answer, split as it is generated: :meth:`feed` each piece of text, :meth:`finish` at the
    end; each returns the ``delta`` objects to send, one a chunk: ``{"reasoning_content": ...}``,
    ``{"content": ...}``, or ``{"tool_calls": [...]}`` as OpenAI streams a call (its index, id, type and name
    once its header is read, then its arguments' text as it comes). The pieces join into what
    :func:`parse_harmony` makes of the whole text, except that a call's arguments are sent before they are known
    to be a JSON object: what was sent stands (as in vLLM)."""

    def __init__(self, tools: bool) -> None:
        self.tools = tools
        self.text = ""
        self.at = 0  # where the reading stands
        self.kind: str | None = None  # the current body's kind; None: reading a header
        self.calls = 0  # calls begun
        self.seen = 0  # a header's <|message|> is not before this

    def feed(self, piece: str) -> list[dict[str, Any]]:
        self.text += piece
        return self._advance(final=False)

    def finish(self) -> list[dict[str, Any]]:
        if MESSAGE not in self.text:  # no harmony at all: the text is content, as parse_harmony has it
            rest = self.text[self.at :]
            self.at = len(self.text)
            return [{"content": rest}] if rest else []
        return self._advance(final=True)

    def reason(self, reason: str) -> str:
        """The choice's ``finish_reason``: ``tool_calls`` once a call was sent and the model stopped."""
        return "tool_calls" if self.calls and reason == "stop" else reason

    def _advance(self, final: bool) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        text = self.text
        while self.at < len(text):
            if self.kind is None:  # a header: wait for its <|message|>
                at = self.at + (len(START) if text.startswith(START, self.at) else 0)
                opened = text.find(MESSAGE, max(at, self.seen))
                if opened < 0:  # (text with no <|message|> at all is content: finish sends it)
                    self.seen = max(at, len(text) - len(MESSAGE) + 1)  # not searched again: linear in the text
                    break
                header = _Header.parse(text[at:opened])
                self.kind = header.kind(self.tools)
                if self.kind == "call":
                    call = {"index": self.calls, "id": new_call_id(), "type": "function"}
                    call["function"] = {"name": header.function(), "arguments": ""}
                    out.append({"tool_calls": [call]})
                    self.calls += 1
                self.at = opened + len(MESSAGE)
                continue
            ends = [(i, m) for m in _BODY_ENDS for i in (text.find(m, self.at),) if i >= 0]
            stop, marker = min(ends) if ends else (len(text), "")
            # (what could begin an end marker waits until it is known)
            upto = stop if ends or final else stop - held_back(text[self.at : stop], _BODY_ENDS)
            if upto > self.at:
                out.append(self._delta(text[self.at : upto]))
                self.at = upto
            if not ends:
                break
            self.kind = None
            self.at = stop + (0 if marker == START else len(marker))
        return _merged(out)

    def _delta(self, body: str) -> dict[str, Any]:
        if self.kind == "call":
            return {"tool_calls": [{"index": self.calls - 1, "function": {"arguments": body}}]}
        return {"reasoning_content" if self.kind == "reasoning" else "content": body}


def _merged(deltas: Sequence[dict[str, Any]]) -> list[dict[str, Any]]:
    """Neighbouring text deltas of one field joined (fewer chunks; the same text)."""
    out: list[dict[str, Any]] = []
    for delta in deltas:
        if out and len(delta) == 1 and set(delta) == set(out[-1]) and isinstance(next(iter(delta.values())), str):
            key = next(iter(delta))
            out[-1] = {key: out[-1][key] + delta[key]}
        else:
            out.append(delta)
    return out
