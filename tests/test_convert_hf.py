"""Hugging Face checkpoints: parity with transformers on golden fixtures, round trips, bad checkpoints.

The fixtures under tests/fixtures/hf/<name>/ are tiny random checkpoints saved by
transformers with its fp32 logits and 32 greedy tokens (scripts/make_hf_fixtures.py);
no torch is needed here. tests/test_convert_live.py repeats the parity checks live.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors import safe_open
from safetensors.numpy import save_file

from modern_jax.convert import (CheckpointError, config_from_hf, convert_from_hf, convert_to_hf, from_hf,
                                load_checkpoint, to_hf)
from modern_jax.convert.hf_checkpoint import Target, hf_tensor, place, plan
from modern_jax.convert.hf_config import architecture
from modern_jax.convert.hf_families import FAMILIES
from modern_jax.convert.hf_weights import Rule

FIXTURES = Path(__file__).parent / "fixtures" / "hf"
MANIFEST = json.loads((FIXTURES / "manifest.json").read_text())
NAMES = sorted(MANIFEST["checkpoints"])
FP32 = [n for n in NAMES if MANIFEST["checkpoints"][n]["dtype"] == "float32"]
LOGIT_TOL = 1e-4


def reference(name: str) -> dict[str, np.ndarray]:
    with np.load(FIXTURES / name / "reference.npz") as z:
        return dict(z)


@nnx.jit
def _forward(model, tokens):
    return model(tokens)


@nnx.jit
def _decode(model, tokens, cache):
    return model(tokens, cache=cache)


def greedy(model, tokens, steps: int) -> tuple[np.ndarray, np.ndarray]:
    """Greedy continuation with the KV cache (prefill, then one token at a time): the tokens
    [B, steps] and the logits each was chosen from [B, steps, V]."""
    B, T = tokens.shape
    cache = model.init_cache(B, T + steps)
    logits, cache = _decode(model, jnp.asarray(tokens), cache)
    out, step_logits = [], []
    for _ in range(steps):
        step_logits.append(logits[:, -1])
        nxt = jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)
        out.append(nxt)
        logits, cache = _decode(model, nxt[:, None], cache)
    return np.asarray(jnp.stack(out, axis=1)), np.asarray(jnp.stack(step_logits, axis=1))


def hf_tensors(directory: Path) -> dict[str, np.ndarray]:
    out = {}
    for file in sorted(directory.glob("*.safetensors")):
        with safe_open(file, framework="np") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


@pytest.fixture(scope="module")
def loaded():
    cache = {}

    def load(name, dtype="float32"):
        if (name, dtype) not in cache:
            cache[name, dtype] = from_hf(FIXTURES / name, dtype=dtype)
        return cache[name, dtype]

    return load


# ----- parity with transformers ----------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_logits_match_transformers(name, loaded):
    ref = reference(name)
    _, model = loaded(name)
    logits = np.asarray(_forward(model, jnp.asarray(ref["tokens"])))
    diff = float(np.max(np.abs(logits - ref["logits"])))
    print(f"{name}: max|logit diff| = {diff:.2e}")
    assert diff <= LOGIT_TOL, diff


@pytest.mark.parametrize("name", NAMES)
def test_greedy_generation_matches_transformers(name, loaded):
    ref = reference(name)
    _, model = loaded(name)
    tokens, step_logits = greedy(model, ref["tokens"], ref["greedy"].shape[1])
    np.testing.assert_array_equal(tokens, ref["greedy"])
    V = ref["step_logits"].shape[-1]
    assert np.max(np.abs(step_logits[..., :V] - ref["step_logits"])) <= LOGIT_TOL


def test_the_fixtures_cover_every_family():
    types = {json.loads((FIXTURES / n / "config.json").read_text())["model_type"] for n in NAMES}
    assert {"llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3_text", "olmo2", "gpt2", "gpt_neox", "gptj",
            "phi", "qwen3_moe", "mixtral", "deepseek_v3", "gpt_oss", "llama4_text"} <= types
    assert (FIXTURES / "qwen2" / "model.safetensors.index.json").exists()  # a sharded checkpoint


# ----- mixtures of experts ------------------------------------------------------------------

def test_expert_tensors_land_in_their_expert_and_layer(loaded):
    """Per-expert tensors (qwen3_moe), fused interleaved ones (gpt-oss) and fused halves (Llama 4) fill
    the stacked `[E, D, F]` kernels; DeepSeek's e_score_correction_bias is the router's selection bias."""
    def moe_block(model, layer):
        (_, s, i, j), = [m for m in model.moe_layers() if m[0] == layer]
        return model.stages[s].blocks[j].mlp, i

    _, qwen = loaded("qwen3_moe")
    mlp, i = moe_block(qwen, 2)
    up = hf_tensors(FIXTURES / "qwen3_moe")["model.layers.2.mlp.experts.5.up_proj.weight"]  # [F, D]
    np.testing.assert_array_equal(np.asarray(mlp.experts.up_proj.kernel[i, 5]), up.T)

    _, oss = loaded("gpt_oss")
    mlp, i = moe_block(oss, 1)
    gate_up = hf_tensors(FIXTURES / "gpt_oss")["model.layers.1.mlp.experts.gate_up_proj"]  # [E, D, 2F]
    np.testing.assert_array_equal(np.asarray(mlp.experts.gate_proj.kernel[i]), gate_up[..., 0::2])
    np.testing.assert_array_equal(np.asarray(mlp.experts.up_proj.kernel[i]), gate_up[..., 1::2])

    _, llama4 = loaded("llama4_text")
    mlp, i = moe_block(llama4, 3)
    gate_up = hf_tensors(FIXTURES / "llama4_text")["model.layers.3.feed_forward.experts.gate_up_proj"]
    F = gate_up.shape[-1] // 2
    np.testing.assert_array_equal(np.asarray(mlp.experts.gate_proj.kernel[i]), gate_up[..., :F])
    np.testing.assert_array_equal(np.asarray(mlp.experts.up_proj.kernel[i]), gate_up[..., F:])
    assert [m[0] for m in llama4.moe_layers()] == [1, 3]

    _, deepseek = loaded("deepseek_v3")
    tensors = hf_tensors(FIXTURES / "deepseek_v3")
    assert [m[0] for m in deepseek.moe_layers()] == [1, 2]  # first_k_dense_replace=1
    for layer in (1, 2):
        mlp, i = moe_block(deepseek, layer)
        bias = tensors[f"model.layers.{layer}.mlp.gate.e_score_correction_bias"]
        assert np.any(bias)
        np.testing.assert_array_equal(np.asarray(mlp.router.selection_bias[i]), bias)


def test_deepseek_multi_token_prediction_layer_is_skipped(tmp_path, loaded, caplog):
    """`model.layers.{num_hidden_layers}.*` (DeepSeek's MTP layer) is not part of the model: loading
    skips it and says so; the same tensors without `num_nextn_predict_layers` are an error."""
    directory = copy_fixture("deepseek_v3", tmp_path)

    def change(t):
        t["model.layers.3.eh_proj.weight"] = np.zeros((32, 64), np.float32)
        t["model.layers.3.mlp.experts.0.up_proj.weight"] = np.zeros((16, 32), np.float32)

    rewrite(directory, change)
    with pytest.raises(CheckpointError, match=r"2 tensor\(s\) the deepseek_v3 model has no place for: "
                                              r"model\.layers\.3\.eh_proj\.weight"):
        from_hf(directory)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(dict(config, num_nextn_predict_layers=1)))
    with caplog.at_level(logging.INFO, logger="modern_jax.convert.hf_checkpoint"):
        _, model = from_hf(directory)
    assert "skipping 2 tensor(s) of the multi-token-prediction layer" in caplog.text
    told = []  # the CLI passes its stderr note as `log`
    from_hf(directory, log=told.append)
    assert len(told) == 1 and "skipping 2 tensor(s) of the multi-token-prediction layer" in told[0]
    ref = reference("deepseek_v3")
    np.testing.assert_array_equal(np.asarray(_forward(model, jnp.asarray(ref["tokens"]))),
                                  np.asarray(_forward(loaded("deepseek_v3")[1], jnp.asarray(ref["tokens"]))))
    to_hf(model, tmp_path / "out", model_type="deepseek_v3")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 0
    assert sorted(hf_tensors(tmp_path / "out")) == sorted(hf_tensors(FIXTURES / "deepseek_v3"))


def test_deepseek_mtp_layer_loads_predicts_as_transformers_and_exports_bit_identical(tmp_path):
    """With mtp_depth=1, DeepSeek-V3's layer n (`eh_proj`, `enorm`, `hnorm`, its block, `shared_head.norm`) loads
    into the MTP module: its logits for token i + 2 equal transformers' `MtpLayer` on the same weights (1e-4), the
    layer's copies of the embedding and head are skipped, and the export writes every tensor back bit-identical
    (the copies included) with num_nextn_predict_layers=1. A depth the checkpoint lacks is refused by name."""
    directory, ref = FIXTURES / "deepseek_v3_mtp", reference("deepseek_v3_mtp")
    told = []
    cfg, model = from_hf(directory, mtp_depth=1, log=told.append)
    assert cfg.mtp_depth == 1 and "copies of the shared tensors" in told[0]
    tokens = jnp.asarray(ref["tokens"])
    B, T = tokens.shape
    h, _ = model.hidden_states(tokens)
    (h1,), _ = model.mtp_states(h, tokens, jnp.broadcast_to(jnp.arange(T), (B, T)))
    np.testing.assert_allclose(np.asarray(model.logits(h1))[:, :T - 1], ref["mtp_logits"], atol=1e-4, rtol=0)
    to_hf(model, tmp_path / "out", model_type="deepseek_v3")
    assert json.loads((tmp_path / "out" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    got, want = hf_tensors(tmp_path / "out"), hf_tensors(directory)
    assert sorted(got) == sorted(want)
    for name in want:
        np.testing.assert_array_equal(got[name], want[name], err_msg=name)
    _, plain = from_hf(directory)  # without mtp_depth: the layer is skipped, as transformers' model leaves it out
    assert plain.mtp is None
    with pytest.raises(ValueError, match=r"mtp_depth=2 .* config has 1 \(num_nextn_predict_layers\): use mtp_depth <= 1"):
        from_hf(directory, mtp_depth=2)


def test_to_hf_refuses_a_mixture_the_family_cannot_express(loaded, tmp_path):
    _, deepseek = loaded("deepseek_v3")  # MLA, a dense first layer, sigmoid routing
    with pytest.raises(ValueError, match=r"mixtral cannot express this model: .*attention_type='mla'"):
        to_hf(deepseek, tmp_path / "a", model_type="mixtral")
    _, qwen = loaded("qwen3_moe")  # a dense layer between the mixtures
    with pytest.raises(ValueError, match=r"mixtral cannot express this model: .*moe_pattern='EDE'"):
        to_hf(qwen, tmp_path / "b", model_type="mixtral")
    _, oss = loaded("gpt_oss")
    with pytest.raises(ValueError, match=r"llama4_text cannot express this model: .*layer types are full_attention"):
        to_hf(oss, tmp_path / "c", model_type="llama4_text")  # sliding layers
    assert not any(tmp_path.iterdir())


# ----- dtypes -------------------------------------------------------------------------------

def test_bf16_checkpoint_loads_exactly_in_both_dtypes(loaded):
    tensors = hf_tensors(FIXTURES / "llama_bf16")
    cfg16, model16 = loaded("llama_bf16", "bfloat16")
    _, model32 = loaded("llama_bf16", "float32")
    assert (cfg16.dtype, cfg16.param_dtype) == ("bfloat16", "bfloat16")
    embed = tensors["model.embed_tokens.weight"]
    assert embed.dtype == jnp.bfloat16
    assert model16.embed_tokens[...].dtype == jnp.bfloat16 and model32.embed_tokens[...].dtype == jnp.float32
    np.testing.assert_array_equal(np.asarray(model16.embed_tokens[...]), embed)
    np.testing.assert_array_equal(np.asarray(model32.embed_tokens[...]), embed.astype(np.float32))
    ref = reference("llama_bf16")
    logits16 = np.asarray(_forward(model16, jnp.asarray(ref["tokens"])))
    assert logits16.dtype == np.float32
    scale = np.max(np.abs(ref["logits"]))
    assert np.max(np.abs(logits16 - ref["logits"])) < 0.1 * scale  # bf16 compute: close, not exact


def test_fp32_checkpoint_loads_as_bf16(loaded):
    _, model = loaded("qwen3", "bfloat16")
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert {leaf.dtype for leaf in leaves} == {jnp.dtype(jnp.bfloat16)}
    q = hf_tensors(FIXTURES / "qwen3")["model.layers.1.self_attn.q_proj.weight"]  # [N*H, D]
    ours = np.asarray(model.stages[0].blocks[0].self_attn.q_proj.kernel[1])  # [D, N, H], layer 1
    np.testing.assert_array_equal(ours.reshape(ours.shape[0], -1).T, q.astype(jnp.bfloat16))


# ----- round trips -----------------------------------------------------------------------

@pytest.mark.parametrize("name", NAMES)
def test_to_hf_writes_the_original_tensors(name, loaded, tmp_path):
    src = FIXTURES / name
    hf = json.loads((src / "config.json").read_text())
    cfg, model = loaded(name, MANIFEST["checkpoints"][name]["dtype"])
    files = to_hf(model, tmp_path, model_type=hf["model_type"])
    assert "config.json" in files
    original, written = hf_tensors(src), hf_tensors(tmp_path)
    assert sorted(written) == sorted(original)
    for key, value in original.items():
        assert written[key].dtype == value.dtype, key
        np.testing.assert_array_equal(written[key], value, err_msg=key)
    back = json.loads((tmp_path / "config.json").read_text())
    assert architecture(config_from_hf(back)) == architecture(cfg)


def transformers_architecture(directory: Path) -> dict:
    """The architecture of the config.json in `directory` as transformers reads it (`AutoConfig`,
    no torch): every field its config class has, defaults filled in, but names, token ids,
    dropout rates, the initialiser's range and the storage dtype; a few of transformers' own
    defaults written out, so that two spellings of one network compare equal."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(directory).to_dict()
    arch = {k: v for k, v in config.items()
            if not (k in ("_name_or_path", "transformers_version", "dtype", "initializer_range", "use_cache")
                    or k.endswith("_token_id") or "dropout" in k or "pdrop" in k)}
    heads = arch.get("num_attention_heads")
    if "head_dim" in arch and arch["head_dim"] is None:  # transformers: hidden_size / heads
        arch["head_dim"] = arch["hidden_size"] // heads
    if arch.get("n_inner", 0) is None:  # GPT-2 style: 4 n_embd
        arch["n_inner"] = 4 * arch["n_embd"]
    if "layer_types" in arch:  # derived from max_window_layers, and what the model reads
        arch.pop("max_window_layers", None)
    if "decoder_sparse_step" in arch:  # Qwen-MoE: which layers are sparse, whichever way it is said
        step, dense = arch.pop("decoder_sparse_step"), arch.pop("mlp_only_layers")
        arch["sparse_layers"] = [i for i in range(arch["num_hidden_layers"])
                                 if i not in dense and arch["num_local_experts"] > 0 and (i + 1) % step == 0]
    if isinstance(arch.get("rope_parameters"), dict):  # `type` is the old name of rope_type
        rope = {k: float(v) if isinstance(v, int) and not isinstance(v, bool) else v
                for k, v in arch["rope_parameters"].items() if k != "type"}
        if rope.get("rope_type") == "yarn":
            rope = {"beta_fast": 32.0, "beta_slow": 1.0, "truncate": True, **rope}
        arch["rope_parameters"] = rope
    return arch


@pytest.mark.parametrize("name", NAMES)
def test_transformers_reads_the_exported_config_as_the_original(name, loaded, tmp_path):
    """`to_hf`'s config.json, parsed by transformers' AutoConfig, has the architecture of the
    fixture's own config.json (hidden size, layers, heads, KV heads, head dim, vocabulary, RoPE
    and its scaling, norms, windows and layer types, experts and routing, ...)."""
    hf = json.loads((FIXTURES / name / "config.json").read_text())
    _, model = loaded(name, MANIFEST["checkpoints"][name]["dtype"])
    to_hf(model, tmp_path, model_type=hf["model_type"])
    want, got = transformers_architecture(FIXTURES / name), transformers_architecture(tmp_path)
    differ = {k: (want[k], got.get(k)) for k in want if got.get(k) != want[k]}
    assert not differ, f"(original, exported): {differ}"
    assert {"vocab_size", "tie_word_embeddings"} <= want.keys()


def test_to_hf_shards_and_reloads(loaded, tmp_path):
    _, model = loaded("gemma2")
    files = to_hf(model, tmp_path, model_type="gemma2", max_shard_bytes=20_000)
    assert "model.safetensors.index.json" in files and len(files) > 3
    _, again = from_hf(tmp_path)
    ref = reference("gemma2")
    np.testing.assert_array_equal(np.asarray(_forward(again, jnp.asarray(ref["tokens"]))),
                                  np.asarray(_forward(model, jnp.asarray(ref["tokens"]))))


def test_to_hf_refuses_a_family_that_cannot_express_the_model(loaded, tmp_path):
    _, model = loaded("qwen3")  # QK-norm: llama has none
    with pytest.raises(ValueError, match=r"llama cannot express this model: qk_norm='head'"):
        to_hf(model, tmp_path, model_type="llama")
    assert not (tmp_path / "model.safetensors").exists()


@pytest.mark.quick
def test_orbax_checkpoint_round_trip(tmp_path):
    src = FIXTURES / "gpt_neox"
    convert_from_hf(src, tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "config.yaml").is_file() and (tmp_path / "ckpt" / "params").is_dir()
    cfg, model = load_checkpoint(tmp_path / "ckpt")
    assert cfg == config_from_hf(json.loads((src / "config.json").read_text()))
    ref = reference("gpt_neox")
    logits = np.asarray(_forward(model, jnp.asarray(ref["tokens"])))
    assert np.max(np.abs(logits - ref["logits"])) <= LOGIT_TOL
    convert_to_hf(tmp_path / "ckpt", tmp_path / "hf")  # model_type remembered from the source
    original, written = hf_tensors(src), hf_tensors(tmp_path / "hf")
    assert sorted(written) == sorted(original)
    for key in original:
        np.testing.assert_array_equal(written[key], original[key], err_msg=key)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config["model_type"] == "gpt_neox" and config["eos_token_id"] == 2  # carried through


# ----- bad checkpoints -------------------------------------------------------------------

def copy_fixture(name: str, dst: Path) -> Path:
    shutil.copytree(FIXTURES / name, dst / name)
    return dst / name


def rewrite(directory: Path, change) -> None:
    file = directory / "model.safetensors"
    tensors = hf_tensors(directory)
    change(tensors)
    save_file(tensors, str(file), metadata={"format": "pt"})


@pytest.mark.quick
def test_missing_tensor_is_named(tmp_path):
    directory = copy_fixture("llama", tmp_path)
    rewrite(directory, lambda t: t.pop("model.layers.1.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) missing: model\.layers\.1\.mlp\.up_proj\.weight"):
        from_hf(directory)


@pytest.mark.quick
def test_wrong_shape_names_the_tensor_and_both_shapes(tmp_path):
    directory = copy_fixture("llama", tmp_path)

    def change(t):
        t["model.layers.2.self_attn.k_proj.weight"] = np.zeros((24, 32), np.float32)

    rewrite(directory, change)
    with pytest.raises(CheckpointError, match=r"model\.layers\.2\.self_attn\.k_proj\.weight: the checkpoint has "
                                              r"\[24, 32\], the model expects \[16, 32\]"):
        from_hf(directory)


def test_unused_tensor_is_named(tmp_path):
    directory = copy_fixture("gpt2", tmp_path)

    def change(t):
        t["transformer.h.0.attn.q_attn.weight"] = np.zeros((32, 32), np.float32)
        t["transformer.h.0.attn.bias"] = np.zeros((1, 1, 64, 64), np.float32)  # an old mask buffer: ignored

    rewrite(directory, change)
    with pytest.raises(CheckpointError, match=r"1 tensor\(s\) the gpt2 model has no place for: "
                                              r"transformer\.h\.0\.attn\.q_attn\.weight$"):
        from_hf(directory)


def test_unknown_family_lists_the_supported_ones(tmp_path):
    directory = copy_fixture("llama", tmp_path)
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps(dict(config, model_type="falcon")))
    with pytest.raises(ValueError, match=r"model_type .falcon. is not supported; supported: llama, mistral, "
                                         r"qwen2, qwen3, gemma2"):
        from_hf(directory)


def test_unsupported_setting_is_named(tmp_path):
    directory = copy_fixture("llama", tmp_path)
    config = json.loads((directory / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "longrope", "rope_theta": 10000.0}
    (directory / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"rope_type='longrope' is not supported"):
        from_hf(directory)


def test_no_safetensors(tmp_path):
    (tmp_path / "config.json").write_text((FIXTURES / "llama" / "config.json").read_text())
    (tmp_path / "pytorch_model.bin").write_bytes(b"")
    with pytest.raises(CheckpointError, match=r"no safetensors files \(found pytorch_model\.bin"):
        from_hf(tmp_path)
    with pytest.raises(CheckpointError, match="no config.json"):
        from_hf(tmp_path / "nowhere")


def test_tied_head_saved_anyway_is_accepted(tmp_path):
    directory = copy_fixture("qwen3", tmp_path)  # tied
    rewrite(directory, lambda t: t.__setitem__("lm_head.weight", t["model.embed_tokens.weight"]))
    _, model = from_hf(directory)
    assert model.lm_head is None


def test_multimodal_gemma3_prefixes(tmp_path, loaded):
    """A gemma3 (multimodal) checkpoint: the text model under language_model, a vision tower to skip."""
    directory = copy_fixture("gemma3", tmp_path)
    text = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({"model_type": "gemma3", "text_config": text}))

    def change(t):
        for key in list(t):
            t["language_model." + key] = t.pop(key)
        t["vision_tower.vision_model.post_layernorm.weight"] = np.ones(4, np.float32)
        t["multi_modal_projector.mm_soft_emb_norm.weight"] = np.ones(4, np.float32)

    rewrite(directory, change)
    _, model = from_hf(directory)
    ref = reference("gemma3")
    assert np.max(np.abs(np.asarray(_forward(model, jnp.asarray(ref["tokens"]))) - ref["logits"])) <= LOGIT_TOL


def test_every_table_entry_is_well_formed():
    for model_type, family in FAMILIES.items():
        for rules in (family.weights.top, family.weights.layer):
            for key, rule in rules.items():
                groups, ours = rule.axes()
                flat = [a for g in groups for a in g if not a.isdigit()]
                assert sorted(flat) == sorted(ours), (model_type, key)


def test_expert_rules_split_a_stacked_parameter_and_put_it_back_bit_identical():
    """Per-expert tensors (`{i}` and `{e}` index the layers and experts axes) and fused ones
    (one tensor a layer, gate and up interleaved on its last axis, as gpt-oss stores them)."""
    L, E, D, F = 3, 4, 5, 6
    layers = (1, 3, 5)  # the layer each slot of the stacked parameter stands for
    rng = np.random.default_rng(0)
    gate, up = (rng.standard_normal((L, E, D, F)).astype(np.float32) for _ in range(2))
    expert = "model.layers.{i}.mlp.experts"
    rules = {
        "per_expert": (gate, Rule(expert + ".{e}.gate_proj.weight", "F D", "D F")),  # torch Linear [out, in]
        "fused_gate": (gate, Rule(expert + ".gate_up_proj", "E D (F 2)", "E D F", part=0)),
        "fused_up": (up, Rule(expert + ".gate_up_proj", "E D (F 2)", "E D F", part=1)),
    }

    def parameters(fresh: bool) -> list[Target]:
        return [Target((key,), nnx.Param(jnp.zeros_like(w) if fresh else jnp.asarray(w)), rule, layers)
                for key, (w, rule) in rules.items()]

    sources = plan(parameters(fresh=False))
    per_expert = [f"model.layers.{i}.mlp.experts.{e}.gate_proj.weight" for i in layers for e in range(E)]
    fused = [f"model.layers.{i}.mlp.experts.gate_up_proj" for i in layers]
    assert list(sources) == per_expert + fused
    assert {s.target.name: s.slot for s in sources["model.layers.3.mlp.experts.2.gate_proj.weight"]} == {
        "per_expert": (1, 2)}
    assert sorted(s.target.name for s in sources["model.layers.5.mlp.experts.gate_up_proj"]) == [
        "fused_gate", "fused_up"]

    hf = {name: hf_tensor(srcs) for name, srcs in sources.items()}
    assert hf["model.layers.3.mlp.experts.2.gate_proj.weight"].shape == (F, D)
    np.testing.assert_array_equal(hf["model.layers.3.mlp.experts.2.gate_proj.weight"], gate[1, 2].T)
    gate_up = hf["model.layers.5.mlp.experts.gate_up_proj"]
    assert gate_up.shape == (E, D, 2 * F)
    np.testing.assert_array_equal(gate_up[..., 0::2], gate[2])
    np.testing.assert_array_equal(gate_up[..., 1::2], up[2])

    back = plan(parameters(fresh=True))  # the loading direction, into zeroed parameters
    assert list(back) == list(sources)
    for name, x in hf.items():
        for src in back[name]:
            assert src.rule.hf_shape(src.shape) == x.shape  # the header check
    for target in {src.target.name: src.target for srcs in back.values() for src in srcs}.values():
        names, shape = target.slots(), tuple(target.variable.shape)[len(target.rule.variables()):]
        target.variable.set_value(place(target, lambda slot, index, t=target, n=names, s=shape: t.rule.read(
            index, s, None, lambda i, x=hf[n[slot]]: x[i])))
        w = rules[target.name][0]
        assert np.asarray(target.variable[...]).tobytes() == w.tobytes(), target.name
    with pytest.raises(ValueError, match=r"cannot index a parameter of shape \(3, 4, 5, 6\) by \('e', 'i'\)"):
        Rule("model.experts.{e}.layers.{i}.weight", "F D", "D F").tensors((L, E, D, F), i=layers)


# ----- streaming --------------------------------------------------------------------------

def test_each_tensor_is_read_once_and_only_after_the_checks(tmp_path, monkeypatch):
    from modern_jax.convert.safetensors_files import SafetensorsFiles

    reads = []
    read = SafetensorsFiles.read

    def counting(self, entry, index=()):
        reads.append(entry.name)
        return read(self, entry, index)

    monkeypatch.setattr(SafetensorsFiles, "read", counting)
    from_hf(FIXTURES / "qwen2")  # sharded
    assert sorted(reads) == sorted(set(reads)) == sorted(hf_tensors(FIXTURES / "qwen2"))
    reads.clear()
    directory = copy_fixture("qwen2", tmp_path)
    (directory / "model-00003-of-00003.safetensors").unlink()
    index = json.loads((directory / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if "00003" not in v}
    (directory / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match="missing"):
        from_hf(directory)
    assert reads == []  # nothing was read before the checkpoint was known to fit


def test_loading_holds_about_one_copy_of_the_model_on_the_host(tmp_path):
    """Host (numpy) memory while loading stays near one model size, not two."""
    import tracemalloc

    from modern_jax.model import Transformer

    cfg = config_from_hf(dict(model_type="llama", vocab_size=4096, hidden_size=256, intermediate_size=512,
                              num_hidden_layers=4, num_attention_heads=4, tie_word_embeddings=False))
    to_hf(Transformer(cfg, rngs=nnx.Rngs(0)), tmp_path, model_type="llama")
    model_bytes = sum(v.nbytes for v in hf_tensors(tmp_path).values())
    tracemalloc.start()
    from_hf(tmp_path)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1.3 * model_bytes, (peak, model_bytes)


def test_padded_vocabulary_loads_and_writes_back(tmp_path):
    """With `vocab_pad_to` the embedding and head get zero rows past the vocabulary; to_hf drops them."""
    from modern_jax.config import ModelConfig

    if "vocab_pad_to" not in ModelConfig.__dataclass_fields__:
        pytest.skip("ModelConfig has no vocab_pad_to")
    ref = reference("gptj")  # untied head with a bias
    cfg, model = from_hf(FIXTURES / "gptj", vocab_pad_to=48)
    V = cfg.vocab_size
    assert model.embed_tokens.shape[0] == cfg.padded_vocab_size > V
    assert not np.any(np.asarray(model.embed_tokens[...])[V:]) and not np.any(np.asarray(model.lm_head.bias[...])[V:])
    logits = np.asarray(_forward(model, jnp.asarray(ref["tokens"])))
    assert np.max(np.abs(logits[..., :V] - ref["logits"])) <= LOGIT_TOL
    to_hf(model, tmp_path, model_type="gptj")
    original, written = hf_tensors(FIXTURES / "gptj"), hf_tensors(tmp_path)
    for key in original:
        np.testing.assert_array_equal(written[key], original[key], err_msg=key)


def test_index_naming_an_absent_shard(tmp_path):
    directory = copy_fixture("qwen2", tmp_path)
    (directory / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"lists files that are not there: model-00002-of-00003\.safetensors"):
        from_hf(directory)


def test_loads_sharded_onto_a_mesh():
    """With a mesh, each parameter lands sharded by the logical-axis rules; the logits do not change."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec

    from modern_jax.sharding import logical_rules

    def mesh(*shape):
        return jax.make_mesh(shape, ("data", "fsdp", "tensor"), axis_types=(AxisType.Auto,) * 3)

    mesh_124 = mesh(1, 2, 4)
    _, model = from_hf(FIXTURES / "llama", mesh=mesh_124)
    q = model.stages[0].blocks[0].self_attn.q_proj.kernel[...]  # [layers, D, N, H]
    assert q.sharding.spec == PartitionSpec(None, "fsdp", "tensor", None)
    assert model.embed_tokens[...].sharding.spec == PartitionSpec("tensor", "fsdp")
    ref = reference("llama")
    tokens = jax.device_put(jnp.asarray(ref["tokens"]), NamedSharding(mesh_124, PartitionSpec(("data", "fsdp"))))
    with logical_rules(mesh_124):
        logits = np.asarray(_forward(model, tokens))
    assert np.max(np.abs(logits - ref["logits"])) <= LOGIT_TOL
    with pytest.raises(ValueError, match="not divisible"):  # 4 query heads over 8 tensor devices
        from_hf(FIXTURES / "llama", mesh=mesh(1, 1, 8))


def test_converted_checkpoint_is_what_the_trainer_loads(tmp_path):
    try:
        from modern_jax.training.checkpoint import load_params
    except ImportError:
        pytest.skip("no modern_jax.training")
    convert_from_hf(FIXTURES / "qwen3", tmp_path / "ckpt")
    cfg, params, _, _ = load_params(tmp_path / "ckpt")
    want_cfg, model = load_checkpoint(tmp_path / "ckpt")
    assert cfg == want_cfg
    want = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    for (path, got), (_, value) in zip(jax.tree_util.tree_leaves_with_path(params),
                                       jax.tree_util.tree_leaves_with_path(want)):
        np.testing.assert_array_equal(np.asarray(got), np.asarray(value), err_msg=str(path))


def test_a_training_run_converts_to_hf(tmp_path):
    """A run directory (config.yaml with model:, checkpoints/<step>/params/) goes to Hugging Face too."""
    import yaml

    from modern_jax.convert import save_checkpoint

    _, model = from_hf(FIXTURES / "llama")
    save_checkpoint(model, tmp_path / "run" / "checkpoints" / "7")
    (tmp_path / "run" / "config.yaml").write_text(yaml.safe_dump({"model": model.cfg.to_dict(), "train": {}}))
    with pytest.raises(ValueError, match="name the model_type"):
        convert_to_hf(tmp_path / "run", tmp_path / "hf")
    convert_to_hf(tmp_path / "run", tmp_path / "hf", model_type="llama")
    original, written = hf_tensors(FIXTURES / "llama"), hf_tensors(tmp_path / "hf")
    assert sorted(written) == sorted(original)
    for key in original:
        np.testing.assert_array_equal(written[key], original[key], err_msg=key)


# ----- by shard ------------------------------------------------------------------------------

QUANTISED = Path(__file__).parent / "fixtures" / "hf_quantised"


@pytest.mark.parametrize("directory", [FIXTURES / "qwen2", FIXTURES / "gpt_oss", QUANTISED / "deepseek_v3_fp8",
                                       QUANTISED / "gpt_oss_mxfp4"], ids=lambda d: d.name)
def test_each_device_reads_its_slice_and_the_model_equals_the_whole_load(directory):
    """On 8 devices (fsdp 8; fsdp 2 x tensor 4), every parameter's slices, read from the files slice
    by slice (q/k/v split into heads, stacked layers and experts, fused gate_up parts, fp8 blocks and
    mxfp4 groups cut mid-way), equal the one-device load of the whole tensors, bit for bit."""
    _, whole = from_hf(directory)
    want = {path: np.asarray(v[...]) for path, v in nnx.to_flat_state(nnx.state(whole, nnx.Param))}
    for shape in ({"fsdp": 8}, {"fsdp": 2, "tensor": 4}):
        mesh = jax.make_mesh(tuple(shape.values()), tuple(shape))
        _, model = from_hf(directory, mesh=mesh)
        for path, v in nnx.to_flat_state(nnx.state(model, nnx.Param)):
            x = v[...]
            assert x.sharding.mesh.shape == mesh.shape, path
            for shard in x.addressable_shards:
                np.testing.assert_array_equal(np.asarray(shard.data), want[path][shard.index], err_msg=f"{path} {shape}")


def test_the_bytes_read_are_the_devices_share_as_the_accounting_says(monkeypatch):
    """What `from_hf` requests from the files is what `load_footprint` counts: with every device on
    one process, each distinct slice once (the whole checkpoint); split over 2 processes, half each."""
    from modern_jax.convert.hf_checkpoint import load_footprint
    from modern_jax.convert.safetensors_files import SafetensorsFiles

    requested = []
    read = SafetensorsFiles.read

    def counting(self, entry, index=()):
        x = read(self, entry, index)
        requested.append(x.nbytes)
        return x

    monkeypatch.setattr(SafetensorsFiles, "read", counting)
    mesh = jax.make_mesh((2, 4), ("fsdp", "tensor"))
    cfg, _ = from_hf(FIXTURES / "llama", mesh=mesh)
    stored = sum(x.nbytes for x in hf_tensors(FIXTURES / "llama").values())
    one = load_footprint(cfg, "llama", {"fsdp": 2, "tensor": 4}, 1, stored_dtype="float32")
    two = load_footprint(cfg, "llama", {"fsdp": 2, "tensor": 4}, 2, stored_dtype="float32")
    assert sum(requested) == one["read"] == stored
    assert stored / 2 <= two["read"] < 0.51 * stored  # the norms, which every device holds whole, read by both
    assert two["held"] == one["held"] // 2


def test_a_truncated_shard_is_refused_in_one_line_naming_it(tmp_path):
    directory = copy_fixture("qwen2", tmp_path)
    shard = directory / "model-00002-of-00003.safetensors"
    shard.write_bytes(shard.read_bytes()[:-100])
    with pytest.raises(CheckpointError) as e:
        from_hf(directory)
    assert re.fullmatch(rf"{re.escape(str(shard))}: truncated: its header describes [\d,]+ bytes, the file holds "
                        rf"[\d,]+: download it again", str(e.value))
