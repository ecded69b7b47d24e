"""A model's geometry from its Hugging Face `config.json` (or a model folder holding one), or
a preset's name: `--model` takes any of the three."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvlab.planner import presets
from kvlab.planner.geometry import Geometry

_DTYPES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float8_e4m3fn": "fp8"}


class ModelError(ValueError):
    """A --model that names nothing the planner can read; the message says what to give."""


def resolve(model: str) -> Geometry:
    p = Path(model)
    if p.is_dir():
        p = p / "config.json"
    if p.suffix == ".json" or p.name == "config.json":
        if not p.is_file():
            raise ModelError(f"--model {model}: no config.json there")
        try:
            return from_config(json.loads(p.read_text()), name=p.parent.name or p.stem)
        except (ValueError, KeyError, TypeError) as e:
            raise ModelError(f"--model {model}: cannot read its geometry ({e})") from None
    try:
        return presets.get(model)
    except KeyError as e:
        raise ModelError(str(e.args[0])) from None


def _active_params(c: dict[str, Any], layers: int, attn: float) -> float:
    """Parameters a token runs through (no embeddings): attention, and the MLP or the experts
    it is routed to plus the shared ones, from the config's sizes."""
    h = c["hidden_size"]
    experts = c.get("num_experts_per_tok") or 0
    moe_inter = c.get("moe_intermediate_size") or 0
    dense_layers = c.get("first_k_dense_replace", 0 if experts else layers)
    dense = 3 * h * c.get("intermediate_size", 4 * h)
    moe = 3 * h * moe_inter * (experts + (c.get("n_shared_experts") or 0)) if experts else dense
    return layers * attn + dense_layers * dense + (layers - dense_layers) * moe


def from_config(c: dict[str, Any], name: str = "config") -> Geometry:
    """Geometry from a Hugging Face config (GQA/MHA, or MLA where kv_lora_rank is set, with a
    sparse-attention indexer where index_topk is)."""
    c = {**c, **(c.get("text_config") or {})}
    layers = int(c["num_hidden_layers"])
    h = int(c["hidden_size"])
    heads = int(c["num_attention_heads"])
    dtype = _DTYPES.get(str(c.get("torch_dtype") or c.get("dtype") or "bfloat16"), "bf16")
    if c.get("kv_lora_rank"):
        rank, rope = int(c["kv_lora_rank"]), int(c["qk_rope_head_dim"])
        qk = int(c.get("qk_nope_head_dim", 128)) + rope
        v = int(c.get("v_head_dim", 128))
        q_rank = c.get("q_lora_rank") or 0
        attn = (
            (h * q_rank + q_rank * heads * qk if q_rank else h * heads * qk)
            + h * (rank + rope)
            + rank * heads * (qk - rope + v)
            + heads * v * h
        )
        indexer = 0
        if c.get("index_topk"):
            # the indexer's own layers, where the config lists them; else every layer
            listed = c.get("index_layers") or c.get("indexer_layers")
            indexer = len(listed) if isinstance(listed, list) else int(listed or layers)
        return Geometry(
            name,
            "mla",
            layers,
            kv_lora_rank=rank,
            rope_dim=rope,
            indexer_layers=indexer,
            indexer_dim=int(c.get("index_head_dim", 128)),
            mtp_layers=int(c.get("num_nextn_predict_layers", 0)),
            native_dtype=dtype,
            active_params=float(_active_params(c, layers, attn)),
            attn_heads=heads,
            attn_qk_dim=qk,
            attn_v_dim=v,
            sparse_topk=int(c.get("index_topk") or 0),
        )
    kv = int(c.get("num_key_value_heads") or heads)
    hd = int(c.get("head_dim") or h // heads)
    attn = h * hd * (2 * heads + 2 * kv)
    return Geometry(
        name,
        "gqa",
        layers,
        kv_heads=kv,
        head_dim=hd,
        native_dtype=dtype,
        active_params=float(_active_params(c, layers, attn)),
        attn_heads=heads,
        attn_qk_dim=hd,
        attn_v_dim=hd,
        mtp_layers=int(c.get("num_nextn_predict_layers", 0)),
    )
