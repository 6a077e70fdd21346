"""The request bodies of ``anyquant serve``'s completion routes, validated against OpenAI's schema with pydantic
before any work starts: :class:`ChatRequest` (``POST /v1/chat/completions``) and :class:`CompletionRequest`
(``POST /v1/completions``), and :func:`parse_json`, the body's JSON with its nesting bounded.

Every field the server reads is typed and bounded here (strict types: ``"1"`` is not a number, ``true`` is not an
integer; numbers finite; strings valid Unicode, no lone surrogates). OpenAI's fields that the server cannot honour
are refused unless they hold their neutral value (``best_of: 1``, ``functions: []``, ...); its fields that only say who
asks (``user``, ``metadata``, ``store``, ...) are accepted and not used; a field OpenAI does not define, and that is
not one of the extensions (``top_k``, ``min_p``, ``repetition_penalty``, vLLM's ``guided_json``, ``guided_regex``
and ``guided_choice``), is refused, as OpenAI refuses it
("Unrecognized request argument supplied"): a misspelt parameter is never silently ignored.

What depends on the model (token ids within its vocabulary) is checked here too, from the validation context
(``{"vocab": callable}``); what depends on the engine (which parameters its sampler takes) stays in :mod:`.app`.
Imported only when a server starts (pydantic is one of anyquant-serve's dependencies).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Discriminator,
    Field,
    PlainValidator,
    Tag,
    ValidationError,
    ValidationInfo,
    model_validator,
)
from pydantic_core import PydanticCustomError

from anyquant.plugin import MIN_TEMPERATURE

__all__ = [
    "MAX_CHOICES",
    "MAX_JSON_DEPTH",
    "MAX_LOGIT_BIAS",
    "ChatRequest",
    "CompletionRequest",
    "RequestError",
    "parse_json",
    "validate",
]

#: the most choices (``n``) one request may ask for: each runs as its own row of the batched decode
MAX_CHOICES = 8
#: the deepest nesting of arrays and objects a body may have (OpenAI's schema needs 4: messages, parts, part)
MAX_JSON_DEPTH = 64
#: the most ``logit_bias`` entries (OpenAI's own bound): each is applied at every decode step
MAX_LOGIT_BIAS = 300
#: the most ``stop`` strings (OpenAI's bound)
MAX_STOPS = 4
#: ``top_logprobs`` / completions' ``logprobs``: at most this many alternatives per token (OpenAI's bound)
MAX_TOP_LOGPROBS = 20
#: seeds are integers in [0, 2**63): what torch's generators take
MAX_SEED = 2**63 - 1
#: the most strings ``guided_choice`` may list
MAX_GUIDED_CHOICES = 1024
#: the most tools one request may offer (OpenAI's bound), and calls one message may carry
MAX_TOOLS = 128


class RequestError(Exception):
    """A request body that does not fit the schema: ``message`` names where, ``code`` is OpenAI's kind of error
    (``invalid_json``, ``invalid_value``, ``unsupported_parameter``, ``unknown_parameter``), ``param`` the top-level
    field (``None`` for the body as a whole)."""

    def __init__(self, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message, self.code, self.param = message, code, param


# ---------------------------------------------------------------------- JSON

_STRING = re.compile(rb'"[^"\\]*(?:\\.[^"\\]*)*(?:"|\\?\Z)', re.DOTALL)  # a string, or an unclosed one to the end
_NOT_BRACKET = bytes(sorted(set(range(256)) - set(b"[]{}")))


def _depth_over(data: bytes, limit: int) -> bool:
    """Whether arrays and objects in ``data`` nest deeper than ``limit``: strings dropped, then the brackets left
    counted, in linear time (the string pattern cannot backtrack: an unclosed string runs to the end)."""
    brackets = _STRING.sub(b"", data).translate(None, _NOT_BRACKET)
    depth = 0
    for byte in brackets:
        if byte in b"[{":
            depth += 1
            if depth > limit:
                return True
        else:
            depth -= 1
    return False


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not JSON")


def parse_json(data: bytes, max_depth: int = MAX_JSON_DEPTH) -> dict[str, Any]:
    """The body as a JSON object. :class:`RequestError` (``invalid_json``) for bytes that are not UTF-8 JSON, for
    ``NaN``/``Infinity`` (not JSON, though Python's parser takes them), for an integer of more than 4,300 digits,
    for arrays and objects nested deeper than ``max_depth`` (counted before parsing: no recursion runs away), and
    for anything but an object."""
    if _depth_over(data, max_depth):
        raise RequestError(f"the request body nests arrays and objects deeper than {max_depth} levels", "invalid_json")
    try:
        body = json.loads(data, parse_constant=_no_constant)
    except (ValueError, UnicodeDecodeError, RecursionError):
        raise RequestError("the request body is not valid JSON", "invalid_json") from None
    if not isinstance(body, dict):
        raise RequestError("the request body must be a JSON object", "invalid_json")
    return body


# ---------------------------------------------------------------------- field types


def _unicode(value: str) -> str:
    """Text that is Unicode: JSON's ``"\\ud800"`` escape decodes to a lone surrogate, which no tokenizer, chat
    template or UTF-8 answer can carry."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise PydanticCustomError(
            "invalid_value",
            "a lone surrogate ({char}) at character {at} is not Unicode text",
            {"char": ascii(value[exc.start : exc.end]), "at": exc.start},
        ) from None
    return value


def _vocab(info: ValidationInfo) -> int | None:
    context = info.context
    if not isinstance(context, dict) or context.get("vocab") is None:
        return None
    vocab = context["vocab"]
    if callable(vocab):  # asked once per request, and only when a token id is there to check
        vocab = context["vocab"] = int(vocab())
    return int(vocab)


def _in_vocab(token: int, info: ValidationInfo) -> int:
    vocab = _vocab(info)
    if vocab is not None and token >= vocab:
        raise PydanticCustomError(
            "invalid_value",
            "token id {token} is not in this model's vocabulary [0, {vocab})",
            {"token": token, "vocab": vocab},
        )
    return token


_TOKEN_KEY = re.compile(r"[0-9]{1,10}")  # ASCII digits only ("²".isdigit() is true); 10 digits bound int()


def _token_key(key: Any, info: ValidationInfo) -> int:
    """A ``logit_bias`` key: a token id written in ASCII digits."""
    if not isinstance(key, str) or not _TOKEN_KEY.fullmatch(key):
        raise PydanticCustomError("invalid_value", "keys are token ids written in ASCII digits (at most 10)")
    return _in_vocab(int(key), info)


def _temperature(value: float) -> float:
    if 0 < value < MIN_TEMPERATURE:
        raise PydanticCustomError(
            "invalid_value",
            "expected 0 (greedy) or at least {least} (a smaller temperature underflows float32)",
            {"least": MIN_TEMPERATURE},
        )
    return value


def _neutral(*allowed: Any) -> Callable[[Any], Any]:
    """An OpenAI field the server cannot honour: accepted absent, ``null`` or with one of its neutral values."""

    def check(value: Any) -> Any:
        if value is None or any(type(value) is type(a) and value == a for a in allowed):
            return value
        raise PydanticCustomError(
            "unsupported_parameter",
            "not supported by anyquant serve{neutral}",
            {"neutral": f" (only {', '.join(map(json.dumps, allowed))})" if allowed else ""},
        )

    return check


def _kind(value: Any) -> str | None:
    """The branch of a string-or-list union a value takes (``None``: neither, the union's own error)."""
    return "~str" if isinstance(value, str) else "~list" if isinstance(value, list) else None


def _either(message: str) -> Discriminator:
    return Discriminator(_kind, custom_error_type="invalid_value", custom_error_message=message)


def _one_prompt(value: Any) -> Any:
    """``["text"]`` or ``[[1, 2]]`` is one prompt in a list (what clients send for one); several are refused."""
    if isinstance(value, list) and value and all(isinstance(v, (str, list)) for v in value):
        if len(value) > 1:
            raise PydanticCustomError(
                "unsupported_parameter", "one prompt per request (a list of {count} was sent)", {"count": len(value)}
            )
        return value[0]
    return value


Text = Annotated[str, AfterValidator(_unicode)]
NonEmptyText = Annotated[str, Field(min_length=1), AfterValidator(_unicode)]
TokenId = Annotated[int, Field(ge=0), AfterValidator(_in_vocab)]
Unsupported = Annotated[Any, AfterValidator(_neutral())]
Penalty = Annotated[float, Field(ge=-2, le=2)]
Stop = Annotated[
    Annotated[NonEmptyText, Tag("~str")] | Annotated[list[NonEmptyText], Field(max_length=MAX_STOPS), Tag("~list")],
    _either(f"expected a string or a list of up to {MAX_STOPS} non-empty strings"),
]
Prompt = Annotated[
    Annotated[NonEmptyText, Tag("~str")] | Annotated[list[TokenId], Field(min_length=1), Tag("~list")],
    _either("expected one non-empty string or one non-empty list of token ids"),
    BeforeValidator(_one_prompt),
]
LogitBias = Annotated[
    dict[Annotated[int, PlainValidator(_token_key)], Annotated[float, Field(ge=-100, le=100)]],
    Field(max_length=MAX_LOGIT_BIAS),
]


class _Strict(BaseModel):
    """Strict JSON types, finite numbers, and no field the schema does not name."""

    model_config = ConfigDict(strict=True, extra="forbid", allow_inf_nan=False, frozen=True)


class TextPart(_Strict):
    type: Literal["text"]
    text: Text


Content = Annotated[
    Annotated[Text, Tag("~str")] | Annotated[list[TextPart], Tag("~list")],
    _either('expected a string or a list of {"type": "text", "text": ...} parts (text only)'),
]


FunctionName = Annotated[str, Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")]


class FunctionCall(_Strict):
    name: FunctionName
    arguments: Text  # JSON text, as the API returned it


class ToolCall(_Strict):
    """A call an assistant message made, sent back in the history."""

    id: Annotated[str, Field(min_length=1, max_length=256), AfterValidator(_unicode)]
    type: Literal["function"]
    function: FunctionCall


class Message(_Strict):
    role: NonEmptyText
    content: Content | None = None
    #: accepted, not used (the chat template sees role and content)
    name: Text | None = None
    #: an assistant message sent back as the API returned it carries these, empty
    refusal: Text | None = None
    annotations: list[Any] | None = None
    #: an assistant message's calls, and a ``tool`` message's answer to one (both passed to the chat template)
    tool_calls: Annotated[list[ToolCall], Field(max_length=MAX_TOOLS)] | None = None
    tool_call_id: Annotated[str, Field(min_length=1, max_length=256), AfterValidator(_unicode)] | None = None
    #: an assistant message's reasoning, sent back as the server returned it (``reasoning``: vLLM's newer name);
    #: passed to the chat template as ``reasoning_content`` (Qwen3's templates read it) and ``thinking`` (gpt-oss's)
    reasoning_content: Text | None = None
    reasoning: Text | None = None
    function_call: Unsupported = None
    audio: Unsupported = None

    def template_dict(self) -> dict[str, Any]:
        """The message as chat templates read it: role and content; an assistant's ``tool_calls`` with their
        arguments as a mapping where the JSON text is one (what Hugging Face's templates expect), and its reasoning
        (``reasoning_content`` and ``thinking``); a tool message's ``tool_call_id`` (and ``name``)."""
        out: dict[str, Any] = {"role": self.role, "content": self.text()}
        if self.tool_calls:
            calls = []
            for call in self.tool_calls:
                try:
                    arguments: Any = json.loads(call.function.arguments)
                except ValueError:
                    arguments = call.function.arguments
                if not isinstance(arguments, dict):
                    arguments = call.function.arguments
                function = {"name": call.function.name, "arguments": arguments}
                calls.append({"id": call.id, "type": "function", "function": function})
            out["tool_calls"] = calls
        reasoning = self.reasoning_content if self.reasoning_content is not None else self.reasoning
        if reasoning:
            out["reasoning_content"] = out["thinking"] = reasoning
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
            if self.name is not None:
                out["name"] = self.name
        return out

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class StreamOptions(_Strict):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # accepted: nothing is padded


class JsonSchema(_Strict):
    """``response_format.json_schema``: OpenAI's ``name`` (optional here), ``description``, ``schema`` (absent:
    any JSON object) and ``strict`` (accepted either way: the schema is always enforced)."""

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")] | None = None
    description: Text | None = None
    schema_: Annotated[dict[str, Any] | bool | None, Field(alias="schema")] = None
    strict: bool | None = None


class ResponseFormat(_Strict):
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchema | None = None

    @model_validator(mode="after")
    def _schema_with_its_type(self) -> ResponseFormat:
        if self.type == "json_schema" and self.json_schema is None:
            raise PydanticCustomError("invalid_value", 'type "json_schema" needs a json_schema object')
        if self.type != "json_schema" and self.json_schema is not None:
            raise PydanticCustomError("invalid_value", 'json_schema goes with type "json_schema" only')
        return self


class FunctionDef(_Strict):
    """A tool's function: ``name``, ``description``, ``parameters`` (a JSON schema of its arguments: absent, none)
    and ``strict`` (accepted either way: a constrained call always follows the schema)."""

    name: FunctionName
    description: Text | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class Tool(_Strict):
    type: Literal["function"]
    function: FunctionDef


class NamedFunction(_Strict):
    name: FunctionName


class NamedToolChoice(_Strict):
    type: Literal["function"]
    function: NamedFunction


ToolChoice = Annotated[
    Annotated[Literal["none", "auto", "required"], Tag("~str")] | Annotated[NamedToolChoice, Tag("~dict")],
    Discriminator(
        lambda v: "~str" if isinstance(v, str) else "~dict" if isinstance(v, dict) else None,
        custom_error_type="invalid_value",
        custom_error_message='expected "none", "auto", "required" or {"type": "function", "function": {"name": ...}}',
    ),
]


#: the fields that constrain the output, one per request: OpenAI's and vLLM's extensions
FORMAT_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_choice")


class _Request(_Strict):
    """The fields both routes share."""

    model: Text
    n: Annotated[int, Field(ge=1, le=MAX_CHOICES)] | None = None
    max_tokens: Annotated[int, Field(ge=0)] | None = None
    temperature: Annotated[float, Field(ge=0, le=2), AfterValidator(_temperature)] | None = None
    top_p: Annotated[float, Field(gt=0, le=1)] | None = None
    seed: Annotated[int, Field(ge=0, le=MAX_SEED)] | None = None
    stop: Stop | None = None
    stream: bool | None = None
    stream_options: StreamOptions | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    logit_bias: LogitBias | None = None
    response_format: ResponseFormat | None = None
    # extensions (vLLM's and llama.cpp's names)
    top_k: Annotated[int, Field(ge=0)] | None = None
    min_p: Annotated[float, Field(ge=0, lt=1)] | None = None
    repetition_penalty: Annotated[float, Field(gt=0, le=10)] | None = None
    guided_json: dict[str, Any] | bool | Text | None = None  # a JSON schema (or its JSON text)
    guided_regex: NonEmptyText | None = None
    guided_choice: Annotated[list[NonEmptyText], Field(min_length=1, max_length=MAX_GUIDED_CHOICES)] | None = None
    # who asks, and how OpenAI bills or stores it: accepted, not used
    user: Text | None = None
    metadata: dict[Text, Text] | None = None
    store: bool | None = None
    service_tier: Text | None = None
    safety_identifier: Text | None = None
    prompt_cache_key: Text | None = None

    def stops(self) -> tuple[str, ...]:
        return (self.stop,) if isinstance(self.stop, str) else tuple(self.stop or ())

    @model_validator(mode="after")
    def _one_format(self) -> _Request:
        asked = [name for name in FORMAT_FIELDS if self._format_of(name) is not None]
        if len(asked) > 1:
            raise PydanticCustomError(
                "invalid_value",
                "one output constraint per request: {names} were sent",
                {"names": " and ".join(asked), "param": asked[-1]},
            )
        return self

    def _format_of(self, name: str) -> Any:
        value = getattr(self, name)
        if name == "response_format" and value is not None and value.type == "text":
            return None
        return value

    def output_format(self) -> tuple[str, Any] | None:
        """The constraint asked for, as ``(field, value)``: ``response_format`` (not ``text``) or one of the
        ``guided_*`` extensions; ``None`` for free text."""
        for name in FORMAT_FIELDS:
            value = self._format_of(name)
            if value is not None:
                return name, value
        return None


class ChatRequest(_Request):
    messages: Annotated[list[Message], Field(min_length=1)]
    max_tokens: Annotated[int, Field(ge=1)] | None = None
    max_completion_tokens: Annotated[int, Field(ge=1)] | None = None
    logprobs: bool | None = None
    top_logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    tools: Annotated[list[Tool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    functions: Annotated[Any, AfterValidator(_neutral([]))] = None
    function_call: Annotated[Any, AfterValidator(_neutral("none"))] = None
    modalities: Annotated[Any, AfterValidator(_neutral(["text"]))] = None
    audio: Unsupported = None
    prediction: Unsupported = None
    #: passed to the chat template, which must read it (gpt-oss's: ``Reasoning: low``)
    reasoning_effort: Literal["minimal", "low", "medium", "high"] | None = None
    verbosity: Unsupported = None
    web_search_options: Unsupported = None
    echo: Annotated[Any, AfterValidator(_neutral(False))] = None  # completions' only

    @model_validator(mode="after")
    def _top_needs_logprobs(self) -> ChatRequest:
        if self.top_logprobs and not self.logprobs:
            raise PydanticCustomError("invalid_value", "needs logprobs: true", {"param": "top_logprobs"})
        return self

    @model_validator(mode="after")
    def _tool_choice_in_tools(self) -> ChatRequest:
        names = [t.function.name for t in self.tools or ()]
        if len(set(names)) < len(names):
            dup = next(n for n in names if names.count(n) > 1)
            raise PydanticCustomError(
                "invalid_value", "two tools are named {name}", {"name": _short(dup), "param": "tools"}
            )
        choice = self.tool_choice
        if choice is None or choice in ("none", "auto"):
            return self
        if not names:
            raise PydanticCustomError(
                "invalid_value", "{choice} needs tools", {"choice": _short(choice), "param": "tool_choice"}
            )
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise PydanticCustomError(
                "invalid_value",
                "names {name}, which is not one of the tools",
                {"name": _short(choice.function.name), "param": "tool_choice"},
            )
        return self

    def tool_mode(self) -> str:
        """``none`` (no tools, or ``tool_choice: "none"``), ``auto``, ``required`` or ``function`` (a named one)."""
        if not self.tools or self.tool_choice == "none":
            return "none"
        if isinstance(self.tool_choice, NamedToolChoice):
            return "function"
        return self.tool_choice or "auto"

    def history_calls(self) -> int:
        """The tool calls the conversation's assistant messages hold (Kimi K2's call ids count them)."""
        return sum(len(m.tool_calls or ()) for m in self.messages if m.role == "assistant")

    def asked_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    def top(self) -> int | None:
        """Alternatives per token to report; ``None``: no log-probabilities."""
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(_Request):
    prompt: Prompt
    logprobs: Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    echo: bool | None = None
    best_of: Annotated[Any, AfterValidator(_neutral(1))] = None
    tools: Annotated[Any, AfterValidator(_neutral([]))] = None  # chat's only
    suffix: Annotated[Any, AfterValidator(_neutral(""))] = None

    @model_validator(mode="after")
    def _zero_needs_echo(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise PydanticCustomError("invalid_value", "0 (the prompt alone) needs echo: true", {"param": "max_tokens"})
        return self

    def asked_tokens(self) -> int | None:
        return self.max_tokens

    def top(self) -> int | None:
        return self.logprobs


# ---------------------------------------------------------------------- errors


def _short(value: Any) -> str:
    """A value for an error message: ASCII, at most 60 characters (a 4,000-digit number by its size)."""
    if isinstance(value, int) and not isinstance(value, bool) and value.bit_length() > 100:
        return f"an integer of {value.bit_length()} bits"
    text = ascii(value)
    return text if len(text) <= 60 else text[:56] + "...'"


def _path(loc: tuple[int | str, ...]) -> str:
    """``messages[0].content[1].text``, ``logit_bias['x']``: a pydantic location without its union tags."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif part.startswith("~") or part == "[key]":
            continue
        elif not out:
            out = part
        elif part.isidentifier() and part.isascii():
            out += f".{part}"
        else:
            out += f"[{_short(part)}]"
    return out


def _request_error(exc: ValidationError) -> RequestError:
    """The first error, as OpenAI reports one: a message naming the field's path (and the value, short), the top
    field as ``param``."""
    first = exc.errors()[0]
    loc = first["loc"]
    kind = first["type"]
    ctx = first.get("ctx") or {}
    param = ctx.get("param") or (str(loc[0]) if loc else None)
    where = _path(loc) or str(param or "the request body")
    if kind == "extra_forbidden":
        return RequestError(f"Unrecognized request argument supplied: {where}", "unknown_parameter", param)
    message = f"{where}: {first['msg']}"
    if loc and loc[-1] == "[key]":
        message = f"{_path(loc[:-2])}: key {_short(loc[-2])}: {first['msg']}"
    elif kind not in ("missing", "unsupported_parameter") and not isinstance(first.get("input"), (dict, list)):
        message += f" (got {_short(first.get('input'))})"
    code = "unsupported_parameter" if kind == "unsupported_parameter" else "invalid_value"
    return RequestError(message, code, param)


def validate(
    body: Mapping[str, Any], chat: bool, vocab: Callable[[], int] | None = None
) -> ChatRequest | CompletionRequest:
    """``body`` as the route's request, or :class:`RequestError` naming the first field that does not fit.
    ``vocab`` (the model's vocabulary size, asked only when a token id is there to check) bounds token ids."""
    cls: type[ChatRequest] | type[CompletionRequest] = ChatRequest if chat else CompletionRequest
    try:
        return cls.model_validate(body, context={"vocab": vocab})
    except ValidationError as exc:
        raise _request_error(exc) from None
