"""The Hugging Face families, one `Family` record per `model_type`.

A record holds everything particular to its family: the transformers class it loads as,
the defaults of its config class (they mirror transformers 5.x, which agree with 4.x for
every key used here), the translation of its `config.json` into `ModelConfig` fields and
back, and its tensor-name table. Families that share logic share the helpers and tables
below, not copies: Llama's descendants (mistral, qwen2, qwen3, olmo2) derive from Llama's,
Gemma 3 from Gemma 2's, and the mixtures of experts (qwen3_moe, mixtral, deepseek_v3,
gpt_oss, llama4_text) add a router and experts (per-expert or fused tensors) to attention
tables of the same kind. `hf_config.py` and `hf_checkpoint.py` read only these records;
the machinery they are written in is in `hf_keys.py` (config keys) and `hf_weights.py`
(tensor rules).

A translation raises `unsupported` (a ValueError naming the key, its value and what is
supported) for anything the model cannot express: a converted model is the same network
or nothing. Keys that do not change the network (token ids, `use_cache`, dropout rates,
...) are ignored.
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from modern_jax.config import ModelConfig, RopeScaling
from modern_jax.convert.hf_keys import (ACTIVATION_TO_HF, Reader, cycle_pattern, expand_pattern, layer_types_to_hf,
                                        rope_scaling_to_hf, unsupported)
from modern_jax.convert.hf_weights import (Rule, WeightTable, attention, experts, fused_experts, fused_qkv, gated_mlp,
                                           latent_attention, linear, mlp, norm, router, top_level)


@dataclass(frozen=True)
class Family:
    """One Hugging Face `model_type`."""

    model_type: str
    architecture: str | None  # the transformers class, written into `architectures`; None: never written
    defaults: Mapping[str, Any]  # of its config class: a config.json may leave out any of these keys
    from_hf: Callable[[Reader], dict[str, Any]]  # config.json (read with `defaults`) -> ModelConfig fields
    to_hf: Callable[[ModelConfig], dict[str, Any]] | None  # ModelConfig -> config.json keys; None: never written
    weights: WeightTable  # our parameter names -> its tensors
    read_only: str = ""  # why `config_to_hf` does not write this model_type
    # checkpoint tensors the network of a config does not use, skipped on loading: (regex, what they are)
    skipped: Callable[[Reader, ModelConfig], tuple[tuple[str, str], ...]] = lambda r, cfg: ()
    # how many multi-token-prediction layers a checkpoint holds (`ModelConfig.mtp_depth` loads that many at most)
    mtp_layers: Callable[[Reader], int] = lambda r: 0

    def __post_init__(self):
        object.__setattr__(self, "defaults", types.MappingProxyType(dict(self.defaults)))
        if (self.to_hf is None) != bool(self.read_only) or (self.to_hf is None) != (self.architecture is None):
            raise ValueError(f"Family {self.model_type}: a family is written (to_hf and architecture) or says why not "
                             f"(read_only)")


# ----- shared by families keyed like Llama ----------------------------------------------

def _sizes(r: Reader, *, gqa: bool = True, head_dim: bool = True) -> dict:
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


def _rope_fields(r: Reader, layout: str = "half", **keys: str) -> dict:
    theta, scaling, fraction = r.rope(**keys)
    return dict(position_embedding="rope", rope_theta=theta, rope_scaling=scaling, rope_fraction=fraction,
                rope_layout=layout)


def _window(r: Reader, pattern: str) -> dict:
    if "L" not in pattern:
        return dict(attention_pattern="G", sliding_window=None)
    window = r("sliding_window")
    if not isinstance(window, int) or window <= 0:
        raise unsupported(r.model_type, "sliding_window", window, "local layers need a positive window")
    return dict(attention_pattern=pattern, sliding_window=window)


def _common_to_hf(cfg: ModelConfig) -> dict:
    return dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_size,
        intermediate_size=cfg.ffn_width, max_position_embeddings=cfg.max_position_embeddings,
        tie_word_embeddings=cfg.tie_embeddings, initializer_range=cfg.init_std,
        attention_dropout=cfg.attn_dropout,
    )


L = "model.layers.{i}"
ROTARY_BUFFERS = (r"\.rotary_emb\.inv_freq$",)


# ----- Llama and its descendants: mistral, qwen2, qwen3, olmo2 ---------------------------

def _llama_like(r: Reader, *, qkv_bias=None, out_bias=None, pattern="G") -> dict:
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


def _llama_like_to_hf(cfg: ModelConfig) -> dict:
    return _common_to_hf(cfg) | dict(
        hidden_act=ACTIVATION_TO_HF.get(cfg.activation, cfg.activation), rms_norm_eps=cfg.norm_eps,
        rope_theta=cfg.rope_theta, rope_scaling=rope_scaling_to_hf(cfg.rope_scaling),
    )


def _llama_to_hf(cfg: ModelConfig) -> dict:
    return _llama_like_to_hf(cfg) | dict(attention_bias=cfg.qkv_bias, mlp_bias=cfg.mlp_bias)


LLAMA = Family(
    "llama", "LlamaForCausalLM",
    defaults=dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32, num_attention_heads=32,
        num_key_value_heads=None, head_dim=None, hidden_act="silu", max_position_embeddings=2048,
        rms_norm_eps=1e-6, tie_word_embeddings=False, attention_bias=False, mlp_bias=False, rope_theta=10000.0,
    ),
    from_hf=_llama_like, to_hf=_llama_to_hf,
    weights=WeightTable(
        top=top_level("model.embed_tokens", "model.norm", head_bias=False),
        layer={
            **norm(f"{L}.input_layernorm", "input_layernorm"),
            **norm(f"{L}.post_attention_layernorm", "pre_feedforward_layernorm"),  # by role: the FFN's input norm
            **attention(f"{L}.self_attn"),
            **norm(f"{L}.self_attn.q_norm", "self_attn.q_norm", "H"),
            **norm(f"{L}.self_attn.k_norm", "self_attn.k_norm", "H"),
            **gated_mlp(f"{L}.mlp"),
        },
        ignore=ROTARY_BUFFERS,
    ),
)


def _mistral(r: Reader) -> dict:
    # MistralAttention has no biases and applies `sliding_window` (when set) to every layer
    return _llama_like(r, qkv_bias=False, out_bias=False, pattern="L" if r("sliding_window") else "G") | dict(
        mlp_bias=False)


def _mistral_to_hf(cfg: ModelConfig) -> dict:
    return _llama_like_to_hf(cfg) | dict(sliding_window=cfg.sliding_window)


MISTRAL = Family(
    "mistral", "MistralForCausalLM",
    defaults={**LLAMA.defaults, "intermediate_size": 14336, "num_key_value_heads": 8,
              "max_position_embeddings": 131072, "sliding_window": 4096},
    from_hf=_mistral, to_hf=_mistral_to_hf, weights=LLAMA.weights,
)


def _qwen_pattern(r: Reader) -> str:
    n = r("num_hidden_layers")
    if not r("use_sliding_window"):  # HF sets sliding_window to None: every layer is global
        return "G"
    if r("layer_types") is not None:
        return r.layer_pattern(n)
    return cycle_pattern("".join("L" if i >= r("max_window_layers") else "G" for i in range(n)))


def _qwen2(r: Reader) -> dict:
    # q, k, v always carry a bias, o never
    return _llama_like(r, qkv_bias=True, out_bias=False, pattern=_qwen_pattern(r)) | dict(mlp_bias=False)


def _qwen2_to_hf(cfg: ModelConfig) -> dict:
    window = "L" in cfg.attention_pattern
    # qwen2 derives layer_types from max_window_layers: the first layer that is local
    first_local = expand_pattern(cfg.attention_pattern, cfg.n_layers).index("L") if window else cfg.n_layers
    return _llama_like_to_hf(cfg) | dict(
        use_sliding_window=window, sliding_window=cfg.sliding_window if window else None,
        max_window_layers=first_local, layer_types=layer_types_to_hf(cfg),
    )


_QWEN_DEFAULTS = {**LLAMA.defaults, "vocab_size": 151936, "intermediate_size": 22016, "num_key_value_heads": 32,
                  "max_position_embeddings": 32768, "use_sliding_window": False, "sliding_window": 4096,
                  "max_window_layers": 28, "layer_types": None}
QWEN2 = Family("qwen2", "Qwen2ForCausalLM", defaults=_QWEN_DEFAULTS, from_hf=_qwen2, to_hf=_qwen2_to_hf,
               weights=LLAMA.weights)


def _qwen3(r: Reader) -> dict:
    return _llama_like(r, pattern=_qwen_pattern(r)) | dict(mlp_bias=False, qk_norm="head")


def _qwen3_to_hf(cfg: ModelConfig) -> dict:
    return _qwen2_to_hf(cfg) | dict(attention_bias=cfg.qkv_bias)


QWEN3 = Family("qwen3", "Qwen3ForCausalLM", defaults={**_QWEN_DEFAULTS, "head_dim": 128}, from_hf=_qwen3,
               to_hf=_qwen3_to_hf, weights=LLAMA.weights)


def _olmo2(r: Reader) -> dict:
    # x = x + Norm(F(x)) with HF's post_attention_layernorm / post_feedforward_layernorm; QK-norm over all heads
    return _llama_like(r) | dict(norm_placement="output", qk_norm="full", mlp_bias=False)


OLMO2 = Family(
    "olmo2", "Olmo2ForCausalLM",
    defaults={**LLAMA.defaults, "vocab_size": 50304, "rms_norm_eps": 1e-5},
    from_hf=_olmo2, to_hf=_llama_to_hf,
    weights=WeightTable(
        top=LLAMA.weights.top,
        layer={
            **{k: v for k, v in LLAMA.weights.layer.items() if "layernorm" not in k},
            **norm(f"{L}.post_attention_layernorm", "post_attention_layernorm"),
            **norm(f"{L}.post_feedforward_layernorm", "post_feedforward_layernorm"),
            **norm(f"{L}.self_attn.q_norm", "self_attn.q_norm", "(N H)"),
            **norm(f"{L}.self_attn.k_norm", "self_attn.k_norm", "(K H)"),
        },
        ignore=ROTARY_BUFFERS,
    ),
)


# ----- Gemma 2 and 3 ---------------------------------------------------------------------

def _gemma(r: Reader, pattern: str) -> dict:
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


def _gemma2(r: Reader) -> dict:
    n = r("num_hidden_layers")
    pattern = r.layer_pattern(n) if r("layer_types") is not None else cycle_pattern(expand_pattern("LG", n))
    return _gemma(r, pattern)


def _gemma_to_hf(cfg: ModelConfig) -> dict:
    scalar = (cfg.attn_scale or cfg.head_size**-0.5) ** -2
    out = _common_to_hf(cfg) | dict(
        hidden_activation=ACTIVATION_TO_HF.get(cfg.activation, cfg.activation), rms_norm_eps=cfg.norm_eps,
        attention_bias=cfg.qkv_bias, query_pre_attn_scalar=round(scalar) if abs(scalar - round(scalar)) < 1e-6 else scalar,
        attn_logit_softcapping=cfg.attn_softcap, final_logit_softcapping=cfg.final_softcap,
        sliding_window=cfg.sliding_window if "L" in cfg.attention_pattern else None, layer_types=layer_types_to_hf(cfg),
        rope_theta=cfg.rope_theta, rope_scaling=rope_scaling_to_hf(cfg.rope_scaling),
    )
    if out["sliding_window"] is None:
        out["sliding_window"] = cfg.max_position_embeddings  # HF wants an int; no layer uses it
    return out


GEMMA2 = Family(
    "gemma2", "Gemma2ForCausalLM",
    defaults=dict(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26, num_attention_heads=8,
        num_key_value_heads=4, head_dim=256, hidden_activation="gelu_pytorch_tanh", max_position_embeddings=8192,
        rms_norm_eps=1e-6, tie_word_embeddings=True, attention_bias=False, query_pre_attn_scalar=256,
        sliding_window=4096, layer_types=None, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
        rope_theta=10000.0, use_bidirectional_attention=None,
    ),
    from_hf=_gemma2, to_hf=_gemma_to_hf,
    weights=WeightTable(
        top=LLAMA.weights.top,
        layer={
            **LLAMA.weights.layer,
            **norm(f"{L}.post_attention_layernorm", "post_attention_layernorm"),
            **norm(f"{L}.pre_feedforward_layernorm", "pre_feedforward_layernorm"),
            **norm(f"{L}.post_feedforward_layernorm", "post_feedforward_layernorm"),
        },
        ignore=ROTARY_BUFFERS,
    ),
)


def _gemma3_text(r: Reader) -> dict:
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


def _gemma3_text_to_hf(cfg: ModelConfig) -> dict:
    out = _gemma_to_hf(cfg)
    out["rope_local_base_freq"] = cfg.rope_local_theta if cfg.rope_local_theta is not None else cfg.rope_theta
    period = len(cfg.attention_pattern)
    if cfg.attention_pattern == "L" * (period - 1) + "G":  # also readable by transformers < 4.53
        out["sliding_window_pattern"] = period
    return out


GEMMA3_TEXT = Family(
    "gemma3_text", "Gemma3ForCausalLM",
    defaults={**GEMMA2.defaults, "vocab_size": 262208, "max_position_embeddings": 131072,
              "final_logit_softcapping": None, "attn_logit_softcapping": None, "rope_theta": 1_000_000.0,
              "rope_local_base_freq": 10_000.0, "sliding_window_pattern": 6, "use_bidirectional_attention": False},
    from_hf=_gemma3_text, to_hf=_gemma3_text_to_hf, weights=GEMMA2.weights,
)


def _gemma3(r: Reader) -> dict:
    """A multimodal Gemma 3 config: its text model."""
    text = dict(r.hf.get("text_config") or {})
    if text.get("model_type", "gemma3_text") != "gemma3_text":
        raise unsupported("gemma3", "text_config.model_type", text.get("model_type"), "expected gemma3_text")
    text.setdefault("tie_word_embeddings", r.hf.get("tie_word_embeddings", True))
    return _gemma3_text(Reader("gemma3_text", text, GEMMA3_TEXT.defaults))


# a multimodal Gemma 3 checkpoint: the text model under another prefix, a vision tower to skip
GEMMA3 = Family(
    "gemma3", None, defaults={},  # its text_config is read with gemma3_text's defaults
    from_hf=_gemma3, to_hf=None,
    weights=dataclasses.replace(
        GEMMA3_TEXT.weights,
        aliases=((r"^language_model\.model\.", "model."), (r"^model\.language_model\.", "model."),
                 (r"^language_model\.lm_head\.", "lm_head.")),
        ignore=ROTARY_BUFFERS + (r"^(model\.)?(vision_tower|multi_modal_projector)\.",),
    ),
    read_only="a text-only model is written as model_type 'gemma3_text' (a 'gemma3' checkpoint also holds a "
              "vision tower)",
)


# ----- GPT-2 and GPT-J (their blocks are `transformer.h.{i}`) ----------------------------

T = "transformer.h.{i}"


def _gpt2(r: Reader) -> dict:
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


def _gpt2_to_hf(cfg: ModelConfig) -> dict:
    return dict(
        vocab_size=cfg.vocab_size, n_embd=cfg.d_model, n_layer=cfg.n_layers, n_head=cfg.n_heads,
        n_inner=cfg.ffn_width, n_positions=cfg.max_position_embeddings, layer_norm_epsilon=cfg.norm_eps,
        activation_function="gelu_new" if cfg.activation == "gelu_tanh" else cfg.activation,
        scale_attn_weights=cfg.attn_scale is None, tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_std, attn_pdrop=cfg.attn_dropout, resid_pdrop=cfg.resid_dropout, embd_pdrop=0.0,
    )


GPT2 = Family(
    "gpt2", "GPT2LMHeadModel",
    defaults=dict(
        vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=None,
        activation_function="gelu_new", layer_norm_epsilon=1e-5, scale_attn_weights=True,
        scale_attn_by_inverse_layer_idx=False, add_cross_attention=False, tie_word_embeddings=True,
    ),
    from_hf=_gpt2, to_hf=_gpt2_to_hf,
    weights=WeightTable(
        top={
            **top_level("transformer.wte", "transformer.ln_f", head_bias=False),
            "embed_positions": Rule("transformer.wpe.weight", "T D", "T D"),
        },
        layer={
            **norm(f"{T}.ln_1", "input_layernorm"),
            **norm(f"{T}.ln_2", "pre_feedforward_layernorm"),
            **fused_qkv(f"{T}.attn.c_attn", "D (3 N H)", "(3 N H)"),  # Conv1D: [in, out]
            "self_attn.o_proj.kernel": Rule(f"{T}.attn.c_proj.weight", "(N H) D", "N H D"),
            "self_attn.o_proj.bias": Rule(f"{T}.attn.c_proj.bias", "D", "D"),
            "mlp.up_proj.kernel": Rule(f"{T}.mlp.c_fc.weight", "D F", "D F"),
            "mlp.up_proj.bias": Rule(f"{T}.mlp.c_fc.bias", "F", "F"),
            "mlp.down_proj.kernel": Rule(f"{T}.mlp.c_proj.weight", "F D", "F D"),
            "mlp.down_proj.bias": Rule(f"{T}.mlp.c_proj.bias", "D", "D"),
        },
        aliases=((r"^(h\.\d+\.|wte\.|wpe\.|ln_f\.)", r"transformer.\1"),),  # the hub's gpt2 has no prefix
        ignore=(r"\.attn\.(masked_)?bias$",),  # causal-mask buffers of old checkpoints
    ),
)


def _gptj(r: Reader) -> dict:
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


def _gptj_to_hf(cfg: ModelConfig) -> dict:
    return dict(
        vocab_size=cfg.vocab_size, n_embd=cfg.d_model, n_layer=cfg.n_layers, n_head=cfg.n_heads,
        n_inner=cfg.ffn_width, n_positions=cfg.max_position_embeddings, rotary_dim=cfg.rotary_dim,
        layer_norm_epsilon=cfg.norm_eps, activation_function="gelu_new" if cfg.activation == "gelu_tanh" else
        cfg.activation, tie_word_embeddings=cfg.tie_embeddings, initializer_range=cfg.init_std,
        attn_pdrop=cfg.attn_dropout, resid_pdrop=cfg.resid_dropout, embd_pdrop=0.0,
    )


GPTJ = Family(
    "gptj", "GPTJForCausalLM",
    defaults=dict(
        vocab_size=50400, n_positions=2048, n_embd=4096, n_layer=28, n_head=16, rotary_dim=64, n_inner=None,
        activation_function="gelu_new", layer_norm_epsilon=1e-5, tie_word_embeddings=False,
    ),
    from_hf=_gptj, to_hf=_gptj_to_hf,
    weights=WeightTable(
        top=top_level("transformer.wte", "transformer.ln_f"),
        layer={
            **norm(f"{T}.ln_1", "input_layernorm"),
            **attention(f"{T}.attn", o_name="out_proj"),
            **mlp(f"{T}.mlp", "fc_in", "fc_out"),
        },
        ignore=(r"\.attn\.(masked_)?bias$",),
    ),
)


# ----- GPT-NeoX --------------------------------------------------------------------------

def _gpt_neox(r: Reader) -> dict:
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


def _gpt_neox_to_hf(cfg: ModelConfig) -> dict:
    return dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, intermediate_size=cfg.ffn_width,
        max_position_embeddings=cfg.max_position_embeddings, hidden_act=ACTIVATION_TO_HF.get(cfg.activation),
        layer_norm_eps=cfg.norm_eps, use_parallel_residual=cfg.norm_placement == "parallel",
        attention_bias=cfg.qkv_bias, rotary_pct=cfg.rope_fraction, rotary_emb_base=cfg.rope_theta,
        rope_scaling=rope_scaling_to_hf(cfg.rope_scaling), tie_word_embeddings=cfg.tie_embeddings,
        initializer_range=cfg.init_std, attention_dropout=cfg.attn_dropout, hidden_dropout=cfg.resid_dropout,
    )


X = "gpt_neox.layers.{i}"
GPT_NEOX = Family(
    "gpt_neox", "GPTNeoXForCausalLM",
    defaults=dict(
        vocab_size=50432, hidden_size=6144, num_hidden_layers=44, num_attention_heads=64, intermediate_size=24576,
        hidden_act="gelu", max_position_embeddings=2048, layer_norm_eps=1e-5, tie_word_embeddings=False,
        use_parallel_residual=True, attention_bias=True, rotary_pct=0.25, rotary_emb_base=10000.0,
    ),
    from_hf=_gpt_neox, to_hf=_gpt_neox_to_hf,
    weights=WeightTable(
        top=top_level("gpt_neox.embed_in", "gpt_neox.final_layer_norm", "embed_out", head_bias=False),
        layer={
            **norm(f"{X}.input_layernorm", "input_layernorm"),
            **norm(f"{X}.post_attention_layernorm", "pre_feedforward_layernorm"),  # by role: the FFN's input norm
            **fused_qkv(f"{X}.attention.query_key_value", "(N 3 H) D", "(N 3 H)"),  # per head: q, k, v
            **linear(f"{X}.attention.dense", "self_attn.o_proj", "D", "(N H)", "N H", "D"),
            **mlp(f"{X}.mlp", "dense_h_to_4h", "dense_4h_to_h"),
        },
        ignore=(r"\.attention\.(masked_)?bias$", r"\.rotary_emb\.inv_freq$"),
    ),
)


# ----- Phi -------------------------------------------------------------------------------

def _phi(r: Reader) -> dict:
    return dict(
        **_sizes(r), d_ff=r("intermediate_size"), norm_type="layernorm", norm_bias=True,
        norm_eps=float(r("layer_norm_eps")), norm_placement="parallel", parallel_shared_norm=True, ffn_type="mlp",
        activation=r.activation("hidden_act"), mlp_bias=True, qkv_bias=True, out_bias=True, head_bias=True,
        qk_norm="head" if r("qk_layernorm") else "none", tie_embeddings=bool(r("tie_word_embeddings")),
        **_rope_fields(r),
    )


def _phi_to_hf(cfg: ModelConfig) -> dict:
    out = _common_to_hf(cfg) | dict(
        hidden_act="gelu_new" if cfg.activation == "gelu_tanh" else cfg.activation, layer_norm_eps=cfg.norm_eps,
        partial_rotary_factor=cfg.rope_fraction, rope_theta=cfg.rope_theta,
        rope_scaling=rope_scaling_to_hf(cfg.rope_scaling), qk_layernorm=cfg.qk_norm == "head",
        resid_pdrop=cfg.resid_dropout, embd_pdrop=0.0,
    )
    out.pop("head_dim")
    return out


PHI = Family(
    "phi", "PhiForCausalLM",
    defaults=dict(
        vocab_size=51200, hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
        num_key_value_heads=None, hidden_act="gelu_new", max_position_embeddings=2048, layer_norm_eps=1e-5,
        tie_word_embeddings=False, qk_layernorm=False, partial_rotary_factor=0.5, rope_theta=10000.0,
    ),
    from_hf=_phi, to_hf=_phi_to_hf,
    weights=WeightTable(
        top=top_level("model.embed_tokens", "model.final_layernorm"),
        layer={
            **norm(f"{L}.input_layernorm", "input_layernorm"),
            **attention(f"{L}.self_attn", o_name="dense"),
            **norm(f"{L}.self_attn.q_layernorm", "self_attn.q_norm", "H"),
            **norm(f"{L}.self_attn.k_layernorm", "self_attn.k_norm", "H"),
            **mlp(f"{L}.mlp", "fc1", "fc2"),
        },
        ignore=ROTARY_BUFFERS,
    ),
)


# ----- mixtures of experts: qwen3_moe, mixtral, deepseek_v3, gpt_oss, llama4_text -----------

def _moe(per_layer: list[bool], d_ff: int, **fields) -> dict:
    """The FFN fields of a model whose layers have experts (`per_layer` True) or a dense gated FFN of
    width `d_ff`; `fields` are the mixture's. Leading dense layers followed only by mixtures are
    `moe_first_dense`, any other arrangement a `moe_pattern`; no mixture at all is a dense model."""
    if not any(per_layer):
        return dict(ffn_type="gated", d_ff=d_ff)
    first = per_layer.index(True)
    if all(per_layer[first:]):
        layout = dict(moe_first_dense=first, moe_pattern="E")
    else:
        layout = dict(moe_pattern=cycle_pattern("".join("E" if m else "D" for m in per_layer)))
    return dict(ffn_type="moe", d_ff=d_ff, **layout, **fields)


def _moe_layers(cfg: ModelConfig) -> list[int]:
    return [i for i, spec in enumerate(cfg.layer_specs()) if spec.moe]


def _aliased(r: Reader, key: str, alias: str) -> Any:
    """A key transformers also accepts under another name (its config's `attribute_map`)."""
    return r(alias) if alias in r.hf and key not in r.hf else r(key)


def _qwen3_moe(r: Reader) -> dict:
    # QK-norm attention as Qwen3's; `use_sliding_window` slides every layer (max_window_layers is not read)
    n, step = r("num_hidden_layers"), r("decoder_sparse_step")
    r.require("decoder_sparse_step", lambda v: isinstance(v, int) and v > 0, "a positive layer interval")
    dense, n_experts = r.layer_indices("mlp_only_layers", n), _aliased(r, "num_experts", "num_local_experts")
    per_layer = [i not in dense and (n_experts or 0) > 0 and (i + 1) % step == 0 for i in range(n)]
    return _llama_like(r, pattern="L" if r("use_sliding_window") else "G") | dict(mlp_bias=False, qk_norm="head") | _moe(
        per_layer, r("intermediate_size"), n_experts=n_experts, experts_per_token=r("num_experts_per_tok"),
        expert_d_ff=r("moe_intermediate_size"), router_score="softmax", router_norm_topk=bool(r("norm_topk_prob")))


def _qwen3_moe_to_hf(cfg: ModelConfig) -> dict:
    window, moe = "L" in cfg.attention_pattern, _moe_layers(cfg)
    return _llama_like_to_hf(cfg) | dict(
        attention_bias=cfg.qkv_bias, use_sliding_window=window, sliding_window=cfg.sliding_window if window else None,
        num_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token, moe_intermediate_size=cfg.expert_width,
        norm_topk_prob=cfg.router_norm_topk, decoder_sparse_step=1,
        mlp_only_layers=[i for i in range(cfg.n_layers) if i not in moe],
    )


QWEN3_MOE = Family(
    "qwen3_moe", "Qwen3MoeForCausalLM",
    defaults=dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, num_hidden_layers=24, num_attention_heads=32,
        num_key_value_heads=4, head_dim=None, hidden_act="silu", max_position_embeddings=32768, rms_norm_eps=1e-6,
        tie_word_embeddings=False, attention_bias=False, rope_theta=10000.0, use_sliding_window=False,
        sliding_window=4096, decoder_sparse_step=1, moe_intermediate_size=768, num_experts_per_tok=8,
        num_experts=128, norm_topk_prob=False, mlp_only_layers=None,
    ),
    from_hf=_qwen3_moe, to_hf=_qwen3_moe_to_hf,
    weights=WeightTable(
        top=LLAMA.weights.top,
        layer={**LLAMA.weights.layer, **router(f"{L}.mlp.gate"), **experts(f"{L}.mlp.experts")},
        ignore=ROTARY_BUFFERS,
    ),
)


def _mixtral(r: Reader) -> dict:
    # Mistral's attention; every layer a mixture whose experts are `intermediate_size` wide; the k
    # softmax weights renormalised (the same as a softmax over the k chosen logits)
    return _mistral(r) | _moe(
        [True] * r("num_hidden_layers"), r("intermediate_size"), n_experts=_aliased(r, "num_local_experts", "num_experts"),
        experts_per_token=r("num_experts_per_tok"), router_score="softmax", router_norm_topk=True)


def _mixtral_to_hf(cfg: ModelConfig) -> dict:
    return _mistral_to_hf(cfg) | dict(intermediate_size=cfg.expert_width, num_local_experts=cfg.n_experts,
                                      num_experts_per_tok=cfg.experts_per_token)


MIXTRAL = Family(
    "mixtral", "MixtralForCausalLM",
    defaults={**MISTRAL.defaults, "rms_norm_eps": 1e-5, "rope_theta": 1_000_000.0, "sliding_window": None,
              "num_local_experts": 8, "num_experts_per_tok": 2},
    from_hf=_mixtral, to_hf=_mixtral_to_hf,
    weights=WeightTable(
        top=LLAMA.weights.top,
        layer={
            **norm(f"{L}.input_layernorm", "input_layernorm"),
            **norm(f"{L}.post_attention_layernorm", "pre_feedforward_layernorm"),
            **attention(f"{L}.self_attn"),
            **router(f"{L}.block_sparse_moe.gate"),
            **experts(f"{L}.block_sparse_moe.experts", gate="w1", up="w3", down="w2"),
        },
        ignore=ROTARY_BUFFERS,
    ),
)


def _deepseek_v3(r: Reader) -> dict:
    """MLA, then a dense FFN on the first `first_k_dense_replace` layers and a mixture on the rest:
    sigmoid scores, chosen with the selection bias (`e_score_correction_bias`) among the best
    `topk_group` of `n_group` groups, plus the shared experts. transformers reads neither
    `scoring_func` nor `topk_method` (it is always sigmoid, noaux_tc), and neither do we."""
    for key in ("hidden_size", "num_attention_heads", "num_hidden_layers"):
        r.require(key, lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0, "expected a positive integer")
    n, N = r("num_hidden_layers"), r("num_attention_heads")
    r.require("num_key_value_heads", lambda v: v in (None, N),
              f"MLA expands one latent into every head: num_key_value_heads equals num_attention_heads={N}")
    r.require("attention_bias", lambda v: not v, "the model's latent attention has no biases")
    r.require("rms_norm_eps", lambda v: v == 1e-6,
              "the latent norms (q_a_layernorm, kv_a_layernorm) use 1e-6, and the model has one epsilon")
    theta, scaling, _ = r.rope()
    first_dense = r("first_k_dense_replace") or 0
    return dict(
        vocab_size=r("vocab_size"), d_model=r("hidden_size"), n_layers=n, n_heads=N,
        max_position_embeddings=r("max_position_embeddings"), attention_type="mla", mla_kv_rank=r("kv_lora_rank"),
        mla_q_rank=r("q_lora_rank") or 0, mla_rope_dim=r("qk_rope_head_dim"), mla_nope_dim=r("qk_nope_head_dim"),
        mla_v_dim=r("v_head_dim"), position_embedding="rope", rope_theta=theta, rope_scaling=scaling,
        # interleaved pairs (x0, x1), (x2, x3), ... rotated; transformers then de-interleaves q and k alike,
        # which leaves q.k as it is
        rope_layout="interleaved" if r("rope_interleave") else "half",
        norm_type="rmsnorm", norm_eps=float(r("rms_norm_eps")), norm_placement="pre",
        activation=r.activation("hidden_act"), tie_embeddings=bool(r("tie_word_embeddings")),
        **_moe([i >= first_dense for i in range(n)], r("intermediate_size"),
               n_experts=_aliased(r, "n_routed_experts", "num_local_experts"),
               experts_per_token=r("num_experts_per_tok"), expert_d_ff=r("moe_intermediate_size"),
               n_shared_experts=r("n_shared_experts") or 0, router_score="sigmoid", router_selection_bias=True,
               router_groups=r("n_group") or 1, router_topk_groups=r("topk_group") or 1,
               router_norm_topk=bool(r("norm_topk_prob")), router_scale=float(r("routed_scaling_factor"))),
    )


def _deepseek_v3_to_hf(cfg: ModelConfig) -> dict:
    moe, F = _moe_layers(cfg), cfg.expert_width
    return dict(
        vocab_size=cfg.vocab_size, hidden_size=cfg.d_model, num_hidden_layers=cfg.n_layers,
        num_attention_heads=cfg.n_heads, num_key_value_heads=cfg.n_heads,
        max_position_embeddings=cfg.max_position_embeddings, intermediate_size=cfg.ffn_width,
        moe_intermediate_size=F, n_routed_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token,
        n_shared_experts=cfg.shared_width // F, first_k_dense_replace=moe[0] if moe else cfg.n_layers,
        n_group=cfg.router_groups, topk_group=cfg.router_topk_groups, norm_topk_prob=cfg.router_norm_topk,
        routed_scaling_factor=cfg.router_scale, topk_method="noaux_tc", scoring_func="sigmoid",
        kv_lora_rank=cfg.mla_kv_rank, q_lora_rank=cfg.mla_q_rank or None, qk_rope_head_dim=cfg.mla_rope_dim,
        qk_nope_head_dim=cfg.mla_nope_dim, v_head_dim=cfg.mla_v_dim, rope_interleave=cfg.rope_layout == "interleaved",
        rope_theta=cfg.rope_theta, rope_scaling=rope_scaling_to_hf(cfg.rope_scaling), rms_norm_eps=cfg.norm_eps,
        hidden_act=ACTIVATION_TO_HF.get(cfg.activation, cfg.activation), attention_bias=False,
        tie_word_embeddings=cfg.tie_embeddings, initializer_range=cfg.init_std, attention_dropout=cfg.attn_dropout,
        num_nextn_predict_layers=cfg.mtp_depth,  # the multi-token-prediction layers the model has
    )


def _deepseek_mtp(r: Reader) -> int:
    return _aliased(r, "num_nextn_predict_layers", "num_mtp_layers") or 0


def _mtp_layers(r: Reader, cfg: ModelConfig) -> tuple[tuple[str, str], ...]:
    """DeepSeek's multi-token-prediction layers, saved as `model.layers.{n + k}.*` past the last decoder
    layer, that the model does not have (all of them unless `mtp_depth` is set): transformers'
    DeepseekV3ForCausalLM does not build them either."""
    n, mtp = r("num_hidden_layers"), _deepseek_mtp(r)
    layers = "|".join(str(n + k) for k in range(cfg.mtp_depth, mtp))
    if not layers:
        return ()
    return ((rf"^model\.layers\.({layers})\.", f"the multi-token-prediction layer (num_nextn_predict_layers={mtp})"),)


DEEPSEEK_V3 = Family(
    "deepseek_v3", "DeepseekV3ForCausalLM",
    defaults=dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048,
        num_hidden_layers=61, num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1,
        n_routed_experts=256, routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64,
        v_head_dim=128, qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8,
        first_k_dense_replace=3, norm_topk_prob=True, hidden_act="silu", max_position_embeddings=4096,
        rms_norm_eps=1e-6, tie_word_embeddings=False, rope_theta=10000.0, rope_interleave=True, attention_bias=False,
        num_nextn_predict_layers=1,
    ),
    from_hf=_deepseek_v3, to_hf=_deepseek_v3_to_hf,
    weights=WeightTable(
        top=LLAMA.weights.top,
        layer={
            **norm(f"{L}.input_layernorm", "input_layernorm"),
            **norm(f"{L}.post_attention_layernorm", "pre_feedforward_layernorm"),
            **latent_attention(f"{L}.self_attn"),
            **gated_mlp(f"{L}.mlp"),  # the first dense layers
            **router(f"{L}.mlp.gate"),
            "mlp.router.selection_bias": Rule(f"{L}.mlp.gate.e_score_correction_bias", "E", "E"),
            **experts(f"{L}.mlp.experts"),
            **gated_mlp(f"{L}.mlp.shared_experts", "mlp.shared_experts"),
        },
        ignore=ROTARY_BUFFERS,
        # DeepSeek-V3's layer n + k: its block under the layer's names, and these (`shared_head.norm` the module's
        # final norm); `embed_tokens` and `shared_head.head` are the main model's, saved again in each MTP layer
        mtp={**norm(f"{L}.enorm", "enorm"), **norm(f"{L}.hnorm", "hnorm"),
             "eh_proj.kernel": Rule(f"{L}.eh_proj.weight", "D W", "W D"), **norm(f"{L}.shared_head.norm", "head_norm")},
        mtp_copies={f"{L}.embed_tokens.weight": "model.embed_tokens.weight",
                    f"{L}.shared_head.head.weight": "lm_head.weight"},
    ),
    skipped=_mtp_layers,
    mtp_layers=_deepseek_mtp,
)

# GptOssConfig's rope when a config.json names none
_GPT_OSS_ROPE = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
                 "original_max_position_embeddings": 4096}


def _gpt_oss(r: Reader) -> dict:
    """Biased attention with a sink per head, sliding / full layers (`layer_types`, by default layer 0
    slides), and a mixture on every layer: the softmax of the k best biased logits, experts with
    biases and the clamped SwiGLU (it ignores `hidden_act`)."""
    if not (r.hf.get("rope_parameters") or r.hf.get("rope_scaling")):
        r = Reader(r.model_type, {**r.hf, "rope_parameters": dict(_GPT_OSS_ROPE)}, r.defaults)
    n, bias = r("num_hidden_layers"), bool(r("attention_bias"))
    pattern = r.layer_pattern(n) if r("layer_types") is not None else cycle_pattern(expand_pattern("LG", n))
    return dict(
        **_sizes(r), norm_type="rmsnorm", norm_eps=float(r("rms_norm_eps")), norm_placement="pre",
        qkv_bias=bias, out_bias=bias, attention_sinks=True, tie_embeddings=bool(r("tie_word_embeddings")),
        **_rope_fields(r), **_window(r, pattern),
        **_moe([True] * n, r("intermediate_size"), n_experts=_aliased(r, "num_local_experts", "num_experts"),
               experts_per_token=r("num_experts_per_tok"), router_score="topk_softmax", router_bias=True,
               expert_bias=True, expert_swiglu_limit=float(r("swiglu_limit")),
               expert_swiglu_alpha=float(r("swiglu_alpha"))),
    )


def _gpt_oss_to_hf(cfg: ModelConfig) -> dict:
    window = "L" in cfg.attention_pattern
    return _common_to_hf(cfg) | dict(
        intermediate_size=cfg.expert_width, num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token,
        rms_norm_eps=cfg.norm_eps, attention_bias=cfg.qkv_bias, hidden_act="silu",
        sliding_window=cfg.sliding_window if window else None, layer_types=layer_types_to_hf(cfg),
        swiglu_limit=cfg.expert_swiglu_limit, swiglu_alpha=cfg.expert_swiglu_alpha, rope_theta=cfg.rope_theta,
        # without one, transformers gives gpt-oss its YaRN rope
        rope_scaling=rope_scaling_to_hf(cfg.rope_scaling) or {"rope_type": "default"},
    )


GPT_OSS = Family(
    "gpt_oss", "GptOssForCausalLM",
    defaults=dict(
        vocab_size=201088, hidden_size=2880, intermediate_size=2880, num_hidden_layers=36, num_attention_heads=64,
        num_key_value_heads=8, head_dim=64, max_position_embeddings=131072, rms_norm_eps=1e-5,
        tie_word_embeddings=False, attention_bias=True, sliding_window=128, layer_types=None, rope_theta=150000.0,
        num_local_experts=128, num_experts_per_tok=4, swiglu_limit=7.0, swiglu_alpha=1.702,
    ),
    from_hf=_gpt_oss, to_hf=_gpt_oss_to_hf,
    weights=WeightTable(
        top=LLAMA.weights.top,
        layer={
            **norm(f"{L}.input_layernorm", "input_layernorm"),
            **norm(f"{L}.post_attention_layernorm", "pre_feedforward_layernorm"),
            **attention(f"{L}.self_attn"),
            "self_attn.sinks": Rule(f"{L}.self_attn.sinks", "N", "N"),
            **router(f"{L}.mlp.router"),
            **fused_experts(f"{L}.mlp.experts", "(F 2)"),  # gate and up interleaved
        },
        ignore=ROTARY_BUFFERS,
    ),
)

LLAMA4_LAYER_TYPES = {"full_attention": "G", "chunked_attention": "C"}


def _llama4_text(r: Reader) -> dict:
    """iRoPE: RoPE layers (`no_rope_layers` 1) with chunked attention and the weightless QK-norm, NoPE
    layers (0) with full attention and temperature tuning; a mixture (one routed expert, its sigmoid
    score scaling the expert's input, and a shared expert) on `moe_layers`, a dense FFN of width
    `intermediate_size_mlp` elsewhere. Complex rotary pairs: the interleaved layout."""
    n = r("num_hidden_layers")
    interval = r("no_rope_layer_interval")
    rope = r.layer_list("no_rope_layers", n, default=[int((i + 1) % interval != 0) for i in range(n)])
    chunk = r("attention_chunk_size")
    if r("layer_types") is not None:
        pattern = r.layer_pattern(n, LLAMA4_LAYER_TYPES)
    else:
        pattern = cycle_pattern("".join("C" if uses and chunk is not None else "G" for uses in rope))
    if "C" in pattern:
        r.require("attention_chunk_size", lambda v: isinstance(v, int) and not isinstance(v, bool) and v > 0,
                  "chunked layers need a positive chunk size")
    if r("moe_layers") is not None:
        moe = r.layer_indices("moe_layers", n)
    else:
        step = r("interleave_moe_layer_step")
        r.require("interleave_moe_layer_step", lambda v: isinstance(v, int) and v > 0, "a positive layer interval")
        moe = set(range(step - 1, n, step))
    if moe:
        r.require("num_experts_per_tok", lambda v: v == 1,
                  "Llama 4 scales the input of each chosen expert by its score, which the model does for one "
                  "expert per token")
    tuning = r.hf.get("attn_temperature_tuning", True)  # Scout's config.json says 4: transformers takes it as true
    if not isinstance(tuning, (bool, int)):
        raise unsupported(r.model_type, "attn_temperature_tuning", tuning, "expected true or false")
    tuned = bool(tuning) and not all(rope)  # only the NoPE layers are tuned
    bias = bool(r("attention_bias"))
    return dict(
        **_sizes(r), norm_type="rmsnorm", norm_eps=float(r("rms_norm_eps")), norm_placement="pre",
        activation=r.activation("hidden_act"), qkv_bias=bias, out_bias=bias,
        tie_embeddings=bool(r("tie_word_embeddings")), **_rope_fields(r, "interleaved"),
        rope_pattern=cycle_pattern("".join("R" if uses else "N" for uses in rope)), attention_pattern=pattern,
        attention_chunk_size=chunk if "C" in pattern else None,
        qk_norm="l2" if r("use_qk_norm") and any(rope) else "none",
        attn_temperature_floor=r("floor_scale") if tuned else None,
        attn_temperature_scale=float(r("attn_scale")) if tuned else 0.1,
        **_moe([i in moe for i in range(n)], r("intermediate_size_mlp"),
               n_experts=r("num_local_experts"), experts_per_token=r("num_experts_per_tok"),
               expert_d_ff=r("intermediate_size"), n_shared_experts=1, router_score="sigmoid", router_on_input=True),
    )


def _llama4_text_to_hf(cfg: ModelConfig) -> dict:
    moe, n = _moe_layers(cfg), cfg.n_layers
    step = next((s for s in range(1, n + 1) if moe == list(range(s - 1, n, s))), None)
    return _common_to_hf(cfg) | dict(
        intermediate_size=cfg.expert_width, intermediate_size_mlp=cfg.ffn_width,
        hidden_act=ACTIVATION_TO_HF.get(cfg.activation, cfg.activation), rms_norm_eps=cfg.norm_eps,
        attention_bias=cfg.qkv_bias, num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.experts_per_token,
        moe_layers=moe, interleave_moe_layer_step=step or 1,
        no_rope_layers=[int(spec.rope is not None) for spec in cfg.layer_specs()],
        layer_types=layer_types_to_hf(cfg, LLAMA4_LAYER_TYPES), attention_chunk_size=cfg.attention_chunk_size,
        use_qk_norm=cfg.qk_norm == "l2", attn_temperature_tuning=cfg.attn_temperature_floor is not None,
        floor_scale=cfg.attn_temperature_floor or 8192, attn_scale=cfg.attn_temperature_scale,
        rope_theta=cfg.rope_theta, rope_scaling=rope_scaling_to_hf(cfg.rope_scaling),
    )


LLAMA4_TEXT = Family(
    "llama4_text", "Llama4ForCausalLM",
    defaults=dict(
        vocab_size=202048, hidden_size=5120, intermediate_size=8192, intermediate_size_mlp=16384,
        num_hidden_layers=48, num_attention_heads=40, num_key_value_heads=8, head_dim=128, hidden_act="silu",
        max_position_embeddings=131072, rms_norm_eps=1e-5, tie_word_embeddings=False, attention_bias=False,
        rope_theta=500000.0, num_experts_per_tok=1, num_local_experts=16, moe_layers=None,
        interleave_moe_layer_step=1, use_qk_norm=True, no_rope_layers=None, no_rope_layer_interval=4,
        attention_chunk_size=8192, layer_types=None, floor_scale=8192, attn_scale=0.1,
    ),
    from_hf=_llama4_text, to_hf=_llama4_text_to_hf,
    weights=WeightTable(
        top=LLAMA.weights.top,
        layer={
            **norm(f"{L}.input_layernorm", "input_layernorm"),
            **norm(f"{L}.post_attention_layernorm", "pre_feedforward_layernorm"),
            **attention(f"{L}.self_attn"),
            **gated_mlp(f"{L}.feed_forward"),  # the dense layers
            **router(f"{L}.feed_forward.router"),
            **fused_experts(f"{L}.feed_forward.experts", "(2 F)"),  # gate, then up
            **gated_mlp(f"{L}.feed_forward.shared_expert", "mlp.shared_experts"),
        },
        ignore=ROTARY_BUFFERS,
    ),
)


FAMILIES: dict[str, Family] = {f.model_type: f for f in (
    LLAMA, MISTRAL, QWEN2, QWEN3, GEMMA2, GEMMA3_TEXT, GEMMA3, OLMO2, GPT2, GPT_NEOX, GPTJ, PHI,
    QWEN3_MOE, MIXTRAL, DEEPSEEK_V3, GPT_OSS, LLAMA4_TEXT)}
# the model types `config_from_hf` reads (gemma3: the text model inside a multimodal config)
SUPPORTED_MODEL_TYPES = tuple(FAMILIES)
