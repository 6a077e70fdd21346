"""A thinking model's ``<think>...</think>`` block as the chat message's ``reasoning_content`` (issue #43): Qwen3,
QwQ, DeepSeek-R1 and its distills, DeepSeek-V3.1 in thinking mode, as llama-server (``--reasoning-format``) and
vLLM's ``deepseek_r1``/``qwen3`` reasoning parsers report it.

Whether the answer begins inside the block is read from the prompt the template rendered: R1's, QwQ's, Qwen3
Thinking-2507's and V3.1's (thinking) end with ``<think>`` open, and the model writes its reasoning, ``</think>``,
then the answer; Qwen3's hybrid template leaves the model to open the block itself (or, with thinking off, closes an
empty one in the prompt). The reasoning is the block's text as written; the content is what follows
``</think>``, without the whitespace that separates them. An answer that never closes the block (cut off by
``max_tokens``) is all reasoning. Standard library only, with the generator's stop-string holding back
(:func:`anyquant_runtime.stops.held_back`).
"""

from __future__ import annotations

from anyquant_runtime.stops import held_back

__all__ = ["THINK", "THINK_END", "ThinkStream", "begins_thinking", "split_thinking", "thinks"]

THINK, THINK_END = "<think>", "</think>"


def thinks(source: str) -> bool:
    """Whether a chat template is a thinking model's (it writes or strips ``</think>``)."""
    return THINK_END in source


def begins_thinking(prompt: str) -> bool:
    """Whether the rendered prompt ends inside an open ``<think>`` block (its answer begins with reasoning)."""
    return prompt.rfind(THINK) > prompt.rfind(THINK_END)


def split_thinking(text: str, thinking: bool) -> tuple[str | None, str]:
    """``(reasoning, content)`` of an answer; ``thinking``: it begins inside the block (else only an answer that
    opens one with ``<think>`` has reasoning). ``None``: no block."""
    if not thinking:
        head = text.lstrip()
        if not head.startswith(THINK):
            return None, text
        text = head[len(THINK) :]
    end = text.find(THINK_END)
    if end < 0:
        return text, ""
    return text[:end], text[end + len(THINK_END) :].lstrip()


class ThinkStream:
    """:func:`split_thinking` as the answer is generated: :meth:`feed` each piece, :meth:`finish` at the end; each
    returns ``(reasoning, content)`` pieces to send now. A suffix that may begin ``<think>`` or ``</think>`` is held
    until it is known; the pieces join into :func:`split_thinking`'s two texts."""

    def __init__(self, thinking: bool) -> None:
        self.text = ""
        self.at = 0  # what has been sent (or skipped) of self.text
        self.state = "reasoning" if thinking else "start"  # start: an opening <think> may come first
        self.stripping = False  # content's leading whitespace after </think> is being skipped
        self.lead = 0  # start: the answer's leading whitespace ends here (or later)

    def feed(self, piece: str) -> tuple[str, str]:
        self.text += piece
        return self._advance(final=False)

    def finish(self) -> tuple[str, str]:
        return self._advance(final=True)

    def _advance(self, final: bool) -> tuple[str, str]:
        text = self.text
        reasoning = content = ""
        if self.state == "start":
            while self.lead < len(text) and text[self.lead].isspace():  # the leading whitespace, read once
                self.lead += 1
            head = text[self.lead : self.lead + len(THINK)]
            if head == THINK:
                self.at, self.state = self.lead + len(THINK), "reasoning"
            elif not final and THINK.startswith(head):  # (empty, or a start of <think>): not known yet
                return "", ""
            else:
                self.state = "content"
        if self.state == "reasoning":
            end = text.find(THINK_END, self.at)
            if end < 0:
                upto = len(text) if final else len(text) - held_back(text[self.at :], (THINK_END,))
                reasoning, self.at = text[self.at : upto], upto
                return reasoning, ""
            reasoning = text[self.at : end]
            self.at, self.state, self.stripping = end + len(THINK_END), "content", True
        if self.stripping:
            while self.at < len(text) and text[self.at].isspace():
                self.at += 1
            if self.at == len(text):
                return reasoning, ""
            self.stripping = False
        content, self.at = text[self.at :], len(text)
        return reasoning, content
