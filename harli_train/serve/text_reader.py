"""TextReader: a completion's text as its tokens arrive, for the API's responses (streamed or whole).

Each ``feed`` decodes only a window of the last tokens (the previous step's and the new ones), as vLLM's
incremental detokenizer does, and hands out what the window adds to the text; decoding the whole completion at
every token would cost a request O(n^2) on the server's thread, host time the engine and the trainer share.
The window starts one step back so that a tokenizer that drops a leading space at a slice's start
(SentencePiece) drops it on both sides of the difference. A window ending in U+FFFD (a multi-byte character
not complete yet) waits for more tokens. With stop strings, the last ``max(len(stop)) - 1`` characters are
held back (a stop string may be cut between tokens) and the text is cut at the first stop string. ``finish``
decodes the whole completion once, so the text handed out in all is what decoding the whole would give.
"""

from __future__ import annotations

from typing import Any


class TextReader:
    """The text of a completion's tokens (``feed``), final once ``finish`` has been called."""

    def __init__(self, tokenizer: Any, stop: list[str]) -> None:
        self.tokenizer, self.stop = tokenizer, stop
        self.ids: list[int] = []
        self.text, self.stopped = "", False  # text: what was handed out
        self._hold = max((len(s) for s in stop), default=1) - 1
        self._decoded = ""  # the text of ids[:read], built window by window
        self._prefix, self._read = 0, 0  # the window: ids[prefix:]; what it had decoded: ids[prefix:read]
        self._searched = 0  # stop strings were looked for in _decoded[:_searched]

    def feed(self, tokens: list[int]) -> str:
        """Add tokens; returns the text that is final now (nothing more once a stop string matched)."""
        if self.stopped:
            return ""
        self.ids.extend(tokens)
        decode = self.tokenizer.decode
        before = decode(self.ids[self._prefix : self._read]) if self._read > self._prefix else ""
        after = decode(self.ids[self._prefix :])
        if len(after) > len(before) and not after.endswith("\ufffd"):
            self._decoded += after[len(before) :]
            self._prefix, self._read = self._read, len(self.ids)
        self._cut_at_stop()
        if self.stopped:
            return self._hand_out(self._decoded)
        return self._hand_out(
            self._decoded[: len(self._decoded) - self._hold] if self._hold else self._decoded
        )

    def finish(self) -> str:
        """The rest of the text, at the end of the request."""
        if not self.stopped:
            self._decoded, self._searched = self.tokenizer.decode(self.ids), 0
            self._cut_at_stop()
        return self._hand_out(self._decoded)

    def _cut_at_stop(self) -> None:
        """Cut ``_decoded`` at the first stop string in it, looking only where a new one may have begun."""
        if not self.stop:
            return
        start = max(self._searched - self._hold, 0)
        cuts = [at for at in (self._decoded.find(s, start) for s in self.stop) if at >= 0]
        if cuts:
            self._decoded, self.stopped = self._decoded[: min(cuts)], True
        self._searched = len(self._decoded)

    def _hand_out(self, final: str) -> str:
        if not final.startswith(self.text) or len(final) <= len(self.text):
            return ""
        piece, self.text = final[len(self.text) :], final
        return piece
