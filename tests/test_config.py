"""ModelConfig validation, YAML presets and dotted overrides."""

import pathlib

import pytest

from modern_jax.config import ModelConfig, TemperatureSpec, ffn_width_rule, model_config_from_file
from modern_jax.configfile import apply_overrides

CONFIGS = sorted((pathlib.Path(__file__).parent.parent / "configs").glob("*.yaml"))

BAD = [
    (dict(n_heads=6, n_kv_heads=4), "n_kv_heads"),
    (dict(n_kv_heads=0), "n_kv_heads"),
    (dict(d_model=130, n_heads=4), "n_heads"),
    (dict(norm_type="batchnorm"), "norm_type"),
    (dict(norm_placement="middle"), "norm_placement"),
    (dict(activation="swish"), "activation"),
    (dict(ffn_type="mlp", activation="identity"), "activation"),
    (dict(position_embedding="alibi"), "position_embedding"),
    (dict(head_dim=33), "head_dim"),  # odd rotary dimension
    (dict(rope_fraction=1.5), "rope_fraction"),
    (dict(rope_fraction=0.3), "rope_fraction"),  # 32 * 0.3 = 9 features: odd
    (dict(sliding_window=0, attention_pattern="L"), "sliding_window"),
    (dict(attention_pattern="L"), "sliding_window"),
    (dict(sliding_window=64), "sliding_window"),
    (dict(attention_pattern="LGX"), "attention_pattern"),
    (dict(n_layers=2, attention_pattern="LLG", sliding_window=8), "attention_pattern"),
    (dict(rope_pattern="RRN", n_layers=2), "rope_pattern"),
    (dict(position_embedding="learned", rope_pattern="RN"), "rope_pattern"),
    (dict(qk_norm="yes"), "qk_norm"),
    (dict(norm_bias=True), "norm_bias"),
    (dict(fused_gate_up=True, ffn_type="mlp", activation="gelu"), "fused_gate_up"),
    (dict(attn_softcap=-1.0), "attn_softcap"),
    (dict(attn_dropout=1.0), "attn_dropout"),
    (dict(attention_type="mla"), "mla_kv_rank"),
    (dict(attention_type="mla", mla_kv_rank=32, mla_rope_dim=15), "mla_rope_dim"),
    (dict(attention_type="mla", mla_kv_rank=32, n_kv_heads=2), "n_kv_heads"),
    (dict(mla_kv_rank=32), "mla_kv_rank"),
    (dict(vocab_size=0), "vocab_size"),
    (dict(n_layers=2.5), "n_layers"),
    (dict(dtype="int8"), "dtype"),
    (dict(rope_local_theta=10.0), "rope_local_theta"),
    (dict(parallel_shared_norm=False), "parallel_shared_norm"),
    (dict(d_ff=-1), "d_ff"),
    (dict(attention_pattern="CCCG"), "attention_chunk_size"),  # chunked layers without a chunk size
    (dict(attention_pattern="C", attention_chunk_size=0), "attention_chunk_size"),
    (dict(attention_pattern="C", attention_chunk_size=2.5), "attention_chunk_size"),
    (dict(attention_chunk_size=64), "attention_chunk_size"),  # a chunk size without chunked layers
    (dict(qk_norm="l2", position_embedding="none"), "qk_norm"),  # l2 normalises the RoPE layers: none here
    (dict(qk_norm="l2", rope_pattern="N"), "qk_norm"),
    (dict(attn_temperature_floor=8192), "attn_temperature_floor"),  # tunes the NoPE layers: none here
    (dict(attn_temperature_floor=0, rope_pattern="RRRN"), "attn_temperature_floor"),
    (dict(attn_temperature_floor=8192, rope_pattern="RRRN", attn_temperature_scale=0.0), "attn_temperature_scale"),
    (dict(attn_temperature_scale=0.2), "attn_temperature_scale"),  # tuning is off
]


@pytest.mark.quick
@pytest.mark.parametrize("kwargs,field", BAD, ids=[f for _, f in BAD])
def test_bad_config_names_the_field(kwargs, field):
    base = dict(vocab_size=64, d_model=128, n_layers=4, n_heads=4)
    with pytest.raises(ValueError, match=rf"ModelConfig\.{field}="):
        ModelConfig(**{**base, **kwargs})


def test_bad_rope_scaling_names_the_field():
    with pytest.raises(ValueError, match=r"rope_scaling\.type"):
        ModelConfig.from_dict({"rope_scaling": {"type": "ntk"}})
    with pytest.raises(ValueError, match=r"rope_scaling\.high_freq_factor"):
        ModelConfig.from_dict({"rope_scaling": {"type": "llama3", "factor": 8, "low_freq_factor": 4,
                                                "high_freq_factor": 1}})


@pytest.mark.quick
def test_unknown_key_suggests_the_closest():
    with pytest.raises(ValueError, match=r"unknown key model\.n_layer; did you mean n_layers"):
        ModelConfig.from_dict({"n_layer": 4})
    with pytest.raises(ValueError, match=r"model\.rope_scaling\.factr"):
        ModelConfig.from_dict({"rope_scaling": {"type": "linear", "factr": 2}})


@pytest.mark.parametrize("d,multiple,expected", [(4096, 256, 11008), (4096, 64, 10944), (5120, 256, 13824),
                                                 (2048, 64, 5504), (256, 1, 683)])
def test_ffn_width_rule_oracles(d, multiple, expected):
    assert ffn_width_rule(d, multiple) == expected
    assert ModelConfig(d_model=d, n_heads=8, ffn_multiple_of=multiple).ffn_width == expected


@pytest.mark.quick
@pytest.mark.parametrize("path", CONFIGS, ids=[p.stem for p in CONFIGS])
def test_every_preset_loads_and_round_trips(path):
    from modern_jax.configfile import load_config_file

    auto_vocab = load_config_file(path)["model"].get("vocab_size") == "auto"  # run files sized by their data
    cfg = model_config_from_file(path, ["model.vocab_size=67"] if auto_vocab else [])
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert path.read_text().startswith("#"), "each preset documents itself and its launch command"


@pytest.mark.quick
def test_dotted_overrides():
    cfg = model_config_from_file(CONFIGS[0].parent / "tiny.yaml",
                                 ["model.n_layers=2", "model.rope_scaling={type: linear, factor: 2.0}",
                                  "model.attn_softcap=null"])
    assert cfg.n_layers == 2 and cfg.rope_scaling.type == "linear" and cfg.rope_scaling.factor == 2.0
    with pytest.raises(ValueError, match="expected section.key=value"):
        apply_overrides({}, ["n_layers=2"])
    with pytest.raises(ValueError, match="expected section.key=value"):
        apply_overrides({}, ["model.n_layers"])
    with pytest.raises(ValueError, match="unknown key model.n_layer"):
        model_config_from_file(CONFIGS[0].parent / "tiny.yaml", ["model.n_layer=2"])
    with pytest.raises(ValueError, match="does not exist"):
        model_config_from_file("configs/nope.yaml")


def test_layer_patterns_cycle_over_depth():
    cfg = ModelConfig(n_layers=8, sliding_window=16, attention_pattern="LLG", rope_pattern="RRRN",
                      rope_local_theta=100.0, rope_theta=1e6)
    specs = cfg.layer_specs()
    assert [s.window for s in specs] == [16, 16, None, 16, 16, None, 16, 16]
    assert [s.rope is None for s in specs] == [False, False, False, True] * 2
    assert specs[0].rope.theta == 100.0 and specs[2].rope.theta == 1e6


def test_llama4_layer_rules_are_per_layer_specs():
    """`CCCG` / `RRRN`: chunks on the RoPE layers, the L2 QK-norm only there, the temperature only
    on the NoPE layers; the errors say how to fix the config."""
    cfg = ModelConfig(n_layers=8, attention_pattern="CCCG", attention_chunk_size=8192, rope_pattern="RRRN",
                      qk_norm="l2", attn_temperature_floor=8192, attn_temperature_scale=0.1)
    specs = cfg.layer_specs()
    assert [s.chunk for s in specs] == [8192, 8192, 8192, None] * 2
    assert [s.span for s in specs] == [8192, 8192, 8192, None] * 2
    assert [s.qk_norm for s in specs] == ["l2", "l2", "l2", "none"] * 2
    assert [s.temperature for s in specs] == [None, None, None, TemperatureSpec(8192, 0.1)] * 2
    assert [s.window for s in specs] == [None] * 8
    assert ModelConfig.from_dict(cfg.to_dict()) == cfg
    assert [s.qk_norm for s in cfg.replace(qk_norm="head").layer_specs()] == ["head"] * 8  # head / full: every layer
    with pytest.raises(ValueError, match=r"attention_chunk_size=None.*chunked layers \('C'\) need a positive"):
        ModelConfig(n_layers=4, attention_pattern="CCCG")
    with pytest.raises(ValueError, match=r"attention_chunk_size=64.*set attention_pattern to 'C'"):
        ModelConfig(attention_chunk_size=64)
    with pytest.raises(ValueError, match=r"attn_temperature_floor=8192.*add an 'N' to rope_pattern"):
        ModelConfig(attn_temperature_floor=8192)
    with pytest.raises(ValueError, match=r"qk_norm='l2'.*RoPE layers"):
        ModelConfig(qk_norm="l2", position_embedding="none")


def test_how_it_runs_is_not_the_model():
    """The kernels, the dispatch, remat and scan are the `execution:` section; the context and
    expert axes' strategies the `parallel:` section. A run file or checkpoint config that still
    sets them under `model:` is read into their new place, each with a one-line notice."""
    import dataclasses
    import warnings

    from modern_jax.config import MovedSetting, NETWORK_FIELDS
    from modern_jax.execution import ExecutionConfig
    from modern_jax.training.config import run_config_from_dict

    moved = {"attention_impl": "chunked", "norm_impl": "reference", "moe_dispatch": "dense", "remat": "full",
             "scan_layers": False, "context_strategy": "ring", "moe_exchange": "all_gather"}
    assert not set(moved) & {f.name for f in dataclasses.fields(ModelConfig)}
    with warnings.catch_warnings(record=True) as notices:
        warnings.simplefilter("always")
        run = run_config_from_dict({"model": {"n_layers": 2, **moved}}, "old.yaml")
    assert (run.execution.attention_impl, run.execution.norm_impl, run.execution.moe_dispatch, run.execution.remat,
            run.execution.scan_layers) == ("chunked", "reference", "dense", "full", False)
    assert (run.parallel.context_strategy, run.parallel.moe_exchange) == ("ring", "all_gather")
    assert run.model.n_layers == 2 and set(run.model_dict) == {"n_layers"}
    texts = sorted(str(n.message) for n in notices if issubclass(n.category, MovedSetting))
    assert len(texts) == len(moved) and texts[0] == ("old.yaml: model.attention_impl is read as "
                                                     "execution.attention_impl, where it lives now (how the model "
                                                     "runs, not what it is): move it there")
    with pytest.warns(MovedSetting), pytest.raises(ValueError, match="model.remat='full' and execution.remat='dots' "
                                                                    "disagree"):
        run_config_from_dict({"model": {"remat": "full"}, "execution": {"remat": "dots"}}, "old.yaml")
    with pytest.warns(MovedSetting, match="model.remat is read as execution.remat"):  # an old checkpoint's config
        assert ModelConfig.from_dict({"n_layers": 3, "remat": "full"}).n_layers == 3
    with pytest.raises(ValueError, match="ExecutionConfig.remat='some' is invalid: expected one of none, full"):
        ExecutionConfig(remat="some")
    with pytest.raises(ValueError, match="ParallelConfig.context_strategy='spiral' is invalid"):
        run_config_from_dict({"model": {}, "parallel": {"context_strategy": "spiral"}})
    assert "dtype" not in NETWORK_FIELDS and "n_layers" in NETWORK_FIELDS  # what a Hugging Face round trip compares
