"""The model's tokenizer and chat template (via transformers), for GGUF files and Hugging Face folders."""

import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import transformers
from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

# AutoTokenizer is imported where a class must be looked up: importing it pulls in transformers' model registry,
# ~0.55 s of a ~5.5 s later start on a Zen 3, which a GGUF's cached tokenizer (one known class) does not need.


class Tokenizer:
    def __init__(self, hf: PreTrainedTokenizerBase, eos_token_ids: set[int], chat_template: str | None = None) -> None:
        self.hf = hf
        self.eos_token_ids = eos_token_ids  # every id that ends generation (eos, end-of-turn, generation_config lists)
        if chat_template is not None:
            self.hf.chat_template = chat_template

    @classmethod
    def load(cls, model_path: Path, chat_template_file: str = "", cache_dir: Path | None = None) -> "Tokenizer":
        """cache_dir: where a GGUF's tokenizer is kept once built (tokenizer.json and its config), so that later
        starts read it in ~0.3 s instead of building it from the file's vocabulary again (~4 s on a 2-core Zen 3)."""
        model_path = Path(model_path)
        if model_path.is_file():  # GGUF: transformers builds a fast tokenizer from the file's metadata
            hf = _cached_gguf_tokenizer(model_path, cache_dir) if cache_dir else _gguf_tokenizer(model_path)
        else:
            from transformers import AutoTokenizer

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


def _gguf_tokenizer(path: Path) -> PreTrainedTokenizerBase:
    if _generic_gguf_tokenizer(path):
        # What AutoTokenizer resolves such a file to, without importing its registry of every model and parsing the
        # whole file again for a config: a first start's tokenizer 10.7 -> 4.3 s (AMD EPYC Zen 3, 2 cores)
        return PreTrainedTokenizerFast.from_pretrained(str(path.parent), gguf_file=path.name)
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


def _generic_gguf_tokenizer(path: Path) -> bool:
    """Whether AutoTokenizer gives this GGUF the generic fast class: a byte-level BPE vocabulary ("gpt2", as Llama
    3, SmolLM and most recent checkpoints ship) under the llama architecture, for which transformers registers no
    tokenizer class of its own (a Mistral named so takes Mistral's)."""
    from transformers.integrations.gguf import read_gguf_metadata

    metadata, _ = read_gguf_metadata(str(path), ())
    name = str(metadata.get("general.name", "")).lower()
    return (
        metadata.get("general.architecture") == "llama"
        and metadata.get("tokenizer.ggml.model") == "gpt2"
        and "mistral" not in name
    )


def _saved_tokenizer(folder: Path) -> PreTrainedTokenizerBase:
    """A tokenizer saved by save_pretrained: the generic fast class where that is the class it was saved as (what
    transformers builds from any GGUF), else whichever class AutoTokenizer finds."""
    saved_class = json.loads((folder / "tokenizer_config.json").read_text()).get("tokenizer_class")
    if saved_class in (PreTrainedTokenizerFast.__name__, "PreTrainedTokenizerFast"):
        return PreTrainedTokenizerFast.from_pretrained(str(folder))
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(folder))


def _cached_gguf_tokenizer(path: Path, cache_dir: Path) -> PreTrainedTokenizerBase:
    stat = path.resolve().stat()
    key = f"{path.resolve()}|{stat.st_size}|{stat.st_mtime_ns}|{transformers.__version__}"
    folder = Path(cache_dir) / "tokenizers" / hashlib.sha256(key.encode()).hexdigest()[:24]
    if (folder / "tokenizer.json").exists() and (folder / "tokenizer_config.json").exists():
        return _saved_tokenizer(folder)
    hf = _gguf_tokenizer(path)
    staging = None
    try:  # written aside and renamed, so that a concurrent start never reads half a folder
        folder.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(dir=folder.parent))
        hf.save_pretrained(str(staging))
        os.replace(staging, folder)
    except OSError:  # a read-only or full cache only costs the next start its time
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
    return hf


def _extra_eos_ids(hf: PreTrainedTokenizerBase) -> set[int]:
    # eos ids declared by the checkpoint (GGUF metadata, generation_config.json) come from ModelConfig, which has
    # already parsed those files; the engine merges both lists. Here: the tokenizer's own end-of-turn tokens.
    ids: set[int] = set()
    for token in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>"):
        token_id = hf.convert_tokens_to_ids(token)
        if isinstance(token_id, int) and token_id != hf.unk_token_id and token in hf.get_vocab():
            ids.add(token_id)
    return ids
