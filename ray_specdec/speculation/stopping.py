"""Stop conditions and incremental text: max_new_tokens, EOS, stop_token_ids, stop strings, and streamed text deltas.

A token that stops generation by its id (EOS or one of stop_token_ids) is kept in token_ids, but its text is not
emitted (as vLLM does for both unless include_stop_str_in_output).

A round can emit several tokens at once; they are fed here one by one so that a generation never overshoots
max_new_tokens or runs past an EOS or a stop string, whatever the tree accepted.

min_tokens holds back stop strings as it holds back EOS and stop_token_ids (speculation/logits_processing.py): a stop
string counts only where it completes in a token after the first min_tokens, i.e. where it ends past the text of those
tokens (vLLM's rule). One that completes earlier stays in the text and generation goes on. Which occurrence ends the
request depends on the tokens alone, not on how rounds grouped them, so speculation stays lossless.

Text is kept incrementally where the tokenizer's decoding is a concatenation: a byte-level BPE decoder (GPT-2's, the
shipped models') without clean-up turns each token into bytes and the whole into UTF-8, so decode(a + b) equals
decode(a) + decode(b) wherever a's bytes end on a whole character. The checker keeps the text of such a settled
prefix and decodes only the tokens after it each round: O(new tokens) a round instead of O(all tokens), which was
O(n^2) over a request (67 us a round at 512 tokens on the shipped tokenizer; ~8 ms a step for 32 requests of 2,000
tokens). Other decoders (SentencePiece's Metaspace drops a leading space, WordPiece joins with spaces, clean-up moves
spaces around punctuation) decode every token each round, as before.
"""

from __future__ import annotations

from typing import Sequence

from ray_specdec.config import SamplingParams


def decodes_by_concatenation(tokenizer) -> bool:
    """Whether decode(a + b) == decode(a) + decode(b) wherever decode(a) ends on a whole character: a byte-level
    decoder and no clean-up of tokenization spaces."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return type(decoder).__name__ == "ByteLevel" and not getattr(tokenizer, "clean_up_tokenization_spaces", True)


class StopChecker:
    def __init__(self, tokenizer, params: SamplingParams, eos_token_ids: frozenset[int]):
        if params.stop and tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        self.tokenizer = tokenizer
        self.params = params
        self.eos_token_ids = frozenset() if params.ignore_eos else eos_token_ids
        self.stop_ids = self.eos_token_ids | frozenset(params.stop_token_ids)  # ids that end generation ("stop")
        self.token_ids: list[int] = []
        self.text = ""  # text of token_ids, cut before a stop string once one is found
        self.emitted = 0  # characters of text already handed out as deltas
        self.finish_reason: str | None = None
        self.stopped_on_id = False  # the last token is an EOS or stop token id: its text stays out
        self.held_chars: int | None = None  # length of the first min_tokens tokens' text, once they are all here
        self._incremental = tokenizer is not None and decodes_by_concatenation(tokenizer)
        self._settled = 0  # with an incremental tokenizer: token_ids[:_settled] decode to _settled_text, whole chars
        self._settled_text = ""

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def remaining(self) -> int:
        return self.params.max_new_tokens - len(self.token_ids)

    def feed(self, new_tokens: Sequence[int]) -> tuple[list[int], str]:
        """Append a round's tokens; returns (tokens kept, text delta safe to stream)."""
        start = len(self.token_ids)
        for token in new_tokens:
            if self.finished:
                break
            self.token_ids.append(int(token))
            if int(token) in self.stop_ids:
                self.finish_reason, self.stopped_on_id = "stop", True
            elif len(self.token_ids) >= self.params.max_new_tokens:
                self.finish_reason = "length"
        if self.tokenizer is not None:
            self.text = self._text(self.token_ids[:-1] if self.stopped_on_id else self.token_ids)
            self._apply_stop_strings(start)
        return self.token_ids[start:], self._delta()

    def _decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def _text(self, ids: list[int]) -> str:
        """decode(ids), where ids extends every list this was asked before: only the tokens after the settled
        prefix are decoded (`_incremental`), and the prefix moves on to the end where the text ends on a whole
        character (not a replacement character: bytes a later token may complete)."""
        if not self._incremental or len(ids) < self._settled:  # (a list cut by a stop string: decoded whole)
            return self._decode(ids)
        tail = self._decode(ids[self._settled:])
        text = self._settled_text + tail
        if not tail.endswith("\ufffd"):
            self._settled, self._settled_text = len(ids), text
        return text

    def _apply_stop_strings(self, round_start: int) -> None:
        min_tokens = self.params.min_tokens
        if not self.params.stop or len(self.token_ids) <= min_tokens:
            return
        if self.held_chars is None:
            # an incomplete character at the end may still change: count only what is settled
            self.held_chars = len(self._decode(self.token_ids[:min_tokens]).rstrip("\ufffd")) if min_tokens else 0
        # where each stop string may start so that it ends past the held text
        starts = {s: max(0, self.held_chars - len(s) + 1) for s in self.params.stop}
        hits = [(self.text.find(s, starts[s]), s) for s in self.params.stop]
        hits = [(i, s) for i, s in hits if i >= 0]
        if not hits:
            return
        cut, stop = min(hits)
        # keep the shortest token prefix whose text contains the stop string where it may end generation
        for n in range(max(round_start, min_tokens + 1), len(self.token_ids) + 1):
            if self._decode(self.token_ids[:n]).find(stop, starts[stop]) >= 0:
                del self.token_ids[n:]
                break
        self.text = self.text[:cut]
        self.finish_reason = "stop"

    def _delta(self) -> str:
        safe = len(self.text)
        if not self.finished:
            # hold back what may still become a stop string or an incomplete UTF-8 character
            safe -= max((len(s) - 1 for s in self.params.stop), default=0)
            while safe > 0 and self.text[safe - 1] == "\ufffd":
                safe -= 1
        if safe <= self.emitted:
            return ""
        delta = self.text[self.emitted : safe]
        self.emitted = safe
        return delta
