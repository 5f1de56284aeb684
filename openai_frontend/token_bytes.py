"""The bytes of each token, for logprobs: OpenAI names a token that holds only part of a UTF-8 character by
its bytes (``bytes:\\xf0\\x9f``), gives chat's ``bytes`` field as the token's own bytes, and counts
``text_offset`` in characters of the text the tokens spell.

A token's own text (``tokenizer.decode([id])``) cannot serve: every partial token decodes to U+FFFD, so the
top alternatives of an emoji collide in the completions API's dict and their bytes are those of U+FFFD.
The bytes come from the vocabulary instead: byte-level BPE pieces (GPT-2, Llama 3, Qwen, SmolLM2) map back
through the byte-to-character table of GPT-2's tokenizer (Radford et al. 2019, ``bytes_to_unicode``);
SentencePiece byte-fallback pieces (``<0xF0>``) are that byte, and its word marker ``▁`` is a space.
"""

from __future__ import annotations

import codecs
import json
import re
from functools import lru_cache

_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def _byte_level_table() -> dict[str, int]:
    """GPT-2's printable stand-in character for each byte, inverted: character -> byte."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) \
        + list(range(ord("®"), ord("ÿ") + 1))
    table, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            table[chr(byte)] = byte
        else:
            table[chr(256 + extra)] = byte
            extra += 1
    return table


@lru_cache(maxsize=16)  # by tokenizer object: the tokenizers are loaded once (openai_frontend.models)
def _is_byte_level(tokenizer) -> bool:
    """Whether a fast tokenizer's decoder is (or contains) tokenizers' ByteLevel decoder."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    decoder = json.loads(backend.to_str()).get("decoder") or {}
    parts = decoder.get("decoders", [decoder]) if decoder.get("type") == "Sequence" else [decoder]
    return any(part.get("type") == "ByteLevel" for part in parts)


class TokenBytes:
    """Token id -> its bytes and its name in OpenAI's logprobs, for one tokenizer.

    Args:
        tokenizer: a transformers tokenizer.
        skip_special_tokens: the answer's text leaves special tokens out, so they span no characters.
    """

    def __init__(self, tokenizer, skip_special_tokens: bool = True):
        self.tokenizer = tokenizer
        self.byte_level = _is_byte_level(tokenizer)
        self.special = frozenset(tokenizer.all_special_ids) if skip_special_tokens else frozenset()
        self.added = {i: t.content for i, t in getattr(tokenizer, "added_tokens_decoder", {}).items()}

    def of(self, token_id: int) -> bytes:
        """The token's bytes (UTF-8 of its text for special and added tokens)."""
        if token_id in self.added:
            return self.added[token_id].encode()
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if piece is None:
            return self.tokenizer.decode([token_id]).encode()
        if self.byte_level:
            table = _byte_level_table()
            if all(c in table for c in piece):
                return bytes(table[c] for c in piece)
            return piece.encode()
        match = _BYTE_PIECE.fullmatch(piece)
        if match:
            return bytes([int(match[1], 16)])
        return piece.replace("▁", " ").encode()

    def name(self, token_id: int) -> str:
        """The token as OpenAI's logprobs name it: its text, or ``bytes:\\xNN...`` where its bytes are not
        whole UTF-8 characters."""
        raw = self.of(token_id)
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def offsets(self) -> "TextOffsets":
        return TextOffsets(self)


class TextOffsets:
    """``text_offset`` of successive tokens of one answer: the characters their bytes spelled before each
    (a character split over tokens counts once it is whole; special tokens left out of the text count none)."""

    def __init__(self, token_bytes: TokenBytes):
        self.token_bytes = token_bytes
        self.decoder = codecs.getincrementaldecoder("utf-8")("replace")
        self.chars = 0

    def restart(self, chars: int) -> None:
        """Continues from character ``chars`` with no partial character pending (a text decoded apart)."""
        self.decoder.reset()
        self.chars = chars

    def next(self, token_id: int, text: str | None = None) -> int:
        """The offset of this token; advances past it. ``text``: the echoed prompt this token is part of, which
        spells special tokens where they were written (a special token counts its characters where ``text`` holds
        it at this offset, none where it does not: a BOS the tokenizer added)."""
        offset = self.chars
        if token_id not in self.token_bytes.special:
            self.chars += len(self.decoder.decode(self.token_bytes.of(token_id)))
        elif text is not None:
            spelled = self.token_bytes.of(token_id).decode("utf-8", "replace")
            if text.startswith(spelled, offset):
                self.chars += len(spelled)
        return offset
