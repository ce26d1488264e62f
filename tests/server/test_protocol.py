"""Protocol and formatting units, no server: literal expectations for the request -> SamplingParams mapping, the
parameter names in errors, and token bytes for logprobs."""

import logging

import pytest

from model.tokenizer import Tokenizer
from server.errors import APIError, _param_from_loc
from server.logprobs import TokenText
from server.protocol import ChatCompletionRequest, CompletionRequest, resolve_max_tokens

USER = [{"role": "user", "content": "Hi"}]


def chat(**fields: object) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"model": "m", "messages": USER, **fields})


def test_openai_fields_map_to_sampling_params() -> None:
    params = chat(
        temperature=0.7,
        top_p=0.9,
        max_tokens=5,
        seed=3,
        stop_token_ids=[7],
        logit_bias={"12": -100},
        frequency_penalty=0.5,
        top_k=40,
        logprobs=True,
        top_logprobs=2,
    ).to_sampling_params(10, 100)
    assert (params.temperature, params.top_p, params.max_tokens, params.seed, params.top_k) == (0.7, 0.9, 5, 3, 40)
    assert params.stop_token_ids == [7] and params.logit_bias == {12: -100.0} and params.frequency_penalty == 0.5
    assert params.logprobs == 2


def test_defaults_and_greedy_spellings() -> None:
    params = chat().to_sampling_params(10, 100)
    assert params.temperature == 1.0 and params.max_tokens == 90 and params.logprobs is None  # rest of the context
    assert chat(top_p=0).to_sampling_params(10, 100).temperature == 0.0  # OpenAI's top_p=0 is greedy
    assert chat(temperature=1e-9).to_sampling_params(10, 100).temperature == 0.0  # no division by ~0
    assert chat(max_completion_tokens=4, max_tokens=9).to_sampling_params(10, 100).max_tokens == 4
    assert CompletionRequest(model="m", prompt="x").to_sampling_params(10, 100).max_tokens == 16
    assert CompletionRequest(model="m", prompt="x", max_tokens=None).to_sampling_params(10, 100).max_tokens == 16


def test_context_errors_give_both_counts() -> None:
    with pytest.raises(APIError) as err:
        resolve_max_tokens(50, 60, 100)
    assert err.value.status == 400 and err.value.code == "context_length_exceeded"
    assert "110 tokens (60 in the prompt, 50 for the completion)" in err.value.message
    with pytest.raises(APIError) as err:
        resolve_max_tokens(None, 100, 100)
    assert err.value.param == "messages"


def test_sampling_param_range_errors_are_400_with_the_param() -> None:
    with pytest.raises(APIError) as err:
        chat(min_tokens=9, max_tokens=3).to_sampling_params(10, 100)
    assert (err.value.status, err.value.param) == (400, "min_tokens")


def test_developer_role_and_text_parts_reach_the_template_as_strings() -> None:
    request = chat(
        messages=[
            {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "user", "content": "q", "name": "bob"},
        ]
    )
    assert request.template_messages() == [
        {"role": "system", "content": "a\nb"},
        {"role": "user", "content": "q", "name": "bob"},
    ]


def test_param_names_in_openai_style() -> None:
    assert _param_from_loc(("body", "messages", 0, "content", "str")) == "messages[0].content"
    assert (
        _param_from_loc(("body", "messages", 2, "content", "list[ContentPart]", 1, "type"))
        == "messages[2].content[1].type"
    )
    assert _param_from_loc(("body", "temperature")) == "temperature"
    assert _param_from_loc(("body",)) is None


def test_unknown_fields_are_accepted_and_logged_once(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="llmserve.server"):
        chat(brand_new_field_xyz=1)
        chat(brand_new_field_xyz=2)
    assert [r.getMessage() for r in caplog.records if "brand_new_field_xyz" in r.getMessage()] == [
        "ChatCompletionRequest: ignoring unknown field 'brand_new_field_xyz' (logged once)"
    ]


def test_token_bytes_for_byte_level_pieces(default_tokenizer: Tokenizer) -> None:
    texts = TokenText(default_tokenizer)
    ids = default_tokenizer.encode("café 🎉")
    pieces = [texts.get(i) for i in ids]
    assert b"".join(bytes(raw) for _, raw in pieces) == "café 🎉".encode()  # the bytes of all tokens = the text
    assert any(token.startswith("bytes:\\x") for token, _ in pieces)  # 🎉 is split mid-character: no U+FFFD then
    assert all("\ufffd" not in token for token, _ in pieces)
