"""`modern-jax evaluate`: loss, perplexity and bits per byte of a checkpoint; for a run trained for
an objective of its own (a `dpo:` or `grpo:` section in its config.yaml), that objective's
figures, as the run's own validation reports them (DPO: TRL's rewards of held-out pairs; GRPO:
the reward, length and KL of completions sampled for held-out prompts).

    modern-jax evaluate --checkpoint runs/tiny [--split val | --data FILE] [--max-windows N|all]
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import re

from modern_jax.cli.shared import _check_flags, _checkpoint_tokenizer, _note, _positive, _scoring_trainer

DEFAULT_EVAL_BATCH = 32  # evaluate --batch-size
# the data layer's fixes through a data: setting ("set data.text_field to ...", "use source: tokens")
_SETTING_FIX = re.compile(r"(?:[:;]| \(or) (?:set|point|use|for token ids use) (?:data\.|source: ).*$")


def add_parser(subparsers) -> None:
    ev = subparsers.add_parser("evaluate", help="loss, perplexity and bits per byte of a checkpoint")
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
    ev.set_defaults(func=run)


def run(args) -> int:
    _check_flags(args, _positive("--seq-len"), _positive("--batch-size"))
    args.max_windows = _max_windows(args.max_windows)
    import jax

    from modern_jax.data.batches import eval_batches, eval_windows
    from modern_jax.training import TrainConfig, evaluate_batches
    from modern_jax.training.metrics import Progress
    from modern_jax.convert.conversions import load_model_params

    main = jax.process_index() == 0
    note = _note if main else (lambda *_: None)
    cfg, params, raw, run_dir = load_model_params(args.checkpoint, log=note)
    run = _objective_run(raw, run_dir)
    if run is not None:
        return _evaluate_objective(args, cfg, params, raw, run_dir, run, main, note)
    seq_len = _eval_seq_len(args, cfg, raw)
    final = _final_evaluation(raw)
    same_split = final is not None and not args.data and args.split == "val" and seq_len == final[1]
    with Progress(None, enabled=main) as progress:
        with progress.phase("reading and tokenizing the data"):
            tokenizer, stream = _checkpoint_data(args, raw, run_dir, cfg)
        what = f"--data {args.data}" if args.data else f"the {args.split} split"
        total = len(eval_windows(stream, seq_len))
        asked, windows = _chosen_windows(args, final, same_split, total, seq_len, what, note)
        scored = f"scored: {_scored(windows, total, seq_len, what)}; {_relation(final, same_split, asked)}"
        run_batch = (raw.get("train") or {}).get("eval_batch_size") if final else None
        batch_size = min(args.batch_size or run_batch or DEFAULT_EVAL_BATCH, windows)
        if args.batch_size is not None and args.batch_size > windows:
            note(f"--batch-size {args.batch_size}: {what} gives {_windows(windows, seq_len)}; one batch of "
                 f"{windows:,}")
        tc = TrainConfig(seq_len=seq_len, eval_batch_size=batch_size, warmup_steps=0)
        # one device; in a launch of several processes every device, each process feeding its rows
        trainer = _scoring_trainer(cfg, raw, tc)
        token_bytes = jax.device_put(tokenizer.token_bytes(), trainer.programs.replicated)
        with progress.phase("compiling the evaluation step"):
            batch_size = _batch_that_fits(args, trainer, params, token_bytes, batch_size, seq_len, note)
        rows, _ = trainer.batches.local_slices(batch_size)
        batches = eval_batches(stream, seq_len=seq_len, batch_size=batch_size, max_windows=asked, rows=rows)
        with progress.phase("evaluating", len(batches), "batches") as advance:
            values = evaluate_batches(trainer, params, batches, token_bytes, rows=batch_size, advance=advance)
    if not main:
        return 0
    _print_scores(args, scored, values)
    return 0


def _chosen_windows(args, final, same_split: bool, total: int, seq_len: int, what: str, note, unit: str = "window"):
    """`(asked, windows)`: the windows (or `unit`s) --max-windows asks for (None: all), by default
    those of the run's final evaluation where they are the same split and length, and how many
    that is of `total`."""
    asked = args.max_windows if args.max_windows is not None else final[0] if same_split else "all"
    asked = None if asked == "all" else asked
    if args.max_windows not in (None, "all") and args.max_windows > total:
        note(f"--max-windows {args.max_windows}: {what} has {_windows(total, seq_len, unit)}; evaluating all of "
             f"them")
    return asked, min(total, asked or total)


def _relation(final, same_split: bool, asked, unit: str = "window") -> str:
    """How the windows scored relate to the run's final evaluation (`_final_evaluation`)."""
    if final is None:
        return "the checkpoint has no run config, so no final evaluation of a run to compare"
    setting = f"train.final_eval_windows={'null' if final[0] is None else final[0]}"
    if same_split and asked == final[0]:
        return f"the {unit}s of the run's final evaluation ({setting}): at its last step, loss is its val_loss"
    count = f"every {unit}" if final[0] is None else _windows(final[0], final[1], unit)
    return (f"the run's final evaluation scored {count} of the val split ({setting}, "
            f"train.seq_len={final[1]}): with no --max-windows, --seq-len, --split or --data, "
            f"evaluate scores those")


def _objective_run(raw: dict, run_dir):
    """The run config of a run trained for an objective of its own (a section of
    `configfile.OBJECTIVES` in its config.yaml), whose evaluation is that objective's; None for
    next-token runs and converted checkpoints."""
    from modern_jax.configfile import OBJECTIVES
    from modern_jax.training.checkpoint import CONFIG_FILE
    from modern_jax.training.config import run_config_from_dict

    if not any(name in raw for name in OBJECTIVES):
        return None
    return run_config_from_dict(raw, str(run_dir / CONFIG_FILE))


def _evaluate_objective(args, cfg, params, raw: dict, run_dir, run, main: bool, note) -> int:
    """The evaluation of `run`'s own objective (`objective.eval_values`: the figures its validation
    writes to metrics.jsonl) on its val split, by default the prompts or pairs of its final
    evaluation; --split train, --data FILE (read as the run reads its data), --max-windows (counting
    its pairs or prompts), --seq-len and --batch-size (rows, as train.eval_batch_size counts them)."""

    import jax

    from modern_jax.training import evaluate_batches
    from modern_jax.training.checkpoint import load_reference
    from modern_jax.training.metrics import Progress

    tc = dataclasses.replace(run.train, seq_len=args.seq_len or run.train.seq_len,
                             eval_batch_size=args.batch_size or run.train.eval_batch_size)
    try:  # what the section's check says of the run's train: settings, said of the flags that changed them
        run.objective.check(tc, f"the run's {run.objective.section}: section")
    except ValueError as e:
        raise ValueError(str(e).replace("train.eval_batch_size=", "--batch-size ").replace(
            "train.seq_len=", "--seq-len ")) from None
    final = (run.train.final_eval_windows, run.train.seq_len)
    same_split = not args.data and args.split == "val" and tc.seq_len == run.train.seq_len
    with Progress(None, enabled=main) as progress:
        trainer = _scoring_trainer(cfg, raw, tc, run.objective)
        objective, unit = trainer.objective, trainer.objective.eval_unit
        with progress.phase("reading and tokenizing the data"):
            tokenizer = _checkpoint_tokenizer(run_dir, cfg)
            split = _objective_data(args, run, objective, tokenizer, run_dir)
        what = f"--data {args.data}" if args.data else f"the {args.split} split"
        total = objective.eval_size(split)
        asked, count = _chosen_windows(args, final, same_split, total, tc.seq_len, what, note, unit)
        scored = (f"scored: {_scored(count, total, tc.seq_len, what, unit)}; "
                  f"{_relation(final, same_split, asked, unit)}")
        # the frozen copy of the start that a full-weight run keeps (a LoRA run's is its base, adapters off)
        reference = load_reference(args.checkpoint, params) if trainer.states.keeps_reference else None
        token_bytes = jax.device_put(tokenizer.token_bytes(), trainer.programs.replicated)
        rows, _ = trainer.batches.local_slices(tc.eval_batch_size)
        batches = objective.eval_batches(split, max_windows=asked, rows=rows)
        with progress.phase("evaluating", len(batches), "batches") as advance:
            values = evaluate_batches(trainer, params, batches, token_bytes, rows=tc.eval_batch_size,
                                      advance=advance, reference=reference)
    if main:
        print(scored)
        print(f"split: {'file ' + args.data if args.data else args.split}")
        for name, value in sorted(values.items(), key=lambda kv: not isinstance(kv[1], int)):  # the count first
            print(f"{name}: {value}" if isinstance(value, int) else f"{name}: {value:.4f}")
    return 0


def _objective_data(args, run, objective, tokenizer, run_dir):
    """The split of `run`'s data that `objective` evaluates (`objective.read`), or every record of
    --data read as the run reads its data (`objective.read_all`)."""
    if args.data:
        data = run.data.replace(source="auto", path=args.data, streaming=False, max_documents=None)
        return _read_file(args, run_dir, lambda: objective.read_all(dataclasses.replace(run, data=data), tokenizer))
    _check_run_data(run.data, run_dir)
    _, train, val = objective.read(run, tokenizer, None)
    return {"train": train, "val": val}[args.split]


def _batch_that_fits(args, trainer, params, token_bytes, batch_size: int, seq_len: int, note) -> int:
    """`batch_size` if its evaluation step fits the device, else (a default, not --batch-size) the
    most windows that do."""
    from modern_jax.accounting import DoesNotFit, check_fits

    def compile_at(batch_size: int, seq_len: int):  # the step it compiles last is the one evaluate runs
        return trainer.compile_eval(params, trainer.batches.abstract((batch_size, seq_len)), token_bytes)

    def fits(batch_size: int) -> None:
        check_fits("evaluate", compile_at, {"batch_size": batch_size, "seq_len": seq_len}, resident=params,
                   lower=("batch_size",), otherwise="seq_len")

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
    return batch_size


def _print_scores(args, scored: str, values: dict) -> None:
    print(scored)
    print(f"split: {'file ' + args.data if args.data else args.split}")
    print(f"tokens: {values['tokens']}")
    print(f"loss: {values['loss']:.4f}")
    print(f"perplexity: {math.exp(values['loss']) if values['loss'] < 700 else math.inf:.4f}")
    print(f"bits_per_byte: {values['bpb']:.4f}")


def _checkpoint_data(args, raw: dict, run_dir, cfg):
    """The tokenizer and the token stream to evaluate: a split of the run's data, or every document
    of a file read as the run reads its data (`data.format`, its fields and chat template)."""
    from modern_jax.data.config import DataConfig
    from modern_jax.data.corpora import load_splits, load_stream

    tokenizer = _checkpoint_tokenizer(run_dir, cfg)
    data_cfg = DataConfig.from_dict(raw.get("data"))
    if args.data:
        file_cfg = data_cfg.replace(source="auto", path=args.data, sources=None, streaming=False, max_documents=None)
        return tokenizer, _read_file(args, run_dir, lambda: load_stream(file_cfg, tokenizer))
    _check_run_data(data_cfg, run_dir)
    if data_cfg.sources is not None:
        raise ValueError(f"the run mixes data.sources ({', '.join(data_cfg.source_names)}), whose validation losses "
                         f"it logged each (metrics.jsonl, split val/<source>): give --data PATH to evaluate one")
    _, train_stream, val_stream = load_splits(data_cfg, tokenizer)
    return tokenizer, {"train": train_stream, "val": val_stream}[args.split]


def _read_file(args, run_dir, read):
    """`read()` of --data, its errors naming the flag (a fix through a data: setting is not
    evaluate's to make)."""
    if not pathlib.Path(args.data).exists():
        raise ValueError(f"--data {args.data} does not exist: give a file or directory of documents")
    try:
        return read()
    except ValueError as e:
        message = str(e).replace(f"data.path={args.data!r}", f"--data {args.data}")
        raise ValueError(_SETTING_FIX.sub(f": evaluate reads --data with the run's data: settings "
                                          f"({run_dir / 'config.yaml'}), which it does not change: give "
                                          f"--data a file they read", message)) from None


def _check_run_data(data_cfg, run_dir) -> None:
    from modern_jax.data.shards import expand

    if data_cfg.path and not expand(data_cfg.path) and data_cfg.resolved_source != "hf":
        raise ValueError(f"the run's data.path={data_cfg.path!r} (in {run_dir / 'config.yaml'}) does not exist: "
                         f"give --data FILE to evaluate a file instead")


def _windows(n: int, seq_len: int, unit: str = "window") -> str:
    """`1,024 windows of 128 tokens`, or of another unit (`3 pairs`, `4 prompts`), which have no one length."""
    return f"{n:,} {unit}{'s' if n != 1 else ''}" + (f" of {seq_len} tokens" if unit == "window" else "")


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


def _final_evaluation(raw: dict) -> tuple[int | None, int | None] | None:
    """`(train.final_eval_windows, train.seq_len)` of the run whose config is `raw`: the windows its
    final evaluation scored on its val split (None: all); None for a checkpoint without a run's
    `train:` section (a converted one)."""
    train = raw.get("train")
    if not isinstance(train, dict) or "final_eval_windows" not in train:
        return None
    return train["final_eval_windows"], train.get("seq_len")


def _scored(windows: int, total: int, seq_len: int, what: str, unit: str = "window") -> str:
    """`1,024 windows of 128 tokens spread evenly over the 10,242 of the val split`, or all of them."""
    if windows == total:
        return f"all {_windows(total, seq_len, unit)} of {what}" + (", end to end" if unit == "window" else "")
    return f"{_windows(windows, seq_len, unit)} spread evenly over the {total:,} of {what}"


def _max_windows(text: str | None) -> int | str | None:
    """`--max-windows`: a positive count, `all`, or None (not given)."""
    if text is None or text == "all":
        return text
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"--max-windows {text} is invalid: expected a positive integer or all")
    return int(text)
