"""Run outputs: `metrics.jsonl` (one JSON object per line), TensorBoard events (tensorboardX,
under `tensorboard/`), Weights & Biases when `train.wandb_project` is set, the progress bar
(rich) and the labelled loss plot (matplotlib); `Shown`, what an objective shows on the last two."""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import pathlib
import secrets
import sys
import time

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_DIR = "tensorboard"
WANDB_ID_FILE = "wandb_run_id"  # a resumed run logs on to the same W&B run


class MetricsLog:
    """`{"step": .., "split": "train"|"val", ...}` per line in `metrics.jsonl`; the same scalars
    as `split/name` to TensorBoard (`tensorboard`) and to W&B (`wandb_project`, logged with
    `config`, the run's resolved config)."""

    def __init__(self, directory, *, tensorboard: bool = True, wandb_project: str | None = None,
                 config: dict | None = None):
        directory = pathlib.Path(directory)
        self.file = (directory / METRICS_FILE).open("a")
        self.writer = self.wandb = None
        if tensorboard:
            from tensorboardX import SummaryWriter

            self.writer = SummaryWriter(str(directory / TENSORBOARD_DIR))
        if wandb_project:
            self.wandb = _wandb_run(directory, wandb_project, config)

    def write(self, step: int, split: str, values: dict) -> None:
        record = {"step": step, "split": split, **{k: _plain(v) for k, v in values.items()}}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        scalars = {f"{split}/{k}": v for k, v in values.items() if _finite(v) and not isinstance(v, bool)}
        if self.writer is not None:
            for name, v in scalars.items():
                self.writer.add_scalar(name, v, step)
            self.writer.flush()  # a log step is rare; a killed run keeps its events
        if self.wandb is not None:
            self.wandb.log(scalars, step=step)

    def close(self) -> None:
        self.file.close()
        if self.writer is not None:
            self.writer.close()
        if self.wandb is not None:
            self.wandb.finish()


def _wandb_run(directory: pathlib.Path, project: str, config: dict | None):
    import wandb  # TrainConfig checked that it is installed

    id_file = directory / WANDB_ID_FILE
    run_id = id_file.read_text().strip() if id_file.is_file() else secrets.token_hex(4)
    id_file.write_text(run_id + "\n")
    return wandb.init(project=project, id=run_id, resume="allow", name=directory.name, dir=str(directory),
                      config=config)


def _plain(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def read_metrics(path) -> list[dict]:
    path = pathlib.Path(path)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


@dataclasses.dataclass(frozen=True)
class Shown:
    """What the console and the plot show of an objective, read by `Progress`, the loop's lines
    and `loss_figure`; each objective provides its own (`training.loss`), so neither asks which
    objective runs.

    `loss_label`: the loss axis. `console`: `(metric, label)` after the loss on each line that
    has the metric (a step's, a validation's, the run's last). `panels`: `(y label, ((metric,
    legend), ...))`, a plot panel each, under the loss."""

    loss_label: str
    console: tuple[tuple[str, str], ...] = ()
    panels: tuple[tuple[str, tuple[tuple[str, str], ...]], ...] = ()

    def values(self, record: dict) -> dict[str, float]:
        """`{label: value}` of the console's metrics that `record` holds, in order."""
        return {label: record[name] for name, label in self.console if name in record}

    def line(self, record: dict, prefix: str = "") -> str:
        """` | margin 0.0123 | accuracy 0.7500`: the console's metrics of `record` (`prefix`: `val_`)."""
        return "".join(f" | {prefix}{label} {value:.4f}" for label, value in self.values(record).items())


class Progress:
    """On a terminal, a rich progress bar `step ━━━━━━╸━━━━ 120/2000 loss 2.3450 | 58.1k tok/s |
    ETA 0:32`, redrawn in place, and under it a second one while a long part of the run goes on
    (`phase`: an evaluation's batches, a compilation); elsewhere (a log file, a pipe) the step's
    figures as a plain line at each log step, and the phases silent (the line that reports what
    each one found follows it). `total` None: no step bar, only phases (`evaluate`)."""

    def __init__(self, total: int | None, start: int = 0, enabled: bool = True, stream=None):
        self.total, self.start, self.enabled = total, start, enabled
        self.stream = stream or sys.stderr
        self.t0 = time.perf_counter()
        self.bar = None
        if enabled and self.stream.isatty():
            from rich.console import Console
            from rich.progress import BarColumn, TextColumn
            from rich.progress import Progress as Bar

            self.bar = Bar(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[count]}"),
                           TextColumn("{task.fields[info]}"), console=Console(file=self.stream), auto_refresh=False)
            if total is not None:
                self.task = self.bar.add_task("step", total=total, completed=start, count=f"{start}/{total}", info="")
            self.bar.start()

    def update(self, step: int, loss: float, tokens_per_s: float, figures: str = "") -> None:
        """The step bar at `step`, with the loss and `figures`, the objective's own (`Shown.line`)."""
        if not self.enabled:
            return
        done = (step - self.start) / max(self.total - self.start, 1)
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / done * (1 - done) if done > 0 else 0.0
        info = f"loss {loss:.4f}{figures} | {tokens_per_s / 1e3:.1f}k tok/s | ETA {_clock(eta)}"
        if self.bar is not None:
            self.bar.update(self.task, completed=step, count=f"{step}/{self.total}", info=info, refresh=True)
        else:
            print(f"step {step}/{self.total} | {info}", file=self.stream, flush=True)

    @contextlib.contextmanager
    def phase(self, what: str, total: int | None = None, unit: str = ""):
        """While inside, on a terminal: a line `what ━━━━╸━━━ 3/16 batches | ETA 0:04` under the
        step bar, moved one `unit` on by each call of the function it yields (`total` None: a
        part with no count, such as a compilation: the line says what runs until it ends); elsewhere
        the function does nothing."""
        if self.bar is None:
            yield lambda: None
            return
        t0, done = time.perf_counter(), 0
        counted = lambda: f"{done}/{total} {unit}".rstrip() if total else ""  # noqa: E731
        task = self.bar.add_task(what, total=total, count=counted(), info="")
        self.bar.refresh()

        def advance() -> None:
            nonlocal done
            done += 1
            eta = (time.perf_counter() - t0) / done * (total - done) if total else 0.0
            self.bar.update(task, completed=done, count=counted(), info=f"ETA {_clock(eta)}" if total else "",
                            refresh=True)

        try:
            yield advance
        finally:
            if self.bar is not None:
                self.bar.remove_task(task)
                self.bar.refresh()

    def message(self, text: str) -> None:
        """A line above the bar (or a plain line)."""
        if self.bar is not None:
            self.bar.console.print(text, markup=False, highlight=False)
        else:
            print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()
            self.bar = None

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


# ----- the loss curve --------------------------------------------------------------


def _series(records: list[dict], split: str, name: str) -> list[tuple[int, float]]:
    return [(r["step"], r[name]) for r in records if r["split"] == split and _finite(r.get(name))]


def loss_figure(records: list[dict], shown: Shown, title: str = ""):
    """A matplotlib `Figure` of `records` (from `read_metrics`) against the step: the train and
    validation losses, the axis labelled by `shown.loss_label`, then a panel for each of
    `shown.panels` (a line per metric, validation as points), each labelled, with a legend; no
    pyplot, so no global backend."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(7, 4.2 + 2.8 * len(shown.panels)), dpi=110)
    axes = fig.subplots(1 + len(shown.panels), 1, squeeze=False, sharex=True)[:, 0]
    panels = (((shown.loss_label, (("loss", "train"),)),) + shown.panels)
    for ax, (label, metrics) in zip(axes, panels):
        for name, legend in metrics:
            train, val = _series(records, "train", name), _series(records, "val", name)
            colour = {"color": ax.plot(*zip(*train), label=legend)[0].get_color()} if train else {}
            if val:  # beside the loss's `train`, `validation`; else in its train line's colour
                ax.plot(*zip(*val), "o-" if legend == "train" else "o--", **({} if legend == "train" else colour),
                        label="validation" if legend == "train" else f"{legend} (validation)")
        if ax is axes[0]:  # a mixture: each source's validation loss
            for split in sorted({r["split"] for r in records if r.get("split", "").startswith("val/")}):
                points = _series(records, split, "loss")
                if points:
                    ax.plot(*zip(*points), "o:", label=f"validation: {split[4:]}")
        ax.set_ylabel(label)
        ax.grid(alpha=0.3)
        if ax.lines:
            ax.legend()
    axes[0].set_title(title)
    axes[-1].set_xlabel("step")  # the panels share it
    fig.tight_layout()
    return fig


def plot_losses(records: list[dict], path, shown: Shown, title: str = ""):
    """Write `loss_figure(records, shown, title)` to `path` as a PNG; returns the figure."""
    fig = loss_figure(records, shown, title)
    fig.savefig(path)
    return fig
