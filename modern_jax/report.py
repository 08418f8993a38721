"""Timing, tables and plots for the benchmark and experiment scripts: Markdown + CSV, and a
matplotlib PNG."""

from __future__ import annotations

import csv
import pathlib
import statistics
import time


def median_seconds(fn, *args, repeats: int) -> float:
    """Median wall time of `fn(*args)` over `repeats` calls, after one call to compile and warm up."""
    import jax

    jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def fmt(value) -> str:
    if isinstance(value, float):
        return f"{value:.3g}" if (value != 0 and (abs(value) < 1e-2 or abs(value) >= 1e5)) else f"{value:.4f}"
    return str(value)


def write_table(rows: list[dict], directory, name: str, title: str = "") -> pathlib.Path:
    """Write `rows` (dicts with the same keys) as `name.md` and `name.csv`; return the .md path."""
    directory = pathlib.Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    keys = list(rows[0])
    with open(directory / f"{name}.csv", "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=keys)
        writer.writeheader()
        writer.writerows(rows)
    lines = ([f"### {title}", ""] if title else []) + ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(fmt(row[k]) for k in keys) + " |" for row in rows]
    path = directory / f"{name}.md"
    path.write_text("\n".join(lines) + "\n")
    return path


def pyplot():
    """matplotlib.pyplot with the headless Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path) -> None:
    """Lay out and write a matplotlib figure as a PNG (110 dpi), and say so."""
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    print(f"wrote {path}")
