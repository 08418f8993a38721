"""The model configuration: one frozen dataclass, validated at construction.

Every architectural choice (the README's Configuration table) is a field here with a closed set of
values. `ModelConfig` knows nothing about training; the run configuration is a
separate object (see `modern_jax.training`).

Per-layer patterns are strings repeated cyclically over the depth:
`attention_pattern` uses `G` (global), `L` (local, `sliding_window` keys) and `C`
(chunked: the keys of the query's own block of `attention_chunk_size` positions);
`rope_pattern` uses `R` (RoPE) and `N` (no positions). Gemma 2 is `"LG"`,
Gemma 3 `"LLLLLG"`, Mistral `"L"`, Llama 4 iRoPE `"RRRN"` with chunks `"CCCG"`. A pattern may
also spell out every layer (its length is then `n_layers`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
from dataclasses import dataclass, field
from typing import Any

import jax

from modern_jax.configfile import MovedSetting, check_keys, fail, load_config_file

NORM_TYPES = ("rmsnorm", "gemma_rmsnorm", "layernorm")  # computed by kernels/norm.py, which checks these names
PLACEMENTS = ("post", "pre", "sandwich", "output", "parallel", "deepnorm")
FFN_TYPES = ("mlp", "gated", "moe")
ROUTER_SCORES = ("softmax", "topk_softmax", "sigmoid")
POSITIONS = ("none", "rope", "sinusoidal", "learned")
ROPE_LAYOUTS = ("half", "interleaved")
ROPE_SCALINGS = ("none", "linear", "llama3", "yarn")
ATTENTION_TYPES = ("mha", "mla")
QK_NORMS = ("none", "head", "full", "l2")
INITS = ("normal", "xavier")
DTYPES = ("float32", "bfloat16", "float16")
# settings that once lived here and now live in another section of a run file (how it runs,
# not what it is): a key in the old place is read there, with a notice
MOVED = {**{name: "execution" for name in ("attention_impl", "norm_impl", "moe_dispatch", "moe_capacity_factor",
                                           "moe_grouped_impl", "remat", "scan_layers")},
         **{name: "parallel" for name in ("context_strategy", "moe_exchange", "moe_exchange_factor")}}


# The activations by name: the one table, which `activation` is checked against and the FFNs
# apply (layers/ffn.py, layers/moe.py). It lives here, not beside the FFN, because imports point
# down the layers (config -> ... -> layers): the config that checks a name cannot import the layer.
ACTIVATIONS = {
    "relu": jax.nn.relu,
    "gelu": lambda x: jax.nn.gelu(x, approximate=False),
    "gelu_tanh": lambda x: jax.nn.gelu(x, approximate=True),
    "silu": jax.nn.silu,
    "sigmoid": jax.nn.sigmoid,
    "identity": lambda x: x,
}

_fail = functools.partial(fail, "ModelConfig")


def _setting(default=None, **kwargs):
    """A field that is not the network itself but how its numbers are kept, made and trained
    (dtypes, initialisation, dropout, row padding): a fine-tune may set it, and a Hugging Face
    round trip does not compare it."""
    return field(default=default, metadata={"network": False}, **kwargs)


def _check_choice(field_name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        _fail(field_name, value, f"expected one of {', '.join(map(str, choices))}")


_EXPECTED = {"int": "an integer", "float": "a number", "str": "a string", "bool": "true or false"}


def _has_type(value: Any, kind: str) -> bool:
    if kind == "int":
        return isinstance(value, numbers.Integral) and not isinstance(value, bool)
    if kind == "float":
        return isinstance(value, numbers.Real) and not isinstance(value, bool)
    if kind == "str":
        return isinstance(value, str)
    if kind == "bool":
        return isinstance(value, bool) or type(value).__name__ == "bool_"
    return True


def _check_types(config: Any, prefix: str) -> None:
    """Each field holds its annotated type (`int`, `float`, `str`, `bool`, optionally `| None`):
    a wrong-typed value from YAML fails here, naming the field, not deep in a comparison."""
    for f in dataclasses.fields(config):
        kind, _, optional = str(f.type).partition(" | ")
        value = getattr(config, f.name)
        if kind in _EXPECTED and not (value is None and optional == "None") and not _has_type(value, kind):
            _fail(prefix + f.name, value, f"expected {_EXPECTED[kind]}" + (" or null" if optional else ""))


@dataclass(frozen=True, slots=True)
class RopeScaling:
    """Context-extension scaling of the RoPE frequencies (Hugging Face `rope_scaling`)."""

    type: str = "none"
    factor: float = 1.0
    # llama3
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    # yarn
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float | None = None
    mscale_all_dim: float | None = None
    attention_factor: float | None = None
    truncate: bool = True

    def __post_init__(self):
        _check_types(self, "rope_scaling.")
        if self.type not in ROPE_SCALINGS:
            _fail("rope_scaling.type", self.type, f"expected one of {', '.join(ROPE_SCALINGS)}")
        if self.type != "none" and not self.factor >= 1.0:
            _fail("rope_scaling.factor", self.factor, "a scaling factor must be >= 1")
        if self.type == "llama3" and not self.high_freq_factor > self.low_freq_factor:
            _fail(
                "rope_scaling.high_freq_factor",
                self.high_freq_factor,
                f"must exceed low_freq_factor={self.low_freq_factor}",
            )
        if self.type in ("llama3", "yarn") and self.original_max_position_embeddings <= 0:
            _fail(
                "rope_scaling.original_max_position_embeddings",
                self.original_max_position_embeddings,
                "must be a positive context length",
            )


@dataclass(frozen=True, slots=True)
class RopeSpec:
    """The rotary embedding one layer applies (derived from `ModelConfig`)."""

    theta: float
    rotary_dim: int
    layout: str
    scaling: RopeScaling


@dataclass(frozen=True, slots=True)
class TemperatureSpec:
    """Attention temperature tuning of a layer without positions (Llama 4's NoPE layers):
    the queries at position p are scaled by `log(floor((p + 1) / floor) + 1) * scale + 1`."""

    floor: int
    scale: float


@dataclass(frozen=True, slots=True)
class LayerSpec:
    """What differs between layers without changing their parameters' shapes."""

    window: int | None  # sliding window: a query sees keys with q_pos - k_pos < window; None: no window
    rope: RopeSpec | None  # None: no positions in this layer (NoPE)
    moe: bool = False  # the FFN is a mixture of experts
    chunk: int | None = None  # chunked attention: a query sees keys in its own block of `chunk` positions
    qk_norm: str = "none"  # ModelConfig.qk_norm, except that 'l2' applies to the RoPE layers only
    temperature: TemperatureSpec | None = None  # None: queries unscaled (every layer with RoPE)

    @property
    def span(self) -> int | None:
        """How many of the latest positions a query can see at most (window or chunk); None: all."""
        return self.window if self.window is not None else self.chunk


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """One decoder-only transformer. Every field is a switch (README: Configuration)."""

    # sizes
    vocab_size: int = 256
    vocab_pad_to: int = _setting(1)  # embedding/head rows padded to a multiple (tensor parallelism); pad logits masked
    d_model: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int | None = None  # None: = n_heads (MHA); 1: MQA; else GQA
    head_dim: int | None = None  # None: d_model // n_heads
    d_ff: int | None = None  # None: 4d (mlp) or ceil(8d/3) rounded up to ffn_multiple_of (gated)
    ffn_multiple_of: int = _setting(1)  # the width rule's rounding (d_ff, the network's width, is derived)
    max_position_embeddings: int = 2048

    # normalisation and its placement
    norm_type: str = "rmsnorm"
    norm_eps: float = 1e-5
    norm_bias: bool = False  # layernorm only
    norm_placement: str = "pre"
    parallel_shared_norm: bool = True  # parallel placement: one norm (GPT-J/PaLM) or two (GPT-NeoX)

    # feed-forward
    ffn_type: str = "gated"
    activation: str = "silu"
    fused_gate_up: bool = False
    mlp_bias: bool = False
    # mixture of experts (ffn_type="moe"; README: Mixture of experts)
    n_experts: int = 0  # E routed experts
    experts_per_token: int = 0  # k
    expert_d_ff: int | None = None  # width of each routed expert; None: d_ff
    n_shared_experts: int = 0  # always-on experts beside the routed ones
    shared_expert_d_ff: int | None = None  # width of each shared expert; None: expert_d_ff
    moe_pattern: str = "E"  # per layer: E experts, D a dense gated FFN of width d_ff (cyclic)
    moe_first_dense: int = 0  # the first layers are dense whatever the pattern (DeepSeek)
    router_score: str = "softmax"  # softmax over all then top-k | top-k then softmax over k | sigmoid
    router_norm_topk: bool = False  # renormalise the k weights to sum to 1
    router_scale: float = 1.0  # the routed output's scale (routed_scaling_factor)
    router_bias: bool = False  # a learned bias on the router logits (gpt-oss)
    router_selection_bias: bool = False  # a bias that chooses experts but does not weight them (DeepSeek-V3)
    router_groups: int = 1  # experts split into groups, each scored by the sum of its top 2 (DeepSeek-V3)
    router_topk_groups: int = 1  # groups kept per token
    router_on_input: bool = False  # the weight scales the expert's input, not its output (Llama 4)
    moe_aux_per_sequence: bool = _setting(False)  # the balance loss per sequence, not over the batch
    expert_bias: bool = False  # biases on the expert projections (gpt-oss)
    expert_swiglu_limit: float | None = None  # gpt-oss: clamp gate and up, (up + 1) * gate * sigmoid(alpha gate)
    expert_swiglu_alpha: float = 1.702

    # positions
    position_embedding: str = "rope"
    rope_theta: float = 10000.0
    rope_layout: str = "half"
    rope_fraction: float = 1.0
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)
    rope_local_theta: float | None = None  # base of the local layers (Gemma 3); None: rope_theta
    rope_pattern: str = "R"

    # attention
    attention_type: str = "mha"
    qkv_bias: bool = False
    out_bias: bool = False
    qk_norm: str = "none"
    attn_scale: float | None = None  # None: 1/sqrt(head_dim)
    attn_softcap: float | None = None
    attention_sinks: bool = False
    sliding_window: int | None = None
    attention_chunk_size: int | None = None  # the blocks of the chunked layers ('C'; Llama 4: 8192)
    attention_pattern: str = "G"
    attn_temperature_floor: int | None = None  # temperature tuning of the NoPE layers (Llama 4: 8192); None: off
    attn_temperature_scale: float = 0.1
    # MLA (attention_type="mla")
    mla_kv_rank: int = 0
    mla_q_rank: int = 0  # 0: full-rank query projection
    mla_rope_dim: int = 64
    mla_nope_dim: int = 128
    mla_v_dim: int = 128

    # embeddings and head
    tie_embeddings: bool = False
    embed_scale: bool = False  # multiply embeddings by sqrt(d_model) (Gemma)
    head_bias: bool = False
    final_softcap: float | None = None

    # multi-token prediction (DeepSeek-V3): D modules past the last layer, module k predicting the token k + 1
    # ahead through the shared embedding and head (`model.MTPLayer`; its loss weight is train.mtp_loss_weight).
    # Extra heads beside the network, as transformers' DeepseekV3ForCausalLM leaves them out: a Hugging Face
    # checkpoint holding them (num_nextn_predict_layers) loads them when this is set, and a fine-tune may set it
    mtp_depth: int = _setting(0)

    # initialisation, regularisation, numerics, depth
    init: str = _setting("normal")
    init_std: float = _setting(0.02)
    attn_dropout: float = _setting(0.0)
    resid_dropout: float = _setting(0.0)
    dtype: str = _setting("float32")  # the compute dtype (activations); parameters are param_dtype
    param_dtype: str = _setting("float32")

    def __post_init__(self):
        for check in (_check_values, _check_widths, _check_positions, _check_attention, _check_scales, _check_mla,
                      _check_moe):
            check(self)
        if not isinstance(self.mtp_depth, int) or isinstance(self.mtp_depth, bool) or self.mtp_depth < 0:
            _fail("mtp_depth", self.mtp_depth, "expected 0 (no multi-token prediction) or a positive depth")

    # ----- derived sizes -------------------------------------------------------

    @property
    def num_kv_heads(self) -> int:
        return self.n_heads if self.n_kv_heads is None else self.n_kv_heads

    @property
    def padded_vocab_size(self) -> int:
        return self.vocab_pad_to * math.ceil(self.vocab_size / self.vocab_pad_to)

    @property
    def head_size(self) -> int:
        return self.head_dim if self.head_dim is not None else self.d_model // self.n_heads

    @property
    def rotary_dim(self) -> int:
        if self.attention_type == "mla":
            return self.mla_rope_dim
        return int(self.head_size * self.rope_fraction)

    @property
    def ffn_width(self) -> int:
        if self.d_ff is not None:
            return self.d_ff
        if self.ffn_type == "mlp":
            return 4 * self.d_model
        return ffn_width_rule(self.d_model, self.ffn_multiple_of)

    @property
    def expert_width(self) -> int:
        return self.expert_d_ff if self.expert_d_ff is not None else self.ffn_width

    @property
    def shared_width(self) -> int:
        """The total width of the shared experts (0: none): they run as one gated FFN."""
        each = self.shared_expert_d_ff if self.shared_expert_d_ff is not None else self.expert_width
        return self.n_shared_experts * each

    @property
    def has_final_norm(self) -> bool:
        return self.norm_placement not in ("post", "deepnorm")

    def layer_specs(self) -> tuple[LayerSpec, ...]:
        """The static per-layer choices (window or chunk, RoPE, ...) the patterns spell out.

        Llama 4's per-layer rules live here: `qk_norm: l2` normalises only the RoPE layers, and
        temperature tuning scales the queries of only the layers without positions.
        """
        specs = []
        for i in range(self.n_layers):
            kind = self.attention_pattern[i % len(self.attention_pattern)]
            local = kind == "L"
            rope = None
            if self.position_embedding == "rope" and self.rope_pattern[i % len(self.rope_pattern)] == "R":
                if local and self.rope_local_theta is not None:
                    rope = RopeSpec(self.rope_local_theta, self.rotary_dim, self.rope_layout, RopeScaling())
                else:
                    rope = RopeSpec(self.rope_theta, self.rotary_dim, self.rope_layout, self.rope_scaling)
            moe = (self.ffn_type == "moe" and i >= self.moe_first_dense
                   and self.moe_pattern[i % len(self.moe_pattern)] == "E")
            temperature = (None if self.attn_temperature_floor is None or rope is not None
                           else TemperatureSpec(self.attn_temperature_floor, self.attn_temperature_scale))
            specs.append(LayerSpec(self.sliding_window if local else None, rope, moe=moe,
                                   chunk=self.attention_chunk_size if kind == "C" else None,
                                   qk_norm="none" if self.qk_norm == "l2" and rope is None else self.qk_norm,
                                   temperature=temperature))
        return tuple(specs)

    # ----- (de)serialisation ---------------------------------------------------

    @classmethod
    def from_dict(cls, values: dict[str, Any], where: str = "") -> ModelConfig:
        """`values` of a `model:` section; a setting that now lives in another section is left
        out, with a notice (`split_moved` reads it there)."""
        if not isinstance(values, dict):
            raise ValueError(f"model: expected a mapping of ModelConfig fields, got {values!r}"[:300])
        values, _ = split_moved(values, where)
        check_keys("model", values, [f.name for f in dataclasses.fields(cls)])
        if isinstance(values.get("rope_scaling"), dict):
            scaling = values["rope_scaling"]
            check_keys("model.rope_scaling", scaling, [f.name for f in dataclasses.fields(RopeScaling)])
            values["rope_scaling"] = RopeScaling(**scaling)
        elif values.get("rope_scaling") is None:
            values.pop("rope_scaling", None)
        return cls(**values)

    def to_dict(self) -> dict[str, Any]:
        out = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            out[f.name] = dataclasses.asdict(value) if isinstance(value, RopeScaling) else value
        return out

    def replace(self, **changes: Any) -> ModelConfig:
        return dataclasses.replace(self, **changes)


# the fields of a mixture of experts: each at its default unless ffn_type is "moe"
MOE_FIELDS = ("n_experts", "experts_per_token", "expert_d_ff", "n_shared_experts", "shared_expert_d_ff", "moe_pattern",
              "moe_first_dense", "router_score", "router_norm_topk", "router_scale", "router_bias",
              "router_selection_bias", "router_groups", "router_topk_groups", "router_on_input", "moe_aux_per_sequence",
              "expert_bias", "expert_swiglu_limit", "expert_swiglu_alpha")
NETWORK_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.metadata.get("network", True))


# ----- the checks of a ModelConfig at construction (each names the field and the fix) -----


def _check_values(cfg: ModelConfig) -> None:
    """Sizes are positive integers, choices among their names, every field of its type."""
    for name in ("vocab_size", "vocab_pad_to", "d_model", "n_layers", "n_heads", "max_position_embeddings"):
        value = getattr(cfg, name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            _fail(name, value, "expected a positive integer")
    for name, choices in (
        ("norm_type", NORM_TYPES),
        ("norm_placement", PLACEMENTS),
        ("ffn_type", FFN_TYPES),
        ("router_score", ROUTER_SCORES),
        ("activation", ACTIVATIONS),
        ("position_embedding", POSITIONS),
        ("rope_layout", ROPE_LAYOUTS),
        ("attention_type", ATTENTION_TYPES),
        ("qk_norm", QK_NORMS),
        ("init", INITS),
        ("dtype", DTYPES),
        ("param_dtype", DTYPES),
    ):
        _check_choice(name, getattr(cfg, name), choices)
    if not isinstance(cfg.rope_scaling, RopeScaling):
        _fail("rope_scaling", cfg.rope_scaling, "expected a RopeScaling (a mapping in YAML)")
    _check_types(cfg, "")

def _check_widths(cfg: ModelConfig) -> None:
    """Heads divide, widths and eps are positive, and the norm and FFN switches fit together."""
    n_kv = cfg.num_kv_heads
    if n_kv <= 0 or cfg.n_heads % n_kv:
        _fail("n_kv_heads", cfg.n_kv_heads, f"must be a positive divisor of n_heads={cfg.n_heads}")
    if cfg.head_dim is None and cfg.attention_type == "mha" and cfg.d_model % cfg.n_heads:
        _fail("n_heads", cfg.n_heads, f"must divide d_model={cfg.d_model} unless head_dim is set")
    if cfg.head_dim is not None and cfg.head_dim <= 0:
        _fail("head_dim", cfg.head_dim, "expected a positive integer")
    if cfg.d_ff is not None and cfg.d_ff <= 0:
        _fail("d_ff", cfg.d_ff, "expected a positive integer or null (width rule)")
    if cfg.ffn_multiple_of <= 0:
        _fail("ffn_multiple_of", cfg.ffn_multiple_of, "expected a positive integer")
    if cfg.norm_eps <= 0:
        _fail("norm_eps", cfg.norm_eps, "expected a positive float")
    if cfg.norm_bias and cfg.norm_type != "layernorm":
        _fail("norm_bias", cfg.norm_bias, f"only layernorm has a bias, norm_type={cfg.norm_type!r}")
    if cfg.ffn_type == "mlp" and cfg.activation in ("identity", "sigmoid"):
        _fail("activation", cfg.activation, "a plain mlp needs relu, gelu, gelu_tanh or silu")
    if cfg.fused_gate_up and cfg.ffn_type != "gated":
        _fail("fused_gate_up", True, "only a gated FFN has gate and up projections")
    if not cfg.parallel_shared_norm and cfg.norm_placement != "parallel":
        _fail("parallel_shared_norm", False, "only applies to norm_placement='parallel'")

def _check_positions(cfg: ModelConfig) -> None:
    """RoPE: its fraction, base, pattern and scaling; sinusoidal positions need an even width."""
    if not 0.0 < cfg.rope_fraction <= 1.0:
        _fail("rope_fraction", cfg.rope_fraction, "expected a fraction in (0, 1]")
    if cfg.rope_theta <= 0:
        _fail("rope_theta", cfg.rope_theta, "expected a positive base")
    uses_rope = cfg.position_embedding == "rope"
    if uses_rope and cfg.attention_type == "mha" and cfg.rotary_dim % 2:
        _fail(
            "head_dim" if cfg.rope_fraction == 1.0 else "rope_fraction",
            cfg.head_dim if cfg.rope_fraction == 1.0 else cfg.rope_fraction,
            f"RoPE rotates pairs: the rotary dimension {cfg.rotary_dim} must be even",
        )
    if not uses_rope and cfg.rope_scaling.type != "none":
        _fail("rope_scaling", cfg.rope_scaling.type, "rope_scaling needs position_embedding='rope'")
    _check_pattern(cfg, "rope_pattern", "RN")
    if "N" in cfg.rope_pattern and not uses_rope:
        _fail("rope_pattern", cfg.rope_pattern, "NoPE layers ('N') need position_embedding='rope'")
    if cfg.rope_local_theta is not None and "L" not in cfg.attention_pattern:
        _fail("rope_local_theta", cfg.rope_local_theta, "applies to local layers; attention_pattern has no 'L'")
    if cfg.position_embedding == "sinusoidal" and cfg.d_model % 2:
        _fail("d_model", cfg.d_model, "sinusoidal positions need an even d_model")

def _check_attention(cfg: ModelConfig) -> None:
    """Layer patterns with their window or chunk, l2 qk-norm and temperature tuning."""
    _check_pattern(cfg, "attention_pattern", "GLC")
    if "L" in cfg.attention_pattern:
        if cfg.sliding_window is None or cfg.sliding_window <= 0:
            _fail("sliding_window", cfg.sliding_window, "local layers ('L') need a positive window")
    elif cfg.sliding_window is not None:
        _fail("sliding_window", cfg.sliding_window, "set attention_pattern to 'L' (all local) or a mix like 'LG'")
    if "C" in cfg.attention_pattern:
        if cfg.attention_chunk_size is None or cfg.attention_chunk_size <= 0:
            _fail("attention_chunk_size", cfg.attention_chunk_size,
                  "chunked layers ('C') need a positive chunk size")
    elif cfg.attention_chunk_size is not None:
        _fail("attention_chunk_size", cfg.attention_chunk_size,
              "set attention_pattern to 'C' (all chunked) or a mix like 'CCCG'")
    if cfg.qk_norm == "l2" and (cfg.position_embedding != "rope" or "R" not in cfg.rope_pattern):
        _fail("qk_norm", cfg.qk_norm, "'l2' normalises the RoPE layers (Llama 4) and this model has none: "
              "set position_embedding='rope' with an 'R' in rope_pattern, or use 'head'")
    if cfg.attn_temperature_floor is not None:
        if cfg.attn_temperature_floor <= 0:
            _fail("attn_temperature_floor", cfg.attn_temperature_floor,
                  "expected a positive number of positions, or null (no temperature tuning)")
        if cfg.position_embedding != "none" and "N" not in cfg.rope_pattern:
            _fail("attn_temperature_floor", cfg.attn_temperature_floor,
                  "tunes the layers without positions, and this model has none: add an 'N' to rope_pattern "
                  "(Llama 4: 'RRRN') or use position_embedding='none'")
    if not (math.isfinite(cfg.attn_temperature_scale) and cfg.attn_temperature_scale > 0):
        _fail("attn_temperature_scale", cfg.attn_temperature_scale, "expected a positive float")
    if cfg.attn_temperature_floor is None and cfg.attn_temperature_scale != 0.1:
        _fail("attn_temperature_scale", cfg.attn_temperature_scale,
              "only applies with attn_temperature_floor set (temperature tuning is off)")

def _check_scales(cfg: ModelConfig) -> None:
    """Soft-caps, scales, dropout rates and the init std are in range."""
    for name in ("attn_softcap", "final_softcap", "attn_scale"):
        value = getattr(cfg, name)
        if value is not None and not value > 0:
            _fail(name, value, "expected a positive float or null")
    for name in ("attn_dropout", "resid_dropout"):
        if not 0.0 <= getattr(cfg, name) < 1.0:
            _fail(name, getattr(cfg, name), "expected a rate in [0, 1)")
    if cfg.init_std <= 0:
        _fail("init_std", cfg.init_std, "expected a positive standard deviation")

def _check_mla(cfg: ModelConfig) -> None:
    """MLA's latent sizes and what it excludes; latent sizes need MLA."""
    if cfg.attention_type == "mla":
        if cfg.mla_kv_rank <= 0:
            _fail("mla_kv_rank", cfg.mla_kv_rank, "MLA needs a positive latent size d_c")
        if cfg.mla_q_rank < 0:
            _fail("mla_q_rank", cfg.mla_q_rank, "expected 0 (full-rank q) or a positive rank")
        for name in ("mla_rope_dim", "mla_nope_dim", "mla_v_dim"):
            if getattr(cfg, name) <= 0:
                _fail(name, getattr(cfg, name), "expected a positive integer")
        if cfg.mla_rope_dim % 2:
            _fail("mla_rope_dim", cfg.mla_rope_dim, "RoPE rotates pairs: must be even")
        if cfg.position_embedding != "rope":
            _fail("position_embedding", cfg.position_embedding, "MLA's decoupled key needs 'rope'")
        if cfg.n_kv_heads not in (None, cfg.n_heads):
            _fail("n_kv_heads", cfg.n_kv_heads, "MLA shares one latent across heads; leave n_kv_heads unset")
        if cfg.qk_norm != "none":
            _fail("qk_norm", cfg.qk_norm, "MLA normalises its latents instead; use 'none'")
    elif cfg.mla_kv_rank or cfg.mla_q_rank:
        _fail("mla_kv_rank" if cfg.mla_kv_rank else "mla_q_rank", cfg.mla_kv_rank or cfg.mla_q_rank,
              "set attention_type='mla' to use a latent")

def _check_moe(cfg: ModelConfig) -> None:
    if cfg.ffn_type != "moe":
        defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
        for name in MOE_FIELDS:
            if getattr(cfg, name) != defaults[name]:
                _fail(name, getattr(cfg, name), "applies to a mixture of experts: set ffn_type='moe'")
        return
    if cfg.activation in ("identity",):
        _fail("activation", cfg.activation, "experts are gated FFNs: use silu, gelu, gelu_tanh, relu or sigmoid")
    if cfg.fused_gate_up:
        _fail("fused_gate_up", True, "a mixture of experts keeps gate and up apart; set fused_gate_up=false")
    if cfg.n_experts < 2:
        _fail("n_experts", cfg.n_experts, "a mixture of experts needs at least 2 routed experts")
    if not 1 <= cfg.experts_per_token <= cfg.n_experts:
        _fail("experts_per_token", cfg.experts_per_token, f"expected 1 .. n_experts={cfg.n_experts}")
    for name in ("expert_d_ff", "shared_expert_d_ff"):
        if getattr(cfg, name) is not None and getattr(cfg, name) <= 0:
            _fail(name, getattr(cfg, name), "expected a positive width or null")
    if cfg.n_shared_experts < 0:
        _fail("n_shared_experts", cfg.n_shared_experts, "expected 0 or more shared experts")
    _check_pattern(cfg, "moe_pattern", "DE")
    if not 0 <= cfg.moe_first_dense <= cfg.n_layers:
        _fail("moe_first_dense", cfg.moe_first_dense, f"expected 0 .. n_layers={cfg.n_layers}")
    if not any(spec.moe for spec in cfg.layer_specs()):
        _fail("moe_pattern", cfg.moe_pattern, f"with moe_first_dense={cfg.moe_first_dense} no layer has experts")
    if cfg.router_groups < 1 or cfg.n_experts % cfg.router_groups:
        _fail("router_groups", cfg.router_groups, f"must divide n_experts={cfg.n_experts}")
    if not 1 <= cfg.router_topk_groups <= cfg.router_groups:
        _fail("router_topk_groups", cfg.router_topk_groups, f"expected 1 .. router_groups={cfg.router_groups}")
    per_group = cfg.n_experts // cfg.router_groups
    if cfg.router_groups > 1 and per_group < 2:
        _fail("router_groups", cfg.router_groups, "each group is scored by its top 2: needs 2 experts or more")
    if cfg.router_groups > 1 and cfg.router_topk_groups * per_group < cfg.experts_per_token:
        _fail("router_topk_groups", cfg.router_topk_groups,
              f"the kept groups hold {cfg.router_topk_groups * per_group} experts, fewer than "
              f"experts_per_token={cfg.experts_per_token}")
    if cfg.router_on_input and cfg.experts_per_token != 1:
        _fail("router_on_input", True, "scaling the input works for one expert per token (experts_per_token=1)")
    if not cfg.router_scale > 0:
        _fail("router_scale", cfg.router_scale, "expected a positive scale")
    if cfg.expert_swiglu_limit is not None and not cfg.expert_swiglu_limit > 0:
        _fail("expert_swiglu_limit", cfg.expert_swiglu_limit, "expected a positive limit or null")

def _check_pattern(cfg: ModelConfig, name: str, letters: str) -> None:
    pattern = getattr(cfg, name)
    if not isinstance(pattern, str) or not pattern or set(pattern) - set(letters):
        _fail(name, pattern, f"expected a non-empty string of {', '.join(letters)}")
    if len(pattern) > cfg.n_layers:
        _fail(name, pattern, f"is longer than n_layers={cfg.n_layers}")


def split_moved(model: dict, where: str = "") -> tuple[dict, dict[str, dict]]:
    """`(the model: section without the settings that moved, {section: {field: value}} of those)`,
    with one notice per setting naming its new place."""
    import warnings

    kept, moved = {}, {}
    for key, value in model.items():
        if key in MOVED:
            section = MOVED[key]
            moved.setdefault(section, {})[key] = value
            warnings.warn(f"{where + ': ' if where else ''}model.{key} is read as {section}.{key}, where it lives now "
                          f"(how the model runs, not what it is): move it there", MovedSetting, stacklevel=3)
        else:
            kept[key] = value
    return kept, moved


def ffn_width_rule(d_model: int, multiple_of: int) -> int:
    """Llama's width: ceil(8d/3) rounded up to a multiple of `multiple_of`."""
    width = math.ceil(8 * d_model / 3)
    return multiple_of * math.ceil(width / multiple_of)


def model_config_from_file(path, overrides: list[str] = ()) -> ModelConfig:
    raw = load_config_file(path, overrides)
    if "model" not in raw:
        raise ValueError(f"{path}: no `model:` section")
    return ModelConfig.from_dict(raw["model"] or {}, str(path))
