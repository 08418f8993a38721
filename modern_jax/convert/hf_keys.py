"""The keys of a Hugging Face `config.json`, read and written: what every family shares.

`Reader` reads one config with its family's defaults filled in (a `config.json` may leave
out any key whose value is the default) and each value checked against the default's type;
both the transformers 4.x keys (`rope_theta`, `rope_scaling`, ...) and the 5.x
`rope_parameters` (flat, or nested by layer type) are read. `unsupported` is the one error:
it names the key, its value and what is supported. The families themselves are in
`hf_families.py`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from modern_jax.config import ModelConfig, RopeScaling

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


class Reader:
    """One Hugging Face config with its family's defaults filled in."""

    def __init__(self, model_type: str, hf: dict[str, Any], defaults: Mapping[str, Any]):
        self.model_type, self.hf, self.defaults = model_type, hf, defaults

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

    def layer_pattern(self, n_layers: int, letters: Mapping[str, str] = LAYER_TYPES) -> str:
        """`attention_pattern` from `layer_types`, shortest repeating unit first; `letters`: the
        layer types the family has, with their pattern letters."""
        types = self("layer_types")
        if types is None:
            return "G"
        if len(types) != n_layers:
            raise unsupported(self.model_type, "layer_types", types, f"expected one entry per layer ({n_layers})")
        for t in types:
            if t not in letters:
                raise unsupported(self.model_type, "layer_types", t, f"supported: {', '.join(letters)}")
        return cycle_pattern("".join(letters[t] for t in types))

    def layer_list(self, key: str, n_layers: int, values: tuple = (0, 1), default: list | None = None) -> list:
        """A per-layer list (`no_rope_layers`: 0 or 1 for each layer); `default` when absent or empty."""
        items = self(key) or default
        if not isinstance(items, list) or len(items) < n_layers or any(v not in values for v in items):
            raise unsupported(self.model_type, key, items, f"expected one of {values} for each of the {n_layers} layers")
        return items[:n_layers]

    def layer_indices(self, key: str, n_layers: int) -> set[int]:
        """A list of layer indices (`mlp_only_layers`, `moe_layers`); None: none."""
        items = self(key) or []
        if not isinstance(items, list) or any(not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < n_layers
                                              for i in items):
            raise unsupported(self.model_type, key, items, f"expected a list of layer indices in [0, {n_layers})")
        return set(items)


def cycle_pattern(per_layer: str) -> str:
    """The shortest string whose cyclic repetition spells `per_layer`."""
    for period in range(1, len(per_layer) + 1):
        unit = per_layer[:period]
        if all(per_layer[i] == unit[i % period] for i in range(len(per_layer))):
            return unit
    return per_layer


def expand_pattern(pattern: str, n_layers: int) -> str:
    return "".join(pattern[i % len(pattern)] for i in range(n_layers))


# ----- writing ---------------------------------------------------------------------------

def rope_scaling_to_hf(s: RopeScaling) -> dict | None:
    if s.type == "none":
        return None
    fields = {k: v for k, v in dataclasses.asdict(s).items() if k in _ROPE_KEYS[s.type] and v is not None}
    return {"rope_type": s.type, **fields}


def layer_types_to_hf(cfg: ModelConfig, letters: Mapping[str, str] = LAYER_TYPES) -> list[str]:
    """`layer_types` of `cfg.attention_pattern`; `letters`: the layer types the family has."""
    names = {v: k for k, v in letters.items()}
    pattern = expand_pattern(cfg.attention_pattern, cfg.n_layers)
    if set(pattern) - set(names):
        raise ValueError(f"attention_pattern={cfg.attention_pattern!r}: the family's layer types are "
                         f"{', '.join(f'{k} ({v})' for k, v in letters.items())}")
    return [names[c] for c in pattern]
