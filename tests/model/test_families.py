"""Every supported family against transformers' own implementation: tiny random models saved as safetensors folders,
loaded by our loader, compared logit by logit (float32) in one prefill and through the paged KV cache."""

import copy
import json
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from config import Settings
from model.engine.engine import Engine
from model.engine.model_runner import build_decoder
from model.engine.sequence import SamplingParams
from model.loaders import load_config
from tests.model.families import (  # noqa: I001
    FAMILIES,
    WINDOW,
    build_hf,
    hf_logits,
    load_ours,
    make_tokenizer,
    our_logits,
    prompts,
    save_hf,
)

TOL = 1e-4
DECODE_STEPS = 16


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_model(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> tuple[str, PreTrainedModel, Path]:
    family = request.param
    model = build_hf(family)
    return family, model, save_hf(model, tmp_path_factory.mktemp(family))


def test_config_carries_the_family_quirks(family_model: tuple[str, PreTrainedModel, Path]) -> None:
    family, model, folder = family_model
    config = load_config(folder)
    hf = model.config.get_text_config()
    assert (config.num_layers, config.num_heads, config.num_kv_heads) == (
        hf.num_hidden_layers,
        hf.num_attention_heads,
        hf.num_key_value_heads,
    )
    assert config.tie_word_embeddings == model.config.tie_word_embeddings
    expected_windows = {
        "mistral": (WINDOW,) * 2,
        "phi3": (WINDOW,) * 3,
        "gemma3": (WINDOW, None, WINDOW, None),
        "gemma3-vision": (WINDOW, None, WINDOW, None),
    }.get(family, (None,) * hf.num_hidden_layers)
    assert config.layer_windows == expected_windows


def test_prefill_logits_match_transformers(family_model: tuple[str, PreTrainedModel, Path]) -> None:
    _, model, folder = family_model
    batch = prompts()  # 5, 23 and 50 tokens in one batch: the last crosses the sliding window of 16
    ours = our_logits(load_ours(folder), batch)
    for prompt, logits in zip(batch, ours, strict=True):
        reference = hf_logits(model, prompt)
        assert logits.shape == reference.shape
        assert (logits - reference).abs().max().item() <= TOL


def test_paged_decode_matches_transformers_and_greedy_is_identical(
    family_model: tuple[str, PreTrainedModel, Path],
) -> None:
    _, model, folder = family_model
    batch = prompts(seed=2, lengths=(48, 9, 61))
    engine = Engine(Settings(model=str(folder), kv_cache_memory=4 * 2**20, block_size=16), tokenizer=make_tokenizer())
    captured: list[tuple[list[str], torch.Tensor]] = []  # per step: (request ids of sampled rows, their logits)
    run, compute_logits = engine.runner.run, engine.runner.decoder.compute_logits

    def recording_run(scheduled, generators):  # type: ignore[no-untyped-def]
        captured.append(([s.seq.request_id for s in scheduled if s.samples], torch.empty(0)))
        return run(scheduled, generators)

    def recording_logits(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute_logits(hidden)
        captured[-1] = (captured[-1][0], logits.clone())
        return logits

    engine.runner.run = recording_run  # type: ignore[method-assign]
    engine.runner.decoder.compute_logits = recording_logits  # type: ignore[method-assign]
    params = SamplingParams(temperature=0, max_tokens=DECODE_STEPS, ignore_eos=True)
    for i, prompt in enumerate(batch):
        engine.add_request(str(i), prompt, params)
    engine._drain_inbox(False)
    generated: dict[str, list[int]] = {str(i): [] for i in range(len(batch))}
    while engine.scheduler.has_work():
        for out in engine.step():
            generated[out.request_id] += out.new_token_ids
    per_request: dict[str, list[torch.Tensor]] = {rid: [] for rid in generated}
    for ids, logits in captured:
        for rid, row in zip(ids, logits, strict=True):
            per_request[rid].append(row)

    for i, prompt in enumerate(batch):
        tokens = generated[str(i)]
        assert len(tokens) == DECODE_STEPS
        # transformers over prompt + our tokens: its logits at the positions we sampled from
        reference = hf_logits(model, prompt + tokens[:-1])[len(prompt) - 1 :]
        ours = torch.stack(per_request[str(i)])
        assert ours.shape == reference.shape
        assert (ours - reference).abs().max().item() <= TOL
        with torch.no_grad():
            hf_tokens = model.generate(
                torch.tensor([prompt]),
                do_sample=False,
                max_new_tokens=DECODE_STEPS,
                min_new_tokens=DECODE_STEPS,
                eos_token_id=None,
                pad_token_id=0,
            )[0, len(prompt) :].tolist()
        assert tokens == hf_tokens


def test_sharded_checkpoint_loads_identically(family_model: tuple[str, PreTrainedModel, Path], tmp_path: Path) -> None:
    _, model, folder = family_model
    sharded = save_hf(model, tmp_path / "sharded", max_shard_size="40KB")
    assert (sharded / "model.safetensors.index.json").exists()
    assert len(list(sharded.glob("*.safetensors"))) > 2
    single, multi = load_ours(folder).state_dict(), load_ours(sharded).state_dict()
    assert single.keys() == multi.keys()
    for name in single:
        assert torch.equal(single[name], multi[name]), name


def test_bfloat16_is_as_close_to_float32_as_transformers_own_bfloat16(
    family_model: tuple[str, PreTrainedModel, Path],
) -> None:
    _, model, folder = family_model
    decoder = build_decoder(folder, load_config(folder), 256, torch.bfloat16, torch.device("cpu"))
    assert {p.dtype for p in decoder.parameters()} == {torch.bfloat16}
    model_bf16 = copy.deepcopy(model).to(torch.bfloat16)
    batch = prompts()
    for prompt, logits in zip(batch, our_logits(decoder, batch), strict=True):
        exact = hf_logits(model, prompt)
        theirs = (hf_logits(model_bf16, prompt) - exact).abs().max().item()
        ours = (logits - exact).abs().max().item()
        assert ours <= 1.5 * theirs  # measured: ours is 0.6-0.9x of transformers' own bfloat16 error


def test_generation_config_adds_eos_ids_and_sampling_defaults(tmp_path: Path) -> None:
    folder = save_hf(build_hf("qwen2"), tmp_path / "m")
    (folder / "generation_config.json").write_text(
        json.dumps({"eos_token_id": [2, 7], "temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05})
    )
    config = load_config(folder)
    assert config.eos_token_ids == (2, 7)  # config.json's 2, then generation_config's extra 7
    assert config.generation_defaults == {"temperature": 0.7, "top_p": 0.8, "top_k": 20, "repetition_penalty": 1.05}


def test_hub_style_config_gets_transformers_defaults(tmp_path: Path) -> None:
    """Hub configs omit fields left at the class default; gemma-3-4b-it's config.json is little more than this."""
    (tmp_path / "config.json").write_text(json.dumps({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "eos_token_id": [1, 106],
        "text_config": {"hidden_size": 2560, "intermediate_size": 10240, "model_type": "gemma3_text",
                        "num_hidden_layers": 34, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                        "sliding_window": 1024},
        "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "image_size": 896,
                          "intermediate_size": 4304, "num_attention_heads": 16, "num_hidden_layers": 27,
                          "patch_size": 14},
    }))  # fmt: skip
    c = load_config(tmp_path)
    assert (c.num_heads, c.num_kv_heads, c.head_dim, c.vocab_size) == (8, 4, 256, 262208)
    assert c.attention_scale == 256**-0.5 and c.embed_scale == 2560**0.5 and c.tie_word_embeddings
    assert c.layer_windows == tuple(None if (i + 1) % 6 == 0 else 1024 for i in range(34))  # every 6th layer global
    assert (c.rope_theta, c.rope_scaling) == (1e6, {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6})
    assert (c.local_rope_theta, c.local_rope_scaling) == (10000.0, None)
    assert c.hidden_act == "gelu_pytorch_tanh" and c.rms_norm_eps == 1e-6


def test_longrope_matches_transformers_cached_decoding_across_the_pretraining_length(tmp_path: Path) -> None:
    model = build_hf("phi3-longrope")
    folder = save_hf(model, tmp_path / "m")
    assert load_config(folder).rope_scaling["rope_type"] == "longrope"  # type: ignore[index]
    batch = prompts(seed=3, lengths=(7, 40, 61))  # all within the 64 pretraining positions: short_factor
    for prompt, logits in zip(batch, our_logits(load_ours(folder), batch), strict=True):
        assert (logits - hf_logits(model, prompt)).abs().max().item() <= TOL
    # decode positions 61..76 one by one through our paged cache and through transformers' own cache
    engine = Engine(Settings(model=str(folder), kv_cache_memory=2**20, block_size=16), tokenizer=make_tokenizer())
    rows: list[torch.Tensor] = []
    compute_logits = engine.runner.decoder.compute_logits
    engine.runner.decoder.compute_logits = lambda h: rows.append(compute_logits(h)) or rows[-1]  # type: ignore[method-assign]
    engine.add_request("r", batch[2], SamplingParams(temperature=0, max_tokens=DECODE_STEPS, ignore_eos=True))
    engine._drain_inbox(False)
    tokens: list[int] = []
    while engine.scheduler.has_work():
        tokens += [t for out in engine.step() for t in out.new_token_ids]
    with torch.no_grad():
        out = model(torch.tensor([batch[2]]), use_cache=True)
        for step, token in enumerate(tokens):
            assert (rows[step][0] - out.logits[0, -1]).abs().max().item() <= TOL
            assert token == int(out.logits[0, -1].argmax())
            out = model(torch.tensor([[token]]), cache=out.past_key_values, use_cache=True)
