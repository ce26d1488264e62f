"""Session-wide fixtures: the real default model (fetched once into models/), its tokenizer, and engines on it."""

import os
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

# The suite's reference configuration: float32, the checkpoint dequantized, eager. Parity with transformers and
# between paths is exact only there. The default fast path (a GGUF's own int4/int8, bfloat16 where the CPU has it,
# the decode step compiled in the background) is tested where a test asks for it by name (test_default_path.py).
# Servers started by tests, in this process or as subprocesses, inherit these.
os.environ.setdefault("LLMSERVE_DTYPE", "float32")
os.environ.setdefault("LLMSERVE_QUANTIZATION", "none")
os.environ.setdefault("LLMSERVE_TORCH_COMPILE", "false")

from config import Settings  # noqa: E402
from config.default_model import ensure_default_model  # noqa: E402
from model.tokenizer import Tokenizer  # noqa: E402


@pytest.fixture(scope="session")
def default_model_path() -> Path:
    return ensure_default_model(ROOT / "models")


@pytest.fixture(scope="session")
def default_tokenizer(default_model_path: Path) -> Tokenizer:
    return Tokenizer.load(default_model_path)


@pytest.fixture(scope="session")
def make_engine(default_model_path: Path, default_tokenizer: Tokenizer) -> Callable[..., "Engine"]:  # noqa: F821
    """Build an Engine on the default model; keyword arguments override Settings fields."""
    from model.engine.engine import Engine

    def make(record_steps: bool = False, **overrides: object) -> Engine:
        settings = Settings(model=str(default_model_path), **overrides)
        return Engine(settings, tokenizer=default_tokenizer, record_steps=record_steps)

    return make


@pytest.fixture(autouse=True)
def _deterministic() -> None:
    torch.manual_seed(0)
