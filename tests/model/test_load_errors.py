"""Each clear loading error, triggered on purpose: the message names what is wrong and where, and nothing loads."""

import json
import re
import subprocess
import sys
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from model.config import SUPPORTED_ARCHITECTURES, UnsupportedModelError
from model.decoder import WeightError
from model.loaders import load_config
from model.loaders.errors import CheckpointFileError
from tests.model.families import build_hf, load_ours, save_hf

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return save_hf(build_hf("llama2-linear"), tmp_path_factory.mktemp("llama"))


def copy_folder(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def edit_config(folder: Path, **changes: object) -> None:
    path = folder / "config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


def edit_weights(folder: Path, drop: str | None = None, add: dict[str, torch.Tensor] | None = None) -> None:
    path = folder / "model.safetensors"
    weights = load_file(path)
    if drop:
        del weights[drop]
    weights.update(add or {})
    save_file(weights, path)


def test_unsupported_architecture_names_the_supported_ones(folder: Path, tmp_path: Path) -> None:
    bad = copy_folder(folder, tmp_path / "m")
    edit_config(bad, model_type="gpt_neox")
    with pytest.raises(UnsupportedModelError) as err:
        load_config(bad)
    assert "'gpt_neox'" in str(err.value)
    assert all(name in str(err.value) for name in SUPPORTED_ARCHITECTURES)


def test_unsupported_rope_type_is_refused_before_loading(folder: Path, tmp_path: Path) -> None:
    bad = copy_folder(folder, tmp_path / "m")
    edit_config(bad, rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0})
    with pytest.raises(
        UnsupportedModelError, match="rope type 'yarn' is not supported; supported: default, linear, llama3, longrope"
    ):
        load_config(bad)


def test_missing_tensor_is_named(folder: Path, tmp_path: Path) -> None:
    bad = copy_folder(folder, tmp_path / "m")
    edit_weights(bad, drop="model.layers.1.self_attn.v_proj.weight")
    # v_proj is one third of our fused qkv_proj: the message still names the checkpoint's tensor
    with pytest.raises(
        WeightError, match=r"missing tensors in the checkpoint: model\.layers\.1\.self_attn\.v_proj\.weight$"
    ):
        load_ours(bad)


def test_unexpected_tensor_is_named(folder: Path, tmp_path: Path) -> None:
    bad = copy_folder(folder, tmp_path / "m")
    edit_weights(bad, add={"model.layers.0.self_attn.extra_proj.weight": torch.zeros(2, 2)})
    with pytest.raises(WeightError, match=r"unexpected tensor 'model\.layers\.0\.self_attn\.extra_proj\.weight'"):
        load_ours(bad)


def test_shape_mismatch_names_the_tensor_and_both_shapes(folder: Path, tmp_path: Path) -> None:
    bad = copy_folder(folder, tmp_path / "m")
    edit_config(bad, intermediate_size=96)  # the checkpoint's MLP is 128 wide
    with pytest.raises(WeightError) as err:
        load_ours(bad)
    # the file holds down_proj first (safetensors sorts names)
    assert str(err.value) == "tensor 'model.layers.0.mlp.down_proj.weight' has shape (64, 128), expected (64, 96)"


@pytest.mark.parametrize("keep", [4, 200, -100], ids=["no-header", "cut-header", "cut-data"])
def test_truncated_safetensors_names_the_file(folder: Path, tmp_path: Path, keep: int) -> None:
    bad = copy_folder(folder, tmp_path / "m")
    data = (bad / "model.safetensors").read_bytes()
    (bad / "model.safetensors").write_bytes(data[:keep])
    with pytest.raises(CheckpointFileError, match=str(bad / "model.safetensors")):
        load_ours(bad)


def test_corrupt_safetensors_header_names_the_file(folder: Path, tmp_path: Path) -> None:
    bad = copy_folder(folder, tmp_path / "m")
    data = bytearray((bad / "model.safetensors").read_bytes())
    data[8:16] = b"\xff\xfe garb"
    (bad / "model.safetensors").write_bytes(bytes(data))
    with pytest.raises(CheckpointFileError, match=f"{bad / 'model.safetensors'}: corrupt header"):
        load_ours(bad)


def test_missing_shard_names_the_file(tmp_path: Path) -> None:
    sharded = save_hf(build_hf("qwen2"), tmp_path / "sharded", max_shard_size="40KB")
    shard = sorted(sharded.glob("*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(CheckpointFileError, match=f"{shard}: listed in model.safetensors.index.json but missing"):
        load_ours(sharded)


def tiny_gguf(path: Path) -> Path:
    writer = gguf.GGUFWriter(str(path), "llama")
    for key, value in [("block_count", 1), ("embedding_length", 32), ("feed_forward_length", 64),
                       ("head_count", 2), ("vocab_size", 16)]:  # fmt: skip
        getattr(writer, f"add_{key}")(value)
    writer.add_tensor("token_embd.weight", np.ones((16, 32), dtype=np.float32))
    writer.add_tensor("output_norm.weight", np.ones(32, dtype=np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_truncated_gguf_names_the_file(tmp_path: Path) -> None:
    path = tiny_gguf(tmp_path / "tiny.gguf")
    path.write_bytes(path.read_bytes()[:-1000])
    # the gguf reader itself notices (it shapes every tensor on open); either way the message names the file
    with pytest.raises(CheckpointFileError, match=f"{re.escape(str(path))}: (truncated|not a readable GGUF file)"):
        load_config(path)


def test_corrupt_gguf_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "garbage.gguf"
    path.write_bytes(b"GGUF" + bytes(range(256)) * 4)
    with pytest.raises(CheckpointFileError, match=f"{path}: not a readable GGUF file"):
        load_config(path)


def test_gguf_missing_tensor_is_named(tmp_path: Path) -> None:
    path = tiny_gguf(tmp_path / "tiny.gguf")  # one layer declared, none of its tensors written
    with pytest.raises(
        WeightError, match=r"missing tensors in the checkpoint: model\.layers\.0\.input_layernorm\.weight"
    ):
        load_ours(path, 16)


def test_cli_exits_non_zero_with_the_message(folder: Path, tmp_path: Path) -> None:
    bad = copy_folder(folder, tmp_path / "m")
    edit_config(bad, model_type="gpt_neox")
    result = subprocess.run(
        [sys.executable, "-m", "server", "inspect", str(bad)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert result.returncode != 0
    assert "unsupported architecture 'gpt_neox'; supported: llama" in result.stderr
