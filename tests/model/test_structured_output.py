"""The grammar layer on its own: xgrammar's view of the vocabulary, the schema checks, the compiled-grammar cache,
and the tool-call parser (streamed in every possible split against the whole text)."""

import json
import re
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from model.structured_output import GrammarCache, GrammarError, GrammarSpec, check_schema, new_matcher, tokenizer_info
from model.tokenizer import Tokenizer
from server.tools import FORMATS, ToolCallParser


def gpt2_byte_decoder() -> dict[str, int]:
    """GPT-2's byte-to-unicode table, inverted: the reference for a byte-level BPE vocabulary's bytes."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    chars, extra = list(printable), 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


@pytest.fixture(scope="module")
def cache(default_tokenizer: Tokenizer) -> GrammarCache:
    return GrammarCache(tokenizer_info(default_tokenizer.hf, len(default_tokenizer.hf), [2]), max_entries=3)


def test_every_token_has_its_bytes(default_tokenizer: Tokenizer, cache: GrammarCache) -> None:
    hf = default_tokenizer.hf
    decoded = cache.info.decoded_vocab
    byte_of = gpt2_byte_decoder()
    special = set(hf.all_special_ids) | {i for i, t in hf.added_tokens_decoder.items() if t.special}
    assert special and 2 in special
    for token_id, token in enumerate(hf.convert_ids_to_tokens(list(range(len(hf))))):
        if token_id in special:
            # special tokens are never allowed inside a grammar; the stop token keeps its text
            assert decoded[token_id] == (token.encode() if token_id == 2 else b""), token
        else:
            assert decoded[token_id] == bytes(byte_of[c] for c in token), (token_id, token)
    # and the bytes of a real multi-byte text come back through the table
    text = "naïve café — 東京 🎉"
    ids = default_tokenizer.encode(text, add_special_tokens=False)
    assert b"".join(decoded[i] for i in ids).decode() == text
    assert cache.info.stop_token_ids == [2]


@pytest.mark.parametrize(
    ("schema", "keyword"),
    [
        ({"type": "object", "not": {"type": "null"}}, "not"),
        ({"type": "array", "items": {"type": "integer", "multipleOf": 2}}, "multipleOf"),
        (
            {"type": "object", "properties": {"a": {"anyOf": [{"type": "string"}, {"uniqueItems": True}]}}},
            "uniqueItems",
        ),
        ({"$defs": {"x": {"if": {}, "then": {}}}, "$ref": "#/$defs/x"}, "if"),
        ({"type": "object", "patternProperties": {"^a": {}}}, "patternProperties"),
    ],
)
def test_unenforceable_keywords_are_named(schema: dict[str, Any], keyword: str) -> None:
    with pytest.raises(GrammarError, match=f"'{keyword}'"):
        check_schema(schema)


def test_names_that_look_like_keywords_are_fine_and_remote_refs_are_not() -> None:
    check_schema({"type": "object", "properties": {"not": {"type": "string"}, "if": {"type": "integer"}}})
    with pytest.raises(GrammarError, match="local"):
        check_schema({"$ref": "https://example.com/schema.json"})
    with pytest.raises(GrammarError, match="JSON Schema object"):
        check_schema([1, 2])


def test_cache_counts_and_evicts_least_recently_used(cache: GrammarCache) -> None:
    specs = [
        GrammarSpec.json_schema({"type": "object", "properties": {f"p{i}": {"type": "integer"}}}) for i in range(4)
    ]
    hits, misses = cache.hits, cache.misses
    first = cache.compile(specs[0])
    assert cache.compile(specs[0]).compiled is first.compiled
    assert (cache.hits - hits, cache.misses - misses) == (1, 1)
    for spec in specs[1:]:
        cache.compile(spec)
    assert len(cache) == 3 and cache.lookup(specs[0]) is None  # the oldest went first
    assert cache.lookup(specs[3]) is not None


def test_bad_grammars_raise_grammar_error(cache: GrammarCache) -> None:
    for spec in (
        GrammarSpec("regex", "([a-z"),
        GrammarSpec("grammar", "root ::= undefined_rule"),
        GrammarSpec("json_schema", json.dumps({"type": "nonsense"})),
    ):
        with pytest.raises(GrammarError):
            cache.compile(spec)


def test_choice_matcher_accepts_exactly_the_choices(cache: GrammarCache, default_tokenizer: Tokenizer) -> None:
    constraint = cache.compile(GrammarSpec("choice", json.dumps(["yes", "no way"])))
    for text, ok in (("yes", True), ("no way", True), ("no", False), ("yes!", False)):
        matcher = new_matcher(constraint)
        accepted = all(matcher.accept_token(t) for t in default_tokenizer.encode(text, add_special_tokens=False))
        assert (accepted and matcher.accept_token(2) and matcher.is_terminated()) == ok, text


CALLS = [("get_weather", '{"city": "Paris", "nested": {"a": [1, {"b": "}"}]}}'), ("get_time", '{"tz": "UTC"}')]


@pytest.mark.parametrize("format_name", sorted(FORMATS))
@pytest.mark.parametrize("lead", ["", "Let me check. "])
def test_parser_streams_any_split_like_the_whole(format_name: str, lead: str) -> None:
    fmt = FORMATS[format_name]
    text = lead + fmt.separator.join(fmt.call_text(name, args) for name, args in CALLS)

    whole = ToolCallParser(fmt)
    content = whole.feed(text)[0] + whole.finish()[0]
    assert content == lead
    assert [(c.name, c.arguments) for c in whole.calls] == CALLS

    for cut in range(1, len(text)):  # every two-piece split, and one character at a time
        for pieces in ([text[:cut], text[cut:]], list(text) if cut == 1 else None):
            if pieces is None:
                continue
            parser = ToolCallParser(fmt)
            streamed, arguments, names = "", [""] * len(CALLS), [""] * len(CALLS)
            for piece in [*pieces, None]:
                more, deltas = parser.finish() if piece is None else parser.feed(piece)
                streamed += more
                for d in deltas:
                    names[d.index] += d.name or ""
                    arguments[d.index] += d.arguments
            assert streamed == lead
            assert list(zip(names, arguments, strict=True)) == CALLS
            # no part of a call ever went out as content: content was final before the trigger arrived
            assert fmt.trigger not in streamed


def test_parser_keeps_plain_text_and_cut_calls() -> None:
    fmt = FORMATS["hermes"]
    parser = ToolCallParser(fmt)
    assert parser.feed("a < b and <tool")[0] == "a < b and "  # "<tool" may still become the trigger
    assert parser.feed("s> are fine")[0] == "<tools> are fine"
    assert parser.finish() == ("", [])
    cut = ToolCallParser(fmt)
    cut.feed(fmt.begin("f") + '{"x": [1, 2')  # max_tokens hit inside the arguments
    cut.finish()
    assert [(c.name, c.arguments) for c in cut.calls] == [("f", '{"x": [1, 2')]
    half = ToolCallParser(fmt)
    assert half.feed('Hi <tool_call>\n{"na')[0] == "Hi "
    assert half.finish() == ("", [])  # a half-written call header is dropped, never shown as text


ENFORCED: dict[str, tuple[dict[str, Any], Any, Any]] = {  # keyword: (schema, a valid instance, an invalid one)
    "const": ({"const": "a"}, "a", "b"),
    "enum": ({"enum": ["a", 1]}, 1, 2),
    "type list": ({"type": ["integer", "null"]}, None, "s"),
    "oneOf": ({"oneOf": [{"type": "integer"}, {"type": "boolean"}]}, 1, "x"),
    "allOf": (
        {"allOf": [{"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}]},
        {"a": 1},
        {"b": 1},
    ),
    "prefixItems": (
        {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "string"}], "items": False},
        [1, "a"],
        ["a", 1],
    ),
    "minItems": ({"type": "array", "items": {"type": "integer"}, "minItems": 2}, [1, 2], [1]),
    "maxItems": ({"type": "array", "items": {"type": "integer"}, "maxItems": 1}, [1], [1, 2]),
    "minLength": ({"type": "string", "minLength": 2}, "ab", "a"),
    "maxLength": ({"type": "string", "maxLength": 2}, "ab", "abc"),
    "pattern": ({"type": "string", "pattern": "^[a-c]+$"}, "abc", "abd"),
    "minimum": ({"type": "integer", "minimum": 3}, 3, 2),
    "maximum": ({"type": "number", "maximum": 1.5}, 1.25, 2.5),
    "exclusiveMinimum": ({"type": "integer", "exclusiveMinimum": 3}, 4, 3),
    "exclusiveMaximum": ({"type": "integer", "exclusiveMaximum": 3}, 2, 3),
    "$ref": (
        {
            "$defs": {"x": {"type": "integer"}},
            "type": "object",
            "properties": {"a": {"$ref": "#/$defs/x"}},
            "required": ["a"],
        },
        {"a": 1},
        {"a": "s"},
    ),
    "additionalProperties": ({"type": "object", "additionalProperties": {"type": "integer"}}, {"x": 1}, {"x": "s"}),
    "required": ({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}, {"a": 1}, {}),
    **{
        f"format {f}": ({"type": "string", "format": f}, good, "~~ not it ~~")
        for f, good in (
            ("date", "2024-01-02"),
            ("time", "03:04:05Z"),
            ("date-time", "2024-01-02T03:04:05Z"),
            ("duration", "P1D"),
            ("email", "a@b.co"),
            ("uuid", "123e4567-e89b-12d3-a456-426614174000"),
            ("ipv4", "1.2.3.4"),
            ("ipv6", "::1"),
            ("hostname", "a.example"),
            ("uri", "https://a.b/c"),
            ("uri-reference", "/a"),
            ("json-pointer", "/a/b"),
        )
    },
}


@pytest.mark.parametrize("keyword", sorted(ENFORCED))
def test_enforced_keywords_reject_what_jsonschema_rejects(cache: GrammarCache, keyword: str) -> None:
    """The README's list of enforced keywords, checked against the jsonschema package's verdict."""
    schema, good, bad = ENFORCED[keyword]
    checker = jsonschema.Draft202012Validator(schema, format_checker=jsonschema.Draft202012Validator.FORMAT_CHECKER)
    constraint = cache.compile(GrammarSpec.json_schema(schema))
    for instance, valid in ((good, True), (bad, False)):
        if not keyword.startswith("format"):  # jsonschema checks some formats only with optional packages
            assert checker.is_valid(instance) == valid, instance
        matcher = new_matcher(constraint)
        accepted = matcher.accept_string(json.dumps(instance)) and matcher.accept_token(2) and matcher.is_terminated()
        assert accepted == valid, (keyword, instance)


def test_sentencepiece_byte_fallback_vocabulary(tmp_path: Path) -> None:
    """Llama 2 / Mistral / Gemma style vocabularies: '▁' is a space and <0xHH> pieces are single bytes."""
    spm = pytest.importorskip("sentencepiece")
    from transformers import LlamaTokenizer

    corpus = tmp_path / "corpus.txt"
    corpus.write_text(
        "\n".join(
            ['The quick brown fox. Café naïve 東京 🎉 1234 {"a": [1, 2]}'] * 50
            + [f"hello world {i}" for i in range(200)]
        )
    )
    spm.SentencePieceTrainer.train(
        input=str(corpus),
        model_prefix=str(tmp_path / "tokenizer"),
        vocab_size=400,
        hard_vocab_limit=False,
        byte_fallback=True,
        model_type="bpe",
        character_coverage=1.0,
        minloglevel=2,
    )
    hf = LlamaTokenizer.from_pretrained(str(tmp_path))
    pieces = spm.SentencePieceProcessor(model_file=str(tmp_path / "tokenizer.model"))
    assert len(hf) == pieces.get_piece_size() > 300
    decoded = tokenizer_info(hf, len(hf), [hf.eos_token_id]).decoded_vocab
    for token_id in range(len(hf)):
        piece = pieces.id_to_piece(token_id)
        byte = re.fullmatch(r"<0x([0-9A-F]{2})>", piece)
        if pieces.is_control(token_id) or pieces.is_unknown(token_id):
            expected = piece.encode() if token_id == hf.eos_token_id else b""
        else:
            expected = bytes([int(byte.group(1), 16)]) if byte else piece.replace("▁", " ").encode()
        assert decoded[token_id] == expected, (token_id, piece)
