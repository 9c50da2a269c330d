"""Incremental detokenization with stop strings.

Each token decodes only a short window: the ids since the previous delta's
start (``prefix``) with and without the new ones, whose difference is the new
text (the window keeps the context that tokenizers like SentencePiece need to
place spaces); ids that end in incomplete UTF-8 (U+FFFD) wait for the next
token. A delta is released only when it cannot change: any suffix that could
still grow into a stop string is held back until the next token or the
finish."""
from __future__ import annotations


class Detokenizer:
    def __init__(self, tokenizer, stop=(), ids=(), emitted: int = 0):
        self.tokenizer = tokenizer
        self.stop = list(stop)
        self.ids = list(ids)
        self.emitted = emitted
        self.stop_from = 0
        self.text = ""
        self.prefix = self.read = 0  # text holds the decoded ids[:read]; the window starts at prefix
        self._advance()

    def add(self, token: int, check_stop: bool = True) -> tuple[str, bool]:
        """Append a token; returns ``(delta, stopped)``."""
        self.ids.append(token)
        self._advance()
        if not check_stop:
            self.stop_from = len(self.text)
        hit = self._find_stop() if check_stop else None
        if hit is not None:
            self.text = self.text[:hit]
            return self._release(len(self.text)), True
        return self._release(self._safe_end()), False

    def flush(self) -> str:
        self._advance(final=True)
        return self._release(len(self.text))

    def _advance(self, final: bool = False) -> None:
        if self.read == len(self.ids):
            return
        before = self.tokenizer.decode(self.ids[self.prefix:self.read]) if self.read > self.prefix else ""
        after = self.tokenizer.decode(self.ids[self.prefix:])
        if len(after) > len(before) and (final or not after.endswith("\ufffd")):
            self.text += after[len(before):]
            self.prefix, self.read = self.read, len(self.ids)

    def _release(self, end: int) -> str:
        end = max(end, self.emitted)
        delta = self.text[self.emitted:end]
        self.emitted = end
        return delta

    def _find_stop(self):
        hits = [i for i in (self.text.find(s, self.stop_from) for s in self.stop) if i >= 0]
        return min(hits) if hits else None

    def _safe_end(self) -> int:
        end = len(self.text)
        while end > self.emitted and self.text[end - 1] == "\ufffd":
            end -= 1
        hold = 0
        for s in self.stop:
            for n in range(min(len(s) - 1, end), hold, -1):
                if self.text[end - n:end] == s[:n]:
                    hold = n
                    break
        return end - hold
