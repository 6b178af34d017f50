"""Stop strings on streamed text: hold back a tail that could still become a stop string."""

from __future__ import annotations


class StopChecker:
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
