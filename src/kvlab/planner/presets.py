"""Named models: the public geometry of the models the seeds and labs run, and the embedded
tiny models (kvlab.model.TinyGeometry), so that `--model NAME` needs no download.

Figures from each model's public config.json; active parameters per token from the model
cards (MoE: the experts a token runs through). GLM-5.x's attention heads and dims are
DeepSeek-V3's (its MLA lineage) where the config is not public: they enter prefill FLOPs only,
never KV bytes.
"""

from __future__ import annotations

from dataclasses import replace

from kvlab.planner.geometry import Geometry

_DEEPSEEK_MLA = dict(
    attention="mla", layers=61, kv_lora_rank=512, rope_dim=64, attn_qk_dim=192, attn_v_dim=128
)
_GLM5 = dict(
    attention="mla",
    layers=78,
    kv_lora_rank=512,
    rope_dim=64,
    mtp_layers=1,
    attn_heads=64,
    attn_qk_dim=192,
    attn_v_dim=128,
    active_params=40e9,
    sparse_topk=2048,
)


def _gqa(name: str, layers: int, kv_heads: int, query_heads: int, active_params: float) -> Geometry:
    """A GQA model with 128-dim heads (every GQA preset here)."""
    return Geometry(
        name,
        "gqa",
        layers,
        kv_heads=kv_heads,
        head_dim=128,
        active_params=active_params,
        attn_heads=query_heads,
        attn_qk_dim=128,
        attn_v_dim=128,
    )


# name: layers, KV heads, query heads, active parameters per token
PRESETS: dict[str, Geometry] = {
    "llama-3.1-8b": _gqa("llama-3.1-8b", 32, 8, 32, 8.0e9),
    "llama-3.1-70b": _gqa("llama-3.1-70b", 80, 8, 64, 70.6e9),
    "qwen3-32b": _gqa("qwen3-32b", 64, 8, 64, 32.8e9),
    "qwen3-235b-a22b": _gqa("qwen3-235b-a22b", 94, 4, 64, 22e9),
    "glm-4.5": _gqa("glm-4.5", 92, 8, 96, 32e9),
    "deepseek-r1": Geometry("deepseek-r1", active_params=37e9, attn_heads=128, **_DEEPSEEK_MLA),
    "kimi-k2": Geometry("kimi-k2", active_params=32e9, attn_heads=64, **_DEEPSEEK_MLA),
    # GLM-5.x: a sparse-attention indexer (128 fp8 + 4 B scale per token) on every layer in
    # GLM-5/5.1, on 21 layers in GLM-5.2/5.3 (shared across the others); one MTP layer.
    "glm-5": Geometry("glm-5", indexer_layers=78, **_GLM5),
    "glm-5.2": Geometry("glm-5.2", indexer_layers=21, **_GLM5),
}
PRESETS["glm-4.6"] = replace(PRESETS["glm-4.5"], name="glm-4.6")
PRESETS["deepseek-r1-0528"] = replace(PRESETS["deepseek-r1"], name="deepseek-r1-0528")
PRESETS["deepseek-v3"] = replace(PRESETS["deepseek-r1"], name="deepseek-v3")
PRESETS["glm-5.1"] = replace(PRESETS["glm-5"], name="glm-5.1")
PRESETS["glm-5.3"] = replace(PRESETS["glm-5.2"], name="glm-5.3")


def tiny_geometry(name: str, g: object) -> Geometry:
    """A kvlab.model.TinyGeometry as the planner sees it (MHA/GQA, its own dtype)."""
    from kvlab.model import TinyGeometry

    assert isinstance(g, TinyGeometry)
    attn = g.hidden_size * g.head_dim * (2 * g.num_attention_heads + 2 * g.num_key_value_heads)
    mlp = 3 * g.hidden_size * g.intermediate_size
    dtype = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}[g.dtype]
    return Geometry(
        name,
        "gqa",
        g.num_hidden_layers,
        kv_heads=g.num_key_value_heads,
        head_dim=g.head_dim,
        native_dtype=dtype,
        active_params=float(g.num_hidden_layers * (attn + mlp)),
        attn_heads=g.num_attention_heads,
        attn_qk_dim=g.head_dim,
        attn_v_dim=g.head_dim,
    )


# The embedded-sweep campaign's light model (campaigns/embedded-sweep.yml).
SWEEP_TINY = dict(
    num_hidden_layers=2,
    num_attention_heads=2,
    num_key_value_heads=2,
    head_dim=32,
    hidden_size=64,
    intermediate_size=128,
)


def _tiny_presets() -> dict[str, Geometry]:
    from kvlab.model import TinyGeometry

    return {
        "tiny": tiny_geometry("tiny", TinyGeometry()),
        "tiny-sweep": tiny_geometry("tiny-sweep", TinyGeometry(**SWEEP_TINY)),
    }


def names() -> list[str]:
    return sorted([*PRESETS, *_tiny_presets()])


def get(name: str) -> Geometry:
    key = name.lower()
    if key in PRESETS:
        return PRESETS[key]
    tiny = _tiny_presets()
    if key in tiny:
        return tiny[key]
    raise KeyError(
        f"model {name!r}: no such preset ({', '.join(names())}); or give a config.json or a model folder"
    )
