"""The default model's check: hashed once, then trusted while its size and mtime stay what was recorded."""

import hashlib
import os
from pathlib import Path

import pytest

from config import default_model


@pytest.fixture
def model_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    path = tmp_path / default_model.FILENAME
    path.write_bytes(b"gguf bytes" * 1000)
    monkeypatch.setattr(default_model, "SHA256", hashlib.sha256(path.read_bytes()).hexdigest())
    return path


def test_a_checked_file_is_not_hashed_again(model_file: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    hashed: list[Path] = []
    real = default_model._sha256
    monkeypatch.setattr(default_model, "_sha256", lambda p: hashed.append(p) or real(p))
    assert default_model.ensure_default_model(model_file.parent) == model_file
    assert default_model.ensure_default_model(model_file.parent) == model_file
    assert hashed == [model_file]


def test_a_changed_file_is_hashed_again_and_refused(model_file: Path) -> None:
    marker = model_file.parent / f".{default_model.FILENAME}.verified"
    assert default_model._verified(model_file, marker)
    stat = model_file.stat()
    model_file.write_bytes(b"other bytes" * 1000)
    os.utime(model_file, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1))
    assert not default_model._verified(model_file, marker)
    model_file.unlink()
    assert not default_model._verified(model_file, marker)
