"""Which device `--device` names: torch alone, so a caller can ask before importing the engine (and what it loads)."""

import torch


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)
