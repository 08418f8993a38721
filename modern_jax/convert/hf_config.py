"""Hugging Face `config.json` <-> `ModelConfig`.

`config_from_hf(hf)` reads a Hugging Face config dict (as in `config.json`) and returns the
`ModelConfig` of the same network; `config_to_hf(cfg, model_type)` writes one back.

Each supported `model_type` has one translation: the defaults of its Hugging Face config
class (a `config.json` may leave out any key whose value is the default; they mirror
transformers 5.x, which agree with 4.x for every key used here), then the `ModelConfig`
fields it sets. Both the 4.x keys (`rope_theta`, `rope_scaling`, `rotary_pct`, ...) and
the 5.x `rope_parameters` (flat, or nested by layer type) are read.

Anything a config asks for that the model cannot express raises a ValueError naming the
key, its value and what is supported: a converted model is the same network or nothing.
Keys that do not change the network (token ids, `use_cache`, dropout rates, ...) are
ignored.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from modern_jax.config import ModelConfig, RopeScaling

# the model types `config_from_hf` reads (gemma3: the text model inside a multimodal config)
SUPPORTED_MODEL_TYPES = (
    "llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "gemma3", "olmo2",
    "gpt2", "gpt_neox", "gptj", "phi",
)

# Hugging Face activation names -> ModelConfig.activation
HF_ACTIVATIONS = {
    "silu": "silu",
    "swish": "silu",
    "relu": "relu",
    "gelu": "gelu",
    "gelu_new": "gelu_tanh",
    "gelu_fast": "gelu_tanh",
    "gelu_pytorch_tanh": "gelu_tanh",
    "sigmoid": "sigmoid",
}
ACTIVATION_TO_HF = {"silu": "silu", "relu": "relu", "gelu": "gelu", "gelu_tanh": "gelu_pytorch_tanh",
                    "sigmoid": "sigmoid"}

ROPE_TYPES = ("default", "linear", "llama3", "yarn")
_ROPE_KEYS = {  # keys allowed in one rope_parameters / rope_scaling dict, by type
    "default": set(),
    "linear": {"factor"},
    "llama3": {"factor", "low_freq_factor", "high_freq_factor", "original_max_position_embeddings"},
    "yarn": {"factor", "original_max_position_embeddings", "beta_fast", "beta_slow", "mscale", "mscale_all_dim",
             "attention_factor", "truncate"},
}
_ROPE_COMMON_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}
LAYER_TYPES = {"full_attention": "G", "sliding_attention": "L"}

# The defaults of each family's Hugging Face config class.
_LLAMA_LIKE = dict(
    vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
    num_key_value_heads=None, head_dim=None, hidden_act="silu", max_position_embeddings=2048, rms_norm_eps=1e-6,
    tie_word_embeddings=False, attention_bias=False, mlp_bias=False, rope_theta=10000.0,
)
DEFAULTS: dict[str, dict[str, Any]] = {
    "llama": _LLAMA_LIKE,
    "mistral": {**_LLAMA_LIKE, "intermediate_size": 14336, "num_key_value_heads": 8,
                "max_position_embeddings": 131072, "sliding_window": 4096},
    "qwen2": {**_LLAMA_LIKE, "vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
              "max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": 4096,
              "max_window_layers": 28, "layer_types": None},
    "qwen3": {**_LLAMA_LIKE, "vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
              "head_dim": 128, "max_position_embeddings": 32768, "use_sliding_window": False,
              "sliding_window": 4096, "max_window_layers": 28, "layer_types": None},
    "gemma2": dict(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192,
        rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False, query_pre_attn_scalar=256,
        sliding_window=4096, layer_types=None, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
        rope_theta=10000.0, use_bidirectional_attention=None,
    ),
    "gemma3_text": dict(
        vocab_size=262208, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=131072,
        rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False, query_pre_attn_scalar=256,
        sliding_window=4096, layer_types=None, final_logit_softcapping=None, attn_logit_softcapping=None,
        rope_theta=1_000_000.0, rope_local_base_freq=10_000.0, sliding_window_pattern=6,
        use_bidirectional_attention=False,
    ),
    "olmo2": {**_LLAMA_LIKE, "vocab_size": 50304, "rms_norm_eps": 1e-5},
    "gpt2": dict(
        vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
        activation_function="gelu_new", layer_norm_epsilon=1e-5, scale_attn_weights=True,
        scale_attn_by_inverse_layer_idx=False, add_cross_attention=False, tie_word_embeddings=True,
    ),
    "gpt_neox": dict(
        vocab_size=50432, hidden_size=6144, num_hidden_layers=44, num_attention_heads=64, intermediate_size=24576,
        hidden_act="gelu", max_position_embeddings=2048, layer_norm_eps=1e-5, tie_word_embeddings=False,
        use_parallel_residual=True, attention_bias=True, rotary_pct=0.25, rotary_emb_base=10000.0,
    ),
    "gptj": dict(
        vocab_size=50400, n_positions=2048, n_embd=4096, n_layer=28, n_head=16, rotary_dim=64, n_inner=None,
        activation_function="gelu_new", layer_norm_epsilon=1e-5, tie_word_embeddings=False,
    ),
    "phi": dict(
        vocab_size=51200, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
        num_key_value_heads=None, hidden_act="gelu_new", max_position_embeddings=2048, layer_norm_eps=1e-5,
        tie_word_embeddings=False, qk_layernorm=False, partial_rotary_factor=0.5, rope_theta=10000.0,
    ),
}

# the Hugging Face class each model type loads as (written into `architectures`)
ARCHITECTURES = {
    "llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
    "qwen3": "Qwen3ForCausalLM", "gemma2": "Gemma2ForCausalLM", "gemma3_text": "Gemma3ForCausalLM",
    "olmo2": "Olmo2ForCausalLM", "gpt2": "GPT2LMHeadModel", "gpt_neox": "GPTNeoXForCausalLM",
    "gptj": "GPTJForCausalLM", "phi": "PhiForCausalLM",
}


def unsupported(model_type: str, key: str, value: Any, supported: str) -> ValueError:
    return ValueError(f"Hugging Face {model_type} config: {key}={value!r} is not supported ({supported})")


_KIND_NAMES = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}


def _same_kind(value: Any, default: Any) -> bool:
    """Whether a config.json value has the type of its family's default (an int passes for a float)."""
    if isinstance(default, bool) or isinstance(value, bool):
        return isinstance(value, bool) == isinstance(default, bool)
    if isinstance(default, float):
        return isinstance(value, (int, float))
    return not isinstance(default, (int, str)) or isinstance(value, type(default))


class _Reader:
    """One Hugging Face config with its family's defaults filled in."""

    def __init__(self, model_type: str, hf: dict[str, Any]):
        self.model_type, self.hf, self.defaults = model_type, hf, DEFAULTS[model_type]

    def __call__(self, key: str) -> Any:
        default = self.defaults.get(key)
        if key not in self.hf:
            return default
        value = self.hf[key]
        if value is not None and default is not None and not _same_kind(value, default):
            raise unsupported(self.model_type, key, value, f"expected {_KIND_NAMES[type(default)]}")
        return value

    def require(self, key: str, ok, supported: str) -> None:
        value = self(key)
        if not ok(value):
            raise unsupported(self.model_type, key, value, supported)

    def activation(self, key: str) -> str:
        name = self(key)
        if name not in HF_ACTIVATIONS:
            raise unsupported(self.model_type, key, name, f"supported: {', '.join(HF_ACTIVATIONS)}")
        return HF_ACTIVATIONS[name]

    def nested_rope(self) -> bool:
        """Whether `rope_parameters` is nested by layer type (transformers 5.x Gemma 3)."""
        params = self.hf.get("rope_parameters")
        return isinstance(params, dict) and bool(set(params) & set(LAYER_TYPES)) and all(
            params[k] is None or isinstance(params[k], dict) for k in params if k in LAYER_TYPES)

    def rope(self, layer_type: str = "full_attention", theta_key: str = "rope_theta",
             fraction_key: str = "partial_rotary_factor") -> tuple[float, RopeScaling, float]:
        """(theta, scaling, partial rotary factor) of the layers of `layer_type`.

        Reads `rope_parameters` (5.x) or `rope_scaling` (4.x); a value missing there comes
        from the top-level `theta_key` / `fraction_key` or the family's default.
        """
        params = self.hf.get("rope_parameters") or self.hf.get("rope_scaling") or {}
        if self.nested_rope():
            params = params.get(layer_type) or {}
        params = dict(params)
        kind = params.get("rope_type", params.get("type", "default"))
        theta = float(params.get("rope_theta", self(theta_key)))
        fraction = float(params.get("partial_rotary_factor", self(fraction_key) or 1.0))
        if kind not in ROPE_TYPES:
            raise unsupported(self.model_type, "rope_scaling.rope_type", kind, f"supported: {', '.join(ROPE_TYPES)}")
        extra = sorted(set(params) - _ROPE_COMMON_KEYS - _ROPE_KEYS[kind])
        if extra:
            raise unsupported(self.model_type, f"rope_scaling.{extra[0]}", params[extra[0]],
                              f"a {kind!r} rope takes {', '.join(sorted(_ROPE_KEYS[kind])) or 'no parameters'}")
        if kind == "default":
            return theta, RopeScaling(), fraction
        fields = {k: params[k] for k in _ROPE_KEYS[kind] if params.get(k) is not None}
        if kind in ("llama3", "yarn"):
            fields.setdefault("original_max_position_embeddings", self("max_position_embeddings"))
        if kind == "yarn" and "factor" not in fields:
            fields["factor"] = self("max_position_embeddings") / fields["original_max_position_embeddings"]
        if "factor" not in fields:
            raise unsupported(self.model_type, "rope_scaling.factor", None, f"a {kind!r} rope needs a factor")
        for key in ("factor", "low_freq_factor", "high_freq_factor", "beta_fast", "beta_slow"):
            if key in fields:
                fields[key] = float(fields[key])
        return theta, RopeScaling(type=kind, **fields), fraction

    def layer_pattern(self, n_layers: int) -> str:
        """`attention_pattern` from `layer_types`, shortest repeating unit first."""
        types = self("layer_types")
        if types is None:
            return "G"
        if len(types) != n_layers:
            raise unsupported(self.model_type, "layer_types", types, f"expected one entry per layer ({n_layers})")
        for t in types:
            if t not in LAYER_TYPES:
                raise unsupported(self.model_type, "layer_types", t, f"supported: {', '.join(LAYER_TYPES)}")
        return cycle_pattern("".join(LAYER_TYPES[t] for t in types))


def cycle_pattern(per_layer: str) -> str:
    """The shortest string whose cyclic repetition spells `per_layer`."""
    for period in range(1, len(per_layer) + 1):
        unit = per_layer[:period]
        if all(per_layer[i] == unit[i % period] for i in range(len(per_layer))):
            return unit
    return per_layer


def expand_pattern(pattern: str, n_layers: int) -> str:
    return "".join(pattern[i % len(pattern)] for i in range(n_layers))


def _sizes(r: _Reader, *, gqa: bool = True, head_dim: bool = True) -> dict:
    """Sizes of families keyed like Llama; `gqa` / `head_dim`: whether the family reads those keys."""
    for key in ("hidden_size", "num_attention_heads"):
        r.require(key, lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
                  "expected a positive integer")
    D, N = r("hidden_size"), r("num_attention_heads")
    K = r("num_key_value_heads") if gqa else None
    H = (r("head_dim") if head_dim else None) or D // N
    return dict(
        vocab_size=r("vocab_size"), d_model=D, n_layers=r("num_hidden_layers"), n_heads=N,
        n_kv_heads=K if K not in (None, N) else None, head_dim=H if H != D // N or D % N else None,
        max_position_embeddings=r("max_position_embeddings"),
    )


def _rope_fields(r: _Reader, layout: str = "half", **keys: str) -> dict:
    theta, scaling, fraction = r.rope(**keys)
    return dict(position_embedding="rope", rope_theta=theta, rope_scaling=scaling, rope_fraction=fraction,
                rope_layout=layout)


def _window(r: _Reader, pattern: str) -> dict:
    if "L" not in pattern:
        return dict(attention_pattern="G", sliding_window=None)
    window = r("sliding_window")
    if not isinstance(window, int) or window <= 0:
        raise unsupported(r.model_type, "sliding_window", window, "local layers need a positive window")
    return dict(attention_pattern=pattern, sliding_window=window)


def _llama_like(r: _Reader, *, qkv_bias=None, out_bias=None, pattern="G") -> dict:
    """Llama and its descendants: pre-norm RMSNorm, SwiGLU, RoPE; HF `post_attention_layernorm` is our
    `pre_feedforward_layernorm` (named by role)."""
    attention_bias = bool(r("attention_bias"))
    return dict(
        **_sizes(r), d_ff=r("intermediate_size"), norm_type="rmsnorm", norm_eps=float(r("rms_norm_eps")),
        norm_placement="pre", ffn_type="gated", activation=r.activation("hidden_act"), mlp_bias=bool(r("mlp_bias")),
        qkv_bias=attention_bias if qkv_bias is None else qkv_bias,
        out_bias=attention_bias if out_bias is None else out_bias,
        tie_embeddings=bool(r("tie_word_embeddings")), **_rope_fields(r), **_window(r, pattern),
    )


def _llama(r: _Reader) -> dict:
    return _llama_like(r)


def _mistral(r: _Reader) -> dict:
    # MistralAttention has no biases and applies `sliding_window` (when set) to every layer
    return _llama_like(r, qkv_bias=False, out_bias=False, pattern="L" if r("sliding_window") else "G") | dict(
        mlp_bias=False)


def _qwen_pattern(r: _Reader) -> str:
    n = r("num_hidden_layers")
    if not r("use_sliding_window"):  # HF sets sliding_window to None: every layer is global
        return "G"
    if r("layer_types") is not None:
        return r.layer_pattern(n)
    return cycle_pattern("".join("L" if i >= r("max_window_layers") else "G" for i in range(n)))


def _qwen2(r: _Reader) -> dict:
    # q, k, v always carry a bias, o never
    return _llama_like(r, qkv_bias=True, out_bias=False, pattern=_qwen_pattern(r)) | dict(mlp_bias=False)


def _qwen3(r: _Reader) -> dict:
    return _llama_like(r, pattern=_qwen_pattern(r)) | dict(mlp_bias=False, qk_norm="head")


def _gemma(r: _Reader, pattern: str) -> dict:
    r.require("use_bidirectional_attention", lambda v: not v, "only causal attention")
    bias = bool(r("attention_bias"))
    softcap = lambda v: None if v is None else float(v)  # noqa: E731
    return dict(
        **_sizes(r), d_ff=r("intermediate_size"), norm_type="gemma_rmsnorm", norm_eps=float(r("rms_norm_eps")),
        norm_placement="sandwich", ffn_type="gated", activation=r.activation("hidden_activation"),
        qkv_bias=bias, out_bias=bias, attn_scale=float(r("query_pre_attn_scalar")) ** -0.5,
        attn_softcap=softcap(r("attn_logit_softcapping")), final_softcap=softcap(r("final_logit_softcapping")),
        embed_scale=True, tie_embeddings=bool(r("tie_word_embeddings")), **_rope_fields(r), **_window(r, pattern),
    )


def _gemma2(r: _Reader) -> dict:
    n = r("num_hidden_layers")
    pattern = r.layer_pattern(n) if r("layer_types") is not None else cycle_pattern(expand_pattern("LG", n))
    return _gemma(r, pattern)


def _gemma3_text(r: _Reader) -> dict:
    n = r("num_hidden_layers")
    if r("layer_types") is not None:
        pattern = r.layer_pattern(n)
    else:
        period = r.hf.get("sliding_window_pattern") or r.hf.get("_sliding_window_pattern") or 6
        pattern = cycle_pattern("".join("G" if (i + 1) % period == 0 else "L" for i in range(n)))
    fields = _gemma(r, pattern) | dict(qk_norm="head")
    if "L" in pattern:  # local layers: the default rope with its own base, never scaled
        if r.nested_rope():
            local_theta, local_scaling, _ = r.rope("sliding_attention")
        else:  # 4.x: `rope_scaling` belongs to the global layers
            local_theta, local_scaling = float(r("rope_local_base_freq")), RopeScaling()
        if local_scaling.type != "none":
            raise unsupported(r.model_type, "rope_parameters.sliding_attention.rope_type", local_scaling.type,
                              "local layers take the default rope")
        fields["rope_local_theta"] = local_theta
    return fields


def _gemma3(hf: dict[str, Any]) -> dict:
    text = dict(hf.get("text_config") or {})
    if text.get("model_type", "gemma3_text") != "gemma3_text":
        raise unsupported("gemma3", "text_config.model_type", text.get("model_type"), "expected gemma3_text")
    text.setdefault("tie_word_embeddings", hf.get("tie_word_embeddings", True))
    return _gemma3_text(_Reader("gemma3_text", text))


def _olmo2(r: _Reader) -> dict:
    # x = x + Norm(F(x)) with HF's post_attention_layernorm / post_feedforward_layernorm; QK-norm over all heads
    return _llama_like(r) | dict(norm_placement="output", qk_norm="full", mlp_bias=False)


def _gpt2(r: _Reader) -> dict:
    r.require("scale_attn_by_inverse_layer_idx", lambda v: not v, "attention scaled by 1/sqrt(head_dim) or 1")
    r.require("add_cross_attention", lambda v: not v, "decoder-only models have no cross-attention")
    D = r("n_embd")
    return dict(
        vocab_size=r("vocab_size"), d_model=D, n_layers=r("n_layer"), n_heads=r("n_head"),
        d_ff=r("n_inner") or 4 * D, max_position_embeddings=r("n_positions"), norm_type="layernorm",
        norm_bias=True, norm_eps=float(r("layer_norm_epsilon")), norm_placement="pre", ffn_type="mlp",
        activation=r.activation("activation_function"), mlp_bias=True, qkv_bias=True, out_bias=True,
        position_embedding="learned", attn_scale=None if r("scale_attn_weights") else 1.0,
        tie_embeddings=bool(r("tie_word_embeddings")),
    )


def _gpt_neox(r: _Reader) -> dict:
    # use_parallel_residual: x + Attn(LN1(x)) + MLP(LN2(x)) (HF post_attention_layernorm is LN2, our
    # pre_feedforward_layernorm); otherwise an ordinary pre-norm block with the same two norms
    parallel, bias = bool(r("use_parallel_residual")), bool(r("attention_bias"))
    return dict(
        **_sizes(r, gqa=False, head_dim=False), d_ff=r("intermediate_size"), norm_type="layernorm", norm_bias=True,
        norm_eps=float(r("layer_norm_eps")), norm_placement="parallel" if parallel else "pre",
        parallel_shared_norm=not parallel, ffn_type="mlp", activation=r.activation("hidden_act"), mlp_bias=True,
        qkv_bias=bias, out_bias=bias, tie_embeddings=bool(r("tie_word_embeddings")),
        **_rope_fields(r, theta_key="rotary_emb_base", fraction_key="rotary_pct"),
    )


def _gptj(r: _Reader) -> dict:
    D, N = r("n_embd"), r("n_head")
    H, rotary = D // N, r("rotary_dim")
    if not isinstance(rotary, int) or not 0 < rotary <= H or rotary % 2 or int(H * (rotary / H)) != rotary:
        raise unsupported("gptj", "rotary_dim", rotary, f"an even number of features in (0, head_dim={H}]")
    return dict(
        vocab_size=r("vocab_size"), d_model=D, n_layers=r("n_layer"), n_heads=N, d_ff=r("n_inner") or 4 * D,
        max_position_embeddings=r("n_positions"), norm_type="layernorm", norm_bias=True,
        norm_eps=float(r("layer_norm_epsilon")), norm_placement="parallel", parallel_shared_norm=True,
        ffn_type="mlp", activation=r.activation("activation_function"), mlp_bias=True, head_bias=True,
        position_embedding="rope", rope_theta=10000.0, rope_layout="interleaved", rope_fraction=rotary / H,
        tie_embeddings=bool(r("tie_word_embeddings")),
    )


def _phi(r: _Reader) -> dict:
    return dict(
        **_sizes(r), d_ff=r("intermediate_size"), norm_type="layernorm", norm_bias=True,
        norm_eps=float(r("layer_norm_eps")), norm_placement="parallel", parallel_shared_norm=True, ffn_type="mlp",
        activation=r.activation("hidden_act"), mlp_bias=True, qkv_bias=True, out_bias=True, head_bias=True,
        qk_norm="head" if r("qk_layernorm") else "none", tie_embeddings=bool(r("tie_word_embeddings")),
        **_rope_fields(r),
    )


_FROM_HF = {
    "llama": _llama, "mistral": _mistral, "qwen2": _qwen2, "qwen3": _qwen3, "gemma2": _gemma2,
    "gemma3_text": _gemma3_text, "gemma3": _gemma3, "olmo2": _olmo2, "gpt2": _gpt2, "gpt_neox": _gpt_neox,
    "gptj": _gptj, "phi": _phi,
}


def model_type_of(hf: dict[str, Any]) -> str:
    model_type = hf.get("model_type")
    if model_type not in _FROM_HF:
        raise ValueError(
            f"Hugging Face model_type {model_type!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    return model_type


def config_from_hf(hf: dict[str, Any], **overrides: Any) -> ModelConfig:
    """The `ModelConfig` of the network a Hugging Face `config.json` describes.

    `overrides` set fields that do not change the network (dtype, param_dtype, remat, ...).
    """
    model_type = model_type_of(hf)
    if model_type == "gemma3":  # multimodal: the text model
        fields = _gemma3(hf)
    else:
        fields = _FROM_HF[model_type](_Reader(model_type, hf))
    return ModelConfig(**{**fields, **overrides})


# ----- ModelConfig -> config.json ---------------------------------------------------

# fields that do not change the network: not compared when checking a round trip
NON_ARCHITECTURE_FIELDS = ("dtype", "param_dtype", "scan_layers", "remat", "init", "init_std", "attn_dropout",
                           "resid_dropout", "ffn_multiple_of", "vocab_pad_to")  # and every "*_impl"


def architecture(cfg: ModelConfig) -> dict[str, Any]:
    """The fields that define the network, with derived sizes resolved and patterns spelled out per layer."""
    out = {k: v for k, v in cfg.to_dict().items() if k not in NON_ARCHITECTURE_FIELDS and not k.endswith("_impl")}
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
    return out


def _rope_scaling_to_hf(s: RopeScaling) -> dict | None:
    if s.type == "none":
        return None
    fields = {k: v for k, v in dataclasses.asdict(s).items() if k in _ROPE_KEYS[s.type] and v is not None}
    return {"rope_type": s.type, **fields}


def _layer_types(cfg: ModelConfig) -> list[str]:
    letters = {v: k for k, v in LAYER_TYPES.items()}
    return [letters[c] for c in expand_pattern(cfg.attention_pattern, cfg.n_layers)]


def _common_to_hf(cfg: ModelConfig) -> dict:
    return dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_size,
        intermediate_size=cfg.ffn_width, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_embeddings, initializer_range=cfg.init_std,
        attention_dropout=cfg.attn_dropout,
    )


def _llama_to_hf(cfg: ModelConfig, model_type: str) -> dict:
    out = _common_to_hf(cfg) | dict(
        hidden_act=ACTIVATION_TO_HF.get(cfg.activation, cfg.activation), rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta, rope_scaling=_rope_scaling_to_hf(cfg.rope_scaling),
    )
    if model_type in ("llama", "olmo2"):
        out.update(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)
    if model_type == "mistral":
        out["sliding_window"] = cfg.sliding_window
    if model_type in ("qwen2", "qwen3"):
        window = "L" in cfg.attention_pattern
        out.update(use_sliding_window=window, sliding_window=cfg.sliding_window if window else None,
                   max_window_layers=cfg.n_layers, layer_types=_layer_types(cfg))
        if window:  # qwen2 derives layer_types from max_window_layers: the first layer that is local
            out["max_window_layers"] = expand_pattern(cfg.attention_pattern, cfg.n_layers).index("L")
    if model_type == "qwen3":
        out["attention_bias"] = cfg.qkv_bias
    return out


def _gemma_to_hf(cfg: ModelConfig, model_type: str) -> dict:
    scalar = (cfg.attn_scale or cfg.head_size**-0.5) ** -2
    out = _common_to_hf(cfg) | dict(
        hidden_activation=ACTIVATION_TO_HF.get(cfg.activation, cfg.activation), rms_norm_eps=cfg.norm_eps,
        attention_bias=cfg.qkv_bias, query_pre_attn_scalar=round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar,
        attn_logit_softcapping=cfg.attn_softcap, final_logit_softcapping=cfg.final_softcap,
        sliding_window=cfg.sliding_window if "L" in cfg.attention_pattern else None, layer_types=_layer_types(cfg),
        rope_theta=cfg.rope_theta, rope_scaling=_rope_scaling_to_hf(cfg.rope_scaling),
    )
    if out["sliding_window"] is None:
        out["sliding_window"] = cfg.max_position_embeddings  # HF wants an int; no layer uses it
    if model_type == "gemma3_text":
        out["rope_local_base_freq"] = cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta
        period = len(cfg.attention_pattern)
        if cfg.attention_pattern == "L" * (period - 1) + "G":  # also readable by transformers < 4.53
            out["sliding_window_pattern"] = period
    return out


def _gpt2_to_hf(cfg: ModelConfig, model_type: str) -> dict:
    return dict(
        vocab_size=cfg.vocab_size, n_embd=cfg.d_model, n_layer=cfg.n_layers, n_head=cfg.n_heads,
        n_inner=cfg.ffn_width, n_positions=cfg.max_position_embeddings, layer_norm_epsilon=cfg.norm_eps,
        activation_function="gelu_new" if cfg.activation == "gelu_tanh" else cfg.activation,
        scale_attn_weights=cfg.attn_scale is None, tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_std, attn_pdrop=cfg.attn_dropout, resid_pdrop=cfg.resid_dropout, embd_pdrop=0.0,
    )


def _gpt_neox_to_hf(cfg: ModelConfig, model_type: str) -> dict:
    return dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, intermediate_size=cfg.ffn_width,
        max_position_embeddings=cfg.max_position_embeddings, hidden_act=ACTIVATION_TO_HF.get(cfg.activation),
        layer_norm_eps=cfg.norm_eps, use_parallel_residual=cfg.norm_placement == "parallel",
        attention_bias=cfg.qkv_bias, rotary_pct=cfg.rope_fraction, rotary_emb_base=cfg.rope_theta,
        rope_scaling=_rope_scaling_to_hf(cfg.rope_scaling), tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_std, attention_dropout=cfg.attn_dropout, hidden_dropout=cfg.resid_dropout,
    )


def _gptj_to_hf(cfg: ModelConfig, model_type: str) -> dict:
    return dict(
        vocab_size=cfg.vocab_size, n_embd=cfg.d_model, n_layer=cfg.n_layers, n_head=cfg.n_heads,
        n_inner=cfg.ffn_width, n_positions=cfg.max_position_embeddings, rotary_dim=cfg.rotary_dim,
        layer_norm_epsilon=cfg.norm_eps, activation_function="gelu_new" if cfg.activation == "gelu_tanh" else
        cfg.activation, tie_word_embeddings=cfg.tie_embeddings, initializer_range=cfg.init_std,
        attn_pdrop=cfg.attn_dropout, resid_pdrop=cfg.resid_dropout, embd_pdrop=0.0,
    )


def _phi_to_hf(cfg: ModelConfig, model_type: str) -> dict:
    out = _common_to_hf(cfg) | dict(
        hidden_act="gelu_new" if cfg.activation == "gelu_tanh" else cfg.activation, layer_norm_eps=cfg.norm_eps,
        partial_rotary_factor=cfg.rope_fraction, rope_theta=cfg.rope_theta,
        rope_scaling=_rope_scaling_to_hf(cfg.rope_scaling), qk_layernorm=cfg.qk_norm == "head",
        resid_pdrop=cfg.resid_dropout, embd_pdrop=0.0,
    )
    out.pop("head_dim")
    return out


_TO_HF = {
    "llama": _llama_to_hf, "mistral": _llama_to_hf, "qwen2": _llama_to_hf, "qwen3": _llama_to_hf,
    "olmo2": _llama_to_hf, "gemma2": _gemma_to_hf, "gemma3_text": _gemma_to_hf, "gpt2": _gpt2_to_hf,
    "gpt_neox": _gpt_neox_to_hf, "gptj": _gptj_to_hf, "phi": _phi_to_hf,
}


def config_to_hf(cfg: ModelConfig, model_type: str) -> dict[str, Any]:
    """A Hugging Face `config.json` dict of `model_type` for the network `cfg`.

    Raises ValueError, listing the fields that differ, when `model_type` cannot express
    `cfg` (checked by reading the result back with `config_from_hf`).
    """
    if model_type == "gemma3":
        raise ValueError("config_to_hf: a text-only model is written as model_type 'gemma3_text' "
                         "(a 'gemma3' checkpoint also holds a vision tower)")
    if model_type not in _TO_HF:
        raise ValueError(f"config_to_hf: model_type {model_type!r} is not supported; "
                         f"supported: {', '.join(_TO_HF)}")
    hf = {"model_type": model_type, "architectures": [ARCHITECTURES[model_type]],
          **_TO_HF[model_type](cfg, model_type), "torch_dtype": cfg.param_dtype}
    try:
        back = config_from_hf(hf)
    except ValueError as e:
        raise ValueError(f"config_to_hf: {model_type} cannot express this model: {e}") from e
    want, got = architecture(cfg), architecture(back)
    keys = list(want) + [k for k in got if k not in want]
    diff = [f"{k}={want.get(k, 'n/a')!r} (a {model_type} config gives {got.get(k, 'n/a')!r})"
            for k in keys if want.get(k, "n/a") != got.get(k, "n/a")]
    if diff:
        raise ValueError(f"config_to_hf: {model_type} cannot express this model: " + "; ".join(diff))
    return hf
