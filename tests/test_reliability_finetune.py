"""Bad fine-tuning inputs: each ends in one line naming the file, field or row and the fix (exit
status 2, no traceback), nothing trains on a silently different meaning, and no run's state is
lost or overwritten.

Covers the adapters of a LoRA run (`modern_jax.lora_config`, `modern_jax.training.loop` resuming one,
`modern_jax.training.checkpoint` checking what it resumes with, `modern_jax.convert.conversions`
reading its base again for evaluate / generate / convert), PEFT adapters read and written
(`modern_jax.convert.peft`), and preference pairs (`modern_jax.data.preference`). Every case goes
through the command a user runs; most stop in the checks before anything compiles, on the tiny
fixtures of tests/fixtures/hf_peft and hf_chat.
"""

from __future__ import annotations

import json
import pathlib
import re
import shutil
import zlib

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from safetensors.numpy import load_file, save_file

from modern_jax.cli import main

from test_reliability_inputs import finetune, refused

REPO = pathlib.Path(__file__).parent.parent
PEFT = REPO / "tests" / "fixtures" / "hf_peft" / "llama"
HF_CHAT = REPO / "tests" / "fixtures" / "hf_chat"


# ----- PEFT adapters read by train --init-adapter -------------------------------------------------

def adapter_copy(tmp_path: pathlib.Path, **config) -> pathlib.Path:
    """A copy of the fixture's PEFT adapter, its adapter_config.json updated with `config`."""
    out = tmp_path / "adapter"
    shutil.copytree(PEFT / "adapter", out)
    saved = json.loads((out / "adapter_config.json").read_text())
    (out / "adapter_config.json").write_text(json.dumps({**saved, **config}))
    return out


def init_adapter(adapter, tmp_path):
    """`train` from the fixture's base with the PEFT adapter `adapter` (a tiny run, if it starts)."""
    return [*finetune(PEFT / "base", tmp_path, f"data.tokenizer_path={HF_CHAT / 'tokenizer.json'}"), "--init-adapter",
            adapter]


@pytest.mark.parametrize("key, value, what", [
    ("layers_to_transform", [0], "adapters on some layers only"),
    ("layers_pattern", "layers", "adapters on some layers only"),
    ("rank_pattern", {"q_proj": 8}, "per-module ranks"),
    ("alpha_pattern", {"q_proj": 16}, "per-module alphas"),
    ("use_rslora", True, "rank-stabilised scaling"),
    ("use_dora", True, "DoRA"),
    ("use_qalora", True, "QA-LoRA's pooled inputs"),
    ("use_bdlora", {"lora_a_is_blockdiagonal": True}, "block-diagonal adapters"),
    ("lora_bias", True, "a trained bias on lora_B"),
    ("modules_to_save", ["lm_head"], "whole modules trained beside the adapters"),
    ("trainable_token_indices", [0, 1], "trained embedding rows"),
    ("target_parameters", ["mlp.experts.gate_up_proj"], "adapters on bare parameters"),
    ("layer_replication", [[0, 2], [1, 2]], "repeated layers"),
    ("alora_invocation_tokens", [5, 6], "activated LoRA, on after its invocation tokens"),
    ("arrow_config", {"top_k": 2}, "Arrow routing"),
    ("megatron_config", {"tensor_model_parallel_size": 2}, "Megatron's parallel layers"),
])
def test_a_peft_option_we_do_not_implement_is_refused_by_name(key, value, what, tmp_path, capsys):
    adapter = adapter_copy(tmp_path, **{key: value})
    line = refused(init_adapter(adapter, tmp_path), capsys)
    assert line.endswith(f"{adapter / 'adapter_config.json'}: {key}={value!r} ({what}) is not supported: train the "
                         f"adapter without it")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("init", ["pissa", "pissa_niter_4", "olora", "corda", "loftq"])
def test_a_peft_adapter_whose_initialisation_rewrote_its_base_is_refused(init, tmp_path, capsys):
    adapter = adapter_copy(tmp_path, init_lora_weights=init)
    line = refused(init_adapter(adapter, tmp_path), capsys)
    assert line.endswith(f"{adapter / 'adapter_config.json'}: init_lora_weights={init!r} rewrote the base weights as "
                         f"training started, so the adapter fits only that rewritten base: save it with PEFT's "
                         f"save_pretrained(..., path_initial_model_for_weight_conversion=...), which makes it a plain "
                         f"LoRA adapter of the original base")


@pytest.mark.parametrize("damage, error", [
    (lambda data: data[:5000], r"truncated: its header describes [\d,]+ bytes, the file holds 5,000"),
    (lambda data: bytes(range(256)) * 8, r"not a readable safetensors file \(a header of \d+ bytes in a file of 2048\): "
                                         r"the file is damaged"),
], ids=["truncated", "garbage"])
def test_a_damaged_peft_adapter_file_is_named(damage, error, tmp_path, capsys):
    adapter = adapter_copy(tmp_path)
    weights = adapter / "adapter_model.safetensors"
    weights.write_bytes(damage(weights.read_bytes()))
    line = refused(init_adapter(adapter, tmp_path), capsys)
    assert re.search(rf"{re.escape(str(weights))}: {error}[:;] download or export the adapter again$", line), line
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("key, value, problem", [
    ("lora_alpha", None, "lora_alpha=None is invalid: expected a number > 0"),
    ("lora_alpha", "sixteen", "lora_alpha='sixteen' is invalid: expected a number > 0"),
    ("r", 0, "r=0 is invalid: expected an integer >= 1"),
    ("lora_dropout", "none", "lora_dropout='none' is invalid: expected a number in [0, 1)"),
])
def test_a_peft_rank_alpha_or_dropout_that_is_not_a_number_is_named_by_its_key(key, value, problem, tmp_path, capsys):
    adapter = adapter_copy(tmp_path, **{key: value})
    line = refused(init_adapter(adapter, tmp_path), capsys)
    assert line.endswith(f"{adapter / 'adapter_config.json'}: {problem}")


def test_a_peft_adapter_holding_nan_or_inf_is_refused_naming_the_tensors(tmp_path, capsys):
    adapter = adapter_copy(tmp_path)
    weights = adapter / "adapter_model.safetensors"
    tensors = load_file(weights)
    a, b = "base_model.model.model.layers.0.mlp.down_proj.lora_B.weight", \
        "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight"
    tensors[a][0, :2], tensors[b][1, 1] = np.nan, np.inf
    save_file(tensors, weights, metadata={"format": "pt"})
    line = refused(init_adapter(adapter, tmp_path), capsys)
    assert line.endswith(f"{weights}: 2 tensor(s) hold NaN or infinite values: {a} (2 NaN, 0 inf of "
                         f"{tensors[a].size:,} values), {b} (0 NaN, 1 inf of {tensors[b].size:,} values). The weights "
                         f"are damaged or come from a run that diverged: download them again, or start from another "
                         f"checkpoint")
    assert not (tmp_path / "run").exists()


# ----- a LoRA run whose checkpoints hold only its adapters: resumed, and its base read again ----------

def lora_train(base, home: pathlib.Path, *overrides):
    """`train` of configs/finetune_lora.yaml from `base` into `home`/run, checkpoints holding the adapters only."""
    return [*finetune(base, home), "--config", REPO / "configs" / "finetune_lora.yaml", "lora.save_base=false",
            *overrides]


@pytest.fixture(scope="module")
def lora_home(tmp_path_factory) -> pathlib.Path:
    """A copy of the chat fixture (`base/`) and a 2-step LoRA run trained from it (`run/`)."""
    home = tmp_path_factory.mktemp("lora")
    shutil.copytree(HF_CHAT, home / "base")
    assert main([str(a) for a in lora_train(home / "base", home)]) == 0
    return home


@pytest.fixture
def lora_run(lora_home, tmp_path) -> pathlib.Path:
    """This test's own copy of `lora_home`, its base.json naming the copied base."""
    shutil.copytree(lora_home, tmp_path, dirs_exist_ok=True)
    record = json.loads((tmp_path / "run" / "base.json").read_text())
    (tmp_path / "run" / "base.json").write_text(json.dumps({**record, "source": str(tmp_path / "base")}))
    return tmp_path / "run"


def lora_changed(lora_run: pathlib.Path, differ: str) -> str:
    return (f"the checkpoints in {str(lora_run)!r} were trained with other lora: settings ({differ}, by its "
            f"config.yaml): resume with the lora: section they were trained with, or start a new train.output_dir")


@pytest.mark.parametrize("changes, differ", [
    (["lora.rank=8"], "lora.rank is 16 there, 8 here"),
    (["lora.alpha=8"], "lora.alpha is 32.0 there, 8.0 here"),
    (["lora.targets=[q_proj,v_proj]"], "lora.targets is ['all-linear'] there, ['q_proj', 'v_proj'] here"),
    (["lora.quantize=int8", "lora.rank=4"], "lora.rank is 16 there, 4 here; lora.quantize is 'none' there, 'int8' "
                                            "here"),
], ids=["rank", "alpha", "targets", "quantize"])
def test_resuming_a_lora_run_with_other_lora_settings_names_them(changes, differ, lora_run, capsys):
    line = refused([*lora_train(lora_run.parent / "base", lora_run.parent), "train.steps=4", "train.resume=true",
                    *changes], capsys)
    assert line.endswith(lora_changed(lora_run, differ))
    assert sorted(p.name for p in (lora_run / "checkpoints").iterdir()) == ["2"]


def test_resuming_a_lora_run_without_its_lora_section_is_refused(lora_run, capsys):
    line = refused([*finetune(lora_run.parent / "base", lora_run.parent), "train.steps=4", "train.resume=true"],
                   capsys)
    assert line.endswith(lora_changed(lora_run, "a lora: section there, none here"))


def crc(path: pathlib.Path) -> str:
    return f"{path.stat().st_size:,} bytes, CRC-32 {zlib.crc32(path.read_bytes()):08x}"


@pytest.mark.parametrize("command", ["evaluate", "generate", "convert --to-hf", "convert --to-peft", "train"])
def test_a_base_replaced_by_another_model_of_its_shape_is_refused(command, lora_run, capsys):
    """The run's base directory now holds other weights of the same shapes (as another fine-tune of
    the same model would): every command that reads the base again names it, before reading it."""
    base, weights = lora_run.parent / "base", lora_run.parent / "base" / "model.safetensors"
    before = crc(weights)
    rng = np.random.default_rng(0)
    save_file({k: v + rng.normal(0, 0.01, v.shape).astype(v.dtype) for k, v in load_file(weights).items()}, weights,
              metadata={"format": "pt"})
    out = lora_run.parent / "out"
    argv = {"evaluate": ["evaluate", "--checkpoint", lora_run],
            "generate": ["generate", "--checkpoint", lora_run, "--prompt", "hi", "--max-new-tokens", "2"],
            "convert --to-hf": ["convert", "--to-hf", lora_run, "--out", out],
            "convert --to-peft": ["convert", "--to-peft", lora_run, "--out", out],
            "train": lora_train(base, lora_run.parent, "train.steps=4", "train.resume=true")}[command]
    line = refused(argv, capsys, command.split()[0])
    fix = "give --init-from-hf the model the run started from, or train into a new train.output_dir" \
        if command == "train" else f"put the model the run started from back there, or point " \
                                   f"{lora_run / 'base.json'}'s source at it"
    assert line.endswith(f"{base} is not the base {lora_run} was trained on (model.safetensors: {before} when the run "
                         f"started, {crc(weights)} now, by its base.json): {fix}")
    assert not out.exists() and sorted(p.name for p in (lora_run / "checkpoints").iterdir()) == ["2"]


def test_a_run_recorded_before_base_checksums_still_evaluates(lora_run, capsys):
    record = json.loads((lora_run / "base.json").read_text())
    assert set(record["files"]) == {"model.safetensors"}
    (lora_run / "base.json").write_text(json.dumps({"source": record["source"]}))
    assert main(["evaluate", "--checkpoint", str(lora_run)]) == 0, capsys.readouterr().err


@pytest.mark.parametrize("to", ["--to-hf", "--to-peft"])
def test_convert_of_a_step_directory_finds_its_runs_hugging_face_files(to, lora_run, capsys):
    """A step of a run started from a Hugging Face model: its family, token ids and tokenizer are
    the run's (`hf/` beside `checkpoints/`), as for the run directory itself."""
    out = lora_run.parent / "out"
    assert main(["convert", to, str(lora_run / "checkpoints" / "2"), "--out", str(out)]) == 0, capsys.readouterr().err
    if to == "--to-hf":
        assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"} <= \
            {p.name for p in out.iterdir()}
        assert json.loads((out / "config.json").read_text())["eos_token_id"] == 2
    else:
        assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in out.iterdir()}


def test_two_processes_write_the_adapters_one_process_writes(lora_run, capsys):
    """`convert --to-peft` in a launch of 2 processes x 2 devices, the base and its adapters laid
    over the 4 (fsdp), each process holding its share: process 0 gathers the adapters alone (the base
    is never gathered) and writes, byte for byte, the files one process writes."""
    one, two = lora_run.parent / "one", lora_run.parent / "two"
    assert main(["convert", "--to-peft", str(lora_run), "--out", str(one)]) == 0, capsys.readouterr().err
    launch = ["launch", "--processes", "2", "--devices", "2", "convert", "--to-peft", str(lora_run), "--out", str(two)]
    assert main(launch) == 0, capsys.readouterr()
    assert sorted(p.name for p in two.iterdir()) == sorted(p.name for p in one.iterdir())
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        assert (two / name).read_bytes() == (one / name).read_bytes(), name


def test_convert_of_a_run_that_does_not_exist_names_it(tmp_path, capsys):
    line = refused(["convert", "--to-peft", tmp_path / "no_such_run", "--out", tmp_path / "out"], capsys)
    assert line.endswith(f"checkpoint {str(tmp_path / 'no_such_run')!r} is not a directory")


# ----- preference pairs read by a DPO run -----------------------------------------------------------

def user(text):
    return {"role": "user", "content": text}


def assistant(text):
    return {"role": "assistant", "content": text}


SYSTEM = {"role": "system", "content": "you are a calculator"}
QUESTION = "what is one plus three"
GOOD = {"explicit_text": {"prompt": QUESTION, "chosen": " four", "rejected": " five"},
        "conversation": {"prompt": [SYSTEM, user(QUESTION)], "chosen": [assistant("four")],
                         "rejected": [assistant("five")]},
        "implicit_text": {"chosen": f"{QUESTION}? four", "rejected": f"{QUESTION}? five"},
        "implicit_conversation": {"chosen": [SYSTEM, user(QUESTION), assistant("four")],
                                  "rejected": [SYSTEM, user(QUESTION), assistant("five")]}}


def dpo(data, tmp_path):
    """`train` of configs/dpo.yaml on the pairs at `data` (a tiny run, if it starts)."""
    return [*finetune(HF_CHAT, tmp_path), "--config", REPO / "configs" / "dpo.yaml", "--data", data]


def pairs_file(tmp_path, good: dict, bad: dict, parquet: bool = False) -> tuple[pathlib.Path, str]:
    """Four pairs, the third `bad`, as JSON Lines or Parquet; with the name of the bad record."""
    records = [good, good, bad, good]
    if parquet:
        pq.write_table(pa.Table.from_pylist(records), tmp_path / "pairs.parquet")
        return tmp_path / "pairs.parquet", f"{tmp_path / 'pairs.parquet'}, row 2"
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return tmp_path / "pairs.jsonl", f"{tmp_path / 'pairs.jsonl'}, line 3"


@pytest.mark.parametrize("kind, bad, field, cut", [
    ("explicit_text", {"chosen": ""}, "chosen", ""),
    ("explicit_text", {"rejected": "  "}, "rejected", ""),
    ("conversation", {"rejected": [assistant("")]}, "rejected", ""),
    ("implicit_text", {"chosen": f"{QUESTION}? "}, "chosen", " after the start both share"),
], ids=["text", "blank_text", "conversation", "implicit_text"])
@pytest.mark.parametrize("parquet", [False, True], ids=["jsonl", "parquet"])
def test_a_preference_pair_with_an_empty_completion_is_named_by_its_row(kind, bad, field, cut, parquet, tmp_path,
                                                                        capsys):
    pairs, where = pairs_file(tmp_path, GOOD[kind], {**GOOD[kind], **bad}, parquet)
    line = refused(dpo(pairs, tmp_path), capsys)
    assert line.endswith(f"{where}: the {field!r} completion is empty{cut}: give {field!r} an answer, or remove the "
                         f"record")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("chosen, rejected, n", [
    (GOOD["implicit_conversation"]["chosen"], [SYSTEM, user("what is two plus two"), assistant("five")], 1),
    ([SYSTEM, user(QUESTION), assistant("four"), user("and plus two?"), assistant("six")],
     [SYSTEM, user(QUESTION), assistant("four"), user("and plus one?"), assistant("six")], 3),
], ids=["only_the_system_turn_shared", "the_last_question_differs"])
def test_implicit_conversations_that_ask_different_questions_are_named(chosen, rejected, n, tmp_path, capsys):
    pairs, where = pairs_file(tmp_path, GOOD["implicit_conversation"], {"chosen": chosen, "rejected": rejected})
    line = refused(dpo(pairs, tmp_path), capsys)
    assert line.endswith(f"{where}: 'chosen' and 'rejected' part at message {n}, a user message, not an assistant's "
                         f"answer, so they answer different questions: give both the same messages up to the answer "
                         f"they differ in")


@pytest.mark.parametrize("kind, bad", [
    ("explicit_text", {"rejected": " four"}),
    ("implicit_conversation", {"rejected": GOOD["implicit_conversation"]["chosen"]}),
], ids=["text", "implicit_conversation"])
def test_a_preference_pair_whose_completions_are_the_same_is_named(kind, bad, tmp_path, capsys):
    pairs, where = pairs_file(tmp_path, GOOD[kind], {**GOOD[kind], **bad})
    line = refused(dpo(pairs, tmp_path), capsys)
    assert line.endswith(f"{where}: the 'chosen' and 'rejected' completions are the same, so the pair teaches nothing "
                         f"(its loss has no gradient): make 'rejected' the worse answer, or remove the record")


@pytest.mark.parametrize("parquet", [False, True], ids=["jsonl", "parquet"])
def test_a_preference_record_whose_prompt_is_null_is_named(parquet, tmp_path, capsys):
    pairs, where = pairs_file(tmp_path, GOOD["explicit_text"], {**GOOD["explicit_text"], "prompt": None}, parquet)
    line = refused(dpo(pairs, tmp_path), capsys)
    assert line.endswith(f"{where}: field 'prompt' is null: give the record its prompt, or leave the field out of "
                         f"every record (the prompt is then the start that 'chosen' and 'rejected' share)")
