"""The tiny model is built in a process of its own, whatever the caller imported.

Ansible's module_utils replaces `sys.intern` with an object that torch._dynamo (imported by
transformers' Llama classes) refuses. The test tiers import Ansible (the testinfra plugin,
tests/lab), so a model built in the test process failed on a fresh machine.
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types
from pathlib import Path

import pytest

from kvlab import model
from kvlab.model import TinyGeometry, ensure_tiny, tree_sha256

# Small enough to build in a few seconds; every field still goes through the builder.
SMALL = TinyGeometry(num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                     hidden_size=64, intermediate_size=128, vocab_size=512, max_position_embeddings=4096)


def test_a_model_builds_after_ansible_was_imported(tmp_path: Path) -> None:
    import ansible.module_utils.basic  # noqa: F401  (the import that patches sys.intern)

    assert not isinstance(sys.intern, types.BuiltinFunctionType), "this process must carry Ansible's patch"
    out = ensure_tiny(seed=3, geometry=SMALL, dest=tmp_path / "tiny", quiet=True)
    meta = json.loads((out / "kvlab-model.json").read_text())
    assert (meta["seed"], meta["num_hidden_layers"], meta["vocab_size"]) == (3, 1, 512)
    assert json.loads((out / "config.json").read_text())["num_key_value_heads"] == 1
    assert not list(tmp_path.glob("tiny.tmp*")), "the temporary build folder was moved into place"


def test_the_cache_is_keyed_by_seed_and_geometry_and_builds_the_same_bytes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVLAB_MODELS", str(tmp_path / "models"))
    a = ensure_tiny(seed=5, geometry=SMALL, quiet=True)
    assert a.parent == tmp_path / "models" and a == model.model_dir(5, SMALL)
    assert ensure_tiny(seed=5, geometry=SMALL, quiet=True) == a, "a cached model is found, not rebuilt"
    again = ensure_tiny(seed=5, geometry=SMALL, dest=tmp_path / "again", quiet=True)
    assert tree_sha256(again) == tree_sha256(a), "the same seed gives the same bytes"
    assert model.model_dir(6, SMALL) != a and model.model_dir(5, TinyGeometry()) != a


def test_a_failed_build_says_so_and_leaves_no_model(tmp_path: Path) -> None:
    bad = dataclasses.replace(SMALL, dtype="float64")  # refused by the builder (no KV size for it)
    with pytest.raises(RuntimeError, match="building the tiny model"):
        ensure_tiny(seed=0, geometry=bad, dest=tmp_path / "bad", quiet=True)
    assert not (tmp_path / "bad" / "kvlab-model.json").exists()
