"""Generated token ids as text, with stop strings: one implementation for the server's responses and
``LLM.generate``."""

from __future__ import annotations


class TextStream:
    """Turns generated token ids into text as they arrive and applies stop strings.

    ``add(new_ids)`` returns ``(kept_ids, text_delta)``: the ids that belong to the output (the ids after a stop
    string's completion are dropped, as is everything once stopped) and the text that is safe to send. Text is held
    back while it ends in an incomplete character or in a prefix of a stop string; the output text never contains the
    stop string. ``flush()`` returns what was held back (call it when the output ends). ``ids`` and ``text`` are the
    output so far; ``stopped`` the stop string that ended it, or None. Without a tokenizer, text stays empty."""

    def __init__(self, tokenizer, stop=()):
        self.tok, self.stop = tokenizer, list(stop)
        self.ids: list[int] = []
        self.text = ""
        self.sent = 0
        self.stopped: str | None = None

    def _decode(self, ids) -> str:
        return self.tok.decode(ids, skip_special_tokens=True) if self.tok is not None and ids else ""

    def _find(self, text: str):
        hits = [(i, s) for s in self.stop if (i := text.find(s)) >= 0]
        return min(hits) if hits else None

    def add(self, new_ids) -> tuple[list[int], str]:
        new_ids = list(new_ids)
        if self.stopped is not None or not new_ids:
            return [], ""
        kept = new_ids
        text = self._decode(self.ids + kept)
        if self.stop and self._find(text) is not None:
            for n in range(1, len(new_ids) + 1):  # the first token that completes a stop string ends the output
                text = self._decode(self.ids + new_ids[:n])
                hit = self._find(text)
                if hit is not None:
                    kept, self.stopped = new_ids[:n], hit[1]
                    text = text[: hit[0]]
                    break
        self.ids += kept
        self.text = text
        ready = len(text) if self.stopped is not None else self._safe_end(text)
        delta = text[self.sent : ready] if ready > self.sent else ""
        self.sent = max(self.sent, ready)
        return kept, delta

    def _safe_end(self, text: str) -> int:
        end = len(text)
        while end > self.sent and text[end - 1] == "\ufffd":  # an incomplete multi-byte character
            end -= 1
        for k in range(min(max((len(s) for s in self.stop), default=1) - 1, end - self.sent), 0, -1):
            tail = text[end - k : end]
            if any(s.startswith(tail) for s in self.stop):
                return end - k
        return end

    def flush(self) -> str:
        rest = self.text[self.sent :]
        self.sent = len(self.text)
        return rest
