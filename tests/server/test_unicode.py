"""Streams never carry half a character: no U+FFFD in any chunk when the model writes emoji, accents and CJK.

Byte-level BPE splits such characters over several tokens (🎉 is three of SmolLM2's tokens), so a server that
decodes token by token sends U+FFFD. Prompts in those scripts make the model continue in them."""

import json

import httpx
import pytest

from tests.server.harness import MODEL

PROMPTS = [
    "日本の首都は東京です。東京は",
    "中文：我喜欢",
    "🎉🎉 Party time! 🎉",
    "Le café était très",
    "Ça coûte 5 €, très cher. Voilà",
]


def streamed_texts(http: httpx.Client, path: str, body: dict) -> list[str]:
    with http.stream("POST", path, json={**body, "stream": True}) as response:
        raw = response.read()
    texts = []
    for frame in raw.split(b"\n\n"):
        if not frame.startswith(b"data: {"):
            continue
        chunk = json.loads(frame[6:])
        for choice in chunk["choices"]:
            texts.append(choice.get("text") or choice.get("delta", {}).get("content") or "")
    return texts


@pytest.mark.parametrize("prompt", PROMPTS)
def test_no_replacement_character_in_completion_chunks(http: httpx.Client, prompt: str) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 24, "temperature": 0}
    pieces = streamed_texts(http, "/v1/completions", body)
    assert all("\ufffd" not in p for p in pieces), pieces
    whole = http.post("/v1/completions", json=body).json()["choices"][0]["text"]
    assert "".join(pieces) == whole  # holding back partial characters loses nothing


def test_model_writes_non_ascii_and_no_chunk_breaks_it(http: httpx.Client) -> None:
    """Sampled continuations of every prompt (seeded, n=3): many multi-byte characters, none cut in half."""
    written = ""
    for prompt in PROMPTS:
        body = {"model": MODEL, "prompt": prompt, "max_tokens": 16, "temperature": 1.0, "seed": 1, "n": 3}
        pieces = streamed_texts(http, "/v1/completions", body)
        assert all("\ufffd" not in p for p in pieces), pieces
        written += "".join(pieces)
    multibyte = [ch for ch in written if len(ch.encode()) > 1]
    assert len(multibyte) >= 20, written  # the test is only worth something if the model did write them
    assert any(len(ch.encode()) == 4 for ch in written) or any("\u4e00" <= ch <= "\u9fff" for ch in written)


def test_chat_answer_with_accents(http: httpx.Client) -> None:
    body = {
        "model": MODEL,
        "temperature": 0,
        "max_tokens": 32,
        "messages": [
            {"role": "user", "content": "Translate into French: The coffee is very good and the café is near."}
        ],
    }
    pieces = streamed_texts(http, "/v1/chat/completions", body)
    assert all("\ufffd" not in p for p in pieces), pieces
    assert any(ord(ch) > 127 for ch in "".join(pieces)), "".join(pieces)
