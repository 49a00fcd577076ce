"""A token's own bytes, for logprobs: what OpenAI's `bytes` field holds and what a client rebuilds text from.

A byte-level tokenizer splits a multi-byte character over tokens: "é" (0xC3 0xA9) can come out as one token per
byte. Decoding such a token alone gives U+FFFD, whose bytes (EF BF BD) are not the token's, and two different byte
tokens then share one string, so completions' `top_logprobs` (a dict keyed by token text) lost all but one of them.
Here a token whose text alone is not whole UTF-8 keeps its real bytes, and its text names them as OpenAI's
completions API does: "bytes:\\xc3".

The bytes come from the tokenizer's own vocabulary string (`convert_ids_to_tokens`), read the way its decoder reads
it: GPT-2's byte-level alphabet (GPTNeoX, Llama 3, Qwen), or SentencePiece's byte fallback pieces "<0xC3>" with "▁"
for a space (Llama 2, Mistral). A tokenizer of another kind keeps the decoded text and its UTF-8.
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Callable

REPLACEMENT = "\ufffd"
BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")


@lru_cache(maxsize=1)
def byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, inverted: the printable character that stands for each byte -> the byte.
    Printable Latin-1 bytes stand for themselves; the other 68 map to U+0100 onwards in byte order."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in chars:
            chars[b] = chr(256 + extra)
            extra += 1
    return {c: b for b, c in chars.items()}


def _decoder_kind(tokenizer) -> str:
    """"byte_level", "byte_fallback" or "other", from the fast tokenizer's decoder."""
    try:
        decoder = json.loads(tokenizer.backend_tokenizer.to_str()).get("decoder") or {}
    except (AttributeError, ValueError, TypeError):  # a slow tokenizer, or no backend: decoded text only
        return "other"
    kinds = {d.get("type") for d in decoder.get("decoders", [decoder])}
    if "ByteLevel" in kinds:
        return "byte_level"
    return "byte_fallback" if "ByteFallback" in kinds else "other"


def _reader(tokenizer) -> Callable[[str], bytes | None]:
    kind = _decoder_kind(tokenizer)
    if kind == "byte_level":
        alphabet = byte_level_alphabet()

        def read(piece: str) -> bytes | None:
            if any(c not in alphabet for c in piece):
                return None  # an added token written as text ("<|endoftext|>" is in the alphabet; others may not be)
            return bytes(alphabet[c] for c in piece)

        return read
    if kind == "byte_fallback":
        def read(piece: str) -> bytes | None:
            match = BYTE_PIECE.fullmatch(piece)
            return bytes([int(match.group(1), 16)]) if match else piece.replace("\u2581", " ").encode("utf-8")

        return read
    return lambda piece: None


class TokenBytes:
    """(text, bytes) of single tokens for one tokenizer, cached by id (a vocabulary's worth at most)."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self._read = _reader(tokenizer)
        self._cache: dict[int, tuple[str, bytes]] = {}

    def __call__(self, token_id: int) -> tuple[str, bytes]:
        found = self._cache.get(token_id)
        if found is None:
            found = self._cache[token_id] = self._look_up(token_id)
        return found

    def text(self, token_id: int) -> str:
        return self(token_id)[0]

    def _look_up(self, token_id: int) -> tuple[str, bytes]:
        text = self.tokenizer.decode([token_id])
        if REPLACEMENT not in text:
            return text, text.encode("utf-8")
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        raw = self._read(piece) if isinstance(piece, str) else None
        if raw is None or REPLACEMENT.encode("utf-8") in raw:  # unknown, or the token really is U+FFFD
            return text, text.encode("utf-8")
        try:
            return raw.decode("utf-8"), raw
        except UnicodeDecodeError:  # part of a character: named by its bytes, as OpenAI's completions name it
            return "bytes:" + "".join(f"\\x{b:02x}" for b in raw), raw


def token_bytes(tokenizer) -> TokenBytes:
    """The tokenizer's TokenBytes, made once and kept on the tokenizer."""
    found = getattr(tokenizer, "_ray_specdec_token_bytes", None)
    if found is None:
        found = TokenBytes(tokenizer)
        try:
            tokenizer._ray_specdec_token_bytes = found
        except AttributeError:  # a tokenizer that takes no attributes: made per call (a cache miss each time)
            pass
    return found
