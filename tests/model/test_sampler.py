"""The batched sampler against float64 references: greedy, min_p/top_k/top_p masks, tempered distributions
(chi-square), penalties and logit_bias, min_tokens, seeds (batch invariance) and raw logprobs."""

import pytest
import torch
from scipy.stats import chisquare

from model.layers.sampler import Sampler, SamplingBatch, apply_penalties, filtered_probs, top_k_of
from model.sampling_params import SamplingParams

EOS = 2


def build(
    params: list[SamplingParams],
    vocab: int,
    prompts: list[list[int]] | None = None,
    outputs: list[list[int]] | None = None,
    generators: list[torch.Generator | None] | None = None,
) -> SamplingBatch:
    n = len(params)
    return SamplingBatch.build(
        params,
        prompts or [[] for _ in range(n)],
        outputs or [[] for _ in range(n)],
        generators or [None] * n,
        [EOS],
        vocab,
        torch.device("cpu"),
    )


def reference_kept(logits: torch.Tensor, p: SamplingParams) -> set[int]:
    """Float64, one row, spelled out: temperature -> min_p -> top_k -> top_p on the renormalized remainder."""
    probs = torch.softmax(logits.double() / p.temperature, dim=-1).tolist()
    order = sorted(range(len(probs)), key=lambda i: -probs[i])
    kept = [i for i in order if probs[i] >= p.min_p * probs[order[0]]]
    if p.top_k > 0:
        kept = kept[: p.top_k]
    mass = sum(probs[i] for i in kept)
    nucleus, before = [], 0.0
    for i in kept:
        if before >= p.top_p * mass:
            break
        nucleus.append(i)
        before += probs[i]
    return set(nucleus)


def distinct_logits(rows: int, vocab: int, scale: float, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(rows, vocab, generator=gen) * scale


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_greedy_equals_float64_argmax(dtype: torch.dtype) -> None:
    logits = distinct_logits(16, 49152, 3.0, 0).to(dtype)
    out = Sampler()(logits, build([SamplingParams(temperature=0)] * 16, 49152))
    assert out.token_ids.dtype == torch.int64
    assert out.token_ids.tolist() == logits.double().argmax(dim=-1).tolist()
    assert out.logprobs is None


def test_greedy_takes_the_first_of_tied_maxima() -> None:
    # few distinct values: most rows hold their maximum many times, at positions found here by a plain scan
    logits = torch.randint(0, 4, (16, 49152), generator=torch.Generator().manual_seed(1)).float()
    logits[3, 7] = logits[3, 40000] = 9.0
    out = Sampler()(logits, build([SamplingParams(temperature=0)] * 16, 49152))
    first = [row.tolist().index(max(row.tolist())) for row in logits]
    assert out.token_ids.tolist() == first
    assert first[3] == 7


def test_greedy_rows_beside_sampled_rows_stay_argmax() -> None:
    logits = distinct_logits(8, 1000, 2.0, 1)
    params = [SamplingParams(temperature=0 if i % 2 else 1.0, top_p=0.5) for i in range(8)]
    ids = Sampler()(logits, build(params, 1000)).token_ids
    assert ids[1::2].tolist() == logits[1::2].double().argmax(dim=-1).tolist()


MASK_CASES = [
    SamplingParams(temperature=1.0, top_k=5),
    SamplingParams(temperature=0.7, top_p=0.8),
    SamplingParams(temperature=1.3, min_p=0.05),
    SamplingParams(temperature=0.9, top_k=40, top_p=0.6),
    SamplingParams(temperature=1.0, min_p=0.02, top_p=0.9),
    SamplingParams(temperature=0.5, min_p=0.01, top_k=20, top_p=0.95),
    SamplingParams(temperature=1.0, top_k=1),
]


@pytest.mark.parametrize("params", MASK_CASES, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
def test_truncation_mask_matches_float64_reference_and_draws_stay_inside(params: SamplingParams) -> None:
    vocab, rows = 2000, 4
    logits = distinct_logits(rows, vocab, 2.5, 2)
    batch = build([params] * rows, vocab)
    kept = filtered_probs(logits, batch) > 0
    references = [reference_kept(logits[r], params) for r in range(rows)]
    for r in range(rows):
        assert set(kept[r].nonzero().squeeze(-1).tolist()) == references[r]
    torch.manual_seed(3)
    seen: list[set[int]] = [set() for _ in range(rows)]
    sampler = Sampler()
    for _ in range(200):
        for r, token in enumerate(sampler(logits, batch).token_ids.tolist()):
            seen[r].add(token)
    for r in range(rows):
        assert seen[r] <= references[r]
        if len(references[r]) <= 5:  # small sets: every member shows up in 200 draws
            assert seen[r] == references[r]


def test_top_p_with_a_nucleus_wider_than_every_head_guess() -> None:
    """A flat distribution: the nucleus holds tens of thousands of ids, so the head widens up to the whole vocab."""
    vocab = 49152
    logits = distinct_logits(2, vocab, 0.3, 4)
    params = [SamplingParams(temperature=1.0, top_p=0.9), SamplingParams(temperature=1.0, top_p=0.05)]
    kept = filtered_probs(logits, build(params, vocab)) > 0
    for r, p in enumerate(params):
        assert set(kept[r].nonzero().squeeze(-1).tolist()) == reference_kept(logits[r], p)
    assert int(kept[0].sum()) > 8 * 1024


LOGITS_8 = torch.tensor([[2.0, 1.5, 1.0, 0.7, 0.2, -0.3, -1.0, -2.0]])


@pytest.mark.parametrize("top_p", [1.0, 0.8])
def test_tempered_distribution_passes_chi_square(top_p: float) -> None:
    draws, temperature = 20_000, 0.7
    expected = torch.softmax(LOGITS_8[0].double() / temperature, dim=-1)
    nucleus = reference_kept(LOGITS_8[0], SamplingParams(temperature=temperature, top_p=top_p))
    mask = torch.tensor([i in nucleus for i in range(8)])
    expected = torch.where(mask, expected, 0.0)
    expected = expected / expected.sum()
    torch.manual_seed(5)
    params = [SamplingParams(temperature=temperature, top_p=top_p)] * draws
    ids = Sampler()(LOGITS_8.expand(draws, 8), build(params, 8)).token_ids
    counts = torch.bincount(ids, minlength=8).double()
    assert counts[~mask].sum() == 0
    assert chisquare(counts[mask].numpy(), (expected[mask] * draws).numpy()).pvalue > 0.001


def test_seeded_generators_draw_the_tempered_distribution() -> None:
    """The per-row generator path: 20,000 rows, each with its own seed."""
    draws, temperature = 20_000, 0.7
    generators: list[torch.Generator | None] = [torch.Generator().manual_seed(1000 + i) for i in range(draws)]
    params = [SamplingParams(temperature=temperature, seed=1000 + i) for i in range(draws)]
    ids = Sampler()(LOGITS_8.expand(draws, 8), build(params, 8, generators=generators)).token_ids
    expected = torch.softmax(LOGITS_8[0].double() / temperature, dim=-1) * draws
    assert chisquare(torch.bincount(ids, minlength=8).numpy(), expected.numpy()).pvalue > 0.001


def test_penalties_and_logit_bias_follow_their_formulas() -> None:
    vocab = 64
    logits = distinct_logits(4, vocab, 3.0, 6)
    prompts = [[1, 5, 5, 9], [3, 4], [7], [10, 11]]
    outputs = [[5, 6, 6, 6, 9, 63], [4, 4, 8], [], [12, 12]]
    params = [
        SamplingParams(temperature=0, presence_penalty=0.5, frequency_penalty=0.3, repetition_penalty=1.3),
        SamplingParams(temperature=0.8, presence_penalty=-1.0, frequency_penalty=2.0, logit_bias={8: -100, 0: 7.5}),
        SamplingParams(temperature=0, repetition_penalty=0.7, logit_bias={7: 3.0}),
        SamplingParams(temperature=1.0),  # untouched
    ]
    original = logits.clone()
    got = apply_penalties(logits, build(params, vocab, prompts, outputs))
    assert torch.equal(logits, original)  # the caller's logits are not edited in place
    want = logits.double().clone()
    for r, p in enumerate(params):
        for token, bias in (p.logit_bias or {}).items():
            want[r, token] += bias
        for token in set(prompts[r] + outputs[r]):  # HF: divide positive logits, multiply negative ones
            x = want[r, token]
            want[r, token] = x / p.repetition_penalty if x > 0 else x * p.repetition_penalty
        for token in set(outputs[r]):  # OpenAI: over generated tokens only
            count = outputs[r].count(token)
            want[r, token] -= count * p.frequency_penalty + p.presence_penalty
    torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)
    ids = Sampler()(logits, build(params, vocab, prompts, outputs)).token_ids
    assert ids[0] == want[0].argmax() and ids[2] == want[2].argmax()


def test_min_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    vocab = 32
    logits = torch.zeros(4, vocab)
    logits[:, EOS] = 10.0
    logits[:, 17] = 9.0  # a stop token id
    logits[:, 5] = 8.0
    params = [SamplingParams(temperature=0, min_tokens=3, stop_token_ids=[17], ignore_eos=True)] * 2
    params += [SamplingParams(temperature=1.0, min_tokens=3, stop_token_ids=[17])] * 2
    outputs = [[4, 4], [4, 4, 4], [4], [4, 4, 4]]
    batch = build(params, vocab, outputs=outputs)
    assert Sampler()(logits, batch).token_ids[:2].tolist() == [5, EOS]
    sampler = Sampler()
    drawn = torch.stack([sampler(logits, batch).token_ids for _ in range(200)])  # [200, 4]
    assert not ((drawn[:, 2] == EOS) | (drawn[:, 2] == 17)).any()
    assert (drawn[:, 3] == EOS).any()


def run_steps(
    params: list[SamplingParams], seeds: list[int | None], target: int, steps: list[torch.Tensor]
) -> list[int]:
    """Sample `len(steps)` tokens for a batch; row `target` sees the same logits in every batch layout."""
    generators = [None if s is None else torch.Generator().manual_seed(s) for s in seeds]
    sampler, tokens = Sampler(), []
    for step, target_logits in enumerate(steps):
        logits = distinct_logits(len(params), target_logits.shape[-1], 3.0, 100 + step)
        logits[target] = target_logits
        ids = sampler(logits, build(params, target_logits.shape[-1], generators=generators)).token_ids
        tokens.append(int(ids[target]))
    return tokens


@pytest.mark.parametrize("target_params", [SamplingParams(temperature=0.9, top_p=0.9), SamplingParams(temperature=1.2)])
def test_same_seed_same_tokens_alone_and_in_a_mixed_batch(target_params: SamplingParams) -> None:
    vocab = 49152
    steps = [distinct_logits(1, vocab, 1.0, 50 + i)[0] for i in range(8)]
    alone = run_steps([target_params], [1234], 0, steps)
    neighbours = [
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=3000),  # widens the top-k head the target's top_p search shares
        SamplingParams(temperature=1.0, top_p=0.5, seed=7),
        SamplingParams(temperature=0.7, min_p=0.1, seed=1234),
        SamplingParams(temperature=1.0, presence_penalty=1.0),
        SamplingParams(temperature=1.5, top_p=0.99),
    ]
    params = neighbours[:3] + [target_params] + neighbours[3:]
    seeds = [None, None, None, 1234, 7, 1234, None, 99]
    torch.manual_seed(11)  # unseeded neighbours draw from the global generator; the target must not care
    in_batch = run_steps(params, seeds, 3, steps)
    assert in_batch == alone
    assert run_steps([target_params], [4321], 0, steps) != alone


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_logprobs_are_raw_log_softmax_with_sorted_top_lists(dtype: torch.dtype) -> None:
    vocab = 5000
    logits = distinct_logits(5, vocab, 4.0, 8).to(dtype)
    params = [
        SamplingParams(temperature=0, logprobs=0),
        SamplingParams(temperature=0.5, top_k=3, logprobs=5, presence_penalty=2.0, logit_bias={0: 100}),
        SamplingParams(temperature=1.0),
        SamplingParams(temperature=1.0, logprobs=20, repetition_penalty=1.5),
        SamplingParams(temperature=0, logprobs=1),
    ]
    out = Sampler()(logits, build(params, vocab, outputs=[[1, 2, 3]] * 5))
    reference = torch.log_softmax(logits.double(), dim=-1)
    assert out.logprobs is not None and out.logprobs[2] is None
    for r, p in enumerate(params):
        entry = out.logprobs[r]
        if p.logprobs is None:
            continue
        assert entry is not None and entry.token_id == int(out.token_ids[r])
        assert entry.logprob == pytest.approx(float(reference[r, entry.token_id]), abs=1e-4)
        assert len(entry.top) == p.logprobs
        values = [v for _, v in entry.top]
        assert values == sorted(values, reverse=True)
        want_ids = reference[r].topk(p.logprobs).indices.tolist()
        assert [t for t, _ in entry.top] == want_ids
        for token, value in entry.top:
            assert value == pytest.approx(float(reference[r, token]), abs=1e-4)


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"temperature": -0.1}, "temperature"),
        ({"top_p": 0.0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"min_p": 1.5}, "min_p"),
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logit_bias": {5: 101}}, "logit_bias"),
        ({"min_tokens": 20, "max_tokens": 10}, "min_tokens"),
        ({"logprobs": 21}, "logprobs"),
    ],
)
def test_out_of_range_params_name_the_parameter(kwargs: dict, param: str) -> None:
    with pytest.raises(ValueError, match=f"^{param}:"):
        SamplingParams(**kwargs)


@pytest.mark.parametrize("k", [1, 5, 20, 128, 1000])
def test_blocked_top_k_equals_torch_topk(k: int) -> None:
    x = torch.softmax(distinct_logits(6, 49152, 3.0, 9), dim=-1)
    x[0, :64] = x[0].max() + 1.0  # one block holding many of the largest values
    got, want = top_k_of(x, k), x.topk(k, dim=-1)
    assert torch.equal(got.values, want.values)
    assert torch.equal(x.gather(1, got.indices), want.values)  # ids point at those values (ties may swap ids)
