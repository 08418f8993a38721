"""The CLI's and the config files' error messages: each names the file, field or flag and the fix.

Every case runs `modern_jax.cli.main` and expects exit status 2 with the message on stderr
and no Python traceback. Nothing here trains or compiles: the checks come first.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from modern_jax.cli import main, parse_args
from modern_jax.configfile import apply_overrides, read_yaml

ROOT = Path(__file__).resolve().parent.parent
TINY = str(ROOT / "configs" / "tiny.yaml")
HF_LLAMA = ROOT / "tests" / "fixtures" / "hf" / "llama"

FILES = {  # written into tmp_path for the cases below
    "tab.yaml": "model:\n\tn_layers: 2\n",
    "colon.yaml": "model:\n  n_layers: 2\n  d_model: 3: 4\n",
    "flow.yaml": "model:\n  n_layers: [1, 2\n  d_model: 3\n",
    "two_docs.yaml": "model: {}\n---\nmodel: {}\n",
    "model5.yaml": "model: 5\n",
    "dup.yaml": "model:\n  n_layers: 2\n  d_model: 64\n  n_layers: 3\n",
    "dup_section.yaml": "model:\n  n_layers: 2\nmodel:\n  n_layers: 3\n",
    "modle.yaml": "modle:\n  n_layers: 2\n",
    "list.yaml": "- model\n",
    "hf_list.json": "[1, 2]",
    "hf_bad.json": '{"model_type": "llama",\n "hidden_size": 32,,}',
    "hf_str.json": '{"model_type": "llama", "hidden_size": "abc"}',
    "hf_none.json": '{"model_type": "llama", "num_attention_heads": null}',
    "hf_bert.json": '{"model_type": "bert"}',
}
MISSING = "no_such_run"  # a checkpoint that does not exist: flag checks must come before loading it


def _case(argv, message):
    return pytest.param(argv, message, id=" ".join(argv)[:70])


CASES = [
    # YAML syntax: the file, the line and the column
    _case(["info", "--config", "{tmp}/tab.yaml"],
          "tab.yaml, line 2, column 1: could not parse YAML (found character '\\t' that cannot start any token: "
          "indent with spaces, YAML does not allow tabs)"),
    _case(["info", "--config", "{tmp}/colon.yaml"],
          "colon.yaml, line 3, column 13: could not parse YAML (mapping values are not allowed here)"),
    _case(["train", "--config", "{tmp}/colon.yaml"], "colon.yaml, line 3, column 13: could not parse YAML"),
    _case(["info", "--config", "{tmp}/flow.yaml"],
          "flow.yaml, line 3, column 10: could not parse YAML (expected ',' or ']', but got ':'; "
          "while parsing a flow sequence at line 2)"),
    _case(["info", "--config", "{tmp}/two_docs.yaml"], "two_docs.yaml, line 2, column 1: could not parse YAML"),
    _case(["info", "--config", "{tmp}/binary.yaml"], "binary.yaml: not UTF-8 text (byte 0): is it a YAML file?"),
    # sections and duplicate keys
    _case(["info", "--config", "{tmp}/model5.yaml"], "model5.yaml: section 'model' must be a mapping, got 5"),
    _case(["train", "--config", "{tmp}/model5.yaml"], "model5.yaml: section 'model' must be a mapping, got 5"),
    _case(["info", "--config", "{tmp}/list.yaml"], "list.yaml: expected a mapping of sections (model:, train:, ...)"),
    _case(["info", "--config", "{tmp}/dup.yaml"],
          "dup.yaml: duplicate key 'n_layers' (lines 2 and 4): give each key once"),
    _case(["train", "--config", "{tmp}/dup_section.yaml"], "dup_section.yaml: duplicate key 'model' (lines 1 and 3)"),
    _case(["info", "--config", TINY, "model.rope_scaling={type: yarn, type: linear}"],
          "bad override 'model.rope_scaling={type: yarn, type: linear}': the value is not valid YAML (duplicate key "
          "'type'"),
    _case(["info", "--config", TINY, "model.n_layers=[1"],
          "bad override 'model.n_layers=[1': the value is not valid YAML (at character 3: expected ',' or ']', "
          "but got '<stream end>')"),
    _case(["train", "--config", TINY, "train.no_decay=5"],
          "TrainConfig.no_decay=5 is invalid: expected a list of groups from embedding, norm, bias"),
    _case(["info", "--config", "{tmp}/modle.yaml"], "modle.yaml: unknown section 'modle'; did you mean model?"),
    _case(["info", "--config", TINY, "trian.steps=3"],
          "bad override 'trian.steps=3': unknown section 'trian'; did you mean train? "
          "(sections: model, execution, train, data, parallel, lora, dpo, grpo)"),
    _case(["info", "--config", TINY, "model.n_layrs=2"], "unknown key model.n_layrs; did you mean n_layers"),
    _case(["plan", "--config", TINY, "--mesh", "data=8", "--batch", "8", "--seq", "16", "modl.n_layers=2"],
          "unknown section 'modl'; did you mean model?"),
    # --config that is not a file
    _case(["info", "--config", "{tmp}"], "is a directory, not a YAML file"),
    _case(["train", "--config", "{tmp}/run"],
          "run is a directory, not a YAML file; did you mean {tmp}/run/config.yaml?"),
    _case(["info", "--config", "{tmp}/nope.yaml"], "nope.yaml' does not exist"),
    # wrong-typed model fields
    _case(["info", "--config", TINY, "model.n_kv_heads=abc"],
          "ModelConfig.n_kv_heads='abc' is invalid: expected an integer or null"),
    _case(["info", "--config", TINY, "model.norm_eps=abc"], "ModelConfig.norm_eps='abc' is invalid: expected a number"),
    _case(["info", "--config", TINY, "model.rope_theta=[1]"],
          "ModelConfig.rope_theta=[1] is invalid: expected a number"),
    _case(["info", "--config", TINY, "model.tie_embeddings=maybe"],
          "ModelConfig.tie_embeddings='maybe' is invalid: expected true or false"),
    _case(["info", "--config", TINY, "model.qk_norm=7"], "ModelConfig.qk_norm=7 is invalid"),
    _case(["info", "--config", TINY, "model.d_model=abc"], "ModelConfig.d_model='abc' is invalid"),
    _case(["info", "--config", TINY, "model.rope_scaling=5"],
          "ModelConfig.rope_scaling=5 is invalid: expected a RopeScaling (a mapping in YAML)"),
    _case(["info", "--config", TINY, "model.rope_scaling={type: yarn, factor: x}"],
          "ModelConfig.rope_scaling.factor='x' is invalid: expected a number"),
    # --hf-config and config.json
    _case(["info", "--hf-config", "{tmp}/none.json"], "none.json does not exist"),
    _case(["info", "--hf-config", "{tmp}/hf_list.json"], "hf_list.json: expected an object {...}, got list [1, 2]"),
    _case(["info", "--hf-config", "{tmp}/hf_bad.json"],
          "hf_bad.json, line 2, column 20: could not parse JSON (Expecting property name enclosed in double quotes)"),
    _case(["info", "--hf-config", "{tmp}/hf_str.json"],
          "hf_str.json: Hugging Face llama config: hidden_size='abc' is not supported (expected an integer)"),
    _case(["info", "--hf-config", "{tmp}/hf_none.json"],
          "hf_none.json: Hugging Face llama config: num_attention_heads=None is not supported (expected a positive"),
    _case(["info", "--hf-config", "{tmp}/hf_bert.json"],
          "hf_bert.json: Hugging Face model_type 'bert' is not supported"),
    _case(["info", "--hf-config", "{tmp}"], "is a directory, not a JSON file"),
    _case(["info", "--config", TINY, "--hf-config", "{tmp}/hf_str.json"], "give one of --config FILE or --hf-config"),
    _case(["info", "--hf-config", str(HF_LLAMA / "config.json"), "train.steps=3"],
          "bad override 'train.steps=3': unknown section 'train' (sections: model)"),
    # flags
    _case(["info", "--config", TINY, "--context", "0"], "--context 0 is invalid: expected a positive integer"),
    _case(["info", "--config", TINY, "--seq-len", "-4"], "--seq-len -4 is invalid: expected a positive integer"),
    _case(["generate", "--checkpoint", MISSING, "--top-k", "0"], "--top-k 0 is invalid: expected a positive integer"),
    _case(["generate", "--checkpoint", MISSING, "--top-p", "0"],
          "--top-p 0.0 is invalid: expected a probability in (0, 1]"),
    _case(["generate", "--checkpoint", MISSING, "--top-p", "1.5"], "--top-p 1.5 is invalid: expected a probability"),
    _case(["generate", "--checkpoint", MISSING, "--num-samples", "0"],
          "--num-samples 0 is invalid: expected a positive"),
    _case(["generate", "--checkpoint", MISSING, "--max-new-tokens", "0"], "--max-new-tokens 0 is invalid: expected a"),
    _case(["generate", "--checkpoint", MISSING, "--temperature", "-0.5"],
          "--temperature -0.5 is invalid: expected a finite number >= 0 (0: greedy)"),
    _case(["generate", "--checkpoint", MISSING, "--temperature", "nan"], "--temperature nan is invalid"),
    # --greedy with a sampling setting, or with several samples (each was accepted and ignored)
    _case(["generate", "--checkpoint", MISSING, "--greedy", "--temperature", "0.5"],
          "--greedy takes the most likely token each time, so --temperature 0.5 would not be used: give one of them"),
    _case(["generate", "--checkpoint", MISSING, "--greedy", "--top-k", "5"], "so --top-k 5 would not be used"),
    _case(["generate", "--checkpoint", MISSING, "--greedy", "--num-samples", "3"],
          "--greedy gives one sequence, so --num-samples 3 would print it 3 times: leave out --greedy to sample 3"),
    _case(["evaluate", "--checkpoint", MISSING, "--seq-len", "0"],
          "--seq-len 0 is invalid: expected a positive integer"),
    _case(["evaluate", "--checkpoint", MISSING, "--batch-size", "0"], "--batch-size 0 is invalid: expected a positive"),
    _case(["evaluate", "--checkpoint", MISSING, "--max-windows", "0"],
          "--max-windows 0 is invalid: expected a positive"),
    _case(["plan", "--config", TINY, "--mesh", "data=8", "--batch", "0", "--seq", "16"],
          "--batch 0 is invalid: expected a positive integer"),
    _case(["plan", "--config", TINY, "--mesh", "data=8", "--batch", "8", "--seq", "16", "--hbm-gib", "0"],
          "--hbm-gib 0.0 is invalid: expected a positive number of GiB"),
    # plan: the batch must split over the data shards, as in train (before any compilation)
    _case(["plan", "--config", TINY, "--mesh", "data=8", "--batch", "4", "--seq", "16"],
          "train.batch_size / grad_accum gives 4 rows, not divisible by the 8 data shards"),
    _case(["plan", "--config", TINY, "--mesh", "data=2,fsdp=4", "--batch", "16", "--seq", "16", "train.grad_accum=4"],
          "train.batch_size / grad_accum gives 4 rows, not divisible by the 8 data shards"),
    # plan --search: each option named before anything compiles (each was a table of refused rows, exit 0)
    _case(["plan", "--config", TINY, "--topology", "v5e:2x2", "--mesh", "fsdp=4", "--batch", "8", "--seq", "16",
           "--search", "--search-remat", "full,nonsense"],
          "--search-remat 'full,nonsense': 'nonsense' is not a remat policy; expected some of none, full, dots"),
    _case(["plan", "--config", TINY, "--topology", "v5e:2x2", "--mesh", "fsdp=4", "--batch", "8", "--seq", "16",
           "--search", "--search-mesh", "fsdp=4;fsdp=2,tensor=4"],
          "--search-mesh 'fsdp=2,tensor=4': its axes multiply to 8, the planned devices are 4 (--mesh fsdp=4)"),
    _case(["plan", "--config", TINY, "--topology", "v5e:2x2", "--mesh", "fsdp=4", "--batch", "8", "--seq", "16",
           "--search", "--search-mesh", "fsdp=four"], "--search-mesh 'fsdp=four': "),
]


@pytest.fixture
def files(tmp_path):
    for name, text in FILES.items():
        (tmp_path / name).write_text(text)
    (tmp_path / "binary.yaml").write_bytes(b"\xff\xfe\x00model")
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "config.yaml").write_text("model: {}\n")
    return tmp_path


@pytest.mark.parametrize("argv, message", CASES)
def test_cli_error_names_the_problem(argv, message, files, capsys, monkeypatch):
    monkeypatch.chdir(files)
    monkeypatch.setenv("XLA_FLAGS", "--xla_force_host_platform_device_count=8")  # plan: no re-execution
    tmp = str(files)
    assert main([a.replace("{tmp}", tmp) for a in argv]) == 2
    err = capsys.readouterr().err
    assert message.replace("{tmp}", tmp) in err, err
    assert err.startswith(f"modern-jax {argv[0]}: error: "), err
    assert "Traceback" not in err, err


# ----- options and overrides in any order ---------------------------------------------------------

def test_info_overrides_before_between_and_after_options_agree(capsys):
    outputs = []
    for argv in (["info", "--config", TINY, "--context", "64", "model.n_layers=2", "model.d_model=64"],
                 ["info", "model.n_layers=2", "--config", TINY, "model.d_model=64", "--context", "64"],
                 ["info", "model.n_layers=2", "model.d_model=64", "--context", "64", "--config", TINY]):
        assert main(argv) == 0
        outputs.append(capsys.readouterr().out)
    assert outputs[0] == outputs[1] == outputs[2]
    assert "kv cache at 64 tokens" in outputs[0]


@pytest.mark.parametrize("command, options", [
    ("train", ["--config", TINY, "--data", "corpus.txt"]),
    ("plan", ["--config", TINY, "--mesh", "data=2", "--batch", "8", "--seq", "16"]),
    ("info", ["--config", TINY, "--kv-dtype", "float32"]),
])
def test_options_and_overrides_mix_in_any_order(command, options):
    overrides = ["model.n_layers=2", "train.steps=3"]
    ordered = parse_args([command, *options, *overrides])
    mixed = parse_args([command, overrides[0], *options[:2], overrides[1], *options[2:]])
    first = parse_args([command, *overrides, *options])
    assert vars(ordered) == vars(mixed) == vars(first)
    assert ordered.overrides == overrides


def test_an_unknown_option_among_overrides_is_still_an_argparse_error(capsys):
    with pytest.raises(SystemExit) as e:
        parse_args(["info", "--config", TINY, "model.n_layers=2", "--bogus"])
    assert e.value.code == 2
    assert "unrecognized arguments: --bogus" in capsys.readouterr().err


# ----- YAML reading ------------------------------------------------------------------------------

@pytest.mark.quick
def test_yaml_reads_exponents_without_a_dot_as_floats_and_overrides_fill_an_empty_section(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("model:\n  norm_eps: 1e-5\ntrain:\n")
    assert read_yaml(path) == {"model": {"norm_eps": 1e-5}, "train": None}
    assert apply_overrides(read_yaml(path), ["train.steps=3", "train.lr=3e-4"])["train"] == {"steps": 3, "lr": 3e-4}


@pytest.mark.quick
def test_yaml_anchors_and_merge_keys_are_not_duplicates(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("base: &b {n_layers: 2, d_model: 64}\nmodel:\n  <<: *b\n  n_layers: 4\n")
    assert read_yaml(path)["model"] == {"n_layers": 4, "d_model": 64}


# ----- tokenizer.json and safetensors files -------------------------------------------------------

@pytest.mark.quick
@pytest.mark.parametrize("text, message", [
    ("{bad", "tokenizer.json, line 1, column 2: could not parse JSON"),
    ("[1]", "tokenizer.json: expected an object {...}, got list [1]"),
    ('{"kind": "char"}', "tokenizer.json: a saved char tokenizer needs its vocabulary as a string `chars`"),
    ('{"kind": "bpe"}', "tokenizer.json: unknown tokenizer kind 'bpe'"),
    ('{"model": 3}', "tokenizer.json: not a tokenizer this library or Hugging Face `tokenizers` can read"),
])
def test_a_malformed_tokenizer_json_names_the_file(text, message, tmp_path):
    from modern_jax.data.tokenizers import load_tokenizer

    (tmp_path / "tokenizer.json").write_text(text)
    with pytest.raises(ValueError) as e:
        load_tokenizer(tmp_path)
    assert message in str(e.value)
    assert str(tmp_path) in str(e.value)


@pytest.mark.parametrize("damage, message", [
    (lambda data: data[: len(data) * 2 // 3], "truncated: its header describes 147,288 bytes, the file holds 98,192: "
                                              "download it again"),
    (lambda data: b"not a safetensors header", "not a readable safetensors file (a header of 7021991845529153390 "
                                               "bytes in a file of 24): the file is damaged; download it again"),
    (lambda data: data[:4], "not a readable safetensors file (a header of 3024 bytes in a file of 4): the file is "
                            "damaged; download it again"),
], ids=["truncated", "not safetensors", "cut in its header"])
def test_a_damaged_safetensors_file_is_named(damage, message, tmp_path):
    from modern_jax.convert import CheckpointError, from_hf

    shutil.copy(HF_LLAMA / "config.json", tmp_path / "config.json")
    file = tmp_path / "model.safetensors"
    file.write_bytes(damage((HF_LLAMA / "model.safetensors").read_bytes()))
    with pytest.raises(CheckpointError) as e:
        from_hf(tmp_path)
    assert str(e.value) == f"{file}: {message}"


@pytest.mark.parametrize("config, index, message", [
    ("{oops", None, "config.json, line 1, column 2: could not parse JSON"),
    ("[]", None, "config.json: expected an object {...}, got list"),
    (None, "{}", 'model.safetensors.index.json: expected a "weight_map" object'),
    (None, "{bad", "model.safetensors.index.json, line 1, column 2: could not parse JSON"),
])
def test_a_malformed_hf_config_or_index_names_the_file(config, index, message, tmp_path):
    from modern_jax.convert import from_hf

    shutil.copy(HF_LLAMA / "model.safetensors", tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text(config or (HF_LLAMA / "config.json").read_text())
    if index is not None:
        (tmp_path / "model.safetensors.index.json").write_text(index)
    with pytest.raises(ValueError) as e:
        from_hf(tmp_path)
    assert message in str(e.value)


def test_a_config_json_value_of_the_wrong_type_is_named(tmp_path):
    from modern_jax.convert import from_hf

    hf = json.loads((HF_LLAMA / "config.json").read_text())
    (tmp_path / "config.json").write_text(json.dumps({**hf, "tie_word_embeddings": "no"}))
    shutil.copy(HF_LLAMA / "model.safetensors", tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"config\.json: Hugging Face llama config: tie_word_embeddings='no' is not "
                                         r"supported \(expected true or false\)"):
        from_hf(tmp_path)
