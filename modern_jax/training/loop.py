"""The training loop: `train(run_config)`.

    tokens -> grain iterator -> train_step (one jit, state donated) -> metrics at log steps
                                                                   -> validation every eval_every
                                                                   -> async Orbax save every checkpoint_every

Per step the host only fetches the next (prefetched) batch and dispatches the compiled
step; metrics stay on the device until a log step fetches them all at once. Compilation
happens ahead of time, before the clock starts, and is reported on its own.

The run resumes from the newest complete checkpoint in `output_dir` (params, optimiser
state, step, RNG and the data iterator's position), so a resumed run computes exactly the
steps the uninterrupted run would have. A new run starts from random parameters, or from
`init` (fine-tuning: a Hugging Face model's or a checkpoint's parameters, with its
tokenizer; `modern_jax.convert.finetune_run` makes it), whose source files (config.json,
tokenizer files) are copied into the run's `hf/` for the way back to Hugging Face.
SIGTERM / SIGINT save a checkpoint and stop. A non-finite loss or gradient skips the
update (the step function keeps the old state) and is logged; `max_nonfinite_steps` in a
row stop the run with `TrainingDiverged`. A checkpoint is only written from finite
parameters.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import shutil
import signal
import threading
import time
from collections.abc import Callable

import jax
import numpy as np
import yaml

from modern_jax.accounting import flops_per_token
from modern_jax.data.corpora import load_splits
from modern_jax.data.pipeline import eval_batches, train_iterator
from modern_jax.data.tokenizers import TOKENIZER_FILE, load_tokenizer
from modern_jax.sharding import RULES, mesh_axes
from modern_jax.training import outputs
from modern_jax.training.checkpoint import CHECKPOINTS, CONFIG_FILE, HF_ASSETS_DIR, Checkpointer, read_config
from modern_jax.training.config import RunConfig
from modern_jax.training.metrics import METRICS_FILE, MetricsLog, Progress, plot_losses, read_metrics
from modern_jax.training.step import Trainer


class TrainingDiverged(RuntimeError):
    """Too many non-finite steps in a row."""


@dataclasses.dataclass(frozen=True)
class Initial:
    """The parameters a new run starts from instead of random ones (fine-tuning)."""

    source: str  # what they are, for the log and errors
    params: Callable[[], dict]  # reads them (a pure dict), only when a new run starts
    tokenizer: object | None = None  # their tokenizer; None: the one `data:` describes
    assets: tuple[pathlib.Path, ...] = ()  # files copied into the run's hf/: config.json, tokenizer files


@dataclasses.dataclass
class TrainResult:
    output_dir: pathlib.Path
    step: int
    history: list[dict]  # one dict of host floats per step run in this call
    val_loss: float | None = None
    val_bpb: float | None = None
    tokens_per_s: float = 0.0
    wall_s: float = 0.0  # the loop, evaluation included, compilation excluded
    compile_s: float = 0.0
    interrupted: bool = False
    samples: list[str] = dataclasses.field(default_factory=list)


class _StopSignal:
    """SIGTERM / SIGINT set a flag the loop checks each step (a second SIGINT interrupts at once)."""

    def __init__(self):
        self.received: int | None = None
        self.previous = {}

    def __enter__(self):
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.previous[sig] = signal.signal(sig, self._handle)
        return self

    def _handle(self, signum, frame):
        self.received = signum
        signal.signal(signal.SIGINT, signal.default_int_handler)

    def __exit__(self, *exc):
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)


def evaluate_batches(trainer: Trainer, params, batches, token_bytes) -> dict:
    """Loss (nats / token), bits per byte and token count over `batches` (one host fetch)."""
    totals = None
    for batch in batches:
        sums = trainer.eval_step(params, trainer.put_batch(batch), token_bytes)
        totals = sums if totals is None else jax.tree.map(lambda a, b: a + b, totals, sums)
    if totals is None:
        raise ValueError("nothing to evaluate: the split is empty")
    totals = jax.device_get(totals)
    ce, weight, n_bytes = float(totals["ce"]), float(totals["weight"]), float(totals["bytes"])
    return {"loss": ce / max(weight, 1.0), "bpb": ce / math.log(2) / max(n_bytes, 1.0), "tokens": int(weight)}


def save_if_finite(checkpointer: Checkpointer, trainer: Trainer, state: dict, meta: dict, log=print) -> bool:
    """Save unless a parameter is NaN or infinite (no checkpoint is written from such a state)."""
    if not trainer.all_finite(state["params"]):
        log(f"step {meta['step']}: parameters are not finite; no checkpoint written")
        return False
    checkpointer.save(state, meta)
    return True


def _check_divisible(name: str, rows: int, mesh, rules=RULES) -> None:
    """The batch rows split over the mesh axes of `activation_batch` and over the hosts."""
    shards = math.prod(mesh.shape[a] for a in mesh_axes("activation_batch", rules) if a in mesh.shape)
    if rows % shards or rows % jax.process_count():
        raise ValueError(f"train.{name} gives {rows} rows, not divisible by the {shards} data shards "
                         f"and {jax.process_count()} hosts")


def prepare_run(run: RunConfig, resume_dir: pathlib.Path | None, tokenizer=None):
    """Tokenizer (a resumed run's, else `tokenizer`, else built from `data:`), splits and the run
    config with its vocabulary resolved."""
    saved = resume_dir / TOKENIZER_FILE if resume_dir is not None else None
    tokenizer = load_tokenizer(saved) if saved is not None and saved.exists() else tokenizer
    tokenizer, train_stream, val_stream = load_splits(run.data, tokenizer, run.vocab_size)
    run = run.with_vocab(tokenizer.vocab_size)
    if tokenizer.vocab_size > run.model.vocab_size:
        raise ValueError(f"model.vocab_size={run.model.vocab_size} is smaller than the {run.data.tokenizer} "
                         f"tokenizer's {tokenizer.vocab_size} ids (use vocab_size: auto or raise it)")
    return run, tokenizer, train_stream, val_stream


def train(run: RunConfig, *, mesh=None, log=print, stop_after: int | None = None,
          init: Initial | None = None) -> TrainResult:
    """Train (or resume) the run. `stop_after`: stop after this many steps in this call, saving
    a checkpoint as a preemption would (the run resumes later with the same schedule). `init`:
    the parameters (and tokenizer) a new run starts from; a resumed run ignores it."""
    tc = run.train
    out_dir = pathlib.Path(tc.output_dir)
    outputs.claim(out_dir, outputs.RUN, "train.output_dir", hint="choose a new train.output_dir (--output-dir)")
    mesh = run.parallel.mesh() if mesh is None else mesh
    # creates nothing on disk until the first save, so a run that fails to start leaves no checkpoints/
    checkpointer = Checkpointer(out_dir / CHECKPOINTS, keep=tc.keep_checkpoints, async_save=tc.async_checkpoints)
    try:
        with _StopSignal() as stop:  # installed first, so a signal during set-up is honoured too
            return _train(run, out_dir, mesh, checkpointer, log, stop_after, stop, init)
    finally:
        checkpointer.close()


def _train(run: RunConfig, out_dir: pathlib.Path, mesh, checkpointer: Checkpointer, log, stop_after,
           stop: _StopSignal, init: Initial | None) -> TrainResult:
    session = _set_up(run, out_dir, mesh, checkpointer, log, init)
    result = _loop(session, mesh, stop_after, stop)
    if not result.interrupted:
        _finish(session, result, log)
    return result


@dataclasses.dataclass
class _Session:
    """What one call of `train` works with, made by `_set_up`; `state` and `data_state` (the
    iterator's position for the step after the last one run) advance with the loop."""

    run: RunConfig
    out_dir: pathlib.Path
    checkpointer: Checkpointer
    trainer: Trainer
    tokenizer: object
    val_stream: object
    iterator: object
    token_bytes: jax.Array
    periodic_eval: list
    state: dict
    data_state: dict
    next_batch: dict
    start: int
    saved_step: int | None
    compile_s: float

    def save(self, step: int, log) -> None:
        meta = {"step": step, "data": self.data_state}
        if self.saved_step != step and save_if_finite(self.checkpointer, self.trainer, self.state, meta, log):
            self.saved_step = step

    def evaluate(self, metrics_log: MetricsLog, step: int, batches) -> dict:
        values = evaluate_batches(self.trainer, self.state["params"], batches, self.token_bytes)
        metrics_log.write(step, "val", values)
        return values

    def eval_batches(self, max_windows):
        tc = self.run.train
        return eval_batches(self.val_stream, seq_len=tc.seq_len, batch_size=tc.eval_batch_size,
                            max_windows=max_windows, host_index=jax.process_index(), host_count=jax.process_count())


def _set_up(run: RunConfig, out_dir: pathlib.Path, mesh, checkpointer: Checkpointer, log,
            init: Initial | None = None) -> _Session:
    """Check everything, restore or initialise the state, write the run's files, compile."""
    tc = run.train
    steps = checkpointer.all_steps()
    if steps and not tc.resume:
        raise ValueError(f"train.output_dir={str(out_dir)!r} already holds checkpoints (step {steps[-1]}); "
                         "set train.resume=true to continue, or choose another output_dir")
    init = None if steps else init
    run, tokenizer, train_stream, val_stream = prepare_run(run, out_dir if steps else None,
                                                           init.tokenizer if init is not None else None)
    model_cfg = run.model
    config_path = out_dir / CONFIG_FILE
    if steps and config_path.exists() and read_config(config_path)["model"] != model_cfg.to_dict():
        raise ValueError(f"the checkpoints in {str(out_dir)!r} belong to a different model (its {CONFIG_FILE} "
                         "differs from this model: section): start a new train.output_dir or keep the model: "
                         "section unchanged")
    rules = run.parallel.rules_table()
    _check_divisible("batch_size / grad_accum", tc.batch_size // tc.grad_accum, mesh, rules)
    _check_divisible("eval_batch_size", tc.eval_batch_size, mesh, rules)
    trainer = Trainer(model_cfg, tc, mesh, rules=rules, context_layout=run.parallel.context_layout)
    latest = None
    if steps:
        latest, state, meta = checkpointer.restore_newest(trainer.abstract_state(), log=log)
        data_state, start = meta["data"], int(meta["step"])
        newest = "" if latest == steps[-1] else " (the newest step that restores completely)"
        log(f"resumed from {out_dir / CHECKPOINTS / str(latest)} at step {start}{newest}")
    else:
        state, data_state, start = trainer.init_state(tc.seed), None, 0
        if init is not None:
            state["params"] = _initial_params(trainer, init, log)
    out_dir.mkdir(parents=True, exist_ok=True)  # every check passed: the run's files may be written
    config_path.write_text(yaml.safe_dump(run.to_dict(), sort_keys=False))
    tokenizer.save(out_dir)
    if init is not None and init.assets:
        (out_dir / HF_ASSETS_DIR).mkdir(exist_ok=True)
        for asset in init.assets:
            shutil.copy2(asset, out_dir / HF_ASSETS_DIR / asset.name)

    iterator = train_iterator(train_stream, seq_len=tc.seq_len, batch_size=tc.batch_size, grad_accum=tc.grad_accum,
                              seed=tc.seed, host_index=jax.process_index(), host_count=jax.process_count(),
                              num_threads=run.data.num_threads, prefetch=run.data.prefetch, state=data_state)
    session = _Session(run, out_dir, checkpointer, trainer, tokenizer, val_stream, iterator,
                       jax.device_put(tokenizer.token_bytes(), trainer.replicated), [], state,
                       iterator.get_state(), {}, start, latest, 0.0)
    session.periodic_eval = list(session.eval_batches(tc.eval_windows))
    # compile everything before the clock starts (a pulled-ahead batch is not counted in data_state)
    session.next_batch = trainer.put_batch(next(iterator))
    session.compile_s = trainer.compile(state, session.next_batch, trainer.put_batch(session.periodic_eval[0]),
                                        session.token_bytes)
    n_params = sum(x.size for x in jax.tree.leaves(state["params"]))
    log(f"model: {n_params:,} parameters | train {len(train_stream):,} tokens, validation {len(val_stream):,} "
        f"tokens | {tc.batch_size} x {tc.seq_len} tokens per step | compiled in {session.compile_s:.1f}s")
    return session


def _initial_params(trainer: Trainer, init: Initial, log) -> dict:
    """`init`'s parameters, checked against the run's model and placed with its shardings."""
    abstract = trainer.abstract_state()["params"]
    params = init.params()
    want = {jax.tree_util.keystr(p): s.shape for p, s in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    got = {jax.tree_util.keystr(p): np.shape(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    wrong = [f"{k}: {list(got.get(k, ()))} (the model: {list(want[k])})" for k in want if got.get(k) != want[k]]
    if wrong or set(got) - set(want):
        raise ValueError(f"{init.source} does not fit the run's model: " + "; ".join(wrong[:4] or sorted(
            set(got) - set(want))[:4]))
    log(f"initialised from {init.source}")
    return jax.tree.map(lambda x, s: jax.device_put(np.asarray(x, s.dtype), s.sharding), params, abstract)


def _loop(s: _Session, mesh, stop_after, stop: _StopSignal) -> TrainResult:
    """Steps until `train.steps` (or a signal, or `stop_after`), with logging, evaluation and saves."""
    tc = s.run.train
    flops = flops_per_token(s.run.model, tc.seq_len)["total"]
    tokens_per_step = tc.batch_size * tc.seq_len
    metrics_log = MetricsLog(s.out_dir, tensorboard=tc.tensorboard, wandb_project=tc.wandb_project,
                             config=s.run.to_dict())
    progress = Progress(tc.steps, s.start, enabled=tc.progress)
    history: list[dict] = []
    pending: list[tuple[int, dict]] = []
    result = TrainResult(s.out_dir, s.start, history, compile_s=s.compile_s)
    loop_start = time.perf_counter()
    interval_start, interval_tokens = loop_start, 0
    step, next_batch = s.start, s.next_batch
    try:
        while step < tc.steps:
            batch, next_batch = next_batch, None
            s.state, metrics = s.trainer.train_step(s.state, batch)
            step += 1
            interval_tokens += tokens_per_step
            pending.append((step, metrics))
            s.data_state = s.iterator.get_state()
            if step < tc.steps:
                next_batch = s.trainer.put_batch(next(s.iterator))  # overlaps with the running step
            if step % tc.log_every == 0 or step == tc.steps or stop.received or step - s.start == stop_after:
                fetched = jax.device_get([m for _, m in pending])  # waits for the steps in flight
                rate = interval_tokens / max(time.perf_counter() - interval_start, 1e-9)
                record = _log_step(pending, fetched, history, rate, flops, tc.peak_flops, mesh.size, progress)
                metrics_log.write(step, "train", record)
                progress.update(step, record["loss"], rate)
                pending.clear()
                if history[-1]["nonfinite_streak"] >= tc.max_nonfinite_steps:
                    raise TrainingDiverged(
                        f"stopping at step {step}: {int(history[-1]['nonfinite_streak'])} non-finite steps in a "
                        f"row (train.max_nonfinite_steps={tc.max_nonfinite_steps}); every such update was "
                        f"skipped; the newest checkpoint is step {s.saved_step}. Lower train.lr or check the data.")
                interval_start, interval_tokens = time.perf_counter(), 0
            if tc.eval_every and step % tc.eval_every == 0 and step < tc.steps:
                values = s.evaluate(metrics_log, step, s.periodic_eval)
                progress.message(f"step {step}: val_loss {values['loss']:.4f} | val_bpb {values['bpb']:.4f}")
            if stop.received or (stop_after is not None and step - s.start >= stop_after and step < tc.steps):
                s.save(step, progress.message)
                s.checkpointer.wait()
                name = signal.Signals(stop.received).name if stop.received else f"stop_after={stop_after}"
                progress.message(f"{name}: saved a checkpoint at step {step} and stopped")
                result.interrupted = True
                break
            if tc.checkpoint_every and step % tc.checkpoint_every == 0:
                s.save(step, progress.message)
        if not result.interrupted:
            final = s.evaluate(metrics_log, step, s.eval_batches(tc.final_eval_windows))
            result.val_loss, result.val_bpb = final["loss"], final["bpb"]
            s.save(step, progress.message)
    finally:
        progress.close()
        metrics_log.close()
    result.wall_s = time.perf_counter() - loop_start
    result.step = step
    result.tokens_per_s = (step - s.start) * tokens_per_step / max(result.wall_s, 1e-9)
    s.checkpointer.wait()
    return result


def _finish(s: _Session, result: TrainResult, log) -> None:
    """Samples and the loss plot of a run that reached `train.steps`."""
    tc = s.run.train
    if tc.samples:
        from modern_jax.generate import sample_texts

        prompt = tc.sample_prompt
        try:
            s.tokenizer.encode(prompt)
        except ValueError as e:
            log(f"train.sample_prompt={prompt!r} cannot be encoded ({e}); sampling from <bos>")
            prompt = ""
        result.samples = sample_texts(s.trainer.graphdef, s.state["params"], s.tokenizer, prompt, n=tc.samples,
                                      max_new_tokens=tc.sample_tokens, seed=tc.seed,
                                      temperature=tc.sample_temperature, top_k=tc.sample_top_k, top_p=tc.sample_top_p)
        (s.out_dir / "samples.txt").write_text("\n\n-----\n\n".join(result.samples) + "\n")
    if tc.plot:
        plot_losses(read_metrics(s.out_dir / METRICS_FILE), s.out_dir / "loss.png", title=str(s.out_dir))
        log(f"loss curve: {s.out_dir / 'loss.png'}")


def _log_step(pending, fetched, history, rate, flops, peak_flops, n_devices, progress) -> dict:
    """Record the fetched metrics of the pending steps, note skipped steps, and summarise."""
    rows = []
    for (step, _), values in zip(pending, fetched):
        row = {"step": step, **{k: np.asarray(v, np.float64).tolist() for k, v in values.items()}}
        if not row["finite"]:
            progress.message(f"step {step}: non-finite loss or gradient (loss {row['loss']}, grad norm "
                             f"{row['grad_norm']}); update skipped")
        rows.append(row)
    history.extend(rows)
    finite_rows = [r for r in rows if r["finite"]] or rows
    record = {
        "loss": float(np.mean([r["loss"] for r in finite_rows])),
        "z_loss": float(np.mean([r["z_loss"] for r in finite_rows])),
        "grad_norm": rows[-1]["grad_norm"],
        "lr": rows[-1]["lr"],
        "max_output_logit": max(r["max_abs_logit"] for r in rows),
        "skipped_steps": sum(1 for r in rows if not r["finite"]),
        "tokens_per_s": rate,
        "model_flops_per_s": rate * flops,
    }
    if "max_attention_logit" in rows[0]:  # train.diagnostics: measured by the steps' own attention
        record["max_attention_logit"] = max(r["max_attention_logit"] for r in rows)
    if any(r["moe_aux_loss"] for r in rows):
        record["moe_aux_loss"] = float(np.mean([r["moe_aux_loss"] for r in rows]))
    if "moe_load_max" in rows[0]:  # a mixture of experts: per MoE layer, the loads over the mean load
        record["moe_router_z_loss"] = float(np.mean([r["moe_router_z_loss"] for r in rows]))
        record["moe_dropped"] = float(np.sum([r["moe_dropped"] for r in rows]))
        record["moe_load_max"] = np.max([r["moe_load_max"] for r in rows], axis=0).round(4).tolist()
        record["moe_load_min"] = np.min([r["moe_load_min"] for r in rows], axis=0).round(4).tolist()
    if peak_flops:
        record["mfu"] = rate * flops / (peak_flops * n_devices)
    return record
