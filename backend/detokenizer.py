"""Incremental, UTF-8 safe detokenization with stop strings held back from the stream."""

from __future__ import annotations

from tokenizers.decoders import DecodeStream


class IncrementalDetokenizer:
    """Turns one request's output tokens into text deltas as they arrive.

    Uses the ``tokenizers`` library's ``DecodeStream``: a character split across tokens is held until
    complete (no U+FFFD in the stream) and SentencePiece word-start spaces are kept, so the joined
    deltas equal ``tokenizer.decode(output_ids)``.

    Stop strings: text that could still grow into a stop string is held back; when one appears the text
    is cut before it (after it with ``include_stop``) and :attr:`stopped` becomes True.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True, stop: list[str] | None = None,
                 include_stop: bool = False) -> None:
        self._backend = tokenizer.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=skip_special_tokens)
        self.stop = list(stop or [])
        self.include_stop = include_stop
        self._max_stop_len = max((len(s) for s in self.stop), default=0)
        self.text = ""
        self.stopped = False
        self._emitted = 0  # characters of self.text already returned
        self._search_from = 0  # stop strings are looked for from here on (min_tokens holds them off)

    def add_token(self, token_id: int, check_stop: bool = True) -> None:
        """Appends a token's text; with ``check_stop`` False (inside min_tokens) stop strings are not matched."""
        if self.stopped:
            return
        chunk = self._stream.step(self._backend, token_id)
        if not chunk:
            return
        if not check_stop:
            self.text += chunk
            self._search_from = len(self.text)
            return
        start = max(self._search_from, len(self.text) - self._max_stop_len + 1)
        self.text += chunk
        hits = [(pos, -len(s)) for pos, s in ((self.text.find(s, start), s) for s in self.stop) if pos >= 0]
        if hits:
            pos, minus_len = min(hits)  # the earliest; the longest of those starting there
            self.text = self.text[: pos - minus_len if self.include_stop else pos]
            self.stopped = True

    def delta(self, final: bool) -> str:
        """Text not returned yet; unless ``final``, minus a tail that may be the start of a stop string."""
        end = len(self.text) if final or self.stopped else len(self.text) - self._held_back()
        end = max(end, self._emitted)
        out = self.text[self._emitted:end]
        self._emitted = end
        return out

    def _held_back(self) -> int:
        """Length of the longest suffix of the text that is a proper prefix of some stop string."""
        longest = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:k]):
                    longest = k
                    break
        return longest
