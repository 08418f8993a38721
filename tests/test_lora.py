"""LoRA and QLoRA: adapters on a frozen (optionally quantized) base, PEFT's format in and out.

References: a naive `W + (alpha / r) A B` built here from the parameters; PEFT's own logits
and adapter files (tests/fixtures/hf_peft, made by scripts/make_hf_fixtures.py peft with
transformers + PEFT); the float base for the quantized ones.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from flax.nnx import traversals
from safetensors.numpy import load_file

from modern_jax.config import ModelConfig
from modern_jax.configfile import load_config_file
from modern_jax.convert import from_hf
from modern_jax.convert.peft import peft_targets, read_peft, read_peft_config, write_peft
from modern_jax.lora_config import LoRAConfig
from modern_jax.model import Transformer, abstract_params
from modern_jax.sharding.mesh import make_mesh
from modern_jax.training import TrainConfig
from modern_jax.training.converters import LoRA

from common import assert_leaves_match, lora_model, make_trainer, one_device, probe, step_gradients, token_batch

REPO = pathlib.Path(__file__).parent.parent
PEFT = REPO / "tests" / "fixtures" / "hf_peft"
TINY = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4, n_kv_heads=4, d_ff=128,
                   max_position_embeddings=32, init_std=0.05)
MOE = dataclasses.replace(TINY, ffn_type="moe", n_experts=4, experts_per_token=2, expert_d_ff=64)
TOKENS = jnp.asarray(np.random.default_rng(0).integers(0, 64, (2, 12)), jnp.int32)


@nnx.jit
def logits(model, tokens):
    """The model's logits, one compile (eagerly each operation would compile)."""
    return model(tokens)


def flat(tree) -> dict:
    if isinstance(tree, nnx.State):
        tree = nnx.to_pure_dict(tree)
    return traversals.flatten_mapping(jax.device_get(tree))


def randomise_b(model, seed: int = 1, std: float = 0.1) -> None:
    """Every adapter's B drawn at random (PEFT's zero B would hide a wrong B A)."""
    for i, (path, v) in enumerate(nnx.to_flat_state(nnx.state(model, nnx.Param))):
        if path[-1] == "lora_b":
            v[...] = std * jax.random.normal(jax.random.key(seed + i), v.shape)


def naive_kernels(model, lora: LoRAConfig) -> dict:
    """`W + scale A B` of every adapted projection, by one einsum over the flattened in / out dims."""
    out = {}
    for path, v in flat(nnx.state(model, nnx.Param)).items():
        if path[-1] != "lora_a":
            continue
        owner = path[:-2]
        a = np.asarray(v)
        b = np.asarray(flat(nnx.state(model, nnx.Param))[(*owner, "adapter", "lora_b")])
        w = np.asarray(flat(nnx.state(model, nnx.Param))[(*owner, "kernel")])
        lead = b.ndim - 1 - (w.ndim - a.ndim + 1)  # leading (layer, expert) dims
        a2 = a.reshape(*a.shape[:lead], -1, a.shape[-1])
        b2 = b.reshape(*b.shape[:lead + 1], -1)
        out[owner] = w + lora.scale * np.einsum("...ir,...ro->...io", a2, b2).reshape(w.shape)
    return out


@pytest.mark.parametrize("cfg", [TINY, MOE], ids=["dense", "moe"])
def test_adapters_start_at_the_base_and_act_as_w_plus_scaled_ba(cfg):
    targets = ("all-linear",) if cfg is MOE else LoRAConfig().targets
    lora = LoRAConfig(rank=4, alpha=8.0, targets=targets)
    base, adapted = Transformer(cfg, rngs=nnx.Rngs(0)), lora_model(cfg, lora)
    want = np.asarray(logits(base, TOKENS))
    np.testing.assert_allclose(np.asarray(logits(adapted, TOKENS)), want, atol=1e-6)  # B = 0: the base, as PEFT starts
    randomise_b(adapted)
    got = np.asarray(logits(adapted, TOKENS))
    assert np.max(np.abs(got - want)) > 0.05  # the adapters act
    # the reference: the base model with each adapted kernel replaced by W + scale A B, built here
    state = flat(nnx.state(base, nnx.Param))
    kernels = naive_kernels(adapted, lora)
    assert len(kernels) == (8 if cfg is MOE else 7)  # q k v o, and the router and 3 expert projections or the FFN's 3
    for owner, w in kernels.items():
        state[(*owner, "kernel")] = w
    reference = nnx.merge(abstract_params(cfg)[0], traversals.unflatten_mapping(state))
    np.testing.assert_allclose(got, np.asarray(logits(reference, TOKENS)), atol=2e-5)
    np.testing.assert_allclose(np.asarray(logits(LoRA(lora).merged(adapted), TOKENS)), got, atol=2e-5)  # what convert --to-hf writes
    # what GRPO's rollouts sample from: the merged model; a quantized base is left as it is
    np.testing.assert_allclose(np.asarray(logits(LoRA(lora).sampling(adapted), TOKENS)), got, atol=2e-5)
    assert LoRA(dataclasses.replace(lora, quantize="nf4")).sampling(adapted) is adapted

    # the adapters' gradients: those of the naive W + scale A B (its products written here, one per kernel)
    graphdef, params = nnx.split(adapted, nnx.Param)
    trained = {k: v for k, v in flat(params).items() if k[-1] in ("lora_a", "lora_b")}
    frozen = {k: v for k, v in flat(params).items() if k not in trained}

    def loss(trained, naive: bool):
        every = {**frozen, **trained}
        if naive:
            plain = {k: v for k, v in every.items() if "adapter" not in k}
            for owner in kernels:
                a, b = every[(*owner, "adapter", "lora_a")], every[(*owner, "adapter", "lora_b")]
                w = every[(*owner, "kernel")]
                lead = b.ndim - 1 - (w.ndim - a.ndim + 1)
                product = jnp.einsum("...ir,...ro->...io", a.reshape(*a.shape[:lead], -1, a.shape[-1]),
                                     b.reshape(*b.shape[:lead + 1], -1))
                plain[(*owner, "kernel")] = w + lora.scale * product.reshape(w.shape)
            model = nnx.merge(abstract_params(cfg)[0], traversals.unflatten_mapping(plain))
        else:
            model = nnx.merge(graphdef, traversals.unflatten_mapping(every))
        return jnp.sum(jnp.sin(model(TOKENS)))

    got_grads, want_grads = (jax.jit(jax.grad(loss), static_argnums=1)(trained, naive) for naive in (False, True))
    for k in trained:
        np.testing.assert_allclose(got_grads[k], want_grads[k], atol=2e-5, rtol=1e-4, err_msg=str(k))


def test_a_lora_step_moves_only_the_adapters_and_keeps_no_optimiser_state_for_the_base():
    lora = LoRAConfig(rank=4, alpha=8.0, targets=("q_proj", "v_proj"))
    tc = TrainConfig(batch_size=2, seq_len=8, steps=2, warmup_steps=0, lr=1e-2, weight_decay=0.0)
    trainer = make_trainer(TINY, tc, one_device(), lora=lora)
    state = trainer.states.init(0)
    adapters = {k: v for k, v in flat(state["params"]).items() if "adapter" in k}
    assert {k[-3] for k in adapters} == {"q_proj", "v_proj"} and len(adapters) == 4
    n_adapter = sum(v.size for v in adapters.values())
    n_opt = sum(np.size(x) for x in jax.tree.leaves(state["opt_state"]))
    assert 2 * n_adapter <= n_opt <= 2 * n_adapter + 8  # Adam's two moments of the adapters, and its counts
    before = flat(state["params"])
    state, metrics = trainer.train_step(state, trainer.batches.put(token_batch(1, 2, 8, 64)))
    after = flat(state["params"])
    moved = {k for k in before if not np.array_equal(before[k], after[k])}
    assert moved == {k for k in adapters if k[-1] == "lora_b"}  # A's gradient is zero while B is (B A: dA = x dy B^T)
    assert bool(metrics["finite"])


def test_lora_on_a_mesh_equals_one_device():
    """FSDP x tensor: the adapters split by the same logical rules; every adapter gradient as on one device."""
    lora = LoRAConfig(rank=4, alpha=8.0)
    tc = probe(TrainConfig(batch_size=4, seq_len=8, steps=2, warmup_steps=0))
    batch = token_batch(1, 4, 8, 64)
    grads = {}
    for name, mesh in (("one", one_device()), ("many", make_mesh(fsdp=2, tensor=2, devices=jax.devices()[:4]))):
        trainer = make_trainer(TINY, tc, mesh, lora=lora)
        state = trainer.states.init(0)
        params = flat(state["params"])
        for i, k in enumerate(sorted(k for k in params if k[-1] == "lora_b")):
            params[k] = 0.1 * np.random.default_rng(i).standard_normal(params[k].shape).astype(np.float32)
        state["params"] = jax.tree.map(lambda x, like: jax.device_put(x, like.sharding),
                                       traversals.unflatten_mapping(params), state["params"])
        if name == "many":
            spec = state["params"]["stages"][0]["blocks"][0]["self_attn"]["q_proj"]["adapter"]["lora_b"].sharding.spec
            assert "tensor" in str(spec)  # B [layers, r, heads, head_dim]: its heads split as the kernel's
        grads[name], _ = step_gradients(trainer, state, batch)
    trained = lambda g: {k: v for k, v in g.items() if "adapter" in k}  # noqa: E731
    got, want = trained(flat(grads["many"])), trained(flat(grads["one"]))
    assert all(np.abs(v).max() > 0 for v in want.values())  # A and B both have gradients now
    assert_leaves_match({"/".join(map(str, k)): v for k, v in got.items()},
                        {"/".join(map(str, k)): v for k, v in want.items()}, rtol=1e-4)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_a_peft_adapter_gives_peft_logits_and_writes_back_the_same_file(family, tmp_path):
    """PEFT's adapter on the transformers base (its logits, made by PEFT) read here; written back
    in PEFT's format, the same tensors under the same names."""
    ref = dict(np.load(PEFT / family / "reference.npz"))
    cfg, base = from_hf(PEFT / family / "base")
    lora = dataclasses.replace(read_peft_config(PEFT / family / "adapter"),
                               targets=peft_targets(PEFT / family / "adapter", base, family))
    assert (lora.rank, lora.alpha) == (4, 8.0)
    model = lora_model(cfg, lora)
    adapters = flat(read_peft(PEFT / family / "adapter", model, family))
    state = flat(nnx.state(model, nnx.Param))
    state.update(flat(nnx.state(base, nnx.Param)))
    state.update(adapters)
    model = nnx.merge(nnx.graphdef(model), traversals.unflatten_mapping(state))
    tokens = jnp.asarray(ref["tokens"])
    V = ref["peft_logits"].shape[-1]
    scale = float(np.max(np.abs(ref["peft_logits"])))
    assert np.max(np.abs(ref["peft_logits"] - ref["base_logits"])) > 0.1  # the adapter matters
    np.testing.assert_allclose(np.asarray(logits(model, tokens))[..., :V], ref["peft_logits"], atol=1e-4 * scale)
    np.testing.assert_allclose(np.asarray(logits(LoRA(lora).merged(model), tokens))[..., :V], ref["merged_logits"], atol=1e-4 * scale)
    write_peft(model, lora, tmp_path, family)
    ours, theirs = load_file(tmp_path / "adapter_model.safetensors"), load_file(PEFT / family / "adapter" /
                                                                              "adapter_model.safetensors")
    assert sorted(ours) == sorted(theirs)
    for name in theirs:
        np.testing.assert_array_equal(ours[name], theirs[name], err_msg=name)
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["peft_type"]) == (4, 8.0, "LORA")


@pytest.mark.parametrize("kind, bound", [("int8", 0.01), ("nf4", 0.15)])
def test_a_quantized_base_stays_near_the_float_base_and_trains_its_adapters(kind, bound):
    """Logits of the int8 / NF4 base within `bound` of the float base's largest |logit| (measured:
    int8 0.5%, NF4 11%, on this model); pieces of the stated dtypes; the adapters train."""
    cfg = dataclasses.replace(TINY, init_std=0.02)
    base = Transformer(cfg, rngs=nnx.Rngs(0))
    model = lora_model(cfg, LoRAConfig(quantize=kind))
    want, got = np.asarray(logits(base, TOKENS)), np.asarray(logits(model, TOKENS))
    distance = float(np.max(np.abs(got - want)) / np.max(np.abs(want)))
    print(f"{kind}: max |logit - float base's| / max |logit| = {distance:.4f}")
    assert distance < bound
    pieces = {k[-1]: v.dtype for k, v in flat(nnx.state(model, nnx.Param)).items() if "q_proj" in k and "kernel" in k}
    assert pieces == ({"q": np.int8, "scale": np.float32} if kind == "int8" else
                      {"codes": np.uint8, "absmax_q": np.int8, "absmax_scale": np.float32,
                       "absmax_mean": np.float32})
    tc = TrainConfig(batch_size=2, seq_len=8, steps=3, warmup_steps=0, lr=1e-2)
    trainer = make_trainer(cfg, tc, one_device(), lora=LoRAConfig(quantize=kind))
    state, batch = trainer.states.init(0), trainer.batches.put(token_batch(1, 2, 8, 64))
    losses = []
    for _ in range(3):
        state, metrics = trainer.train_step(state, batch)
        losses.append(float(metrics["loss"]))
    assert losses[-1] < losses[0] - 0.1


def test_what_lora_refuses():
    with pytest.raises(ValueError, match=r"lora.targets: 'qproj' names no projection .*self_attn.q_proj"):
        lora_model(TINY, LoRAConfig(targets=("qproj",)))
    with pytest.raises(ValueError, match=r"lora.dropout=0.1 cannot apply to mlp.experts.gate_proj"):
        lora_model(MOE, LoRAConfig(dropout=0.1, targets=("experts.gate_proj",)))
    narrow = dataclasses.replace(TINY, n_kv_heads=2)  # k_proj: 2 heads x 16 = 32 outputs
    with pytest.raises(ValueError, match=r"blocks of 64, and self_attn.k_proj has 32"):
        lora_model(narrow, LoRAConfig(quantize="nf4"))
    for field, value, allowed in (("rank", 0, "integer >= 1"), ("alpha", -1.0, "> 0"), ("dropout", 1.0, r"\[0, 1\)"),
                                  ("quantize", "fp4", "none, int8, nf4"), ("targets", [], "non-empty")):
        with pytest.raises(ValueError, match=rf"LoRAConfig.{field}=.* is invalid: .*{allowed}"):
            LoRAConfig.from_dict({field: value})
    with pytest.raises(ValueError, match=r"unknown key lora.ranks; did you mean rank"):
        LoRAConfig.from_dict({"ranks": 4})


def test_what_a_peft_adapter_import_refuses(tmp_path, capsys):
    from modern_jax.cli import main

    base = str(PEFT / "llama" / "base")
    common = ["train", "--config", str(REPO / "configs/finetune_lora.yaml"), "--init-from-hf", base,
              "--data", str(REPO / "tests/fixtures/hf_chat/chat.jsonl"), "--output-dir", str(tmp_path / "run"),
              f"data.tokenizer_path={REPO / 'tests/fixtures/hf_chat/tokenizer.json'}"]
    assert main([*common[:3], *common[5:], "--init-adapter", str(PEFT / "llama" / "adapter")]) == 2
    assert "--init-adapter needs --init-from-hf" in capsys.readouterr().err
    assert main([*common, "--init-adapter", str(PEFT / "llama" / "adapter")]) == 2  # the config's rank 16, the adapter's 4
    assert "lora.rank=16 disagrees with the adapter --init-adapter" in capsys.readouterr().err
    bad = tmp_path / "adapter"
    bad.mkdir()
    config = json.loads((PEFT / "llama" / "adapter" / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, "use_dora": True}))
    (bad / "adapter_model.safetensors").write_bytes((PEFT / "llama" / "adapter" / "adapter_model.safetensors").read_bytes())
    with pytest.raises(ValueError, match=r"adapter_config.json: use_dora=True \(DoRA\) is not supported"):
        read_peft_config(bad)
    assert not (tmp_path / "run").exists()  # nothing was written


def test_expert_adapters_round_trip_through_peft_names_one_per_expert(tmp_path):
    """A mixture's experts (Qwen3-MoE: one torch Linear per expert) take one adapter each, under
    PEFT's per-module names; written and read back, the same model."""
    cfg = dataclasses.replace(MOE, qk_norm="head", tie_embeddings=False)
    lora = LoRAConfig(rank=4, alpha=8.0, targets=("q_proj", "experts.gate_proj", "experts.down_proj"))
    model = lora_model(cfg, lora)
    randomise_b(model)
    write_peft(model, lora, tmp_path, "qwen3_moe")
    names = set(load_file(tmp_path / "adapter_model.safetensors"))
    assert "base_model.model.model.layers.1.mlp.experts.3.down_proj.lora_B.weight" in names
    assert len(names) == 2 * 2 * (1 + 2 * 4)  # A and B, 2 layers, q_proj and 2 projections x 4 experts
    config = json.loads((tmp_path / "adapter_config.json").read_text())
    import re

    assert re.fullmatch(config["target_modules"], "model.layers.0.mlp.experts.2.gate_proj")
    assert not re.fullmatch(config["target_modules"], "model.layers.0.mlp.experts.2.up_proj")
    back = flat(read_peft(tmp_path, model, "qwen3_moe"))
    for k, v in back.items():
        np.testing.assert_array_equal(v, flat(nnx.state(model, nnx.Param))[k], err_msg=str(k))


PRESETS = [p for p in sorted((REPO / "configs").glob("*.yaml"))
           if "vocab_size" in (load_config_file(p).get("model") or {})]  # the model configs (not run files)


@pytest.mark.parametrize("run_file", ["finetune_lora.yaml", "finetune_qlora.yaml"])
def test_the_shipped_lora_run_files_adapt_every_preset(run_file):
    """The shipped LoRA and QLoRA run files build on every model preset (dense with gated or GELU
    FFNs, MLA, mixtures of experts with shared experts and routers), abstractly: every projection
    in the blocks gains an adapter; lora.dropout reaches each one with an input of its own, and the
    experts' and routers' (added to their weights) are named by `undropped`, which the run logs."""
    from flax import nnx

    from modern_jax.config import model_config_from_file
    from modern_jax.model import projections
    from modern_jax.training.converters import MERGED_SITES, abstract_converted

    lora = LoRAConfig.of_run(load_config_file(REPO / "configs" / run_file))
    assert lora.dropout > 0
    kinds = set()
    for path in PRESETS:
        auto_vocab = load_config_file(path)["model"]["vocab_size"] == "auto"
        cfg = model_config_from_file(path, ["model.vocab_size=256"] if auto_vocab else [])
        model = nnx.merge(*abstract_converted(cfg, LoRA(lora)))
        sites = {name: module for name, module, _, _ in projections(model)}
        assert all(hasattr(module, "adapter") for module in sites.values()), path.name
        merged_sites = {name for name, module in sites.items()
                        if isinstance(module, MERGED_SITES) or name.endswith("router.proj")}
        assert LoRA(lora).undropped(model) == sorted(merged_sites), path.name
        assert all(module.adapter.dropout == lora.dropout for name, module in sites.items()
                   if name not in merged_sites), path.name
        kinds.add(("moe" if merged_sites else "dense", "mla" if "self_attn.q_a_proj" in sites else
                   "gated" if "mlp.gate_proj" in sites else "plain"))
    assert {k for k, _ in kinds} == {"moe", "dense"} and {k for _, k in kinds} == {"mla", "gated", "plain"}
