"""GRPO steps of `modern-jax train` beside TRL 1.16's `GRPOTrainer`, on the same CPU, model, prompts,
reward functions and settings, side by side, with their ratio.

    uv run python scripts/bench_grpo.py --hf-python .hfvenv/bin/python                 # a random 24M Qwen2
    uv run python scripts/bench_grpo.py --hf-python .hfvenv/bin/python --model tests/fixtures/hf_chat

Both sides train LoRA adapters (rank 16, alpha 32, every linear projection) on
configs/grpo.yaml's reward functions over scripts/make_arithmetic.py's sums (chat prompts, the
model's template): `--prompts` x `--generations` completions a step of at most `--new-tokens`
tokens, sampled at temperature 1, DAPO's loss, no KL term, one iteration a batch, `--steps`
steps. The default model is a random Qwen2 made by transformers (8 layers, width 512, 24.3M
parameters) with the tiny fixture's tokenizer (tests/fixtures/hf_chat). Ours runs at each
`--seq-lens` (`train.seq_len`; TRL pads each batch to its own longest row, so it has no such
setting); theirs in the reference interpreter (torch, transformers, trl, peft), float32 eager
PyTorch on every core. Each side's time is the sum of its steps (sampling and scoring, then
the training passes), best of `--repeats` runs (`--overlap`: ours also with `grpo.overlap` at the
first of `--seq-lens`, its sampling then the part the step does not hide); ours leaves compilation out (the first run
compiles every width it meets, the later ones run compiled), as theirs leaves out loading.
Each side's step also splits into its sampling (the rollouts and their scoring) and the rest.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FIXTURE = ROOT / "tests" / "fixtures" / "hf_chat"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

MAKE_MODEL = r"""
import json, shutil, sys
import torch
from transformers import Qwen2Config, Qwen2ForCausalLM
args = json.loads(sys.argv[1])
torch.manual_seed(0)
vocab = json.load(open(args["fixture"] + "/config.json"))["vocab_size"]
config = Qwen2Config(vocab_size=vocab, hidden_size=512, intermediate_size=1280, num_hidden_layers=8,
                     num_attention_heads=8, num_key_value_heads=8, max_position_embeddings=256, eos_token_id=2,
                     pad_token_id=3, bos_token_id=None, tie_word_embeddings=False)
model = Qwen2ForCausalLM(config)
model.save_pretrained(args["out"])
for name in args["files"]:
    shutil.copy(args["fixture"] + "/" + name, args["out"] + "/" + name)
print(sum(p.numel() for p in model.parameters()))
"""

REFERENCE = r"""
import importlib.util, json, sys, time
import torch
from datasets import Dataset
from peft import LoraConfig
from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
from trl import GRPOConfig, GRPOTrainer
args = json.loads(sys.argv[1])
torch.set_num_threads(args["threads"])
spec = importlib.util.spec_from_file_location("rewards", args["rewards"])
rewards = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rewards)
records = [json.loads(line) for line in open(args["data"])]
dataset = Dataset.from_list(records)


class Clock(TrainerCallback):
    def __init__(self):
        self.steps = []

    def on_step_begin(self, *a, **k):
        self.start = time.perf_counter()

    def on_step_end(self, *a, **k):
        self.steps.append(time.perf_counter() - self.start)


runs = []
for repeat in range(args["repeats"]):
    config = GRPOConfig(output_dir=args["out"], report_to="none", use_cpu=True, bf16=False, seed=repeat,
                        per_device_train_batch_size=args["rows"], num_generations=args["generations"],
                        max_completion_length=args["new"], temperature=1.0, top_p=1.0, beta=0.0, epsilon=0.2,
                        epsilon_high=0.28, loss_type="dapo", learning_rate=2e-3, lr_scheduler_type="constant",
                        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, max_steps=args["steps"],
                        logging_steps=1, save_strategy="no", reward_weights=[1.0, 0.2], disable_dropout=True)
    model = AutoModelForCausalLM.from_pretrained(args["model"], dtype=torch.float32)
    clock = Clock()
    trainer = GRPOTrainer(model=model, reward_funcs=[rewards.exact_answer, rewards.number_last], args=config,
                          train_dataset=dataset, processing_class=AutoTokenizer.from_pretrained(args["model"]),
                          peft_config=LoraConfig(r=16, lora_alpha=32, target_modules="all-linear", lora_dropout=0.0),
                          callbacks=[clock])
    sampled = []
    generate = trainer._generate_and_score_completions

    def timed(*a, **k):
        start = time.perf_counter()
        out = generate(*a, **k)
        sampled.append(time.perf_counter() - start)
        return out

    trainer._generate_and_score_completions = timed
    trainer.train()
    runs.append({"steps": sum(clock.steps), "sampling": sum(sampled)})
print(json.dumps(min(runs, key=lambda r: r["steps"])))
"""


def make_model(hf_python: str, out: Path) -> int:
    done = subprocess.run([hf_python, "-c", MAKE_MODEL, json.dumps({"fixture": str(FIXTURE), "out": str(out),
                                                                     "files": TOKENIZER_FILES})],
                          capture_output=True, text=True)
    if done.returncode:
        sys.exit(f"making the model failed:\n{done.stderr[-3000:]}")
    return int(done.stdout.split()[-1])


def theirs(args, model: Path, data: Path, work: Path) -> dict:
    spec = {"model": str(model), "data": str(data), "rewards": str(ROOT / "configs" / "rewards.py"),
            "out": str(work / "trl"), "rows": args.prompts * args.generations, "generations": args.generations,
            "new": args.new_tokens, "steps": args.steps, "repeats": args.repeats, "threads": args.threads}
    done = subprocess.run([args.hf_python, "-c", REFERENCE, json.dumps(spec)], capture_output=True, text=True,
                          cwd=work)
    if done.returncode:
        sys.exit(f"TRL failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def ours(args, model: Path, data: Path, work: Path, seq_len: int, overlap: bool) -> dict:
    """The best of `--repeats` runs of `--steps` steps: `{steps, sampling}` seconds, and the train
    step's compilations (one a width)."""
    import jax

    from modern_jax.convert import finetune_run
    from modern_jax.training import loop
    from modern_jax.training.config import load_run_config
    from modern_jax.training.objectives.grpo import GRPO
    from modern_jax.training.trainer import Trainer

    clock = {"sampling": 0.0, "training": 0.0}

    def timed(part, fn, counted=True):
        def wrapped(*a, **k):
            start = time.perf_counter()
            out = fn(*a, **k)
            out = out if callable(out) else jax.block_until_ready(out)
            if counted:
                clock[part] += time.perf_counter() - start
            return timed(part, out, counted) if callable(out) else out  # a batch begun: its finish too
        return wrapped

    begin, step = GRPO.begin_batch, Trainer.train_step
    runs, made = [], []
    make = loop.trainer_for
    try:  # a step: its batch begun and finished (an evaluation's is no step's), and the training step
        GRPO.begin_batch = lambda self, *a, **k: timed("sampling", begin, k["step"] is not None)(self, *a, **k)
        Trainer.train_step = timed("training", step)
        loop.trainer_for = lambda *a, **k: made.append(make(*a, **k)) or made[-1]
        for repeat in range(args.repeats):
            run = load_run_config(ROOT / "configs" / "grpo.yaml", [
                f"train.output_dir={work / f'ours_{seq_len}_{overlap}_{repeat}'}", f"data.path={data}",
                "data.val_fraction=0.02", f"train.batch_size={args.prompts * args.generations}",
                f"train.eval_batch_size={args.prompts * args.generations}",
                f"grpo.num_generations={args.generations}", f"grpo.max_completion_length={args.new_tokens}",
                f"train.seq_len={seq_len}", f"train.steps={args.steps}", f"train.checkpoint_every={args.steps}",
                "train.eval_every=0", "train.progress=false", "train.plot=false", "train.log_every=1",
                f"train.seed={repeat}", "grpo.completions_per_log=0", f"grpo.overlap={str(overlap).lower()}"])
            run, init = finetune_run(run, model)
            clock.update(sampling=0.0, training=0.0)
            result = loop.train(run, init=init, log=lambda *a, **k: None)
            assert result.step == args.steps, result.step
            runs.append({"steps": clock["sampling"] + clock["training"], "sampling": clock["sampling"]})
    finally:
        GRPO.begin_batch, Trainer.train_step, loop.trainer_for = begin, step, make
    # the train step's programs: one a width the batches took (the later runs reuse them)
    return dict(min(runs, key=lambda r: r["steps"]), widths=sum(t.programs.compilations.get("train", 0) for t in made))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-python", required=True, help="an interpreter with torch, transformers, trl and peft")
    parser.add_argument("--model", help="a Hugging Face model directory with its tokenizer (default: a random "
                                        "24M Qwen2, made now)")
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--generations", type=int, default=8)
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seq-lens", type=int, nargs="+", default=[128, 64])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--overlap", action="store_true", help="also time ours with grpo.overlap (the next "
                                                                    "batch sampled while a step trains) at the first "
                                                                    "of --seq-lens")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        model = Path(args.model).resolve() if args.model else work / "model"
        if not args.model:
            print(f"model: a random Qwen2 of {make_model(args.hf_python, model):,} parameters")
        data = work / "arithmetic.jsonl"
        subprocess.run([sys.executable, str(ROOT / "scripts" / "make_arithmetic.py"), "--out", str(data)], check=True,
                       capture_output=True)
        print(f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores; {args.prompts} prompts x "
              f"{args.generations} generations, {args.new_tokens} new tokens, {args.steps} steps, best of "
              f"{args.repeats}")
        settings = [(n, False) for n in args.seq_lens] + ([(args.seq_lens[0], True)] if args.overlap else [])
        timed = {}
        for seq_len, overlap in settings:
            timed[seq_len, overlap] = got = ours(args, model, data, work, seq_len, overlap)
            name = f"ours, train.seq_len={seq_len}" + (", grpo.overlap" if overlap else "")
            print(f"{name}: {got['steps']:.2f} s (sampling {got['sampling']:.2f} s, the rest "
                  f"{got['steps'] - got['sampling']:.2f} s; the train step compiled for "
                  f"{got['widths']} widths)", flush=True)
        trl = theirs(args, model, data, work)
        print(f"TRL GRPOTrainer: {trl['steps']:.2f} s (sampling {trl['sampling']:.2f} s, the rest "
              f"{trl['steps'] - trl['sampling']:.2f} s)")
        for (seq_len, overlap), got in timed.items():
            print(f"ratio (ours, train.seq_len={seq_len}{', grpo.overlap' if overlap else ''} / TRL): "
                  f"{got['steps'] / trl['steps']:.2f}  (sampling "
                  f"{got['sampling'] / trl['sampling']:.2f}, the rest "
                  f"{(got['steps'] - got['sampling']) / (trl['steps'] - trl['sampling']):.2f})")


if __name__ == "__main__":
    main()
