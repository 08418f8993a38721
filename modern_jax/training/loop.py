"""The training loop: `train(run_config)`.

    tokens -> grain iterator -> train_step (one jit, state donated) -> metrics at log steps
                                                                   -> validation every eval_every
                                                                   -> async Orbax save every checkpoint_every

Per step the host only fetches the next (prefetched) batch and dispatches the compiled
step; metrics stay on the device until a log step fetches them all at once. Compilation
happens ahead of time, before the clock starts, and is reported on its own.

The run resumes from the newest complete checkpoint in `output_dir` (params, optimiser
state, step, RNG and the data iterator's position), so a resumed run computes exactly the
steps the uninterrupted run would have; it keeps its objective, model, adapters and
tokenizer (`checkpoint.check_objective`, `checkpoint.check_resume`). A new run starts from
random parameters, or from `init` (fine-tuning: a Hugging Face model's or a checkpoint's
parameters, with its tokenizer;
`modern_jax.convert.finetune_run` makes it), whose source files (config.json, tokenizer
files) are copied into the run's `hf/` for the way back to Hugging Face. SIGTERM / SIGINT
save a checkpoint and stop (`signals.StopSignal`). A non-finite loss or gradient skips the
update (the step function keeps the old state) and is logged; `max_nonfinite_steps` in a row
stop the run with `TrainingDiverged`. A checkpoint is only written from finite parameters.
lm-eval's benchmarks (`train.harness_tasks`) come from above, as `train`'s `benchmarks`:
training does not import the harness.

The run directory has one writer: `outputs.RunDirectory` claims and locks it (`outputs.RunLock`)
before anything is written, and a start that fails removes what it wrote. In a launch of
several processes (`multihost.distributed`) process 0 takes the lock and writes the run's
files (config, tokenizer, metrics, TensorBoard, plots, samples) and prints; every process
computes and saves its shards of each checkpoint; the processes agree on the directory's
verdict, the step to resume from and the step a signal stops at.
"""

from __future__ import annotations

import dataclasses
import json
import math
import pathlib
import shutil
import time
from collections.abc import Callable

import jax
import numpy as np
from flax import nnx
import yaml

from modern_jax import execution
from modern_jax.accounting import flops_per_token
from modern_jax.data.corpora import Mixture
from modern_jax.data.tokenizers import TOKENIZER_FILE, load_tokenizer
from modern_jax.multihost import distributed
from modern_jax.training import outputs
from modern_jax.training.checkpoint import (BASE_FILE, CHECKPOINTS, CONFIG_FILE, HF_ASSETS_DIR, Checkpointer,
                                           check_base, check_objective, check_resume)
from modern_jax.training.config import RunConfig
from modern_jax.training.metrics import METRICS_FILE, MetricsLog, Progress, plot_losses, read_metrics
from modern_jax.training.placement import from_whole
from modern_jax.training.signals import StopSignal
from modern_jax.training import objectives
from modern_jax.training.objectives.base import BatchFailed
from modern_jax.training.converters import abstract_converted, converter_of
from modern_jax.training.evaluation import eval_batch, evaluate_batches
from modern_jax.training.programs import describe_kernels
from modern_jax.training.trainer import Trainer, trainer_for


class TrainingDiverged(RuntimeError):
    """Too many non-finite steps in a row."""


@dataclasses.dataclass(frozen=True)
class Initial:
    """The parameters a new run starts from instead of random ones (fine-tuning)."""

    source: str  # what they are, for the log and errors
    params: Callable[..., dict]  # reads them (a pure dict), only when a new run starts; given the run's
    # abstract parameters (with their shardings), a Hugging Face source places each process's share as it reads
    tokenizer: object | None = None  # their tokenizer; None: the one `data:` describes
    assets: tuple[pathlib.Path, ...] = ()  # files copied into the run's hf/: config.json, tokenizer files
    adapters: Callable[[], dict] | None = None  # a LoRA run's adapters (a PEFT adapter's), read like `params`
    path: str | None = None  # where they come from (`lora.save_base: false` reads the base there again)
    checksums: Callable[[], dict] | None = None  # the size and CRC-32 of each weight file there, read when called


@dataclasses.dataclass
class TrainResult:
    output_dir: pathlib.Path
    step: int
    history: list[dict]  # one dict of host floats per step run in this call
    val_loss: float | None = None
    val_bpb: float | None = None
    val_shown: dict = dataclasses.field(default_factory=dict)  # the objective's own figures of it (`Shown.values`)
    tokens_per_s: float = 0.0
    wall_s: float = 0.0  # the loop, evaluation included, compilation excluded
    compile_s: float = 0.0
    interrupted: bool = False
    signal: int | None = None  # the signal that stopped it (None: stop_after, or another process's signal)
    samples: list[str] = dataclasses.field(default_factory=list)
    harness: dict = dataclasses.field(default_factory=dict)  # the final benchmarks (train.harness_tasks): task/metric


def save_if_finite(checkpointer: Checkpointer, trainer: Trainer, state: dict, meta: dict, log=print) -> bool:
    """Save unless a parameter is NaN or infinite (no checkpoint is written from such a state)."""
    if not trainer.states.all_finite(state["params"]):
        log(f"step {meta['step']}: parameters are not finite; no checkpoint written")
        return False
    checkpointer.save(state, meta)
    return True


def prepare_run(run: RunConfig, objective, resume_dir: pathlib.Path | None, tokenizer=None,
                shared: pathlib.Path | None = None):
    """Tokenizer (a resumed run's, else `tokenizer`, else built from `data:`), the objective's
    training and validation splits and the run config with its vocabulary resolved. `shared`:
    where the processes of a launch build the token streams together."""
    tokenizer, train_split, val_split = objective.read(run, _saved_tokenizer(resume_dir, tokenizer), shared)
    return _with_vocab(run, tokenizer, f"the {run.data.tokenizer} tokenizer's"), tokenizer, train_split, val_split


def _saved_tokenizer(resume_dir: pathlib.Path | None, tokenizer):
    """A resumed run's own tokenizer, else `tokenizer`."""
    saved = resume_dir / TOKENIZER_FILE if resume_dir is not None else None
    return load_tokenizer(saved) if saved is not None and saved.exists() else tokenizer


def _with_vocab(run: RunConfig, tokenizer, whose: str) -> RunConfig:
    """`run` with `vocab_size: auto` resolved to the tokenizer's; a model too small for it is an error."""
    run = run.with_vocab(tokenizer.vocab_size)
    if tokenizer.vocab_size > run.model.vocab_size:
        raise ValueError(f"model.vocab_size={run.model.vocab_size} is smaller than {whose} "
                         f"{tokenizer.vocab_size} ids (use vocab_size: auto or raise it)")
    return run


def train(run: RunConfig, *, mesh=None, log=print, stop_after: int | None = None,
          init: Initial | None = None, benchmarks: Callable[..., object] | None = None) -> TrainResult:
    """Train (or resume) the run. `stop_after`: stop after this many steps in this call, saving
    a checkpoint as a preemption would (the run resumes later with the same schedule). `init`:
    the parameters (and tokenizer) a new run starts from; a resumed run ignores it. `benchmarks`:
    what scores `train.harness_tasks`, called with the run's state builder, tokenizer and train
    config before the first step and giving a function of the parameters -> `{task/metric: value}`
    (`modern_jax.harness.Benchmarks`, which the train command passes); a run with harness tasks
    needs it."""
    tc = run.train
    if tc.harness_tasks and benchmarks is None:  # refused before anything is written
        raise ValueError(f"train.harness_tasks={list(tc.harness_tasks)} needs the benchmarks that score them: pass "
                         f"train(..., benchmarks=modern_jax.harness.Benchmarks), as `modern-jax train` does, or "
                         f"leave train.harness_tasks empty")
    log = log if distributed.is_main() else _quiet
    with outputs.RunDirectory(tc.output_dir, log) as directory:
        mesh = run.parallel.mesh() if mesh is None else mesh
        # creates nothing on disk until the first save, so a run that fails to start leaves no checkpoints/
        checkpointer = Checkpointer(directory.root / CHECKPOINTS, keep=tc.keep_checkpoints,
                                    async_save=tc.async_checkpoints)
        try:
            with StopSignal() as stop:  # installed first, so a signal during set-up is honoured too
                return _train(run, directory, mesh, checkpointer, log, stop_after, stop, init, benchmarks)
        finally:
            checkpointer.close()
            shutil.rmtree(directory.path / _SHARED_DATA, ignore_errors=True) if distributed.is_main() else None


def _quiet(*_) -> None:
    """What processes other than 0 print of the run's progress: nothing."""


_SHARED_DATA = ".data"  # in a launch of several processes: the token streams they built together


def _train(run: RunConfig, directory: outputs.RunDirectory, mesh, checkpointer: Checkpointer, log, stop_after,
           stop: StopSignal, init: Initial | None, benchmarks) -> TrainResult:
    with Progress(None, enabled=run.train.progress and distributed.is_main()) as setup:  # the data, the compilation
        session = _set_up(run, directory, mesh, checkpointer, log, init, setup, benchmarks)
    result = _loop(session, mesh, stop_after, stop)
    if not result.interrupted:
        _finish(session, result, log)
    return result


@dataclasses.dataclass
class _Session:
    """What one call of `train` works with, made by `_set_up`; `state` and `data_state` (the
    iterator's position for the step after the last one run) advance with the loop."""

    run: RunConfig
    directory: outputs.RunDirectory
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
    benchmarks: object = None  # train.harness_tasks on the parameters, made by `train`'s `benchmarks`
    mixture: Mixture | None = None  # data.sources: the training split's sources, whose shares are logged

    @property
    def out_dir(self) -> pathlib.Path:
        return self.directory.path

    def save(self, step: int, log) -> None:
        self.directory.check()
        meta = {"step": step, "data": self.data_state, "model": self.run.model.to_dict()}
        if self.saved_step != step and save_if_finite(self.checkpointer, self.trainer, self.trainer.states.saved(self.state),
                                                      meta, log):
            self.saved_step = step
            distributed.note(resume=self.resume_hint())
        self.directory.sync()  # on object storage: the run's files beside the checkpoints

    def newest(self) -> str:
        return f"the newest checkpoint is step {self.saved_step}" if self.saved_step is not None else \
            "no checkpoint has been written yet"

    def resume_hint(self) -> str:
        return f" {self.newest().capitalize()}; run the same command again (every process) to resume."

    def kept(self, error: BatchFailed) -> BatchFailed:
        """`error` (a batch the objective could not make), saying what the run keeps and how it goes on."""
        if self.saved_step is None:
            return BatchFailed(f"{error}; no checkpoint was written: run the same command again to start over")
        return BatchFailed(f"{error}; the run keeps its checkpoint of step {self.saved_step}: run the same command "
                           f"again to resume from it")

    def batch(self, batch: dict, rows: int, step: int) -> dict:
        """Step `step`'s batch on the mesh (GRPO samples it from the current weights, with the step's key)."""
        return self.begin(batch, rows, step)()

    def begin(self, batch: dict, rows: int, step: int):
        """`batch` begun on the mesh from the current weights (`Objective.begin_batch`): what finishes it."""
        key = jax.random.fold_in(jax.random.wrap_key_data(self.state["rng"]), step)
        return self.trainer.objective.begin_batch(batch, trainer=self.trainer, params=self.state["params"], rows=rows,
                                                  step=step, key=key)

    def evaluate(self, metrics_log: MetricsLog | None, step: int, batches, progress: Progress,
                 what: str = "validation") -> dict:
        """The validation figures over `batches` (logged at `step`), a bar `what` of them on `progress`.
        A mixture's `batches` are each source's: its figures are logged as `val/<source>`, and the
        mixture's (`val`) are their means by weight."""
        if isinstance(batches, dict):
            per = {name: self.evaluate(None, step, part, progress, f"{what}: {name}") for name, part in batches.items()}
            weights = dict(zip(self.val_stream.names, self.val_stream.weights))
            first = next(iter(per.values()))
            values = {k: sum(weights[name] * v[k] for name, v in per.items()) if isinstance(first[k], float) else
                      sum(v[k] for v in per.values()) for k in first}  # counts (tokens) add up
            if metrics_log is not None:
                for name, v in per.items():
                    metrics_log.write(step, f"val/{name}", v)
        else:
            with progress.phase(what, len(batches), "batches") as advance:
                values = evaluate_batches(self.trainer, self.state["params"], batches, self.token_bytes,
                                          self.run.train.eval_batch_size, advance, self.state.get("reference"))
        if metrics_log is not None:
            metrics_log.write(step, "val", values)
        return values

    def benchmark(self, metrics_log: MetricsLog | None, step: int, progress: Progress) -> dict:
        """lm-eval's figures of the tasks of train.harness_tasks (logged at `step` as harness/task/metric)."""
        with progress.phase(f"benchmarks: {', '.join(self.run.train.harness_tasks)}"):
            values = self.benchmarks(self.state["params"])
        if metrics_log is not None:
            metrics_log.write(step, "harness", values)
        return values

    def eval_batches(self, max_windows):
        tc = self.run.train
        rows, _ = self.trainer.batches.local_slices(tc.eval_batch_size)
        if isinstance(self.val_stream, Mixture):  # each source's, evaluated on its own
            return {name: self.trainer.objective.eval_batches(stream, max_windows=max_windows, rows=rows)
                    for name, stream in zip(self.val_stream.names, self.val_stream.streams)}
        return self.trainer.objective.eval_batches(self.val_stream, max_windows=max_windows, rows=rows)


def _set_up(run: RunConfig, directory: outputs.RunDirectory, mesh, checkpointer: Checkpointer, log,
            init: Initial | None, progress: Progress, benchmarks) -> _Session:
    """Check everything, restore or initialise the state, make the benchmarks (`benchmarks`, for
    train.harness_tasks), compile, then write the run's files (`progress` shows the long parts)."""
    tc, out_dir, root = run.train, directory.path, directory.root
    steps = checkpointer.all_steps()
    init, base = _checked_start(run, root, mesh, steps, init)
    objective = objectives.objective(run.objective, tc)
    run, tokenizer, train_stream, val_stream = _read_data(run, directory, objective, steps, init, progress)
    if steps:
        distributed.decide("resume", lambda: check_resume(root, run, log))
    trainer = _trainer(run, mesh, objective, log)
    state, data_state, start, latest = _start_state(run, trainer, checkpointer, steps, init, log)
    tasks = None
    if tc.harness_tasks:  # the tasks are checked and their data read before any step
        with progress.phase("reading the benchmark tasks (lm-eval)"):
            tasks = benchmarks(trainer.states, tokenizer, tc)
    rows, _ = trainer.batches.local_slices(tc.batch_size // tc.grad_accum)
    iterator = objective.train_batches(train_stream, rows=rows, data=run.data, state=data_state)
    session = _Session(run, directory, checkpointer, trainer, tokenizer, val_stream, iterator,
                       jax.device_put(tokenizer.token_bytes(), trainer.programs.replicated), [], state,
                       iterator.get_state(), {}, start, latest, 0.0, tasks)
    periodic = session.eval_batches(tc.eval_windows)
    session.periodic_eval = {k: list(v) for k, v in periodic.items()} if isinstance(periodic, dict) else list(periodic)
    session.mixture = train_stream if isinstance(train_stream, Mixture) else None
    _note_eval_size(objective, val_stream, tc, log)
    # compile everything before the clock starts (a pulled-ahead batch is not counted in data_state)
    try:
        session.next_batch = session.batch(next(iterator), tc.batch_size // tc.grad_accum, start)
        with progress.phase("compiling the training and evaluation steps"):
            session.compile_s = trainer.compile(state, session.next_batch,
                                                eval_batch(trainer, state["params"], _first(session.periodic_eval),
                                                           tc.eval_batch_size, 0), session.token_bytes)
    except BatchFailed as e:
        raise session.kept(e) from None
    if distributed.is_main():  # every check passed and the steps compiled: the run's files may be written
        _write_run_files(out_dir, run, tokenizer, init, base)
    directory.started = True
    distributed.note(step=start, resume=session.resume_hint())
    _report_model(session, objective, train_stream, log)
    return session


def _first(batches: list | dict) -> dict:
    """The first evaluation batch (of the first source of a mixture)."""
    return next(iter(batches.values()))[0] if isinstance(batches, dict) else batches[0]


def _checked_start(run: RunConfig, out_dir, mesh, steps: list[int],
                   init: Initial | None) -> tuple[Initial | None, dict | None]:
    """Refuse a start that cannot go on, and processes that would start differently; `(init, base)`:
    what a new run starts from (None for a resumed one, unless it reads its base again) and the size
    and CRC-32 of each weight file of a base left out of the checkpoints."""
    tc = run.train
    if steps and not tc.resume:
        raise ValueError(f"train.output_dir={str(out_dir)!r} already holds checkpoints (step {steps[-1]}); "
                         "set train.resume=true to continue, or choose another output_dir")
    adapters_only = not converter_of(run).saves_base
    if adapters_only and (init is None or init.path is None):
        raise ValueError("lora.save_base=false keeps the frozen base out of the checkpoints, so the run must start "
                         "from a model it can read again: give --init-from-hf (the same one each time), or set "
                         "lora.save_base=true")
    if steps:  # before the data, whose records the objective decides
        distributed.decide("objective", lambda: check_objective(out_dir, run))
    init = None if steps and not adapters_only else init  # such a run reads its base again to resume
    base = None  # the size and CRC-32 of each weight file of a base left out of the checkpoints
    if adapters_only:
        base = distributed.decide("base", lambda: _base_files(out_dir, init, resumed=bool(steps)))
    distributed.check_same("run", {**distributed.flatten(run.to_dict()), "init": init.source if init else None,
                                   "mesh": dict(mesh.shape), "devices": mesh.size, "resume from": steps[-1:] or None})
    return init, base


def _read_data(run: RunConfig, directory: outputs.RunDirectory, objective, steps: list[int], init: Initial | None,
               progress: Progress):
    """`prepare_run` for this start: `(run, tokenizer, train split, validation split)`. In a launch of
    several processes they build the token streams together in the run directory (removed if the
    start fails)."""
    out_dir = directory.path
    shared = None
    if distributed.joined() and not directory.remote:  # on object storage each process tokenizes on its own
        shared = out_dir / _SHARED_DATA
        directory.made.append(shared)
    with progress.phase("reading and tokenizing the data"):
        return prepare_run(run, objective, out_dir if steps else None, init.tokenizer if init is not None else None,
                           shared)


def _trainer(run: RunConfig, mesh, objective, log) -> Trainer:
    """The run's Trainer; a LoRA run's dropout names the adapted projections it cannot reach."""
    model_cfg = run.model
    trainer = trainer_for(run, mesh, objective=objective)
    for note in trainer.converter.notes(nnx.merge(*abstract_converted(model_cfg, trainer.converter))):
        log(note)  # a mixture's experts and routers: their adapters are added to the weights, undropped
    return trainer


def _start_state(run: RunConfig, trainer: Trainer, checkpointer: Checkpointer, steps: list[int],
                 init: Initial | None, log) -> tuple[dict, dict | None, int, int | None]:
    """`(state, data_state, start, latest)`: restored from the newest checkpoint that restores
    completely (step `latest`; a base left out of it is read again from `init`), else a new state
    (with `init`'s parameters, if given) at step 0."""
    tc, model_cfg = run.train, run.model
    latest = None
    if steps:
        latest, state, meta = checkpointer.restore_newest(trainer.states.saved(trainer.states.abstract()), log=log,
                                                          model=model_cfg)
        if not trainer.converter.saves_base:  # the checkpoint holds the adapters: the frozen base is read again
            state["params"] = trainer.states.join(state["params"], trainer.states.split(_initial_params(trainer, init, log))[1])
        data_state, start = meta["data"], int(meta["step"])
        newest = "" if latest == steps[-1] else " (the newest step that restores completely)"
        log(f"resumed from {checkpointer.directory / str(latest)} at step {start}{newest}")
    else:
        state, data_state, start = trainer.states.init(tc.seed), None, 0
        if init is not None:
            state = trainer.states.with_start(state, _initial_params(trainer, init, log))
    return state, data_state, start, latest


def _note_eval_size(objective, val_stream, tc, log) -> None:
    """What the validation split holds: say so when train.eval_windows or train.final_eval_windows
    asks more (all of it is evaluated)."""
    windows, unit = objective.eval_size(val_stream), objective.eval_unit
    for name in ("eval_windows", "final_eval_windows") if tc.eval_every > 0 else ("final_eval_windows",):
        asked = getattr(tc, name)
        if asked is not None and asked > windows:
            log(f"train.{name}={asked:,}: the validation split has {windows:,} {unit}{'s' if windows != 1 else ''} "
                f"of {tc.seq_len} tokens; evaluating all of them")


def _report_model(session: _Session, objective, train_stream, log) -> None:
    """The parameters (a LoRA run's base and the adapters it trains), the data, the batch, the
    compilation's time and the kernels."""
    trainer, state, tc = session.trainer, session.state, session.run.train
    n_params = sum(math.prod(x.shape) for x in jax.tree.leaves(trainer.states.abstract_base()))
    if not trainer.converter.trains_all:  # the base's count (stored quantized or not), and the adapters trained
        trained = sum(x.size for x in jax.tree.leaves(trainer.states.split(state["params"])[0]))
        n_params = f"{n_params:,} + {trained:,} trained"
    else:
        n_params = f"{n_params:,}"
    what = getattr(train_stream, "unit", objective.unit)  # a stream read as batches ask counts its records
    log(f"model: {n_params} parameters | train {len(train_stream):,} {what}, validation {len(session.val_stream):,} "
        f"{what} | {tc.batch_size} x {tc.seq_len} tokens per step | compiled in {session.compile_s:.1f}s")
    log(f"kernels: {describe_kernels(trainer.programs.kernels)}")


def _base_files(out_dir, init: Initial, resumed: bool) -> dict | None:
    """The size and CRC-32 of each weight file of the base a run leaves out of its checkpoints; a
    resumed run's must be those it started from (`checkpoint.check_base`)."""
    files = init.checksums() if init.checksums is not None else None
    if resumed and files is not None:
        check_base(out_dir, init.path, files, fix="give --init-from-hf the model the run started from, or train "
                                                  "into a new train.output_dir")
    return files


def _write_run_files(out_dir: pathlib.Path, run: RunConfig, tokenizer, init: Initial | None,
                     base: dict | None = None) -> None:
    (out_dir / CONFIG_FILE).write_text(yaml.safe_dump(run.to_dict(), sort_keys=False))
    if init is not None and init.path is not None:  # where the run started, and the files of a base left out
        record = {"source": init.path, **({} if base is None else {"files": base})}
        (out_dir / BASE_FILE).write_text(json.dumps(record) + "\n")
    tokenizer.save(out_dir)
    if init is not None and init.assets:
        (out_dir / HF_ASSETS_DIR).mkdir(exist_ok=True)
        for asset in init.assets:
            shutil.copy2(asset, out_dir / HF_ASSETS_DIR / asset.name)


def _initial_params(trainer: Trainer, init: Initial, log) -> dict:
    """`init`'s parameters, checked against the run's model and placed with its shardings (a LoRA
    run's: its base, then its adapters added and its frozen projections quantized)."""
    abstract = trainer.states.abstract_base()
    params = init.params(abstract)
    want = {jax.tree_util.keystr(p): s.shape for p, s in jax.tree_util.tree_flatten_with_path(abstract)[0]}
    got = {jax.tree_util.keystr(p): np.shape(x) for p, x in jax.tree_util.tree_flatten_with_path(params)[0]}
    wrong = [f"{k}: {list(got.get(k, ()))} (the model: {list(want[k])})" for k in want if got.get(k) != want[k]]
    if wrong or set(got) - set(want):
        raise ValueError(f"{init.source} does not fit the run's model: " + "; ".join(wrong[:4] or sorted(
            set(got) - set(want))[:4]))
    log(f"initialised from {init.source}")
    params = trainer.states.from_base(jax.tree.map(_placed, params, abstract), trainer.train_cfg.seed)
    if init.adapters is None:
        return params
    trained, frozen = trainer.states.split(params)
    adapters = init.adapters()
    return trainer.states.join(jax.tree.map(lambda x, a: from_whole(np.asarray(x, a.dtype), a.sharding), adapters, trained),
                        frozen)


def _placed(x, s) -> jax.Array:
    """`x` as abstract parameter `s` (its dtype and sharding): as it is when already so placed."""
    if isinstance(x, jax.Array) and x.dtype == s.dtype and x.sharding == s.sharding:
        return x
    return from_whole(np.asarray(x, s.dtype), s.sharding)


@dataclasses.dataclass
class _Logbook:
    """Where the loop's figures go: every step's to `history` (host floats) once fetched (the steps
    not yet fetched wait in `pending`), to metrics.jsonl, TensorBoard and W&B (`metrics_log`,
    process 0's), to the bar and the printed lines (`message`); the interval since the last log
    step's start and tokens give the rate."""

    metrics_log: MetricsLog | None
    progress: Progress
    message: Callable[[str], None]
    flops: float  # the model's per token (`accounting.flops_per_token`)
    n_devices: int
    history: list[dict] = dataclasses.field(default_factory=list)
    pending: list[tuple[int, dict]] = dataclasses.field(default_factory=list)
    interval_start: float = 0.0
    interval_tokens: int = 0

    @classmethod
    def open(cls, s: _Session, mesh) -> _Logbook:
        tc = s.run.train
        main = distributed.is_main()
        metrics_log = MetricsLog(s.out_dir, tensorboard=tc.tensorboard, wandb_project=tc.wandb_project,
                                 config=s.run.to_dict()) if main else None
        progress = Progress(tc.steps, s.start, enabled=tc.progress and main)
        return cls(metrics_log, progress, progress.message if main else _quiet,
                   flops_per_token(s.run.model, tc.seq_len)["total"], mesh.size)

    def close(self) -> None:
        self.progress.close()
        if self.metrics_log is not None:
            self.metrics_log.close()


def _loop(s: _Session, mesh, stop_after, stop: StopSignal) -> TrainResult:
    """Steps until `train.steps` (or a signal, or `stop_after`), with logging, evaluation and saves;
    a run that reaches `train.steps` ends with the final evaluation and a save."""
    tc = s.run.train
    book = _Logbook.open(s, mesh)
    result = TrainResult(s.directory.root, s.start, book.history, compile_s=s.compile_s)
    loop_start = time.perf_counter()
    book.interval_start = loop_start
    try:
        step, result.interrupted = _steps(s, book, stop_after, stop)
        if not result.interrupted:
            _final_evaluation(s, book, result, step)
    except BatchFailed as e:
        raise _failed(s, book, e) from None
    finally:
        book.close()
    result.wall_s = time.perf_counter() - loop_start
    result.step = step
    result.tokens_per_s = (step - s.start) * tc.batch_size * tc.seq_len / max(result.wall_s, 1e-9)
    result.signal = stop.received
    s.checkpointer.wait()
    return result


def _steps(s: _Session, book: _Logbook, stop_after, stop: StopSignal) -> tuple[int, bool]:
    """The steps from `s.start`; `(the last step run, whether the run stopped before train.steps)`."""
    tc = s.run.train
    tokens_per_step = tc.batch_size * tc.seq_len
    rows = tc.batch_size // tc.grad_accum
    step, next_batch = s.start, s.next_batch
    every = s.trainer.objective.steps_per_batch  # a run stops and saves only between batches that serve several steps
    saves = lambda k: bool(tc.checkpoint_every) and k % tc.checkpoint_every == 0  # noqa: E731  (after step k)
    asked = False  # a stop signal came
    while step < tc.steps:
        batch, next_batch, begun = next_batch, None, None
        # the next batch, from the weights this step starts with; not across a checkpoint, whose next
        # batch is sampled from the weights it saves, as a run resumed from it samples its first
        if s.trainer.objective.ahead and step + 1 < tc.steps and not saves(step + 1):
            s.data_state = s.iterator.get_state()  # what a stop after this step saves: the begun batch comes again
            begun = s.begin(next(s.iterator), rows, step + 1)
        s.state, metrics = s.trainer.train_step(s.state, batch)
        step += 1
        distributed.note(step=step)
        book.interval_tokens += tokens_per_step
        book.pending.append((step, metrics))
        if begun is None:
            s.data_state = s.iterator.get_state()
        asked = stop.due(step) or asked  # every process calls it at every step
        stopping = step % every == 0 and (asked or (stop_after is not None and step - s.start >= stop_after
                                                    and step < tc.steps))
        if step < tc.steps and not stopping:  # overlaps with the running step
            next_batch = begun() if begun is not None else s.batch(next(s.iterator), rows, step)
        if step % tc.log_every == 0 or step == tc.steps or stopping:
            _log(s, book, step)
        _evaluate_between(s, book, step)
        if stopping:
            _stop(s, book, step, stop, stop_after)
            return step, True
        if saves(step):
            s.save(step, book.message)
    return step, False


def _failed(s: _Session, book: _Logbook, error: BatchFailed) -> BatchFailed:
    """A batch the objective could not make (a reward function that raised) after the steps began:
    the steps run are logged and, in a run of one process between batches, saved (the batch of
    the step after a checkpoint is made before it is saved); `error` then says what the run keeps.
    (In a launch the other processes may be inside a step: the run keeps its newest checkpoint.)"""
    step = book.pending[-1][0] if book.pending else book.history[-1]["step"] if book.history else s.start
    if book.pending:
        _log(s, book, step)
    if step > s.start and step % s.trainer.objective.steps_per_batch == 0 and not distributed.joined():
        s.save(step, book.message)
        s.checkpointer.wait()
    return s.kept(error)


def _log(s: _Session, book: _Logbook, step: int) -> None:
    """Fetch the pending steps' metrics (waiting for the steps in flight), record and show them;
    `train.max_nonfinite_steps` non-finite steps in a row stop the run."""
    tc = s.run.train
    fetched = jax.device_get([m for _, m in book.pending])  # waits for the steps in flight
    rate = book.interval_tokens / max(time.perf_counter() - book.interval_start, 1e-9)
    record = _log_step(book.pending, fetched, book.history, rate, book.flops, tc.peak_flops, book.n_devices,
                       book.message, s.trainer.objective.metric_names)
    if book.metrics_log is not None:
        book.metrics_log.write(step, "train", record)
        if s.mixture is not None:  # each source's share of the tokens of the steps since the last log
            rows = tc.batch_size
            first = book.pending[0][0] - 1  # step k trains on batch k - 1
            book.metrics_log.write(step, "data", {f"share/{name}": share for name, share in
                                                  s.mixture.shares(first * rows, (step - first) * rows).items()})
        _write_samples(s.out_dir, step, s.trainer.objective.samples())
    book.progress.update(step, record["loss"], rate, s.trainer.objective.display.line(record))
    book.pending.clear()
    if book.history[-1]["nonfinite_streak"] >= tc.max_nonfinite_steps:
        raise TrainingDiverged(
            f"stopping at step {step}: {int(book.history[-1]['nonfinite_streak'])} non-finite steps in a "
            f"row (train.max_nonfinite_steps={tc.max_nonfinite_steps}); every such update was "
            f"skipped; {s.newest()}. Lower train.lr or check the data.")
    book.interval_start, book.interval_tokens = time.perf_counter(), 0


def _evaluate_between(s: _Session, book: _Logbook, step: int) -> None:
    """The validation every `train.eval_every` steps and the benchmarks every `train.harness_every`
    (the last step has the final ones)."""
    tc = s.run.train
    if tc.eval_every and step % tc.eval_every == 0 and step < tc.steps:
        values = s.evaluate(book.metrics_log, step, s.periodic_eval, book.progress)
        book.message(f"step {step}: val_loss {values['loss']:.4f}" + s.trainer.objective.display.line(values, "val_"))
    if s.benchmarks is not None and tc.harness_every and step % tc.harness_every == 0 and step < tc.steps:
        values = s.benchmark(book.metrics_log, step, book.progress)
        book.message(f"step {step}: " + ", ".join(f"{k} {v:.4f}" for k, v in values.items()))


def _stop(s: _Session, book: _Logbook, step: int, stop: StopSignal, stop_after) -> None:
    """Save at `step`, and say why the run stops there (a signal, or `stop_after`) and how it resumes."""
    s.save(step, book.message)
    s.checkpointer.wait()
    name = stop.name() if stop_after is None or step - s.start < stop_after else f"stop_after={stop_after}"
    book.message(f"{name}: saved a checkpoint at step {step} and stopped; run the same command again to resume")


def _final_evaluation(s: _Session, book: _Logbook, result: TrainResult, step: int) -> None:
    """The validation over `train.final_eval_windows` and the benchmarks, into `result`; then a save."""
    tc = s.run.train
    final = s.evaluate(book.metrics_log, step, s.eval_batches(tc.final_eval_windows), book.progress,
                       "final validation")
    result.val_loss, result.val_bpb = final["loss"], final.get("bpb")
    result.val_shown = s.trainer.objective.display.values(final)
    if s.benchmarks is not None:
        result.harness = s.benchmark(book.metrics_log, step, book.progress)
    s.save(step, book.message)


SAMPLES_FILE = "completions.jsonl"  # rows of the batches an objective made (GRPO's completions and rewards)


def _write_samples(out_dir: pathlib.Path, step: int, samples: list[dict]) -> None:
    if samples:
        with open(out_dir / SAMPLES_FILE, "a", encoding="utf-8") as f:
            f.writelines(json.dumps({"step": step, **sample}, ensure_ascii=False) + "\n" for sample in samples)


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
        with execution.use(s.run.execution), Progress(None, enabled=tc.progress and distributed.is_main()) as bar, \
                bar.phase(f"sampling {tc.samples} x {tc.sample_tokens} tokens"):
            result.samples = sample_texts(s.trainer.states.graphdef, s.trainer.states.model_params(s.state["params"]), s.tokenizer,
                                          prompt, n=tc.samples, max_new_tokens=tc.sample_tokens, seed=tc.seed,
                                          temperature=tc.sample_temperature, top_k=tc.sample_top_k,
                                          top_p=tc.sample_top_p)
        if distributed.is_main():
            (s.out_dir / "samples.txt").write_text("\n\n-----\n\n".join(result.samples) + "\n")
    if tc.plot and distributed.is_main():
        plot_losses(read_metrics(s.out_dir / METRICS_FILE), s.out_dir / "loss.png", s.trainer.objective.display,
                    title=str(s.directory.root))
        log(f"loss curve: {s.directory.root / 'loss.png'}")


def _log_step(pending, fetched, history, rate, flops, peak_flops, n_devices, message, named=()) -> dict:
    """Record the fetched metrics of the pending steps, note skipped steps, and summarise."""
    rows = []
    for (step, _), values in zip(pending, fetched):
        row = {"step": step, **{k: np.asarray(v, np.float64).tolist() for k, v in values.items()}}
        if not row["finite"]:
            message(f"step {step}: non-finite loss or gradient (loss {row['loss']}, grad norm "
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
    for name in named:  # the objective's own figures (DPO's rewards): means over the interval's steps
        record[name] = float(np.mean([r[name] for r in finite_rows]))
    for name in (n for n in rows[0] if n.startswith("mtp_loss_")):  # each multi-token-prediction module's loss
        record[name] = float(np.mean([r[name] for r in finite_rows]))
    if "max_attention_logit" in rows[0]:  # train.diagnostics: measured by the steps' own attention
        record["max_attention_logit"] = max(r["max_attention_logit"] for r in rows)
    if "qk_clipped_heads" in rows[0]:  # train.qk_clip_tau: the heads rescaled, over the interval's steps
        record["qk_clipped_heads"] = int(sum(r["qk_clipped_heads"] for r in rows))
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
