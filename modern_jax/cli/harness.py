"""`modern-jax harness`: lm-eval's benchmarks (multiple choice, generation, perplexity) on a
checkpoint or a Hugging Face model.

    modern-jax harness --checkpoint runs/chat | --hf HF_DIR --tasks sums_choice [--include-path configs/harness ...]
"""

from __future__ import annotations

import contextlib
import gc
import math

from modern_jax.cli.shared import _check_flags, _checkpoint_tokenizer, _note, _positive


def add_parser(subparsers) -> None:
    ha = subparsers.add_parser("harness", help="lm-eval's benchmarks (multiple choice, generation, perplexity) on a "
                                               "checkpoint or a Hugging Face model")
    ha.add_argument("--checkpoint", help="a run directory, a step directory, or a converted checkpoint")
    ha.add_argument("--hf", help="a Hugging Face model directory (config.json, safetensors, tokenizer.json), "
                                 "converted as it is read")
    ha.add_argument("--tasks", nargs="+", required=True, metavar="TASK",
                    help="lm-eval task names, space- or comma-separated (e.g. hellaswag arc_easy, or sums_choice "
                         "with --include-path configs/harness)")
    ha.add_argument("--include-path", help="a directory of task YAML files, added to lm-eval's own")
    ha.add_argument("--num-fewshot", type=int, help="examples in each prompt (default: the task's, else 0)")
    ha.add_argument("--limit", type=float, help="documents per task: a whole count, or a fraction below 1")
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
    ha.set_defaults(func=run)


def run(args) -> int:
    """lm-eval's tasks on a checkpoint or a Hugging Face model: its table, its result and sample files."""
    _check_flags(args, _positive("--batch-size"), ("--num-fewshot", lambda n: n >= 0, "an integer >= 0"),
                 ("--limit", lambda x: 0 < x < 1 or 1 <= x < math.inf and x == int(x),
                  "a whole count of documents, or a fraction below 1"))
    if bool(args.checkpoint) == bool(args.hf):
        raise ValueError("give one of --checkpoint RUN (a run, a step or a converted checkpoint) or --hf DIR "
                         "(a Hugging Face model directory)")
    tasks = [t for item in args.tasks for t in item.split(",") if t]
    if not tasks:
        raise ValueError("--tasks: give one or more task names (lm-eval's, or those of --include-path)")
    if not args.output_path:
        return _evaluate(args, tasks, None)
    from modern_jax.training import outputs

    # lm-eval writes a local disk: on object storage, a local directory copied up at the end
    with outputs.staged(args.output_path, outputs.HARNESS, "--output-path", command="harness") as output_path:
        return _evaluate(args, tasks, output_path)


def _evaluate(args, tasks: list[str], output_path) -> int:
    """The tasks' results, printed, and written into `output_path` (None: not written)."""
    with _long_lived():
        import jax

        from modern_jax import harness
        from modern_jax.training import outputs

        main = jax.process_index() == 0
        note = _note if main else (lambda *_: None)
        if output_path:  # before anything is read: refused early, written by process 0 only
            outputs.claim(output_path, outputs.HARNESS, "--output-path", hint="choose a new directory")
        harness.quiet_lm_eval()
        manager = harness.task_manager(args.include_path, tasks=tasks)
        harness.check_tasks(manager, tasks)
        harness.load_tasks(manager, tasks)  # a task whose data cannot be read is refused before the model is
        cfg, params, raw, tokenizer, source = _harness_model(args, note)
        trainer = _harness_trainer(cfg, raw, args)
        params = params(trainer.states.shardings["params"])  # a Hugging Face model: each process reads its share
    lm = harness.HarnessLM(harness.Scorer(trainer.states, params, args.batch_size, chunk=trainer.train_cfg.loss_vocab_chunk), tokenizer, seed=args.seed,
                           name=source)
    tracker = None
    if output_path and main:
        from lm_eval.loggers import EvaluationTracker

        tracker = EvaluationTracker(output_path=str(output_path))
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
        outputs.mark(output_path, outputs.HARNESS, "modern-jax harness")
        note(f"wrote {args.output_path}")
    from lm_eval.utils import make_table

    print(f"{source}: limit {args.limit}, num_fewshot {args.num_fewshot}, batch_size {args.batch_size}")
    print(make_table(results))
    if "groups" in results:
        print(make_table(results, "groups"))
    return 0


def _harness_model(args, note):
    """`(config, parameters, run config, tokenizer, name)` of --checkpoint or --hf; the parameters are
    a function of the scoring state's shardings, which a Hugging Face model is read into."""
    if args.hf:
        from modern_jax.convert.conversions import initial_weights

        cfg, init = initial_weights(args.hf, log=note)
        if init.tokenizer is None:
            raise ValueError(f"--hf {args.hf} has no tokenizer.json: lm-eval's tasks are text, and the model's "
                             f"token ids mean nothing to another tokenizer: put its tokenizer files beside it")
        note(f"converting {init.source}")
        return cfg, init.params, {}, init.tokenizer, str(args.hf)
    from modern_jax.convert.conversions import load_model_params

    cfg, params, raw, run_dir = load_model_params(args.checkpoint, log=note)
    return cfg, lambda _: params, raw, _checkpoint_tokenizer(run_dir, cfg), str(args.checkpoint)


def _harness_trainer(cfg, raw: dict, args):
    """The scoring Trainer on --mesh, else the run's mesh (its parallel: section), else every device on data."""
    from modern_jax.data.config import DataConfig
    from modern_jax.lora_config import LoRAConfig
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
