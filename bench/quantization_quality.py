"""How close the default path (the GGUF's own int4/int8, bfloat16 activations where the CPU has them, the decode
step compiled), `--quantization int8` / `int4` and `--dtype bfloat16` stay to the reference on the default model:
the checkpoint dequantized, in float32, eager. Greedy tokens on 20 prompts (how many agree on their first 16
tokens), the max abs difference of the prompt's last-position logits, and, where a prompt's tokens part from the
reference, how near a tie the reference itself was there (its top logit minus the logit of the token taken instead).

    .venv/bin/python bench/quantization_quality.py
"""

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

from config import Settings  # noqa: E402
from model.engine.engine import Engine  # noqa: E402
from model.engine.sequence import SamplingParams  # noqa: E402

PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about autumn.",
    "Explain photosynthesis in one sentence.",
    "List three prime numbers.",
    "Who wrote Romeo and Juliet?",
    "Translate 'good morning' into Spanish.",
    "What is 12 times 12?",
    "Give me a tip for learning to code.",
    "Describe the color blue to someone.",
    "Why is the sky blue?",
    "Name a famous painting.",
    "What does a CPU do?",
    "Suggest a name for a cat.",
    "How many legs does a spider have?",
    "What is the boiling point of water?",
    "Tell me a fun fact about space.",
    "What is a noun?",
    "Recommend a book for a long flight.",
    "How do bees make honey?",
    "What is machine learning?",
]


@torch.inference_mode()
def run(engine: Engine, together: bool = False) -> tuple[list[list[int]], list[torch.Tensor]]:
    """Greedy tokens per prompt, the prompts one at a time or (together) all decoded in one batch, as under load;
    and each prompt's last-position logits."""
    from tests.model.test_smollm2_parity import single_sequence_batch

    prompt_ids = [engine.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in PROMPTS]
    tokens: dict[str, list[int]] = {str(i): [] for i in range(len(PROMPTS))}
    batches = [list(tokens)] if together else [[key] for key in tokens]
    for batch in batches:
        for key in batch:
            params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
            engine.add_request(key, prompt_ids[int(key)], params)
        engine._drain_inbox(block=False)
        while engine.scheduler.has_work():
            for o in engine.step():
                tokens[o.request_id] += o.new_token_ids
    # last-position logits of each prompt, via one uncached forward through the same runner; the LM head takes the
    # last position alone, as a serving step does (all positions through it would take its many-row path instead)
    decoder = engine.runner.decoder
    logits = [decoder.compute_logits(decoder(single_sequence_batch(ids))[-1:])[-1] for ids in prompt_ids]
    return list(tokens.values()), logits


REFERENCE = {"quantization": "none", "dtype": "float32", "torch_compile": False}


def engine(**overrides: object) -> Engine:
    # prefix caching off: the uncached forward in run() writes K/V into pool slots 0..T, which must hold nothing cached
    e = Engine(Settings(enable_prefix_caching=False, **overrides))  # type: ignore[arg-type]
    e.runner.wait_compiled()  # a compiled default takes over at the first step
    return e


@torch.inference_mode()
def tie_margin(reference: Engine, reference_tokens: list[int], tokens: list[int], prompt: str) -> float:
    """At the first token where `tokens` part from `reference_tokens`: the reference's logit for its own token
    minus its logit for the one taken instead. Near 0, the two paths split a near-tie."""
    from tests.model.test_smollm2_parity import single_sequence_batch

    k = next(i for i, (a, b) in enumerate(zip(reference_tokens, tokens, strict=True)) if a != b)
    ids = reference.tokenizer.apply_chat_template([{"role": "user", "content": prompt}]) + reference_tokens[:k]
    decoder = reference.runner.decoder
    logits = decoder.compute_logits(decoder(single_sequence_batch(ids)))[-1].float()
    return (logits[reference_tokens[k]] - logits[tokens[k]]).item()


def main() -> None:
    reference = engine(**REFERENCE)
    f32_tokens, f32_logits = run(reference)
    scale = max(a.abs().max().item() for a in f32_logits)
    print(f"against float32, the checkpoint dequantized, eager (max abs float32 logit {scale:.1f})\n")
    print(
        "| flags | prompts | first 16 greedy tokens identical | max abs logit error "
        "| widest reference margin where tokens part |"
    )
    print("|---|---:|---:|---:|---:|")
    variants: dict[str, dict[str, object]] = {
        "(defaults)": {},
        "(defaults), the 20 prompts decoded as one batch": {"together": True},
        "(defaults) --no-torch-compile": {"torch_compile": False},
        "--dtype float32 (auto quantization, compiled)": {"dtype": "float32"},
        "--quantization int8": {**REFERENCE, "quantization": "int8"},
        "--quantization int4": {**REFERENCE, "quantization": "int4"},
        "--dtype bfloat16 --quantization none": {**REFERENCE, "dtype": "bfloat16"},
    }
    for flags, overrides in variants.items():
        together = bool(overrides.pop("together", False))
        q_tokens, q_logits = run(engine(**overrides), together)
        same = sum(a == b for a, b in zip(f32_tokens, q_tokens, strict=True))
        max_err = max((a - b).abs().max().item() for a, b in zip(f32_logits, q_logits, strict=True))
        margins = [
            tie_margin(reference, a, b, prompt)
            for a, b, prompt in zip(f32_tokens, q_tokens, PROMPTS, strict=True)
            if a != b
        ]
        widest = f"{max(margins):.3f}" if margins else "-"
        print(f"| `{flags}` | {len(PROMPTS)} | {same} | {max_err:.3f} | {widest} |")


if __name__ == "__main__":
    main()
