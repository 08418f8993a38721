"""LoRA adapters in PEFT's format: `adapter_config.json` + `adapter_model.safetensors`.

    write_peft(model, lora, "out/adapter", model_type="llama")  # PeftModel.from_pretrained(base, dir) loads it
    lora, adapters = read_peft("some/adapter", model)      # a PEFT adapter onto our model

PEFT keeps one `lora_A` `[r, in]` and one `lora_B` `[out, r]` per adapted torch Linear, named
after the module (`base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight`), and
scales `B A` by `lora_alpha / r`. Ours are `A [in..., r]` and `B [r, out...]` on the same
projection, so each adapter maps through its kernel's rule in the family's table
(`hf_weights.Rule`): the module is the kernel's tensor name without `.weight`, `A`'s layout
is `r` by the kernel's input axes and `B`'s the kernel's output axes by `r`. That covers every
family whose projections are one torch Linear each (experts saved one Linear per expert
included, `{e}`); a projection Hugging Face fuses with others (GPT-2's `c_attn`, gpt-oss's
`gate_up_proj`) has no adapter of its own there, and is refused by name.

An adapter is read only if it computes `W + (lora_alpha / r) B A` on every layer of the modules its
tensors name: an adapter_config.json option that changes that (DoRA, rsLoRA, per-layer or
per-module choices, trained biases or modules, an initialisation that rewrote the base) is refused
by name, and so is a damaged or truncated `adapter_model.safetensors` or one holding NaN or
infinite values.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import jax
import numpy as np
from flax.nnx import traversals
from safetensors.numpy import save_file

from modern_jax.configfile import read_json
from modern_jax.convert.hf_checkpoint import nonfinite, open_safetensors, refuse_nonfinite
from modern_jax.convert.hf_families import FAMILIES
from modern_jax.convert.hf_weights import Rule
from modern_jax.lora_config import LoRAConfig
from modern_jax.model import Transformer, projections
from modern_jax.training.converters import LoRA

CONFIG, WEIGHTS = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."


def _rules(rule: Rule, in_dims: int, where: str) -> tuple[str, Rule, Rule]:
    """`(module, rule of A, rule of B)` for the adapter of a kernel held by `rule`."""
    groups = re.findall(r"\([^)]*\)|\S+", rule.hf_layout)
    ours = rule.layout.split()
    ins, outs = ours[:in_dims], ours[in_dims:]
    letters = [g.strip("()").split() for g in groups]
    if rule.part is not None or not rule.hf.endswith(".weight") or len(groups) != 2 or \
            sorted(letters[0] + letters[1]) != sorted(ours):
        raise ValueError(f"{where}: Hugging Face holds it in {rule.hf} ({rule.hf_layout}) with other weights, so "
                         f"PEFT has no adapter of its own for it: leave it out of lora.targets to export to PEFT")
    hf_in, hf_out = (groups[1], groups[0]) if letters[1] == ins else (groups[0], groups[1])
    module = rule.hf[:-len(".weight")]
    return (module, Rule(f"{PREFIX}{module}.lora_A.weight", f"r {hf_in}", f"{' '.join(ins)} r"),
            Rule(f"{PREFIX}{module}.lora_B.weight", f"{hf_out} r", f"r {' '.join(outs)}"))


def adapter_tensors(model: Transformer, model_type: str):
    """Each adapter parameter of `model` with PEFT's tensors for it:
    `(path in the parameter tree, rule, [(name, slot)], the variable)`."""
    if model_type not in FAMILIES:
        raise ValueError(f"model_type={model_type!r} is not a family this library converts "
                         f"(families: {', '.join(sorted(FAMILIES))})")
    table = FAMILIES[model_type].weights.layer
    out = []
    for name, module, s, j in LoRA.adapted(model):
        key = f"{name}.kernel"
        if key not in table:
            raise ValueError(f"{model_type}: the adapted projection {name} has no Hugging Face counterpart")
        layers = model.stages[s].layer_numbers(j)
        _, rule_a, rule_b = _rules(table[key], module.in_dims, f"{model_type} {name}")
        for leaf, rule in (("lora_a", rule_a), ("lora_b", rule_b)):
            variable = getattr(module.adapter, leaf)
            path = ("stages", s, "blocks", j, *name.split("."), "adapter", leaf)
            tensors = rule.tensors(tuple(variable.shape), i=layers)
            out.append((path, rule, tensors, variable))
    return out


def _module_pattern(names: list[str]) -> str:
    """A regex PEFT fullmatches against module names: exactly these modules, layer numbers as `\\d+`."""
    shapes = sorted({re.sub(r"\\\.\d+\\\.", r"\\.\\d+\\.", re.escape(n)) for n in names})
    return "(" + "|".join(shapes) + ")"


def write_peft(model: Transformer, lora: LoRAConfig, path, model_type: str, base: str = "") -> list[str]:
    """Write the adapters of `model` (converted by `lora`) as a PEFT LoRA adapter directory;
    returns the files written."""
    if not LoRA.adapted(model):
        raise ValueError("the model has no adapters: convert --to-peft needs a LoRA run (a `lora:` section)")
    from jax.experimental import multihost_utils

    tensors, modules = {}, []
    for path_, rule, names, variable in adapter_tensors(model, model_type):
        x = variable[...]  # an adapter of a launch of several processes: gathered (the adapters are small)
        x = np.asarray(x if x.is_fully_addressable else multihost_utils.process_allgather(x, tiled=True), np.float32)
        for name, slot in names:
            tensors[name] = np.ascontiguousarray(rule.to_hf([x[slot]]))
            modules.append(name[len(PREFIX):].rsplit(".", 2)[0])
    if jax.process_index() != 0:  # process 0 writes them
        return [CONFIG, WEIGHTS]
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / WEIGHTS), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": base or None,
              "r": lora.rank, "lora_alpha": lora.alpha, "lora_dropout": lora.dropout, "bias": "none",
              "target_modules": _module_pattern(sorted(set(modules))), "fan_in_fan_out": False,
              "use_rslora": False, "use_dora": False, "init_lora_weights": True, "inference_mode": True,
              "modules_to_save": None, "rank_pattern": {}, "alpha_pattern": {}}
    (path / CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return [CONFIG, WEIGHTS]


# adapter_config.json options that make the adapter compute something other than W + (alpha / r) B A on
# every layer of the modules its tensors name: refused when set. fan_in_fan_out is not one: PEFT sets
# it by the layer's type (Conv1D stores (in, out), Linear (out, in)), and lora_A / lora_B keep one layout
# either way. A variant whose extra tensors are not listed here is refused by them (`peft_targets`).
_REFUSED = {
    "use_rslora": "rank-stabilised scaling", "use_dora": "DoRA",
    "use_qalora": "QA-LoRA's pooled inputs", "use_bdlora": "block-diagonal adapters",
    "lora_bias": "a trained bias on lora_B", "modules_to_save": "whole modules trained beside the adapters",
    "trainable_token_indices": "trained embedding rows", "target_parameters": "adapters on bare parameters",
    "layers_to_transform": "adapters on some layers only", "layers_pattern": "adapters on some layers only",
    "layer_replication": "repeated layers", "rank_pattern": "per-module ranks", "alpha_pattern": "per-module alphas",
    "alora_invocation_tokens": "activated LoRA, on after its invocation tokens", "arrow_config": "Arrow routing",
    "kasa_config": "KaSA's singular values", "monteclora_config": "MonteCLoRA's sampled adapters",
    "megatron_config": "Megatron's parallel layers"}
# init_lora_weights that only initialise A and B; the others (PiSSA, OLoRA, CorDA, LoftQ, LoRA-GA) also
# rewrite the base weights, so their adapters fit only that rewritten base
_BASE_KEEPING_INITS = (True, False, "gaussian", "eva", "orthogonal")
_FIELDS = {"r": ("rank", 8), "lora_alpha": ("alpha", 8), "lora_dropout": ("dropout", 0.0)}  # (LoRAConfig's, default)


def read_peft_config(path) -> LoRAConfig:
    """The `LoRAConfig` of a PEFT LoRA adapter directory (targets: set when its tensors are read)."""
    path = Path(path)
    if not (path / CONFIG).is_file() or not (path / WEIGHTS).is_file():
        raise ValueError(f"{path}: not a PEFT adapter (expected {CONFIG} and {WEIGHTS})")
    cfg = read_json(path / CONFIG)
    if cfg.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"{path / CONFIG}: peft_type={cfg.get('peft_type')!r}; only LORA adapters are read")
    for key, what in _REFUSED.items():
        if cfg.get(key):
            raise ValueError(f"{path / CONFIG}: {key}={_shown(cfg[key])} ({what}) is not supported: train the "
                             f"adapter without it")
    if cfg.get("init_lora_weights", True) not in _BASE_KEEPING_INITS:
        raise ValueError(f"{path / CONFIG}: init_lora_weights={_shown(cfg['init_lora_weights'])} rewrote the base "
                         f"weights as training started, so the adapter fits only that rewritten base: save it with "
                         f"PEFT's save_pretrained(..., path_initial_model_for_weight_conversion=...), which makes "
                         f"it a plain LoRA adapter of the original base")
    if cfg.get("bias", "none") != "none":
        raise ValueError(f"{path / CONFIG}: bias={cfg['bias']!r}: only adapters without trained biases are read")
    values = {ours: cfg.get(key, default) for key, (ours, default) in _FIELDS.items()}
    values["dropout"] = values["dropout"] or 0.0  # null: none
    if type(values["alpha"]) is int:
        values["alpha"] = float(values["alpha"])
    try:
        return LoRAConfig(**values)
    except ValueError as e:  # named by PEFT's key
        message = str(e)
        for key, (ours, _) in _FIELDS.items():
            message = message.replace(f"LoRAConfig.{ours}=", f"{key}=")
        raise ValueError(f"{path / CONFIG}: {message}") from None


def _shown(value) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _weights(path: Path):
    """The adapter's safetensors file, open; a damaged one is one error naming it."""
    return open_safetensors(path / WEIGHTS, fix="download or export the adapter again")


def peft_targets(path, model: Transformer, model_type: str) -> tuple[str, ...]:
    """Our projection names (as `lora.targets`) that the adapter at `path` has tensors for."""
    with _weights(Path(path)) as f:
        present = set(f.keys())
    table = FAMILIES[model_type].weights.layer
    found, unused = set(), set(present)
    for name, module, s, j in projections(model):
        rule = table.get(f"{name}.kernel")
        if rule is None or rule.part is not None or not rule.hf.endswith(".weight"):
            continue
        layers = model.stages[s].layer_numbers(j)
        _, rule_a, rule_b = _rules(rule, module.in_dims, name)
        names = [n for r in (rule_a, rule_b) for n, _ in r.tensors(tuple(module.kernel.shape), i=layers)]
        if any(n in present for n in names):
            found.add(name)
            unused -= set(names)
    if unused:
        listed = ", ".join(sorted(unused)[:4])
        raise ValueError(f"{path}: {len(unused)} adapter tensor(s) match no projection of the {model_type} model: "
                         f"{listed}")
    if not found:
        raise ValueError(f"{path}: no adapter tensor matches a projection of the {model_type} model")
    return tuple(sorted(found))


def read_peft(path, model: Transformer, model_type: str) -> dict:
    """The adapters of `model` (made with the adapter's `LoRAConfig` and targets) filled from the
    PEFT adapter at `path`: a pure dict of every adapter parameter, host arrays."""
    path = Path(path)
    out, bad = {}, []
    with _weights(path) as f:
        present = set(f.keys())
        tensors = adapter_tensors(model, model_type)
        rank = next(v.shape[-1] for tree_path, _, _, v in tensors if tree_path[-1] == "lora_a")
        for tree_path, rule, names, variable in tensors:
            buffer = np.zeros(variable.shape, np.float32)
            for name, slot in names:
                if name not in present:
                    raise ValueError(f"{path / WEIGHTS}: {name} is missing (every layer of an adapted projection "
                                     f"needs its lora_A and lora_B)")
                x = f.get_tensor(name)
                want = rule.hf_shape(buffer.shape[len(slot):])
                if tuple(x.shape) != want:
                    raise ValueError(f"{path / WEIGHTS}: {name} has shape {list(x.shape)}, the model needs "
                                     f"{list(want)} (rank {rank})")
                if (count := nonfinite(x)) is not None:
                    bad.append(f"{name} ({count})")
                buffer[slot] = rule.to_ours(x.astype(np.float32), buffer.shape[len(slot):])
            out[tree_path] = buffer
    refuse_nonfinite(str(path / WEIGHTS), bad)
    return traversals.unflatten_mapping(out)
