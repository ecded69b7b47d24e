"""Engine tier: the real vLLM CPU engine and the tiny model, built once into the user cache."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvlab.model import ensure_tiny


@pytest.fixture(scope="session")
def tiny_model() -> Path:
    return ensure_tiny(seed=0)
