"""Hugging Face `config.json` <-> `ModelConfig`.

`config_from_hf(hf)` reads a Hugging Face config dict (as in `config.json`) and returns the
`ModelConfig` of the same network; `config_to_hf(cfg, model_type)` writes one back. Each
supported `model_type` is one record in `hf_families.py` (its defaults and its translation
both ways); this module only looks the record up and checks the round trip.

Anything a config asks for that the model cannot express raises a ValueError naming the
key, its value and what is supported: a converted model is the same network or nothing.
Keys that do not change the network (token ids, `use_cache`, dropout rates, ...) are
ignored.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from modern_jax.config import MOE_FIELDS, NETWORK_FIELDS, ModelConfig, RopeScaling
from modern_jax.convert.hf_families import FAMILIES, SUPPORTED_MODEL_TYPES, Family
from modern_jax.convert.hf_keys import Reader, expand_pattern


def model_type_of(hf: dict[str, Any]) -> str:
    model_type = hf.get("model_type")
    if model_type not in FAMILIES:
        raise ValueError(
            f"Hugging Face model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return model_type


def family_of(hf: dict[str, Any]) -> Family:
    """The record of the family a Hugging Face `config.json` belongs to."""
    return FAMILIES[model_type_of(hf)]


def config_from_hf(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
    """The `ModelConfig` of the network a Hugging Face `config.json` describes.

    `overrides` set fields that are not the network itself (`config.NETWORK_FIELDS` are the
    others): dtype, param_dtype, vocab_pad_to, dropout, initialisation.
    """
    family = family_of(hf)
    reader = Reader(family.model_type, hf, family.defaults)
    fields = family.from_hf(reader)
    depth, held = overrides.get("mtp_depth", 0), family.mtp_layers(reader)
    if isinstance(depth, int) and depth > held:
        raise ValueError(f"mtp_depth={depth} loads that many multi-token-prediction layers, and this "
                         f"{family.model_type} config has {held} (num_nextn_predict_layers): use mtp_depth <= {held}")
    return ModelConfig(**{**fields, **overrides})


# ----- ModelConfig -> config.json ---------------------------------------------------

def architecture(cfg: ModelConfig) -> dict[str, Any]:
    """The fields that define the network, with derived sizes resolved and patterns spelled out per layer."""
    out = {k: v for k, v in cfg.to_dict().items() if k in NETWORK_FIELDS}  # not dtypes, initialisation, dropout
    out.update(n_kv_heads=cfg.num_kv_heads, head_dim=cfg.head_size, d_ff=cfg.ffn_width,
               attention_pattern=expand_pattern(cfg.attention_pattern, cfg.n_layers),
               rope_pattern=expand_pattern(cfg.rope_pattern, cfg.n_layers))
    out.pop("rope_fraction")
    out["rotary_dim"] = cfg.rotary_dim if cfg.position_embedding == "rope" else None
    if "L" not in out["attention_pattern"]:
        out["sliding_window"] = None
    if "G" not in out["attention_pattern"] and cfg.rope_local_theta is not None:  # only the local rope is used
        out.update(rope_theta=cfg.rope_local_theta, rope_local_theta=None, rope_scaling=dataclasses.asdict(RopeScaling()))
    if cfg.position_embedding != "learned":
        out["max_position_embeddings"] = None
    if cfg.position_embedding != "rope":  # no rotary layer: its settings are moot
        for k in ("rope_theta", "rope_layout", "rope_scaling", "rope_local_theta", "rope_pattern"):
            out.pop(k)
    if cfg.attention_type != "mla":
        for k in ("mla_rope_dim", "mla_nope_dim", "mla_v_dim"):
            out.pop(k)
    else:  # MLA's heads have their own sizes
        out.pop("head_dim")
    if cfg.ffn_type != "moe":
        for k in MOE_FIELDS:
            out.pop(k, None)
        return out
    # a mixture: which layers have experts, spelled out; the shared experts as the one FFN they run as
    specs = cfg.layer_specs()
    out.update(moe_pattern="".join("E" if s.moe else "D" for s in specs), expert_d_ff=cfg.expert_width,
               shared_width=cfg.shared_width)
    for k in ("moe_first_dense", "n_shared_experts", "shared_expert_d_ff"):
        out.pop(k)
    if all(s.moe for s in specs):  # no dense layer: its width is moot
        out["d_ff"] = None
    if cfg.expert_swiglu_limit is None:
        out.pop("expert_swiglu_alpha")
    if cfg.router_score == "topk_softmax":  # the k weights sum to 1 already
        out.pop("router_norm_topk")
    return out


def config_to_hf(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    """A Hugging Face `config.json` dict of `model_type` for the network `cfg`.

    Raises ValueError, listing the fields that differ, when `model_type` cannot express
    `cfg` (checked by reading the result back with `config_from_hf`).
    """
    family = FAMILIES.get(model_type)
    if family is not None and family.read_only:
        raise ValueError(f"config_to_hf: {family.read_only}")
    if family is None:
        written = [t for t, f in FAMILIES.items() if not f.read_only]
        raise ValueError(f"config_to_hf: model_type {model_type!r} is not supported; "
                         f"supported: {', '.join(written)}")
    try:
        hf = {"model_type": model_type, "architectures": [family.architecture], **family.to_hf(cfg),
              "torch_dtype": cfg.param_dtype}
        back = config_from_hf(hf, mtp_depth=cfg.mtp_depth)  # a family without MTP layers refuses them
    except ValueError as e:
        raise ValueError(f"config_to_hf: {model_type} cannot express this model: {e}") from e
    want, got = architecture(cfg), architecture(back)
    keys = list(want) + [k for k in got if k not in want]
    diff = [f"{k}={want.get(k, 'n/a')!r} (a {model_type} config gives {got.get(k, 'n/a')!r})"
            for k in keys if want.get(k, "n/a") != got.get(k, "n/a")]
    if diff:
        raise ValueError(f"config_to_hf: {model_type} cannot express this model: " + "; ".join(diff))
    return hf
