"""The `modern-jax` command.

    modern-jax train [--config configs/tiny.yaml] [--data PATH] [train.steps=500 model.n_layers=2 ...]
    modern-jax train --init-from-hf HF_DIR --data chats.jsonl [--config configs/finetune_chat.yaml] [...]
    modern-jax evaluate --checkpoint runs/tiny [--split val | --data FILE] [--max-windows N|all]
    modern-jax generate --checkpoint runs/tiny --prompt "def " [--temperature 0.8 --top-k 50 --top-p 0.95]
    modern-jax harness --checkpoint runs/chat | --hf HF_DIR --tasks sums_choice [--include-path configs/harness ...]
    modern-jax info --config configs/llama3_8b.yaml [model.n_layers=4 ...] [--context 8192]
    modern-jax info --hf-config path/to/config.json
    modern-jax convert --from-hf HF_DIR --out CKPT  |  --to-hf CKPT --out HF_DIR [--model-type llama]
    modern-jax plan --config configs/llama3_8b.yaml --mesh data=1,fsdp=8,tensor=1 --batch 8 --seq 8192 --hbm-gib 141
    modern-jax plan --config configs/llama3_8b.yaml --topology v5p:2x2x2 --mesh fsdp=8 --batch 8 --seq 8192
    modern-jax launch --processes 2 --devices 4 train --mesh data=2,fsdp=2,tensor=2 [...]   (rehearse a pod run)

Under a cluster launcher (srun, mpirun, a Cloud TPU pod's workers) or with --coordinator /
--num-processes / --process-id (or JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID),
train, evaluate, generate, harness and plan join the other processes first (`multihost.distributed`).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import pathlib
import re
import sys
import traceback
import warnings

DEFAULT_CONFIG = pathlib.Path(__file__).resolve().parent.parent / "configs" / "tiny.yaml"
FINETUNE_CONFIG = DEFAULT_CONFIG.parent / "finetune_chat.yaml"  # the default run file of --init-from-hf
DEFAULT_EVAL_BATCH = 32  # evaluate --batch-size
# the data layer's fixes through a data: setting ("set data.text_field to ...", "use source: tokens")
_SETTING_FIX = re.compile(r"(?:[:;]| \(or) (?:set|point|use|for token ids use) (?:data\.|source: ).*$")


def _check_flags(args, *checks) -> None:
    """`(flag, ok, expected)`: each given flag's value must pass `ok`, else a message naming the flag."""
    for flag, ok, expected in checks:
        value = getattr(args, flag.lstrip("-").replace("-", "_"))
        if value is not None and not ok(value):
            raise ValueError(f"{flag} {value} is invalid: expected {expected}")


def _positive(flag: str):
    return flag, lambda v: v >= 1, "a positive integer"


def _load_model_config(args):
    from modern_jax.config import ModelConfig, model_config_from_file
    from modern_jax.configfile import apply_overrides, read_json

    _check_flags(args, _positive("--context"), _positive("--seq-len"))
    if args.hf_config and args.config:
        raise ValueError("give one of --config FILE or --hf-config config.json, not both")
    if args.hf_config:
        from modern_jax.convert.hf_config import config_from_hf

        path = pathlib.Path(args.hf_config)
        if path.is_dir() and (path / "config.json").is_file():
            path = path / "config.json"
        hf = read_json(path)
        try:
            cfg = config_from_hf(hf)
        except (ValueError, TypeError) as e:  # TypeError: a value of a type no family default has
            raise ValueError(f"{path}: {e}") from None
        raw = apply_overrides({"model": cfg.to_dict()}, args.overrides, sections=("model",))
        return ModelConfig.from_dict(raw["model"])
    if not args.config:
        raise ValueError("give --config FILE (a configs/*.yaml preset) or --hf-config config.json")
    return model_config_from_file(args.config, args.overrides)


def cmd_info(args) -> None:
    from modern_jax.accounting import (flops_per_token, format_bytes, kv_cache_bytes, kv_cache_bytes_per_token,
                                       param_counts)

    cfg = _load_model_config(args)
    counts = param_counts(cfg)
    dtype_bytes = {"bfloat16": 2, "float16": 2, "float32": 4}[args.kv_dtype]
    print(f"parameters: {counts['total']}")
    if cfg.ffn_type == "moe":
        print(f"active parameters: {counts['active']}")
        print(f"routed experts per token: {cfg.experts_per_token} of {cfg.n_experts}"
              + (f", plus {cfg.n_shared_experts} shared" if cfg.n_shared_experts else ""))
    print(f"embedding parameters: {counts['embedding']}")
    print(f"head parameters: {counts['head']}" + (" (tied to the embedding)" if cfg.tie_embeddings else ""))
    print(f"non-embedding parameters: {counts['total'] - counts['embedding']}")
    runs, start = [], 0
    blocks = counts["per_block"]
    for i in range(1, len(blocks) + 1):
        if i == len(blocks) or blocks[i] != blocks[start]:
            runs.append(f"layers {start}-{i - 1}: {blocks[start]}" if i - 1 > start else f"layer {start}: {blocks[start]}")
            start = i
    print("parameters per block: " + "; ".join(runs))
    per_token = kv_cache_bytes_per_token(cfg, dtype_bytes)
    print(f"kv cache per token ({args.kv_dtype}): {per_token} ({format_bytes(per_token)})")
    context = args.context or cfg.max_position_embeddings
    total = kv_cache_bytes(cfg, context, dtype_bytes)
    print(f"kv cache at {context} tokens: {total} ({format_bytes(total)}) per sequence")
    seq = args.seq_len or min(context, 4096)
    flops = flops_per_token(cfg, seq)
    print(f"training flops per token at seq_len {seq}: {flops['total']:.4e} "
          f"(6N = {flops['weights']:.4e}, attention = {flops['attention']:.4e})")


def cmd_train(args) -> int:
    import signal

    from modern_jax.harness import Benchmarks
    from modern_jax.multihost import distributed
    from modern_jax.training import TrainingDiverged, load_run_config, train

    overrides = list(args.overrides)
    if args.data is not None:
        overrides.append(f"data.path={json.dumps(args.data)}")
    if args.output_dir is not None:
        overrides.append(f"train.output_dir={json.dumps(args.output_dir)}")
    if args.mesh is not None:
        from modern_jax.sharding.mesh import parse_mesh

        overrides += [f"parallel.{axis}={size}" for axis, size in parse_mesh(args.mesh).items()]
    config = args.config or (FINETUNE_CONFIG if args.init_from_hf else DEFAULT_CONFIG)
    run = load_run_config(config, overrides)
    init = None
    if args.init_from_hf:
        from modern_jax.convert import finetune_run

        run, init = finetune_run(run, args.init_from_hf, log=_note, adapter=args.init_adapter)
    elif args.init_adapter:
        raise ValueError("--init-adapter needs --init-from-hf: the Hugging Face model the adapter was trained on")
    source = f"{config} from {args.init_from_hf}" if init is not None else str(config)
    main = distributed.is_main()
    if main:
        print(f"training {source} -> {run.train.output_dir}", flush=True)
    try:
        with _warnings_as_notes(quiet=not main):
            result = train(run, init=init, benchmarks=Benchmarks)
    except TrainingDiverged as e:
        if main:
            print(f"modern-jax train: {e}", file=sys.stderr)
        return 3
    if result.interrupted:  # after a checkpoint: Ctrl-C is 130; a stop request (SIGTERM, a preemption notice,
        return 130 if result.signal == signal.SIGINT and not distributed.joined() else 0  # any signal in a launch) 0
    if not main:
        return 0
    for i, text in enumerate(result.samples):
        print(f"--- sample {i} ---\n{text}")
    print(f"steps: {result.step}")
    print(f"wall_s: {result.wall_s:.1f}")
    print(f"compile_s: {result.compile_s:.1f}")
    for label, value in result.val_shown.items():  # the objective's own figures (bits per byte, DPO's margin)
        print(f"val_{label}: {value:.4f}")
    print(f"val_loss: {result.val_loss:.4f}")
    for name, value in result.harness.items():  # train.harness_tasks: lm-eval's figures at the last step
        print(f"harness/{name}: {value:.4f}")
    print(f"tokens_per_s: {result.tokens_per_s:.0f}")
    return 0


def _checkpoint_tokenizer(run_dir, cfg):
    """The run's tokenizer.json, a converted checkpoint's hf/tokenizer.json, else bytes (if the
    model has room for their ids)."""
    from modern_jax.convert.checkpoint import checkpoint_tokenizer
    from modern_jax.data.tokenizers import TOKENIZER_FILE, ByteTokenizer

    tokenizer = checkpoint_tokenizer(run_dir)
    if tokenizer is None:
        if cfg.vocab_size < ByteTokenizer.vocab_size:
            raise ValueError(f"no {TOKENIZER_FILE} in {run_dir} (nor in its hf/), and the byte tokenizer's "
                             f"{ByteTokenizer.vocab_size} ids do not fit the model's vocab_size={cfg.vocab_size}: "
                             f"copy the tokenizer.json the model was trained with into {run_dir}")
        _note(f"no {TOKENIZER_FILE} in {run_dir}: using the byte tokenizer")
        return ByteTokenizer()
    return tokenizer


def _checkpoint_data(args, raw: dict, run_dir, cfg):
    """The tokenizer and the token stream to evaluate: a split of the run's data, or every document
    of a file read as the run reads its data (`data.format`, its fields and chat template)."""
    from modern_jax.data.config import DataConfig
    from modern_jax.data.corpora import load_splits, load_stream

    tokenizer = _checkpoint_tokenizer(run_dir, cfg)
    data_cfg = DataConfig.from_dict(raw.get("data"))
    if args.data:
        if not pathlib.Path(args.data).exists():
            raise ValueError(f"--data {args.data} does not exist: give a file or directory of documents")
        file_cfg = data_cfg.replace(source="auto", path=args.data, streaming=False, max_documents=None)
        try:
            return tokenizer, load_stream(file_cfg, tokenizer)
        except ValueError as e:  # name the flag; a fix through a data: setting is not evaluate's to make
            message = str(e).replace(f"data.path={args.data!r}", f"--data {args.data}")
            raise ValueError(_SETTING_FIX.sub(f": evaluate reads --data with the run's data: settings "
                                              f"({run_dir / 'config.yaml'}), which it does not change: give "
                                              f"--data a file they read", message)) from None
    if data_cfg.path and not pathlib.Path(data_cfg.path).exists() and data_cfg.resolved_source != "hf":
        raise ValueError(f"the run's data.path={data_cfg.path!r} (in {run_dir / 'config.yaml'}) does not exist: "
                         f"give --data FILE to evaluate a file instead")
    _, train_stream, val_stream = load_splits(data_cfg, tokenizer)
    return tokenizer, {"train": train_stream, "val": val_stream}[args.split]


def _windows(n: int, seq_len: int) -> str:
    return f"{n:,} window{'s' if n != 1 else ''} of {seq_len} tokens"


def _eval_seq_len(args, cfg, raw: dict) -> int:
    """`--seq-len`, else the run's train.seq_len, else (said so) min(1024, max_position_embeddings);
    a length past the positions is refused for learned ones, said so for the others."""
    P = cfg.max_position_embeddings
    seq_len = args.seq_len or (raw.get("train") or {}).get("seq_len")
    if seq_len is None:
        seq_len = min(1024, P)
        _note(f"windows of {seq_len} tokens: the checkpoint's config has no train.seq_len (--seq-len sets it)")
    if seq_len > P and cfg.position_embedding == "learned":
        raise ValueError(f"--seq-len {seq_len} exceeds the model's max_position_embeddings={P} (learned positions "
                         f"have no row past it): give --seq-len {P} or less")
    if args.seq_len and seq_len > P:
        _note(f"--seq-len {seq_len} exceeds the model's max_position_embeddings={P}: the windows run past the "
              f"trained context ({cfg.position_embedding} positions), and the loss there measures that")
    return seq_len


@contextlib.contextmanager
def _warnings_as_notes(quiet: bool = False):
    """The library's warnings (a request it shortens, a context it runs past) as one line each on
    stderr (`quiet`: none, on the processes of a launch other than 0)."""
    with warnings.catch_warnings():
        show = warnings.showwarning

        def note(message, category, filename, lineno, file=None, line=None):
            if issubclass(category, UserWarning):
                if not quiet:
                    _note(str(message))
            else:
                show(message, category, filename, lineno, file, line)

        warnings.showwarning = note
        yield


def _final_evaluation(raw: dict) -> tuple[int | None, int | None] | None:
    """`(train.final_eval_windows, train.seq_len)` of the run whose config is `raw`: the windows its
    final evaluation scored on its val split (None: all); None for a checkpoint without a run's
    `train:` section (a converted one)."""
    train = raw.get("train")
    if not isinstance(train, dict) or "final_eval_windows" not in train:
        return None
    return train["final_eval_windows"], train.get("seq_len")


def _scored(windows: int, total: int, seq_len: int, what: str) -> str:
    """`1,024 windows of 128 tokens spread evenly over the 10,242 of the val split`, or all of them."""
    if windows == total:
        return f"all {_windows(total, seq_len)} of {what}, end to end"
    return f"{_windows(windows, seq_len)} spread evenly over the {total:,} of {what}"


def _max_windows(text: str | None) -> int | str | None:
    """`--max-windows`: a positive count, `all`, or None (not given)."""
    if text is None or text == "all":
        return text
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"--max-windows {text} is invalid: expected a positive integer or all")
    return int(text)


def _scoring_trainer(cfg, raw: dict, tc):
    """The Trainer that evaluates or samples checkpoint `cfg` (its run config `raw`: its adapters)
    under `tc`: next-token scoring, no optimiser, one device (in a launch of several processes
    every device, each process feeding its rows)."""
    import jax

    from modern_jax.data.config import DataConfig
    from modern_jax.lora import LoRAConfig
    from modern_jax.sharding.mesh import make_mesh
    from modern_jax.training import RunConfig, trainer_for

    run = RunConfig(cfg.to_dict(), tc, DataConfig(), lora=LoRAConfig.of_run(raw))
    mesh = make_mesh(data=-1, devices=jax.devices()[:1] if jax.process_count() == 1 else None)
    return trainer_for(run, mesh, optimizer=False)


def cmd_evaluate(args) -> int:
    _check_flags(args, _positive("--seq-len"), _positive("--batch-size"))
    args.max_windows = _max_windows(args.max_windows)
    import jax

    from modern_jax.accounting import DoesNotFit, check_fits
    from modern_jax.data.pipeline import eval_batches, eval_windows
    from modern_jax.training import TrainConfig, evaluate_batches
    from modern_jax.training.metrics import Progress
    from modern_jax.convert.checkpoint import load_model_params

    main = jax.process_index() == 0
    note = _note if main else (lambda *_: None)
    cfg, params, raw, run_dir = load_model_params(args.checkpoint, log=note)
    seq_len = _eval_seq_len(args, cfg, raw)
    final = _final_evaluation(raw)
    same_split = final is not None and not args.data and args.split == "val" and seq_len == final[1]
    with Progress(None, enabled=main) as progress:
        with progress.phase("reading and tokenizing the data"):
            tokenizer, stream = _checkpoint_data(args, raw, run_dir, cfg)
        what = f"--data {args.data}" if args.data else f"the {args.split} split"
        total = len(eval_windows(stream, seq_len))
        # by default the windows of the run's final evaluation where they are the same split and length
        asked = args.max_windows if args.max_windows is not None else final[0] if same_split else "all"
        asked = None if asked == "all" else asked
        if args.max_windows not in (None, "all") and args.max_windows > total:
            note(f"--max-windows {args.max_windows}: {what} has {_windows(total, seq_len)}; evaluating all of them")
        windows = min(total, asked or total)
        if final is None:
            relation = "the checkpoint has no run config, so no final evaluation of a run to compare"
        else:
            setting = f"train.final_eval_windows={'null' if final[0] is None else final[0]}"
            if same_split and asked == final[0]:
                relation = f"the windows of the run's final evaluation ({setting}): at its last step, loss is " \
                           f"its val_loss"
            else:
                count = "every window" if final[0] is None else _windows(final[0], final[1])
                relation = (f"the run's final evaluation scored {count} of the val split ({setting}, "
                            f"train.seq_len={final[1]}): with no --max-windows, --seq-len, --split or --data, "
                            f"evaluate scores those")
        scored = f"scored: {_scored(windows, total, seq_len, what)}; {relation}"
        run_batch = (raw.get("train") or {}).get("eval_batch_size") if final else None
        batch_size = min(args.batch_size or run_batch or DEFAULT_EVAL_BATCH, windows)
        if args.batch_size is not None and args.batch_size > windows:
            note(f"--batch-size {args.batch_size}: {what} gives {_windows(windows, seq_len)}; one batch of "
                 f"{windows:,}")
        tc = TrainConfig(seq_len=seq_len, eval_batch_size=batch_size, warmup_steps=0)
        # one device; in a launch of several processes every device, each process feeding its rows
        trainer = _scoring_trainer(cfg, raw, tc)
        token_bytes = jax.device_put(tokenizer.token_bytes(), trainer.replicated)

        def compile_at(batch_size: int, seq_len: int):  # the step it compiles last is the one evaluate runs
            return trainer.eval_executable(params, trainer.batches.abstract((batch_size, seq_len)), token_bytes)

        def fits(batch_size: int) -> None:
            check_fits("evaluate", compile_at, {"batch_size": batch_size, "seq_len": seq_len}, resident=params,
                       lower=("batch_size",), otherwise="seq_len")

        with progress.phase("compiling the evaluation step"):
            try:
                fits(batch_size)
            except DoesNotFit as e:
                if args.batch_size is not None or e.lower != "batch_size" or not e.fits:  # asked for: refused
                    raise ValueError(e.describe({"batch_size": "--batch-size", "seq_len": "--seq-len"})) from None
                note(f"batches of {e.fits:,} windows, the most that fit (the default, {batch_size:,}, does not); "
                     f"the loss is the same but for rounding")
                batch_size = e.fits
                try:
                    fits(batch_size)
                except DoesNotFit as e:
                    raise ValueError(e.describe({"batch_size": "--batch-size", "seq_len": "--seq-len"})) from None
        rows, _ = trainer.batches.local_slices(batch_size)
        batches = eval_batches(stream, seq_len=seq_len, batch_size=batch_size, max_windows=asked, rows=rows)
        with progress.phase("evaluating", len(batches), "batches") as advance:
            values = evaluate_batches(trainer, params, batches, token_bytes, rows=batch_size, advance=advance)
    if not main:
        return 0
    print(scored)
    print(f"split: {'file ' + args.data if args.data else args.split}")
    print(f"tokens: {values['tokens']}")
    print(f"loss: {values['loss']:.4f}")
    print(f"perplexity: {math.exp(values['loss']) if values['loss'] < 700 else math.inf:.4f}")
    print(f"bits_per_byte: {values['bpb']:.4f}")
    return 0


def cmd_generate(args) -> int:
    _check_flags(args, _positive("--max-new-tokens"), _positive("--num-samples"), _positive("--top-k"),
                 ("--top-p", lambda p: 0 < p <= 1, "a probability in (0, 1]"),
                 ("--temperature", lambda t: 0 <= t < math.inf, "a finite number >= 0 (0: greedy)"))
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # a byte of the shell's argv that is not UTF-8 (surrogate-escaped)
        byte = ord(args.prompt[e.start]) - 0xDC00 if 0xDC80 <= ord(args.prompt[e.start]) <= 0xDCFF else None
        shown = f"the byte 0x{byte:02x}" if byte is not None else f"{args.prompt[e.start]!r}"
        raise ValueError(f"--prompt is not UTF-8 text: {shown} at character {e.start}; give the prompt as "
                         f"UTF-8 (check the terminal's or the file's encoding)") from None
    from modern_jax.accounting import DoesNotFit
    from modern_jax.generate import sample_texts
    from modern_jax.convert.checkpoint import load_model_params
    from modern_jax.training import TrainConfig
    from modern_jax.training.metrics import Progress

    import jax

    cfg, params, raw, run_dir = load_model_params(args.checkpoint, log=_note if jax.process_index() == 0 else None)
    tokenizer = _checkpoint_tokenizer(run_dir, cfg)
    try:
        tokenizer.encode(args.prompt)
    except ValueError as e:
        raise ValueError(f"--prompt cannot be encoded: {e}") from None
    graphdef = _scoring_trainer(cfg, raw, TrainConfig(warmup_steps=0)).graphdef
    temperature = 0.0 if args.greedy else args.temperature
    try:
        with _warnings_as_notes(), Progress(None, enabled=jax.process_index() == 0) as progress, \
                progress.phase(f"sampling {args.num_samples} x {args.max_new_tokens} tokens"):
            texts = sample_texts(graphdef, params, tokenizer, args.prompt, n=args.num_samples,
                                 max_new_tokens=args.max_new_tokens, seed=args.seed, temperature=temperature,
                                 top_k=args.top_k, top_p=args.top_p)
    except DoesNotFit as e:
        raise ValueError(e.describe({"max_new_tokens": "--max-new-tokens", "rows": "--num-samples"})) from None
    if jax.process_index() != 0:  # every process of a launch samples; process 0 prints
        return 0
    for i, text in enumerate(texts):
        if len(texts) > 1:
            print(f"--- sample {i} ---")
        print(text)
    return 0


def cmd_harness(args) -> int:
    """lm-eval's tasks on a checkpoint or a Hugging Face model: its table, its result and sample files."""
    _check_flags(args, _positive("--batch-size"), ("--num-fewshot", lambda n: n >= 0, "an integer >= 0"),
                 ("--limit", lambda x: 0 < x < math.inf, "a positive count of documents, or a fraction below 1"))
    if bool(args.checkpoint) == bool(args.hf):
        raise ValueError("give one of --checkpoint RUN (a run, a step or a converted checkpoint) or --hf DIR "
                         "(a Hugging Face model directory)")
    tasks = [t for item in args.tasks for t in item.split(",") if t]
    if not tasks:
        raise ValueError("--tasks: give one or more task names (lm-eval's, or those of --include-path)")
    with _long_lived():
        import jax

        from modern_jax import harness
        from modern_jax.training import outputs

        main = jax.process_index() == 0
        note = _note if main else (lambda *_: None)
        if args.output_path:  # before anything is read: refused early, written by process 0 only
            outputs.claim(args.output_path, outputs.HARNESS, "--output-path", hint="choose a new directory")
        harness.quiet_lm_eval()
        manager = harness.task_manager(args.include_path, tasks=tasks)
        harness.check_tasks(manager, tasks)
        harness.load_tasks(manager, tasks)  # a task whose data cannot be read is refused before the model is
        cfg, params, raw, tokenizer, source = _harness_model(args, note)
        trainer = _harness_trainer(cfg, raw, args)
    lm = harness.HarnessLM(harness.Scorer(trainer, params, args.batch_size), tokenizer, seed=args.seed,
                           name=source)
    tracker = None
    if args.output_path and main:
        from lm_eval.loggers import EvaluationTracker

        tracker = EvaluationTracker(output_path=args.output_path)
    results = harness.evaluate_tasks(lm, tasks, include_path=args.include_path, num_fewshot=args.num_fewshot,
                                     limit=args.limit, log_samples=args.log_samples,
                                     apply_chat_template=args.apply_chat_template or False,
                                     gen_kwargs=args.gen_kwargs, seed=args.seed, model_args={"pretrained": source},
                                     tracker=tracker, manager=manager)
    if not main or results is None:
        return 0
    if tracker is not None:
        samples = results.pop("samples", None)
        tracker.save_results_aggregated(results=results, samples=samples)
        for task in results["configs"] if samples else ():
            tracker.save_results_samples(task_name=task, samples=samples[task])
        outputs.mark(args.output_path, outputs.HARNESS, "modern-jax harness")
        note(f"wrote {args.output_path}")
    from lm_eval.utils import make_table

    print(f"{source}: limit {args.limit}, num_fewshot {args.num_fewshot}, batch_size {args.batch_size}")
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    return 0


def _harness_model(args, note):
    """`(config, parameters, run config, tokenizer, name)` of --checkpoint or --hf."""
    if args.hf:
        from modern_jax.convert.checkpoint import initial_weights

        cfg, init = initial_weights(args.hf, log=note)
        if init.tokenizer is None:
            raise ValueError(f"--hf {args.hf} has no tokenizer.json: lm-eval's tasks are text, and the model's "
                             f"token ids mean nothing to another tokenizer: put its tokenizer files beside it")
        note(f"converting {init.source}")
        return cfg, init.params(), {}, init.tokenizer, str(args.hf)
    from modern_jax.convert.checkpoint import load_model_params

    cfg, params, raw, run_dir = load_model_params(args.checkpoint, log=note)
    return cfg, params, raw, _checkpoint_tokenizer(run_dir, cfg), str(args.checkpoint)


def _harness_trainer(cfg, raw: dict, args):
    """The scoring Trainer on --mesh, else the run's mesh (its parallel: section), else every device on data."""
    from modern_jax.data.config import DataConfig
    from modern_jax.lora import LoRAConfig
    from modern_jax.sharding import ParallelConfig
    from modern_jax.sharding.mesh import parse_mesh
    from modern_jax.training import RunConfig, TrainConfig, trainer_for

    parallel = dict(raw.get("parallel") or {}) if isinstance(raw.get("parallel"), dict) else {}
    if args.mesh:
        parallel.update(parse_mesh(args.mesh))
    parallel = ParallelConfig.from_dict(parallel)
    seq_len = cfg.max_position_embeddings
    tc = TrainConfig(seq_len=seq_len, batch_size=args.batch_size, eval_batch_size=args.batch_size, warmup_steps=0)
    run = RunConfig(cfg.to_dict(), tc, DataConfig(), parallel, lora=LoRAConfig.of_run(raw))
    try:
        mesh = parallel.mesh()
    except ValueError as e:
        raise ValueError(f"the mesh {'--mesh ' + args.mesh if args.mesh else 'of the run (parallel:)'}: {e}") from None
    try:
        return trainer_for(run, mesh, optimizer=False)
    except ValueError as e:
        raise ValueError(str(e).replace("train.eval_batch_size", "--batch-size").replace("train.batch_size / grad_accum",
                                                                                       "--batch-size")) from None


@contextlib.contextmanager
def _long_lived():
    """What a command makes inside (its imports, the model, the tasks) lives as long as the process:
    the cycle collector is off while it is made and leaves it alone afterwards (`gc.freeze`), so
    that its full collections walk only what the command makes later (walking the ~1M objects of
    lm-eval, jax and the model took 1.5 s of an 8 s `harness` run)."""
    gc.disable()
    try:
        yield
    finally:
        gc.freeze()
        gc.enable()


def _note(message: str) -> None:
    """Progress for the user on stderr, so stdout keeps only the command's result."""
    print(message, file=sys.stderr, flush=True)


def cmd_convert(args) -> int:
    from modern_jax.convert import convert_from_hf, convert_to_hf
    from modern_jax.convert.checkpoint import convert_to_peft

    if sum(map(bool, (args.from_hf, args.to_hf, args.to_peft))) != 1:
        raise ValueError("give exactly one of --from-hf HF_DIR, --to-hf CHECKPOINT or --to-peft RUN")
    if args.to_peft:
        convert_to_peft(args.to_peft, args.out, model_type=args.model_type, overwrite=args.overwrite, log=_note)
    elif args.from_hf:
        convert_from_hf(args.from_hf, args.out, dtype=args.dtype or "float32", overwrite=args.overwrite, log=_note)
    else:
        convert_to_hf(args.to_hf, args.out, model_type=args.model_type, dtype=args.dtype, overwrite=args.overwrite,
                      log=_note)
    print(f"wrote {args.out}")
    return 0


def cmd_plan(args) -> int:
    from modern_jax.sharding.mesh import parse_mesh

    _check_flags(args, _positive("--batch"), _positive("--seq"), _positive("--slices"),
                 ("--hbm-gib", lambda g: 0 < g < math.inf, "a positive number of GiB"))
    sizes = {"stage": 1, "data": 1, "fsdp": 1, "expert": 1, "context": 1, "tensor": 1, **parse_mesh(args.mesh)}
    if any(v < 1 for v in sizes.values()):
        raise ValueError("plan needs explicit mesh sizes (no -1)")
    if args.slices > 1 and not args.topology:
        raise ValueError("--slices needs --topology (the slices of a TPU topology)")
    if args.search and not args.topology:
        raise ValueError("--search needs --topology: it ranks by the TPU compiler's estimated step time")
    if args.topology:
        from modern_jax.sharding.devices import check_topology

        check_topology(args.topology)
    searched = _search_options(args, sizes) if args.search else None  # refused before anything compiles
    from modern_jax.training.config import load_run_config

    # only the training step is planned: the evaluation batch follows --batch unless it is given
    overrides = ([f"train.eval_batch_size={args.batch}"] + list(args.overrides)
                 + [f"train.batch_size={args.batch}", f"train.seq_len={args.seq}"]
                 + [f"parallel.{axis}={size}" for axis, size in sizes.items()])  # the run's mesh is the plan's
    run = load_run_config(args.config, overrides)  # config errors here, before any re-execution
    if not isinstance(run.model_dict.get("vocab_size"), int):
        raise ValueError("plan needs a numeric model.vocab_size (override model.vocab_size=N)")
    env = {"JAX_PLATFORMS": "cpu"}  # the TPU is only a compile target; host CPU devices otherwise
    if not args.topology:
        flag = f"--xla_force_host_platform_device_count={math.prod(sizes.values())}"
        if flag not in os.environ.get("XLA_FLAGS", ""):
            env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flag}".strip()
    if any(os.environ.get(k) != v for k, v in env.items()):  # set before JAX starts: in a fresh process
        import subprocess

        return subprocess.call([sys.executable, "-m", "modern_jax.cli", *args.argv],  # it joins no launch
                               env={**os.environ, **env, "MODERN_JAX_ALONE": "1"})
    from modern_jax.planner import format_plan, format_search, plan, search

    if args.search:
        searched["microbatches"] = searched["microbatches"] or [run.parallel.microbatches]
        result = search(run, args.topology, slices=args.slices, **searched, chunks=_chunks(args.search_chunk, run),
                        log=_note)
        print(format_search(result))
        return 0
    print(format_plan(plan(run, sizes, args.hbm_gib, topology=args.topology, slices=args.slices,
                           speed=not args.no_speed)))
    return 0


def _search_options(args, sizes: dict) -> dict:
    """`--search`'s meshes, remat policies and micro-batch counts, each flag checked by name."""
    from modern_jax.execution import REMAT_POLICIES
    from modern_jax.sharding.mesh import parse_mesh

    devices = math.prod(sizes.values())
    ones = {k: 1 for k in sizes}
    meshes = [sizes, {**ones, "fsdp": devices}]
    if args.search_mesh:
        meshes = []
        for text in args.search_mesh.split(";"):
            try:
                mesh = {**ones, **parse_mesh(text)}
            except ValueError as e:
                raise ValueError(f"--search-mesh {text!r}: {e}") from None
            if math.prod(mesh.values()) != devices or min(mesh.values()) < 1:
                raise ValueError(f"--search-mesh {text!r}: its axes multiply to {math.prod(mesh.values())}, the "
                                 f"planned devices are {devices} (--mesh {args.mesh}): give sizes whose product is "
                                 f"{devices}, separated by ';'")
            meshes.append(mesh)
    remats = _names(args.search_remat, "--search-remat")
    unknown = [r for r in remats if r not in REMAT_POLICIES]
    if unknown:
        raise ValueError(f"--search-remat {args.search_remat!r}: {', '.join(map(repr, unknown))} is not a remat "
                         f"policy; expected some of {', '.join(REMAT_POLICIES)}")
    microbatches = _numbers(args.search_microbatches, "--search-microbatches") if args.search_microbatches else None
    return {"meshes": meshes, "remats": remats, "accums": _numbers(args.search_accum, "--search-accum"),
            "microbatches": microbatches}


def _names(text: str, flag: str) -> list[str]:
    names = [n.strip() for n in text.split(",") if n.strip()]
    if not names:
        raise ValueError(f"{flag} {text!r}: give one or more comma-separated choices")
    return list(dict.fromkeys(names))


def _numbers(text: str, flag: str) -> list[int]:
    names = _names(text, flag)
    if not all(n.isdigit() and int(n) > 0 for n in names):
        raise ValueError(f"{flag} {text!r}: expected positive integers, e.g. 1,2,4")
    return [int(n) for n in names]


def _chunks(text: str | None, run) -> list[int]:
    whole = run.model.padded_vocab_size
    if text is None:
        return sorted({run.train.loss_vocab_chunk, whole})
    names = _names(text, "--search-chunk")
    if not all(n == "whole" or (n.isdigit() and int(n) > 0) for n in names):
        raise ValueError(f"--search-chunk {text!r}: expected positive integers or 'whole', e.g. 8192,whole")
    return sorted({whole if n == "whole" else int(n) for n in names})


def _plan_once(args) -> int:
    """`plan` compiles ahead of time on one host: under a launcher process 0 plans and the others wait."""
    from modern_jax.multihost import distributed

    if not distributed.joined():
        return cmd_plan(args)
    status = cmd_plan(args) if distributed.is_main() else 0
    distributed.barrier("plan")
    return status


def cmd_launch(args) -> int:
    from modern_jax.multihost.launch import launch_local

    if not args.rest:
        raise ValueError("launch needs a command to run: modern-jax launch --processes 2 --devices 4 train ...")
    command = args.rest[1:] if args.rest[0] == "--" else args.rest
    if command and command[0] != "launch":
        parse_args(command)  # a command the processes would refuse, refused once (argparse's own message)
    return launch_local(command, processes=args.processes, devices=args.devices, port=args.port)


def _launch_flags(sub: argparse.ArgumentParser) -> None:
    """How a command joins the other processes of a launch (each is found by itself under srun,
    mpirun or a Cloud TPU pod slice's workers)."""
    group = sub.add_argument_group("many processes (found from the launcher's environment when not given)")
    group.add_argument("--coordinator", metavar="HOST:PORT", help="process 0's address (JAX_COORDINATOR_ADDRESS)")
    group.add_argument("--num-processes", type=int, metavar="N", help="processes in the launch (JAX_NUM_PROCESSES)")
    group.add_argument("--process-id", type=int, metavar="I", help="this process's id, 0 to N-1 (JAX_PROCESS_ID)")
    group.add_argument("--heartbeat-timeout", type=float, default=60.0, metavar="SECONDS",
                       help="a process silent this long is lost, and the others stop with its name (default 60)")
    group.add_argument("--join-timeout", type=float, default=120.0, metavar="SECONDS",
                       help="how long the processes wait for each other to start, before saying which could not "
                            "join (default 120)")


COMPUTING = ("train", "evaluate", "generate", "harness", "plan")  # the commands that join a launch
COMPILE_CACHE_ENV = "MODERN_JAX_COMPILE_CACHE"
COMPILE_CACHE = "~/.cache/modern_jax/xla"


def _compile_cache() -> None:
    """The programs a command compiles kept on disk (jax's persistent compilation cache), so that
    the same command again (a resumed run, the benchmarks of another checkpoint of the same model)
    reads them instead of compiling: in MODERN_JAX_COMPILE_CACHE (`off`: none), by default
    ~/.cache/modern_jax/xla, least recently used entries removed past 4 GiB. A directory given to jax
    itself (JAX_COMPILATION_CACHE_DIR) is left as it is. (The planner keeps its own cache.) A named
    directory that cannot be made is refused; the default, noted and done without."""
    where = os.environ.get(COMPILE_CACHE_ENV, "").strip()
    if where == "off" or os.environ.get("JAX_COMPILATION_CACHE_DIR"):
        return
    path = os.path.expanduser(where or COMPILE_CACHE)
    try:
        os.makedirs(path, exist_ok=True)
        reason = None if os.access(path, os.W_OK) else "not writable"
    except OSError as e:
        reason = e.strerror or type(e).__name__
    if reason is not None:
        if where:
            raise ValueError(f"{COMPILE_CACHE_ENV}={where}: compiled programs cannot be kept there ({reason}): "
                             f"give a writable directory, or off")
        _note(f"note: compiling without a cache: {path} cannot be made ({reason}); set {COMPILE_CACHE_ENV} to "
              f"a writable directory, or off")
        return
    import jax

    jax.config.update("jax_compilation_cache_dir", path)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.1)  # a program worth reading back
    jax.config.update("jax_compilation_cache_max_size", 4 << 30)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="modern-jax", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    info = sub.add_parser("info", help="parameters, KV-cache bytes and FLOPs of a config, without weights")
    info.add_argument("--config", help="a YAML config with a model: section")
    info.add_argument("--hf-config", help="a Hugging Face config.json")
    info.add_argument("--context", type=int, help="context length for the KV-cache total (default: max positions)")
    info.add_argument("--seq-len", type=int, help="training sequence length for the FLOPs (default: min(context, 4096))")
    info.add_argument("--kv-dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    info.add_argument("overrides", nargs="*", help="dotted overrides, e.g. model.n_layers=4")
    info.set_defaults(func=cmd_info)

    tr = sub.add_parser("train", help="train a model (default: configs/tiny.yaml on the embedded corpus)")
    tr.add_argument("--config", help=f"a run file with model:, train:, data: sections (default: {DEFAULT_CONFIG.name})")
    tr.add_argument("--data", help="text file or directory, .jsonl(.gz), .parquet, a saved Hugging Face dataset, "
                                   "token .bin or ArrayRecord (sets data.path)")
    tr.add_argument("--output-dir", help="run directory: checkpoints, metrics, samples (sets train.output_dir)")
    tr.add_argument("--init-from-hf", metavar="SOURCE",
                    help="fine-tune: start from this Hugging Face model directory or hub name (org/name, from the "
                         "local cache), or a converted checkpoint, with its config and tokenizer; the run file "
                         f"(default: {FINETUNE_CONFIG.name}) supplies train: and data:")
    tr.add_argument("--init-adapter", metavar="DIR",
                    help="with --init-from-hf: start a LoRA run from this PEFT adapter of that model (its rank, "
                         "alpha and projections set lora:)")
    tr.add_argument("--mesh", help="device mesh, e.g. data=2,fsdp=1,tensor=4 (-1 fills; sets "
                                   "parallel.stage/data/fsdp/expert/context/tensor)")
    tr.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.steps=500 model.n_layers=2")
    tr.set_defaults(func=cmd_train)

    ev = sub.add_parser("evaluate", help="loss, perplexity and bits per byte of a checkpoint")
    ev.add_argument("--checkpoint", required=True, help="a run directory, a step directory, or params/ + config.yaml")
    ev.add_argument("--split", default="val", choices=("val", "train"), help="a split of the run's data")
    ev.add_argument("--data", help="evaluate on every document of this file or directory instead, read as the "
                                   "run reads its data (data.format, fields, chat template)")
    ev.add_argument("--seq-len", type=int, help="window length (default: the run's train.seq_len)")
    ev.add_argument("--batch-size", type=int,
                    help=f"windows per batch (default: the run's train.eval_batch_size, else {DEFAULT_EVAL_BATCH}; "
                         f"all the windows if fewer)")
    ev.add_argument("--max-windows", metavar="N|all",
                    help="score N windows spread evenly over the split, or all of them (default: the windows of "
                         "the run's final evaluation, train.final_eval_windows, on its val split; else all)")
    ev.set_defaults(func=cmd_evaluate)

    ge = sub.add_parser("generate", help="sample text from a checkpoint with the KV cache")
    ge.add_argument("--checkpoint", required=True, help="a run directory, a step directory, or params/ + config.yaml")
    ge.add_argument("--prompt", default="", help="text to continue (default: start from <bos>)")
    ge.add_argument("--max-new-tokens", type=int, default=200)
    ge.add_argument("--num-samples", type=int, default=1)
    ge.add_argument("--temperature", type=float, default=0.8)
    ge.add_argument("--top-k", type=int)
    ge.add_argument("--top-p", type=float)
    ge.add_argument("--greedy", action="store_true", help="argmax decoding (temperature 0)")
    ge.add_argument("--seed", type=int, default=0)
    ge.set_defaults(func=cmd_generate)

    ha = sub.add_parser("harness", help="lm-eval's benchmarks (multiple choice, generation, perplexity) on a "
                                        "checkpoint or a Hugging Face model")
    ha.add_argument("--checkpoint", help="a run directory, a step directory, or a converted checkpoint")
    ha.add_argument("--hf", help="a Hugging Face model directory (config.json, safetensors, tokenizer.json), "
                                 "converted as it is read")
    ha.add_argument("--tasks", nargs="+", required=True, metavar="TASK",
                    help="lm-eval task names, space- or comma-separated (e.g. hellaswag arc_easy, or sums_choice "
                         "with --include-path configs/harness)")
    ha.add_argument("--include-path", help="a directory of task YAML files, added to lm-eval's own")
    ha.add_argument("--num-fewshot", type=int, help="examples in each prompt (default: the task's, else 0)")
    ha.add_argument("--limit", type=float, help="documents per task: a count, or a fraction below 1")
    ha.add_argument("--batch-size", type=int, default=32, help="rows per scoring or decoding batch (default 32; a "
                                                               "multiple of the mesh's data shards)")
    ha.add_argument("--log-samples", action="store_true", help="with --output-path: write each document's requests, "
                                                               "answers and metrics (lm-eval's samples_*.jsonl)")
    ha.add_argument("--output-path", help="a directory for lm-eval's results_*.json (and samples): new, empty, or one "
                                          "this command wrote before")
    ha.add_argument("--apply-chat-template", nargs="?", const=True, default=False, metavar="NAME",
                    help="render prompts with the tokenizer's chat template")
    ha.add_argument("--gen-kwargs", help="generation settings over the tasks', e.g. temperature=0.8,do_sample=True,"
                                         "max_gen_toks=16")
    ha.add_argument("--seed", type=int, default=0, help="seeds lm-eval's shuffles and few-shot draws, and sampling")
    ha.add_argument("--mesh", help="device mesh, e.g. data=4,tensor=2 (default: the run's parallel: section, else "
                                   "every device on data)")
    ha.set_defaults(func=cmd_harness)

    co = sub.add_parser("convert", help="Hugging Face checkpoint <-> modern_jax (Orbax) checkpoint")
    co.add_argument("--from-hf", help="a Hugging Face model directory (config.json + safetensors) or a hub name "
                                      "(org/name, from the local cache)")
    co.add_argument("--to-hf", help="a converted checkpoint, a run directory or a step directory (a LoRA run: "
                                    "its adapters merged into the base)")
    co.add_argument("--to-peft", help="a LoRA run or a step of one: write its adapters in PEFT's format")
    co.add_argument("--out", required=True, help="the directory to write: new or empty (see --overwrite)")
    co.add_argument("--overwrite", action="store_true",
                    help="replace --out if it holds an earlier conversion of the same kind (never a training run)")
    co.add_argument("--model-type", help="--to-hf / --to-peft: the Hugging Face family to write (default: the "
                                         "source's)")
    co.add_argument("--dtype", choices=("float32", "bfloat16"), help="parameter dtype (default: float32 / as stored)")
    co.set_defaults(func=cmd_convert)

    pl = sub.add_parser("plan", help="per-device memory of the training step on a mesh or a TPU topology "
                                     "(no accelerator needed)")
    pl.add_argument("--config", required=True, help="a YAML config (model:, optional train:)")
    pl.add_argument("--mesh", required=True,
                    help="e.g. data=1,fsdp=8,tensor=1 (axes: stage, data, fsdp, expert, context, tensor)")
    pl.add_argument("--batch", type=int, required=True, help="sequences per step, all devices together")
    pl.add_argument("--seq", type=int, required=True, help="tokens per sequence")
    pl.add_argument("--topology", help="compile with the TPU compiler for this topology (libtpu), e.g. v5p:2x2x2, "
                                       "v5e:2x2, v6e:4x4; without it, host CPU devices give an estimate")
    pl.add_argument("--slices", type=int, default=1, help="--topology: the number of slices (multi-slice)")
    pl.add_argument("--hbm-gib", type=float, help="device memory to check the plan against (default with "
                                                  "--topology: the chip's)")
    pl.add_argument("--no-speed", action="store_true",
                    help="--topology: memory only, without the estimated step time (which compiles counting programs)")
    pl.add_argument("--search", action="store_true",
                    help="--topology: compile the combinations of the --search-* choices and rank those that fit by "
                         "estimated tokens/s per chip")
    pl.add_argument("--search-microbatches", metavar="M,M",
                    help="--search: pipeline microbatches, parallel.microbatches, for meshes with stages (default: "
                         "the run's)")
    pl.add_argument("--search-remat", default="full,save_qkv_out,dots", metavar="P,P",
                    help="--search: remat policies (default full,save_qkv_out,dots)")
    pl.add_argument("--search-accum", default="1,2", metavar="A,A",
                    help="--search: micro-batches per step, train.grad_accum (default 1,2)")
    pl.add_argument("--search-mesh", metavar="MESH;MESH",
                    help="--search: meshes of the topology's chips, ';'-separated (default: --mesh, and fsdp over "
                         "all chips)")
    pl.add_argument("--search-chunk", metavar="N,N",
                    help="--search: loss vocabulary chunks, train.loss_vocab_chunk; 'whole' is the vocabulary in one "
                         "(default: the run's and whole)")
    pl.add_argument("overrides", nargs="*", help="dotted overrides, e.g. execution.remat=full model.dtype=bfloat16")
    pl.set_defaults(func=_plan_once)

    la = sub.add_parser("launch", help="run a command as N processes of one launch on this machine (a pod run "
                                       "rehearsed on host CPU devices)")
    la.add_argument("--processes", "-n", type=int, default=2, help="processes to start (default 2)")
    la.add_argument("--devices", type=int, default=4, help="host CPU devices per process (default 4)")
    la.add_argument("--port", type=int, help="the coordinator's port on localhost (default: a free one)")
    la.add_argument("rest", nargs=argparse.REMAINDER, help="the command and its arguments, e.g. train --mesh ...")
    la.set_defaults(func=cmd_launch)
    for name in COMPUTING:
        _launch_flags(sub.choices[name])
    parser.commands = sub.choices
    return parser


def parse_args(argv=None) -> argparse.Namespace:
    """Options and `section.key=value` overrides may come in any order (`train model.n_layers=2 --config X`)."""
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    args, _ = parser.parse_known_args(argv)
    if "overrides" in args and argv[0] == args.command:
        return parser.commands[args.command].parse_intermixed_args(argv[1:], argparse.Namespace(command=args.command))
    return parser.parse_args(argv)


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    args = parse_args(argv)
    args.argv = argv  # the command as given (plan re-runs it in a fresh process)
    from modern_jax.multihost import distributed

    status, message, agreed = 1, None, False
    try:
        from modern_jax.sharding.devices import no_tpu_runtime_without_chips

        no_tpu_runtime_without_chips()  # every command: convert and report place arrays too
        if args.command in COMPUTING and args.command != "plan":
            _compile_cache()
        if args.command in COMPUTING and not os.environ.get("MODERN_JAX_ALONE"):
            seconds = (lambda t: 0 < t < math.inf, "a positive number of seconds")
            _check_flags(args, _positive("--num-processes"), ("--heartbeat-timeout", *seconds),
                         ("--join-timeout", *seconds))
            launch = distributed.detect(args.coordinator, args.num_processes, args.process_id)
            distributed.start(launch, args.command, args.heartbeat_timeout, join_timeout=args.join_timeout)
        status = args.func(args) or 0
    except ValueError as e:
        status, message, agreed = 2, str(e), isinstance(e, distributed.Refused)
        if distributed.is_main() or not agreed:  # an agreed refusal is said once, by process 0
            prefix = f"process {distributed.index()}: " if distributed.joined() and not agreed else ""
            print(f"modern-jax {args.command}: error: {prefix}{e}", file=sys.stderr)
    except BaseException as e:  # a bug, or Ctrl-C before the loop: the others must not wait for this process
        if not distributed.joined():
            raise
        from jax.errors import JaxRuntimeError

        if isinstance(e, JaxRuntimeError):  # a collective that lost its peer: the watchdog names it
            distributed.await_lost_peer()
        traceback.print_exc()
        message = f"{type(e).__name__}: {e}"
    finally:
        if distributed.joined():
            distributed.finish(failed=None if message is None or agreed else message)
            if message is not None and not agreed:  # this process's own error: no shutdown barrier
                from modern_jax.multihost import watch

                sys.stdout.flush()
                watch.close()
                os._exit(status)
    return status


if __name__ == "__main__":
    sys.exit(main())
