"""Where kvlab keeps things that outlive a checkout: models, images, wheels, stores.

CI clones the project afresh for every run, so anything expensive to rebuild lives in a
user cache folder keyed by the hash of its inputs, never inside the checkout.
"""

from __future__ import annotations

import os
from pathlib import Path


def cache_dir() -> Path:
    """The user cache folder (KVLAB_CACHE, else XDG_CACHE_HOME/kvlab, else ~/.cache/kvlab)."""
    explicit = os.environ.get("KVLAB_CACHE")
    if explicit:
        return Path(explicit)
    xdg = os.environ.get("XDG_CACHE_HOME")
    base = Path(xdg) if xdg else Path.home() / ".cache"
    return base / "kvlab"


def models_dir() -> Path:
    """Where locally built models are cached (KVLAB_MODELS, else the cache folder's models/).

    Apart from the rest of the cache so that CI can start every run with no model while
    the VM image, which takes minutes to build, stays warm.
    """
    explicit = os.environ.get("KVLAB_MODELS")
    return Path(explicit) if explicit else cache_dir() / "models"


def repo_root() -> Path:
    """The checkout this module was imported from (src/kvlab/paths.py → root)."""
    return Path(__file__).resolve().parents[2]


def state_dir() -> Path:
    """Scratch space for running things (engine logs, stores of the embedded default)."""
    explicit = os.environ.get("KVLAB_STATE")
    return Path(explicit) if explicit else cache_dir() / "state"
