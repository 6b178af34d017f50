"""One choice of an answer as its tokens arrive: the text (and an echoed prompt), logprobs in
the OpenAI shape of the endpoint (chat: `content` entries; completions: `tokens`,
`token_logprobs`, `top_logprobs`, `text_offset`), tool calls parsed from the text, and the
deltas a stream sends."""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

from pdserve.protocol import messages as m
from pdserve.router.tools import might_be_tool_call, parse_tool_calls


class Piece(NamedTuple):
    """What one token adds to a choice (token None: the finish reason alone)."""

    text: str
    finish: str | None
    token: int | None
    logprobs: m.Logprobs | None


class Choice:
    """`want_logprobs`: include logprobs; `tools`: the text may be a tool call (held back
    while streaming as long as it could be one); `keep_output` False: the answer is the echoed
    prompt only (completions with max_tokens=0)."""

    def __init__(
        self,
        index: int,
        *,
        chat: bool,
        token_text: Callable[[int], str],
        want_logprobs: bool = False,
        tools: bool = False,
        keep_output: bool = True,
    ):
        self.index, self.chat, self.token_text = index, chat, token_text
        self.want_logprobs, self.tools, self.keep_output = want_logprobs, tools, keep_output
        self.text = ""  # all of it
        self.sent = 0  # characters of text already streamed
        self.entries: list = []  # logprob entries, all of them
        self.sent_entries = 0
        self.offset = 0  # completions' text_offset of the next streamed token
        self.finish: str | None = None
        self.calls: list[dict] = []
        self.started = False  # the first delta (chat: with the role) went out

    def prepend(self, text: str, prompt: list[int], logprobs: list[m.Logprobs] | None) -> None:
        """Echo: the prompt's text, and its tokens' logprobs (the first has none)."""
        self.text = text + self.text
        if self.want_logprobs:
            lps = [None, *(logprobs or [None] * (len(prompt) - 1))]
            self.entries[:0] = [self._entry(t, lp) for t, lp in zip(prompt, lps, strict=True)]

    def add(self, piece: Piece) -> None:
        if piece.finish is not None:
            self.finish = piece.finish
        if not self.keep_output:
            return
        self.text += piece.text
        if self.want_logprobs and piece.token is not None:
            self.entries.append(self._entry(piece.token, piece.logprobs))
        if self.finish is not None and self.tools:
            content, self.calls = parse_tool_calls(self.text)
            if self.calls:
                self.text, self.finish = content or "", "tool_calls"

    def _entry(self, token: int, lp: m.Logprobs | None):
        text = self.token_text(token)
        value = lp.logprob if lp is not None else None
        top = [(self.token_text(t), v) for t, v in lp.top] if lp is not None else None
        if self.chat:
            return {
                "token": text,
                "logprob": value,
                "bytes": list(text.encode()),
                "top_logprobs": [
                    {"token": t, "logprob": v, "bytes": list(t.encode())} for t, v in top or ()
                ],
            }
        return text, value, dict(top) if top is not None else None

    def _logprobs(self, entries: list) -> dict | None:
        if not self.want_logprobs:
            return None
        if self.chat:
            return {"content": entries}
        offsets = []
        for text, _, _ in entries:
            offsets.append(self.offset)
            self.offset += len(text)
        return {
            "tokens": [e[0] for e in entries],
            "token_logprobs": [e[1] for e in entries],
            "top_logprobs": [e[2] for e in entries],
            "text_offset": offsets,
        }

    def whole(self) -> dict:
        """The choice of a non-streamed answer."""
        choice = {"index": self.index, "finish_reason": self.finish}
        choice["logprobs"] = self._logprobs(self.entries)
        if not self.chat:
            return {**choice, "text": self.text}
        message = {"role": "assistant", "content": self.text}
        if self.calls:
            message = {"role": "assistant", "content": self.text or None, "tool_calls": self.calls}
        return {**choice, "message": message}

    def delta(self) -> dict | None:
        """What a stream sends now (None: nothing yet); text that could still turn out to be a
        tool call is held back until it cannot, or until the end."""
        if self.tools and not self.sent and self.finish is None and might_be_tool_call(self.text):
            return None  # (once any text went out as content, none is held back again)
        text, entries = self.text[self.sent :], self.entries[self.sent_entries :]
        if not text and not entries and self.finish is None and self.started:
            return None
        self.sent, self.sent_entries = len(self.text), len(self.entries)
        choice = {"index": self.index, "finish_reason": self.finish}
        choice["logprobs"] = self._logprobs(entries)
        if not self.chat:
            return {**choice, "text": text}
        delta = {"content": text} if text or not self.calls else {}
        if not self.started:
            delta = {"role": "assistant", **delta}
        if self.calls:
            delta["tool_calls"] = [{"index": i, **c} for i, c in enumerate(self.calls)]
        self.started = True
        return {**choice, "delta": delta}
