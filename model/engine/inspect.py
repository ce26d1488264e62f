"""`llmserve inspect`: the decoder's module tree with shapes and parameter counts, like print() of a
transformers model."""

import torch

from config import Settings
from model.device import resolve_device
from model.engine.model_runner import build_decoder, resolve_dtype
from model.loaders import load_config


def describe_model(settings: Settings) -> str:
    device = resolve_device(settings.device)
    dtype = resolve_dtype(settings.dtype, device)
    config = load_config(settings.model_path)
    # the checkpoint's own structure and parameter count: no CPU prepacking or quantization
    max_len = settings.max_model_len or config.max_position_embeddings
    decoder = build_decoder(settings.model_path, config, max_len, dtype, device, prepack_weights=False)
    params = sum(p.numel() for p in decoder.parameters())
    c = config
    header = (
        f"{settings.model_path}\n"
        f"architecture={c.architecture} layers={c.num_layers} heads={c.num_heads} kv_heads={c.num_kv_heads} "
        f"head_dim={c.head_dim} hidden={c.hidden_size} intermediate={c.intermediate_size} vocab={c.vocab_size} "
        f"context={c.max_position_embeddings} tied_lm_head={c.tie_word_embeddings}\n"
        f"parameters: {params:,} ({params * dtype.itemsize / 2**20:.1f} MiB in {str(dtype).removeprefix('torch.')})\n"
    )
    return header + str(decoder)


if __name__ == "__main__":
    torch.set_grad_enabled(False)
    print(describe_model(Settings()))
