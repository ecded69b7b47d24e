"""Every preset's KV bytes per token against the values computed by hand from the public
configurations (issue 25), the GLM-5.3 seed's 10.75 GB, and TP replication."""

from __future__ import annotations

import json

import pytest

from kvlab.planner import presets
from kvlab.planner.modelconfig import from_config, resolve

# (preset, dtype, with MTP, bytes per token) — the hand-computed values
HAND = [
    ("llama-3.1-8b", "bf16", False, 2 * 32 * 8 * 128 * 2),  # 131,072
    ("llama-3.1-70b", "bf16", False, 327_680),
    ("qwen3-32b", "bf16", False, 262_144),
    ("qwen3-235b-a22b", "bf16", False, 192_512),
    ("glm-4.5", "bf16", False, 376_832),
    ("glm-4.6", "bf16", False, 376_832),
    ("deepseek-r1", "bf16", False, 70_272),
    ("deepseek-r1-0528", "bf16", False, 70_272),
    ("deepseek-v3", "bf16", False, 70_272),
    ("deepseek-r1", "fp8", False, 35_136),
    ("kimi-k2", "bf16", False, 70_272),
    ("kimi-k2", "fp8", False, 35_136),
    ("glm-5.3", "fp8", False, 78 * 656 + 21 * 132),  # 53,940
    ("glm-5.3", "fp8", True, 54_728),
    ("glm-5.2", "fp8", False, 53_940),
    ("glm-5", "fp8", False, 78 * 656 + 78 * 132),
    ("glm-5.1", "fp8", False, 78 * 656 + 78 * 132),
    ("glm-5", "bf16", False, 78 * 576 * 2 + 78 * 132),
    ("tiny", None, False, 16_384),  # make demo's: 8 x 4 x 64 x K,V x fp32
    ("tiny-sweep", None, False, 1_024),  # embedded-sweep's: 2 x 2 x 32 x K,V x fp32
]


@pytest.mark.parametrize(("name", "dtype", "mtp", "want"), HAND, ids=[f"{h[0]}-{h[1]}-{h[2]}" for h in HAND])
def test_preset_bytes_per_token(name: str, dtype: str | None, mtp: bool, want: int) -> None:
    assert presets.get(name).kv_bytes_per_token(dtype, mtp) == want


def test_every_preset_is_hand_checked() -> None:
    assert set(presets.names()) == {h[0] for h in HAND}


def test_glm53_seed_prompt_is_the_seeds_10_75_gb() -> None:
    g = presets.get("glm-5.3")
    low, high = 196_000 * g.kv_bytes_per_token("fp8"), 196_000 * g.kv_bytes_per_token("fp8", True)
    assert (round(low / 1e9, 2), round(high / 1e9, 2)) == (10.57, 10.73)
    assert abs(low / 10.75e9 - 1) < 0.02
    naive = 196_000 * 78 * 576  # the 576-byte layout the fp8_ds_mla layout is not
    assert round(naive / 1e9, 1) == 8.8


@pytest.mark.parametrize(
    ("name", "tp", "per_gpu", "replication"),
    [
        ("llama-3.1-70b", 1, 327_680, 1.0),
        ("llama-3.1-70b", 8, 327_680 // 8, 1.0),  # 8 KV heads over 8 ranks: one each
        ("qwen3-235b-a22b", 8, 192_512 // 4, 2.0),  # 4 KV heads, 8 ranks: each head on two ranks
        ("qwen3-235b-a22b", 2, 192_512 // 2, 1.0),
        ("deepseek-r1", 8, 70_272, 8.0),  # MLA: the latent whole on every rank
        ("glm-5.3", 8, 53_940, 8.0),
    ],
)
def test_tp_replication(name: str, tp: int, per_gpu: int, replication: float) -> None:
    g = presets.get(name)
    d = "fp8" if name.startswith("glm-5") else "bf16"
    assert g.kv_bytes_per_token_per_gpu(tp, d) == per_gpu
    assert g.replication(tp) == replication


def test_config_json_gives_the_presets_geometry(tmp_path) -> None:
    llama70 = {
        "num_hidden_layers": 80,
        "hidden_size": 8192,
        "num_attention_heads": 64,
        "num_key_value_heads": 8,
        "intermediate_size": 28672,
        "torch_dtype": "bfloat16",
    }
    r1 = {
        "num_hidden_layers": 61,
        "hidden_size": 7168,
        "num_attention_heads": 128,
        "kv_lora_rank": 512,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 128,
        "v_head_dim": 128,
        "q_lora_rank": 1536,
        "num_nextn_predict_layers": 1,
        "torch_dtype": "bfloat16",
    }
    assert from_config(llama70).kv_bytes_per_token() == 327_680
    assert from_config(r1).kv_bytes_per_token() == 70_272
    assert from_config(r1).kv_bytes_per_token(with_mtp=True) == 62 * 1152
    folder = tmp_path / "Llama-3.1-70B"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(llama70))
    assert resolve(str(folder)).kv_bytes_per_token_per_gpu(8) == 40_960
    # about 70B parameters a token runs through, from the config's sizes
    assert 65e9 < from_config(llama70).active_params < 71e9


def test_unknown_model_names_the_presets() -> None:
    with pytest.raises(ValueError, match="llama-3.1-70b"):
        resolve("no-such-model")
