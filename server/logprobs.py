"""Token logprobs in OpenAI's two shapes: chat (`content: [{token, logprob, bytes, top_logprobs}]`) and the legacy
completions shape (`tokens`, `token_logprobs`, `top_logprobs`, `text_offset`).

A token's `bytes` are its raw bytes, which may be half a UTF-8 character; its `token` string is those bytes decoded,
or vLLM's `bytes:\\xe2\\x80` spelling when they do not decode, so no U+FFFD ever appears in a response.
"""

from functools import lru_cache

from model.sampling_params import TokenLogprob
from model.tokenizer import Tokenizer
from server.responses import ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, TopLogprob


@lru_cache(maxsize=1)
def _byte_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable-character table, inverted (byte-level BPE vocabularies spell bytes with it)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    extra = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(bs, cs, strict=True)}


class TokenText:
    """Per-token bytes and display strings for one tokenizer, cached by id."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def _bytes(self, token_id: int) -> bytes:
        piece = self.tokenizer.hf.convert_ids_to_tokens(token_id)
        if not isinstance(piece, str):  # an id outside the vocabulary
            return b""
        if token_id in self.tokenizer.hf.all_special_ids:
            return piece.encode()
        table = _byte_decoder()
        if all(ch in table for ch in piece):  # byte-level BPE (GPT-2, Llama 3, SmolLM2, Qwen)
            return bytes(table[ch] for ch in piece)
        if len(piece) == 6 and piece.startswith("<0x") and piece.endswith(">"):  # SentencePiece byte fallback
            return bytes([int(piece[3:5], 16)])
        return piece.replace("\u2581", " ").encode()  # SentencePiece word boundary

    def get(self, token_id: int) -> tuple[str, list[int]]:
        cached = self._cache.get(token_id)
        if cached is None:
            raw = self._bytes(token_id)
            try:
                text = raw.decode("utf-8")
            except UnicodeDecodeError:
                text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
            cached = self._cache[token_id] = (text, list(raw))
        return cached


def _safe(logprob: float) -> float:
    return max(logprob, -9999.0)  # -inf is not JSON


def chat_logprobs(texts: TokenText, entries: list[TokenLogprob]) -> ChatLogprobs:
    content = []
    for entry in entries:
        token, raw = texts.get(entry.token_id)
        top = [TopLogprob(token=texts.get(tid)[0], logprob=_safe(lp), bytes=texts.get(tid)[1]) for tid, lp in entry.top]
        content.append(ChatTokenLogprob(token=token, logprob=_safe(entry.logprob), bytes=raw, top_logprobs=top))
    return ChatLogprobs(content=content, refusal=None)


def completion_logprobs(texts: TokenText, entries: list[TokenLogprob], text_offset: int) -> CompletionLogprobs:
    """`text_offset` is where the first of these tokens starts in the choice's text (after an echoed prompt)."""
    out = CompletionLogprobs()
    for entry in entries:
        token, _ = texts.get(entry.token_id)
        out.tokens.append(token)
        out.token_logprobs.append(_safe(entry.logprob))
        top = {texts.get(tid)[0]: _safe(lp) for tid, lp in entry.top}
        top.setdefault(token, _safe(entry.logprob))  # OpenAI: the sampled token is always there, up to k + 1 entries
        out.top_logprobs.append(top)
        out.text_offset.append(text_offset)
        text_offset += len(token)
    return out
