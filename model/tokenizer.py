"""The model's tokenizer and chat template (via transformers), for GGUF files and Hugging Face folders."""

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer, PreTrainedTokenizerBase


class Tokenizer:
    def __init__(self, hf: PreTrainedTokenizerBase, eos_token_ids: set[int], chat_template: str | None = None) -> None:
        self.hf = hf
        self.eos_token_ids = eos_token_ids  # every id that ends generation (eos, end-of-turn, generation_config lists)
        if chat_template is not None:
            self.hf.chat_template = chat_template

    @classmethod
    def load(cls, model_path: Path, chat_template_file: str = "") -> "Tokenizer":
        model_path = Path(model_path)
        if model_path.is_file():  # GGUF: transformers builds a fast tokenizer from the file's metadata
            hf = AutoTokenizer.from_pretrained(str(model_path.parent), gguf_file=model_path.name)
        else:
            hf = AutoTokenizer.from_pretrained(str(model_path))
        eos = {hf.eos_token_id} if hf.eos_token_id is not None else set()
        eos |= _extra_eos_ids(hf)
        template = Path(chat_template_file).read_text() if chat_template_file else None
        return cls(hf, eos, template)

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=add_special_tokens))

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str:
        text = self.hf.decode(token_ids, skip_special_tokens=skip_special_tokens)
        assert isinstance(text, str)  # one sequence in, one string out (a list only for a batch)
        return text

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        **template_kwargs: Any,
    ) -> list[int]:
        text = self.hf.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt and not continue_final_message,
            continue_final_message=continue_final_message,
            **template_kwargs,
        )
        assert isinstance(text, str)  # tokenize=False: the rendered text
        # The template already wrote any BOS it wants; do not add another.
        return self.encode(text, add_special_tokens=False)


def _extra_eos_ids(hf: PreTrainedTokenizerBase) -> set[int]:
    # eos ids declared by the checkpoint (GGUF metadata, generation_config.json) come from ModelConfig, which has
    # already parsed those files; the engine merges both lists. Here: the tokenizer's own end-of-turn tokens.
    ids: set[int] = set()
    for token in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>"):
        token_id = hf.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != hf.unk_token_id and token in hf.get_vocab():
            ids.add(token_id)
    return ids
