"""Stop strings on streamed text, token by token: the router's answers and the offline
`LLM.generate` both end their text here (the engine itself knows only stop token ids)."""

from __future__ import annotations

from pdserve.model.tokenizer import IncrementalDecoder, Tokenizer


class StopChecker:
    """Holds back a tail of the text that could still become a stop string."""

    def __init__(self, stops: tuple[str, ...]):
        self.stops = stops
        self.text = ""
        self.sent = 0  # characters of text already released
        self.hit = False

    def push(self, delta: str) -> str:
        """Add decoded text; return what may be sent now (never part of a stop string)."""
        self.text += delta
        if not self.stops:
            out, self.sent = self.text[self.sent :], len(self.text)
            return out
        cut = min(
            (i for s in self.stops if (i := self.text.find(s, max(0, self.sent - len(s)))) >= 0),
            default=None,
        )
        if cut is not None:
            self.hit = True
            out = self.text[self.sent : cut]
            self.text, self.sent = self.text[:cut], cut
            return out
        hold = max(
            (k for s in self.stops for k in range(1, len(s)) if self.text.endswith(s[:k])),
            default=0,
        )
        end = len(self.text) - hold
        out, self.sent = self.text[self.sent : end], max(self.sent, end)
        return out

    def flush(self) -> str:
        out, self.sent = self.text[self.sent :], len(self.text)
        return out


class TextStream:
    """Output tokens in, text out: decoded incrementally (special tokens such as EOS add no
    text), cut before the first stop string (`hit` then)."""

    def __init__(self, tokenizer: Tokenizer, stops: tuple[str, ...], eos: set[int]):
        self.decoder, self.stop, self.eos = IncrementalDecoder(tokenizer), StopChecker(stops), eos

    @property
    def hit(self) -> bool:
        return self.stop.hit

    @property
    def text(self) -> str:
        """All the text so far, held-back tail included."""
        return self.stop.text

    def push(self, token: int | None) -> str:
        """The text that may be sent after `token` (None: no token, only a finish)."""
        if token is None or token in self.eos or self.stop.hit:
            return ""
        return self.stop.push(self.decoder.push(token))

    def flush(self) -> str:
        return self.stop.flush()
