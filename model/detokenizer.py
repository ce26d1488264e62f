"""The text emitter: token ids in, safe-to-show text out, with stop strings. One per request (per choice).

Incremental decoding follows vLLM's and HF's `prefix_offset/read_offset` scheme: the window holds the tokens already
shown last time (context for decoders that look back, e.g. SentencePiece's leading-space rule) plus the new ones,
and the new text is `decode(window)[len(decode(shown part)):]`. So each push decodes a few tokens, not the whole
output. Text is held back while it ends in U+FFFD (a UTF-8 character split across tokens) and, for byte-fallback
tokenizers, while the last token is a `<0xNN>` piece (a run of those decodes as a unit, so its text may still change).

Stop strings: the emitter keeps back the longest tail that could still grow into a stop string and emits the rest.
When several stop strings occur, the one that ends first wins (the one a token-by-token stream completes first),
ties going to the one that starts first; so the same tokens give the same text however they are split into pushes.
"""

import functools
import re
from collections.abc import Callable

from model.tokenizer import Tokenizer

_REPLACEMENT = "\ufffd"
_BYTE_PIECE = re.compile(r"<0x[0-9A-Fa-f]{2}>")


class TextEmitter:
    def __init__(
        self,
        tokenizer: Tokenizer,
        stop: list[str],
        include_stop_str_in_output: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self._decode = _decoder(tokenizer, skip_special_tokens)
        self._byte_pieces, specials = _byte_piece_ids(tokenizer.hf)
        self._invisible = specials if skip_special_tokens else frozenset()  # ids the decoder never sees
        self._stops = [s for s in stop if s]  # an empty stop string would match everywhere; the server rejects it
        self._include_stop = include_stop_str_in_output
        self._window: list[int] = []  # tokens shown last time (context) + tokens not shown yet
        self._read = 0  # window[:read] is the context, already shown
        self._pending = ""  # decoded text not emitted yet: it could still become a stop string
        self.stopped = False  # a stop string was hit; nothing more is emitted
        self.text = ""  # everything emitted so far

    def push(self, token_ids: list[int]) -> str:
        """Add tokens; return the text that is now safe to emit (may be "")."""
        if self.stopped or not token_ids:
            return ""
        checked = len(self._window)  # window[:checked] is known not to end at a stable point
        self._window.extend(token_ids)
        return self._emit(self._stable_text(checked), final=False)

    def push_until_stop(self, token_ids: list[int]) -> tuple[str, int]:
        """Like push, one token at a time, so that a stop string inside several tokens at once (speculative
        decoding) also tells how many of them were used: (text, tokens consumed)."""
        if not self._stops or len(token_ids) < 2:
            return self.push(token_ids), len(token_ids)
        text = ""
        for used, token_id in enumerate(token_ids, 1):
            text += self.push([token_id])
            if self.stopped:
                return text, used
        return text, len(token_ids)

    def flush(self) -> str:
        """At the end of generation: decode whatever was held back (even a trailing U+FFFD) and emit it."""
        if self.stopped:
            return ""
        shown = self._decode(self._window[: self._read])
        tail = self._decode(self._window)[len(shown) :]
        self._window, self._read = [], 0
        return self._emit(tail, final=True)

    def _stable_text(self, checked: int) -> str:
        """New text up to the last token where it cannot change any more (no split UTF-8 character, no open run of
        byte pieces), or "". Only ends past `checked` are tried: one decode per push when tokens come one by one."""
        shown = self._decode(self._window[: self._read])
        for end in range(len(self._window), max(checked, self._read), -1):
            full = self._decode(self._window[:end])
            if len(full) > len(shown) and not full.endswith(_REPLACEMENT) and not self._in_byte_run(end):
                # The tokens shown now become the next call's context; window[end:] stays unread.
                self._window, self._read = self._window[self._read :], end - self._read
                return full[len(shown) :]
        return ""

    def _in_byte_run(self, end: int) -> bool:
        """Whether the last token the decoder sees in window[:end] is a byte piece (skipped specials are invisible:
        byte pieces on both sides of one decode as one run)."""
        if not self._byte_pieces:
            return False
        for token in reversed(self._window[:end]):
            if token not in self._invisible:
                return token in self._byte_pieces
        return False

    def _emit(self, new_text: str, final: bool) -> str:
        text = self._pending + new_text
        hit = self._first_stop(text)
        if hit is not None:
            start, end = hit
            out = text[: end if self._include_stop else start]
            self.stopped, self._pending = True, ""
        elif final:
            out, self._pending = text, ""
        else:
            keep = self._stop_prefix_len(text)
            out, self._pending = text[: len(text) - keep], text[len(text) - keep :]
        self.text += out
        return out

    def _first_stop(self, text: str) -> tuple[int, int] | None:
        """(start, end) of the stop string occurrence that ends first in `text` (ties: starts first)."""
        best: tuple[int, int] | None = None
        for stop in self._stops:
            start = text.find(stop)  # a string's first occurrence is also the one that ends first
            if start >= 0 and (best is None or (start + len(stop), start) < (best[1], best[0])):
                best = (start, start + len(stop))
        return best

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest tail of `text` that is the beginning of some stop string (0 if none)."""
        longest = max((len(s) - 1 for s in self._stops), default=0)
        for size in range(min(longest, len(text)), 0, -1):
            tail = text[-size:]
            if any(stop.startswith(tail) for stop in self._stops):
                return size
        return 0


def _decoder(tokenizer: Tokenizer, skip_special_tokens: bool) -> Callable[[list[int]], str]:
    """ids -> text without transformers' clean-up pass (it rewrites " ." and " 's" by context, so it cannot be
    applied to pieces; the default model does not use it). The Rust decoder directly when there is one."""
    backend = getattr(tokenizer.hf, "backend_tokenizer", None)
    hf = tokenizer.hf

    def decode(ids: list[int]) -> str:
        if backend is not None:
            return str(backend.decode(ids, skip_special_tokens=skip_special_tokens))
        return str(hf.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False))

    return decode


@functools.lru_cache(maxsize=8)
def _byte_piece_ids(hf: object) -> tuple[frozenset[int], frozenset[int]]:
    """(ids of `<0xNN>` byte-fallback pieces, ids of special tokens) for tokenizers whose decoder has a ByteFallback
    step; two empty sets for the others (byte-level BPE needs neither: a split character shows as U+FFFD)."""
    backend = getattr(hf, "backend_tokenizer", None)
    if backend is None or "ByteFallback" not in str(backend.decoder):
        return frozenset(), frozenset()
    vocab: dict[str, int] = backend.get_vocab(with_added_tokens=False)
    pieces = frozenset(i for piece, i in vocab.items() if _BYTE_PIECE.fullmatch(piece))
    specials = frozenset(i for i, token in backend.get_added_tokens_decoder().items() if token.special)
    return pieces, specials
