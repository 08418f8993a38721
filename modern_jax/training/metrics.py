"""Run outputs: a JSONL metrics log (and TensorBoard events when tensorboardX is installed),
the progress line, and the loss-curve PNG (matplotlib when installed, else a small
built-in PNG writer that draws the curves without text)."""

from __future__ import annotations

import json
import math
import pathlib
import struct
import sys
import time
import zlib


class MetricsLog:
    """One JSON object per line in `metrics.jsonl`: `{"step": .., "split": "train"|"val", ...}`."""

    def __init__(self, directory, tensorboard: bool = True):
        self.path = pathlib.Path(directory) / "metrics.jsonl"
        self.file = self.path.open("a")
        self.writer = None
        if tensorboard:
            try:
                from tensorboardX import SummaryWriter
            except ImportError:
                pass
            else:
                self.writer = SummaryWriter(str(pathlib.Path(directory) / "tensorboard"))

    def write(self, step: int, split: str, values: dict) -> None:
        record = {"step": step, "split": split, **{k: _plain(v) for k, v in values.items()}}
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.writer is not None:
            for k, v in values.items():
                if isinstance(v, (int, float)) and math.isfinite(v):
                    self.writer.add_scalar(f"{split}/{k}", v, step)

    def close(self) -> None:
        self.file.close()
        if self.writer is not None:
            self.writer.close()


def _plain(v):
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def read_metrics(path) -> list[dict]:
    path = pathlib.Path(path)
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()] if path.exists() else []


class Progress:
    """`step 120/2000 [####......] loss 2.345 | 58.1k tok/s | ETA 0:32`, redrawn in place on a
    terminal, printed at log steps otherwise."""

    def __init__(self, total: int, start: int, enabled: bool = True, stream=None):
        self.total, self.start, self.enabled = total, start, enabled
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.t0 = time.perf_counter()

    def update(self, step: int, loss: float, tokens_per_s: float) -> None:
        if not self.enabled:
            return
        done = (step - self.start) / max(self.total - self.start, 1)
        elapsed = time.perf_counter() - self.t0
        eta = elapsed / done * (1 - done) if done > 0 else 0.0
        width = 24
        bar = "#" * int(width * step / self.total) + "." * (width - int(width * step / self.total))
        line = (f"step {step}/{self.total} [{bar}] loss {loss:.4f} | {tokens_per_s / 1e3:.1f}k tok/s | "
                f"ETA {_clock(eta)}")
        if self.tty:
            self.stream.write("\r" + line + "\x1b[K")
        else:
            self.stream.write(line + "\n")
        self.stream.flush()

    def message(self, text: str) -> None:
        if self.tty and self.enabled:
            self.stream.write("\r\x1b[K")
        print(text, file=self.stream, flush=True)

    def close(self) -> None:
        if self.tty and self.enabled:
            self.stream.write("\n")
            self.stream.flush()


def _clock(seconds: float) -> str:
    seconds = int(seconds)
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


# ----- the loss curve --------------------------------------------------------------


def plot_losses(records: list[dict], path) -> str:
    """Write the train / validation loss curves to `path`; returns which writer drew it."""
    train = [(r["step"], r["loss"]) for r in records if r["split"] == "train" and _finite(r.get("loss"))]
    val = [(r["step"], r["loss"]) for r in records if r["split"] == "val" and _finite(r.get("loss"))]
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        write_line_png(path, [(train, (31, 119, 180)), (val, (255, 127, 14))])
        return "builtin"
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=110)
    if train:
        ax.plot(*zip(*train), label="train")
    if val:
        ax.plot(*zip(*val), "o-", label="validation")
    ax.set_xlabel("step")
    ax.set_ylabel("loss (nats / token)")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return "matplotlib"


def _finite(v) -> bool:
    return isinstance(v, (int, float)) and math.isfinite(v)


def write_line_png(path, series, width: int = 640, height: int = 400) -> None:
    """A plain RGB PNG: a frame, quarter gridlines and each series as a polyline (x: step, y: value)."""
    pixels = bytearray(b"\xff" * (width * height * 3))
    left, right, top, bottom = 40, width - 20, 20, height - 30
    points = [p for s, _ in series for p in s]

    def put(x, y, color):
        if 0 <= x < width and 0 <= y < height:
            i = 3 * (y * width + x)
            pixels[i : i + 3] = bytes(color)

    def line(x0, y0, x1, y1, color):
        n = max(abs(x1 - x0), abs(y1 - y0), 1)
        for k in range(n + 1):
            put(round(x0 + (x1 - x0) * k / n), round(y0 + (y1 - y0) * k / n), color)

    for k in range(5):  # frame and gridlines
        gray = (0, 0, 0) if k in (0, 4) else (220, 220, 220)
        y = top + (bottom - top) * k // 4
        x = left + (right - left) * k // 4
        line(left, y, right, y, gray)
        line(x, top, x, bottom, gray)
    if points:
        x_lo, x_hi = min(p[0] for p in points), max(p[0] for p in points)
        y_lo, y_hi = min(p[1] for p in points), max(p[1] for p in points)
        sx = (right - left) / max(x_hi - x_lo, 1e-9)
        sy = (bottom - top) / max(y_hi - y_lo, 1e-9)
        to_px = lambda p: (round(left + (p[0] - x_lo) * sx), round(bottom - (p[1] - y_lo) * sy))  # noqa: E731
        for data, color in series:
            pts = [to_px(p) for p in data]
            for a, b in zip(pts, pts[1:]):
                line(*a, *b, color)
            for x, y in pts if len(pts) < 50 else ():
                for dx in (-1, 0, 1):
                    for dy in (-1, 0, 1):
                        put(x + dx, y + dy, color)
    raw = b"".join(b"\x00" + bytes(pixels[3 * width * y : 3 * width * (y + 1)]) for y in range(height))

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 6)) + chunk(b"IEND", b""))
    pathlib.Path(path).write_bytes(png)
