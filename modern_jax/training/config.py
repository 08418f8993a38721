"""The run configuration: `TrainConfig` (the `train:` section), and the whole run file.

A run file has these sections, each validated by its own frozen dataclass:

    model:     ModelConfig     (modern_jax.config: the architecture)
    execution: ExecutionConfig (modern_jax.execution: kernels, dispatch, remat, scan; optional)
    train:     TrainConfig     (this module)
    data:      DataConfig      (modern_jax.data.config)
    parallel:  ParallelConfig  (modern_jax.sharding.config; optional: all devices on `data`)

`model.vocab_size: auto` takes the tokenizer's vocabulary size (the char tokenizer builds
its vocabulary from the data).
"""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import math
from dataclasses import dataclass
from typing import Any

from modern_jax.config import ModelConfig, split_moved
from modern_jax.configfile import RUN_SECTIONS, check_keys, check_sections, fail, load_config_file
from modern_jax.data.config import DataConfig
from modern_jax.execution import ExecutionConfig
from modern_jax.lora_config import LoRAConfig
from modern_jax.training import objectives
from modern_jax.sharding.config import ParallelConfig

SCHEDULES = ("cosine", "wsd", "constant")
NO_DECAY_GROUPS = ("embedding", "norm", "bias")
OPTIMIZERS = ("adamw", "muon")
MUON_GROUPS = ("attention", "mlp", "experts", "router")  # the hidden projections' groups (`optimizer.projection_groups`)
MUON_ADJUST_LR = ("match_rms_adamw", "original")
SECTIONS = RUN_SECTIONS


_fail = functools.partial(fail, "TrainConfig")


@dataclass(frozen=True, slots=True)
class TrainConfig:
    """How to train: steps, batch, optimiser, loss, logging, evaluation, checkpoints."""

    output_dir: str = "runs/default"
    seed: int = 0
    steps: int = 1000
    batch_size: int = 16  # sequences per optimiser step, all hosts together
    seq_len: int = 128
    grad_accum: int = 1  # micro-batches per step (batch_size / grad_accum sequences each)

    # AdamW (or Muon for the hidden projections) with warmup + cosine / WSD / constant schedule
    optimizer: str = "adamw"  # adamw, or muon: Muon for the projections of `muon_groups`, AdamW for the rest
    lr: float = 1e-3
    min_lr_ratio: float = 0.1  # the schedule ends at lr * min_lr_ratio
    warmup_steps: int = 100
    schedule: str = "cosine"
    decay_fraction: float = 0.2  # wsd: the final fraction of steps that decays
    b1: float = 0.9
    b2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    no_decay: tuple[str, ...] = NO_DECAY_GROUPS  # parameter groups without weight decay
    clip_norm: float | None = 1.0  # global-norm clipping; null: none
    muon_groups: tuple[str, ...] = ("attention", "mlp", "experts")  # projections Muon moves; the rest: AdamW
    muon_momentum: float = 0.95  # Muon's Nesterov momentum
    muon_adjust_lr: str = "match_rms_adamw"  # Muon's update scale: Moonlight's (AdamW's lr carries over), or Jordan's
    muon_ns_steps: int = 5  # Newton-Schulz iterations
    qk_clip_tau: float | None = None  # QK-clip (MuonClip): a head's max attention logit kept at most this; null: off

    # loss
    z_loss_weight: float = 1e-4
    moe_aux_weight: float = 0.0  # weight of sown `moe_aux_loss` values, if the model sows any
    moe_router_z_weight: float = 0.0  # weight of a mixture of experts' router z-loss
    moe_bias_update_rate: float = 0.0  # auxiliary-loss-free balancing: the selection bias's step size
    mtp_loss_weight: float = 0.3  # lambda of the multi-token-prediction losses, lambda / D sum_k CE_k (model.mtp_depth)
    loss_vocab_chunk: int = 8192  # vocabulary chunk of the loss; the whole batch's logits never exist at once

    # logging, evaluation, sampling
    log_every: int = 50
    eval_every: int = 500  # 0: only at the end
    eval_windows: int | None = 256  # windows per periodic evaluation (None: the whole split)
    eval_batch_size: int = 64
    final_eval_windows: int | None = None  # the closing evaluation; None: the whole validation split
    diagnostics: bool = True  # max |attention logit|, measured by the train step's own attention
    peak_flops: float | None = None  # per-device peak FLOP/s for the MFU estimate; null: no MFU
    progress: bool = True
    tensorboard: bool = True  # events under output_dir/tensorboard/
    wandb_project: str | None = None  # log to this Weights & Biases project (needs wandb installed)
    plot: bool = True  # loss-curve PNG at the end
    samples: int = 3
    sample_tokens: int = 200
    sample_prompt: str = ""
    sample_temperature: float = 0.8
    sample_top_k: int | None = None
    sample_top_p: float | None = 0.95
    # lm-eval's benchmarks during training (modern_jax/harness.py): logged as harness/{task}/{metric}
    harness_tasks: tuple[str, ...] = ()  # lm-eval task names; none: no benchmark
    harness_every: int = 0  # steps between benchmarks; 0: only at the end
    harness_limit: float | None = None  # documents per task (a whole count, or a fraction below 1); null: all
    harness_include_path: str | None = None  # a directory of task YAML files (e.g. configs/harness)

    # checkpoints and robustness
    checkpoint_every: int = 500  # 0: only at the end
    keep_checkpoints: int = 3
    async_checkpoints: bool = True
    resume: bool = True  # continue from the newest complete checkpoint in output_dir
    max_nonfinite_steps: int = 5  # stop after this many non-finite steps in a row

    def __post_init__(self):
        for name in ("no_decay", "muon_groups"):
            if isinstance(getattr(self, name), list):
                object.__setattr__(self, name, tuple(getattr(self, name)))
        if isinstance(self.harness_tasks, str):  # one name, or names separated by commas
            object.__setattr__(self, "harness_tasks", tuple(t for t in self.harness_tasks.split(",") if t))
        if isinstance(self.harness_tasks, list):
            object.__setattr__(self, "harness_tasks", tuple(self.harness_tasks))
        if not isinstance(self.harness_tasks, tuple) or not all(isinstance(t, str) and t for t in self.harness_tasks):
            _fail("harness_tasks", self.harness_tasks, "expected a list of lm-eval task names")
        limit = self.harness_limit
        if limit is not None and (isinstance(limit, bool) or not isinstance(limit, (int, float)) or not (
                0 < limit < 1 or 1 <= limit < math.inf and limit == int(limit))):
            _fail("harness_limit", limit, "expected a whole count of documents, a fraction below 1, or null")
        if not isinstance(self.no_decay, tuple):
            _fail("no_decay", self.no_decay, f"expected a list of groups from {', '.join(NO_DECAY_GROUPS)}")
        self._check_optimizer()
        for name in ("steps", "batch_size", "seq_len", "grad_accum", "log_every", "eval_batch_size",
                     "keep_checkpoints", "max_nonfinite_steps"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                _fail(name, value, "expected a positive integer")
        for name in ("seed", "warmup_steps", "eval_every", "checkpoint_every", "samples", "sample_tokens",
                     "harness_every"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                _fail(name, value, "expected a non-negative integer")
        for name in ("eval_windows", "final_eval_windows", "sample_top_k"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or value <= 0):
                _fail(name, value, "expected a positive integer or null")
        if self.batch_size % self.grad_accum:
            _fail("grad_accum", self.grad_accum, f"must divide batch_size={self.batch_size}")
        if self.schedule not in SCHEDULES:
            _fail("schedule", self.schedule, f"expected one of {', '.join(SCHEDULES)}")
        if not self.lr > 0:
            _fail("lr", self.lr, "expected a positive learning rate")
        if not 0.0 <= self.min_lr_ratio <= 1.0:
            _fail("min_lr_ratio", self.min_lr_ratio, "expected a fraction in [0, 1]")
        if not 0.0 < self.decay_fraction <= 1.0:
            _fail("decay_fraction", self.decay_fraction, "expected a fraction in (0, 1]")
        if self.warmup_steps >= self.steps and self.schedule != "constant":
            _fail("warmup_steps", self.warmup_steps, f"must be below steps={self.steps}")
        for name in ("b1", "b2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                _fail(name, getattr(self, name), "expected a decay rate in [0, 1)")
        for name in ("eps", "weight_decay", "z_loss_weight", "moe_aux_weight", "moe_router_z_weight",
                     "moe_bias_update_rate", "mtp_loss_weight"):
            if not getattr(self, name) >= 0:
                _fail(name, getattr(self, name), "expected a non-negative float")
        unknown = set(self.no_decay) - set(NO_DECAY_GROUPS)
        if unknown:
            _fail("no_decay", list(self.no_decay), f"groups are {', '.join(NO_DECAY_GROUPS)}")
        if self.clip_norm is not None and not self.clip_norm > 0:
            _fail("clip_norm", self.clip_norm, "expected a positive norm or null")
        if self.loss_vocab_chunk <= 0:
            _fail("loss_vocab_chunk", self.loss_vocab_chunk, "expected a positive integer")
        if self.peak_flops is not None and not self.peak_flops > 0:
            _fail("peak_flops", self.peak_flops, "expected a positive FLOP/s figure or null")
        if not 0 <= self.sample_temperature < math.inf:
            _fail("sample_temperature", self.sample_temperature, "expected a finite number >= 0 (0: greedy)")
        if self.sample_top_p is not None and not 0.0 < self.sample_top_p <= 1.0:
            _fail("sample_top_p", self.sample_top_p, "expected a probability in (0, 1] or null")
        if not self.output_dir:
            _fail("output_dir", self.output_dir, "expected a directory")
        if self.wandb_project is not None:
            if not isinstance(self.wandb_project, str) or not self.wandb_project:
                _fail("wandb_project", self.wandb_project, "expected a W&B project name or null")
            if importlib.util.find_spec("wandb") is None:
                _fail("wandb_project", self.wandb_project, "W&B logging needs the wandb package: `uv sync --extra "
                      "wandb` (or pip install wandb), or leave train.wandb_project unset")

    def _check_optimizer(self) -> None:
        if self.optimizer not in OPTIMIZERS:
            _fail("optimizer", self.optimizer, f"expected one of {', '.join(OPTIMIZERS)}")
        if not isinstance(self.muon_groups, tuple) or set(self.muon_groups) - set(MUON_GROUPS):
            _fail("muon_groups", self.muon_groups, f"expected a list of groups from {', '.join(MUON_GROUPS)}")
        if self.muon_adjust_lr not in MUON_ADJUST_LR:
            _fail("muon_adjust_lr", self.muon_adjust_lr, f"expected one of {', '.join(MUON_ADJUST_LR)}")
        if isinstance(self.muon_momentum, bool) or not isinstance(self.muon_momentum, (int, float)) or \
                not 0.0 <= self.muon_momentum < 1.0:
            _fail("muon_momentum", self.muon_momentum, "expected a decay rate in [0, 1)")
        if not isinstance(self.muon_ns_steps, int) or isinstance(self.muon_ns_steps, bool) or self.muon_ns_steps <= 0:
            _fail("muon_ns_steps", self.muon_ns_steps, "expected a positive integer")
        if self.qk_clip_tau is not None:
            if isinstance(self.qk_clip_tau, bool) or not isinstance(self.qk_clip_tau, (int, float)) or \
                    not 0 < self.qk_clip_tau < math.inf:
                _fail("qk_clip_tau", self.qk_clip_tau, "expected a positive max attention logit, or null (off)")
            if not self.diagnostics:
                _fail("qk_clip_tau", self.qk_clip_tau, "QK-clip reads the max attention logits that train.diagnostics "
                      "measures: set train.diagnostics=true, or qk_clip_tau=null")

    @classmethod
    def from_dict(cls, values: dict[str, Any] | None) -> TrainConfig:
        values = dict(values or {})
        check_keys("train", values, [f.name for f in dataclasses.fields(cls)])
        return cls(**_floats_from_strings(cls, values))

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["no_decay"] = list(self.no_decay)
        out["muon_groups"] = list(self.muon_groups)
        out["harness_tasks"] = list(self.harness_tasks)
        return out

    def replace(self, **changes: Any) -> TrainConfig:
        return dataclasses.replace(self, **changes)


def _floats_from_strings(cls, values: dict) -> dict:
    """YAML 1.1 reads `1e-3` (no dot) as a string: take such values of float fields as floats."""
    out = dict(values)
    for f in dataclasses.fields(cls):
        value = out.get(f.name)
        if isinstance(value, str) and "float" in str(f.type):
            try:
                out[f.name] = float(value)
            except ValueError:
                raise ValueError(f"{cls.__name__}.{f.name}={value!r} is invalid: expected a number") from None
    return out


@dataclass(frozen=True)
class RunConfig:
    """A whole run: the model, how to train it, and its data. `model_dict` may hold
    `vocab_size: auto` until the tokenizer is known (`with_vocab`)."""

    model_dict: dict
    train: TrainConfig
    data: DataConfig
    parallel: ParallelConfig = ParallelConfig()
    execution: ExecutionConfig = ExecutionConfig()
    lora: LoRAConfig | None = None  # a `lora:` section: train low-rank adapters on a frozen base
    # the training objective: its section's config (`dpo:`), or next-token's
    objective: objectives.Config = dataclasses.field(default_factory=lambda: objectives.config_of({}, None, ""))

    @property
    def model(self) -> ModelConfig:
        return ModelConfig.from_dict(self.model_dict)

    @property
    def vocab_size(self) -> int | None:
        value = self.model_dict.get("vocab_size", ModelConfig.vocab_size)
        return None if value == "auto" else value

    def with_vocab(self, vocab_size: int) -> RunConfig:
        if self.vocab_size is not None:
            return self
        return dataclasses.replace(self, model_dict={**self.model_dict, "vocab_size": vocab_size})

    def to_dict(self) -> dict:
        model = self.model.to_dict() if self.vocab_size is not None else dict(self.model_dict)
        return {"model": model, "execution": self.execution.to_dict(), "train": self.train.to_dict(),
                "data": self.data.to_dict(), "parallel": self.parallel.to_dict(),
                **({} if self.lora is None else {"lora": self.lora.to_dict()}),
                **({} if self.objective.section is None else {self.objective.section: self.objective.to_dict()})}


def run_config_from_dict(raw: dict, where: str = "config") -> RunConfig:
    """Validate every section; `model.vocab_size: auto` is checked once the tokenizer exists."""
    _check_sections(raw, where)
    if "model" not in raw:
        raise ValueError(f"{where}: no `model:` section")
    model, moved = split_moved(dict(raw.get("model") or {}), where)
    sections = {name: dict(raw.get(name) or {}) for name in ("execution", "parallel")}
    for section, values in moved.items():
        for key, value in values.items():
            if key in sections[section] and sections[section][key] != value:
                raise ValueError(f"{where}: model.{key}={value!r} and {section}.{key}={sections[section][key]!r} "
                                 f"disagree: {key} now lives in {section}, keep that one")
            sections[section].setdefault(key, value)
    train = TrainConfig.from_dict(raw.get("train"))
    data = DataConfig.from_dict(raw.get("data"))
    parallel = ParallelConfig.from_dict(sections["parallel"])
    execution = ExecutionConfig.from_dict(sections["execution"])
    if model.get("vocab_size") != "auto":
        model_cfg = ModelConfig.from_dict(model)  # validate now
    else:
        model_cfg = ModelConfig.from_dict({**model, "vocab_size": 1})
    if model_cfg.mtp_depth and parallel.stage > 1:
        raise ValueError(f"{where}: model.mtp_depth={model_cfg.mtp_depth} with parallel.stage={parallel.stage}: the "
                         f"pipeline schedules do not run the multi-token-prediction modules; use parallel.stage=1 "
                         f"or model.mtp_depth=0")
    if model_cfg.mtp_depth and parallel.context != 1 and parallel.context_layout != "contiguous":
        raise ValueError(f"{where}: model.mtp_depth={model_cfg.mtp_depth} with parallel.context={parallel.context} "
                         f"and parallel.context_layout={parallel.context_layout}: that layout reorders each sequence "
                         f"over the context axis, and the multi-token-prediction modules read token i + k by "
                         f"position; use parallel.context_layout=contiguous")
    P = model_cfg.max_position_embeddings
    if model_cfg.position_embedding == "learned" and train.seq_len > P:
        raise ValueError(f"{where}: train.seq_len={train.seq_len} exceeds model.max_position_embeddings={P} "
                         f"(learned positions have no row past it): lower train.seq_len")
    objective = objectives.config_of(raw, train, where)
    if data.sources is not None and objective.section is not None:
        raise ValueError(f"{where}: data.sources (a mixture) feeds the next-token objective, not "
                         f"{objective.section}: give its data as data.path")
    return RunConfig(model, train, data, parallel, execution, LoRAConfig.of_run(raw), objective)


def _check_sections(raw: dict, where: str) -> None:
    check_sections(raw, where, SECTIONS)


def load_run_config(path, overrides: list[str] = ()) -> RunConfig:
    """Read a run file (`model:`, `train:`, `data:`) and apply dotted overrides."""
    return run_config_from_dict(load_config_file(path, overrides), str(path))
