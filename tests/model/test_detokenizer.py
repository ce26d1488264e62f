"""The text emitter on the real SmolLM2 tokenizer (byte-level BPE) and on a small SentencePiece-style byte-fallback
tokenizer: stop strings, hold-back, split UTF-8 characters, and streamed == non-streamed text."""

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer as RustTokenizer
from tokenizers import decoders, models
from transformers import PreTrainedTokenizerFast

from model.detokenizer import TextEmitter
from model.tokenizer import Tokenizer

SENTENCE = "The stop word STOP ends here"  # ['The', ' stop', ' word', ' ST', 'OP', ' ends', ' here']


def stream(
    tok: Tokenizer, ids: list[int], stop: list[str], include: bool = False, sizes: list[int] | None = None
) -> tuple[list[str], TextEmitter]:
    """Push `ids` in chunks of `sizes` (cycled; default one token at a time), then flush; the deltas and the emitter."""
    emitter = TextEmitter(tok, stop, include_stop_str_in_output=include)
    deltas: list[str] = []
    i, sizes = 0, sizes or [1]
    while i < len(ids):
        size = sizes[len(deltas) % len(sizes)]
        deltas.append(emitter.push(ids[i : i + size]))
        i += size
    deltas.append(emitter.flush())
    return deltas, emitter


def whole(tok: Tokenizer, ids: list[int], stop: list[str], include: bool = False) -> str:
    """The non-streamed text: one push of everything, then flush."""
    emitter = TextEmitter(tok, stop, include_stop_str_in_output=include)
    return emitter.push(ids) + emitter.flush()


def reference(text: str, stop: list[str], include: bool) -> str:
    """Cut the full decode at the stop occurrence that ends first (ties: starts first)."""
    hits = [(text.find(s) + len(s), text.find(s)) for s in stop if s and s in text]
    if not hits:
        return text
    end, start = min(hits)
    return text[: end if include else start]


@pytest.fixture(scope="module")
def sentence_ids(default_tokenizer: Tokenizer) -> list[int]:
    ids = default_tokenizer.encode(SENTENCE, add_special_tokens=False)
    assert [default_tokenizer.decode([i]) for i in ids][3:5] == [" ST", "OP"]
    return ids


@pytest.mark.parametrize(
    ("stop", "include", "want"),
    [
        (["STOP"], False, "The stop word "),  # spans two tokens
        (["STOP"], True, "The stop word STOP"),
        (["word STOP"], False, "The stop "),  # spans three tokens: ' word', ' ST', 'OP'
        (["The"], False, ""),  # at the very start
        (["The s"], True, "The s"),
        (["here"], False, "The stop word STOP ends "),  # at the very end
        (["here"], True, SENTENCE),
        (["here!"], False, SENTENCE),  # a stop prefix at the end is flushed, not lost
        (["word STOP", "STOP ends"], False, "The stop "),  # overlapping: the one that ends first wins
        (["STOP ends", "ST"], False, "The stop word "),
        (["op word", "stop"], False, "The "),
        (["OP", "STOP"], False, "The stop word "),  # same end: the longer (earlier start) wins
        (["OP", "STOP"], True, "The stop word STOP"),
        (["xyz", "nothing"], False, SENTENCE),
    ],
)
def test_stop_strings(
    default_tokenizer: Tokenizer, sentence_ids: list[int], stop: list[str], include: bool, want: str
) -> None:
    for sizes in ([1], [2], [3, 1], [len(sentence_ids)]):
        deltas, emitter = stream(default_tokenizer, sentence_ids, stop, include, sizes)
        assert "".join(deltas) == want == emitter.text
        assert emitter.stopped == any(s in SENTENCE for s in stop)
    assert whole(default_tokenizer, sentence_ids, stop, include) == want


def test_nothing_leaks_after_a_stop(default_tokenizer: Tokenizer, sentence_ids: list[int]) -> None:
    emitter = TextEmitter(default_tokenizer, ["STOP"])
    deltas = [emitter.push([i]) for i in sentence_ids[:5]]
    assert deltas == ["The", " stop", " word", " ", ""] and emitter.stopped
    assert [emitter.push([i]) for i in sentence_ids[5:]] == ["", ""]
    assert emitter.flush() == "" and emitter.text == "The stop word "


def test_holds_back_only_a_possible_stop_prefix(default_tokenizer: Tokenizer, sentence_ids: list[int]) -> None:
    emitter = TextEmitter(default_tokenizer, ["STOP!", "nds x"])
    deltas = [emitter.push([i]) for i in sentence_ids]
    # ' ST': "ST" could begin "STOP!"; 'OP': "STOP" still could;
    # ' ends': "STOP" no longer can, "nds" could begin "nds x".
    assert deltas == ["The", " stop", " word", " ", "", "STOP e", "nds here"]
    assert emitter.flush() == "" and not emitter.stopped and emitter.text == SENTENCE


def test_split_characters_and_special_tokens(default_tokenizer: Tokenizer) -> None:
    text = "日本 🎉🙂 ok"
    ids = default_tokenizer.encode(text, add_special_tokens=False) + [2]  # 2 = <|im_end|>, special
    deltas, emitter = stream(default_tokenizer, ids, [])
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
    assert "" in deltas  # the first byte pieces of a character were held back
    keep = TextEmitter(default_tokenizer, [], skip_special_tokens=False)
    assert keep.push(ids) + keep.flush() == text + "<|im_end|>"


def test_an_unfinished_character_at_the_end_is_flushed(default_tokenizer: Tokenizer) -> None:
    ids = default_tokenizer.encode("a🎉", add_special_tokens=False)[:-1]  # drop the emoji's last byte piece
    full = default_tokenizer.decode(ids, skip_special_tokens=True)
    assert full.endswith("\ufffd")
    emitter = TextEmitter(default_tokenizer, [])
    assert emitter.push(ids) == "a" and emitter.flush() == full[1:]


@pytest.fixture(scope="module")
def fragment_ids(default_tokenizer: Tokenizer) -> list[int]:
    """Ids whose text alone is not valid UTF-8 (pieces of emoji, CJK, accented letters), plus specials."""
    backend = default_tokenizer.hf.backend_tokenizer
    pieces = [i for i in range(default_tokenizer.vocab_size) if "\ufffd" in backend.decode([i])]
    samples = "日本語のテキスト 🎉🙂👍🏽 naïve café 中文 한국어 ✓"
    return sorted(set(pieces) | set(default_tokenizer.encode(samples, add_special_tokens=False)) | {0, 1, 2, 3, 5})


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_streamed_deltas_equal_the_full_decode(
    default_tokenizer: Tokenizer, fragment_ids: list[int], data: st.DataObject
) -> None:
    token = st.one_of(st.sampled_from(fragment_ids), st.integers(0, default_tokenizer.vocab_size - 1))
    ids = data.draw(st.lists(token, max_size=40), label="ids")
    sizes = data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=5), label="sizes")
    full = default_tokenizer.decode(ids, skip_special_tokens=True)
    emitter = TextEmitter(default_tokenizer, [])
    shown = ""
    for start in range(0, len(ids), sizes[0]):
        shown += emitter.push(ids[start : start + sizes[0]])
        assert full.startswith(shown)  # so no delta has a U+FFFD the full decode lacks
    assert shown + emitter.flush() == full == emitter.text
    stops = data.draw(st.lists(st.one_of(st.text(min_size=1, max_size=3), _substrings(full)), max_size=3), label="stop")
    include = data.draw(st.booleans(), label="include")
    want = reference(full, stops, include)
    assert "".join(stream(default_tokenizer, ids, stops, include, sizes)[0]) == want
    assert whole(default_tokenizer, ids, stops, include) == want


def _substrings(text: str) -> st.SearchStrategy[str]:
    if not text:
        return st.just("x")
    return st.tuples(st.integers(0, len(text) - 1), st.integers(1, 6)).map(lambda t: text[t[0] : t[0] + t[1]])


@pytest.fixture(scope="module")
def byte_fallback_tokenizer() -> Tokenizer:
    """A SentencePiece-style tokenizer: '▁' for spaces, <0xNN> byte pieces, leading space stripped (Llama's decoder)."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2} | {f"<0x{b:02X}>": 3 + b for b in range(256)}
    for piece in ["▁Hello", "▁world", "a", "b", "▁", "▁ST", "OP", "."]:
        vocab[piece] = len(vocab)
    rust = RustTokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>", byte_fallback=True))
    rust.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    rust.add_special_tokens(["<s>", "</s>"])
    return Tokenizer(PreTrainedTokenizerFast(tokenizer_object=rust), {2})


def test_byte_fallback_run_is_held_until_it_closes(byte_fallback_tokenizer: Tokenizer) -> None:
    byte = {b: 3 + b for b in range(256)}
    a = 3 + 256 + 2
    # 'A' alone decodes to "A", but 'A' + E4 + 'B' as one run of byte pieces decodes to three U+FFFD.
    ids = [byte[0x41], byte[0xE4], byte[0x42], a, byte[0xE4], byte[0xB8], byte[0xAD]]
    deltas, _ = stream(byte_fallback_tokenizer, ids, [])
    assert deltas == ["", "", "", "\ufffd\ufffd\ufffda", "", "", "", "中"]
    assert "".join(deltas) == byte_fallback_tokenizer.decode(ids, skip_special_tokens=True)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(data=st.data())
def test_byte_fallback_streamed_deltas_equal_the_full_decode(
    byte_fallback_tokenizer: Tokenizer, data: st.DataObject
) -> None:
    utf8 = [3 + b for b in "é中🎉".encode()]
    token = st.one_of(st.sampled_from(utf8), st.integers(0, byte_fallback_tokenizer.vocab_size - 1))
    ids = data.draw(st.lists(token, max_size=30), label="ids")
    full = byte_fallback_tokenizer.decode(ids, skip_special_tokens=True)
    sizes = data.draw(st.lists(st.integers(1, 4), min_size=1, max_size=4), label="sizes")
    deltas, _ = stream(byte_fallback_tokenizer, ids, [], sizes=sizes)
    shown = ""
    for delta in deltas:
        shown += delta
        assert full.startswith(shown)
    assert shown == full


def test_each_push_decodes_a_bounded_window(default_tokenizer: Tokenizer) -> None:
    """O(1) per token: pushing a long output token by token never decodes more than a few ids at once."""
    ids = default_tokenizer.encode(
        "Streaming text, 日本語 and 🎉 emoji, token by token. " * 60, add_special_tokens=False
    )
    emitter = TextEmitter(default_tokenizer, ["never appears"])
    decode, widths = emitter._decode, []

    def counting(window: list[int]) -> str:
        widths.append(len(window))
        return decode(window)

    emitter._decode = counting
    text = "".join(emitter.push([i]) for i in ids) + emitter.flush()
    assert text == default_tokenizer.decode(ids) and len(ids) > 1000
    assert max(widths) <= 8
