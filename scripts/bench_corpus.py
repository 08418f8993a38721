"""Benchmark training on token shards: start-up time and peak RSS against the corpus's size.

    uv run python scripts/bench_corpus.py                        # 1e8, 1e9, 1e10 tokens (about 20 GB under /tmp)
    uv run python scripts/bench_corpus.py --sizes 1e6 1e8 --root /tmp/corpus_bench
    uv run python scripts/bench_corpus.py --format arrayrecord --sizes 1e7 1e8 1e9   # ArrayRecord token records
    uv run python scripts/bench_corpus.py --format jsonl --sizes 1e8 1e9             # JSON Lines (or parquet) text

Makes, under `--root`, a corpus of each size as 64 shards of uint16 ids (a random block
repeated, documents ending at id 258, the byte tokenizer's `<eos>`; with `--format
arrayrecord`, ArrayRecord shards of one document of 1,000 ids a record; with `jsonl` or `parquet`,
documents of 1,000 bytes of text, byte-level), unless it is there
already, and a one-shard corpus of 1e5 ids (the baseline: the model, its optimizer and the
runtime). After a warm-up run that fills the compilation cache, each corpus is trained on by `modern-jax train` (configs/tiny.yaml, a few steps, a
small evaluation) in a fresh process; the script prints side by side the process's wall time
(start-up and compilation dominate it), its peak RSS, and both as ratios to the smallest
corpus's, and the peak RSS beyond the baseline's.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parent.parent
SHARDS, BLOCK, SEPARATOR = 64, 1 << 22, 258


def begun(directory: pathlib.Path) -> bool:
    """False when `directory` holds a corpus made whole before; else True, with it empty and ready."""
    if (directory / ".complete").exists():
        return False
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    return True


def make_corpus(directory: pathlib.Path, n_tokens: int, shards: int) -> None:
    """`shards` files of uint16 ids, `n_tokens` in all: a random block (documents of about 1,000
    ids ending at SEPARATOR) written again and again."""
    if not begun(directory):
        return
    rng = np.random.default_rng(0)
    block = rng.integers(0, 256, BLOCK, dtype=np.uint16)
    block[rng.integers(0, BLOCK, BLOCK // 1000)] = SEPARATOR
    per_shard = [n_tokens // shards + (i < n_tokens % shards) for i in range(shards)]
    for i, n in enumerate(per_shard):
        with open(directory / f"part-{i:05d}.bin", "wb") as f:
            for at in range(0, n, BLOCK):
                f.write(block[: min(BLOCK, n - at)].tobytes())
    (directory / ".complete").write_text("")


def make_records(directory: pathlib.Path, n_tokens: int, shards: int) -> None:
    """`shards` ArrayRecord files of records of 1,000 uint16 ids, `n_tokens` in all."""
    from array_record.python.array_record_module import ArrayRecordWriter

    if not begun(directory):
        return
    records = np.random.default_rng(0).integers(0, 256, (1024, 1000), dtype=np.uint16)
    per_shard = [n_tokens // 1000 // shards + (i < n_tokens // 1000 % shards) for i in range(shards)]
    for i, n in enumerate(per_shard):
        writer = ArrayRecordWriter(str(directory / f"part-{i:05d}.array_record"), "group_size:64")
        for j in range(max(n, 1)):
            writer.write(records[j % len(records)].tobytes())
        writer.close()
    (directory / ".complete").write_text("")


def make_text(directory: pathlib.Path, n_tokens: int, shards: int, kind: str) -> None:
    """`shards` JSON Lines or Parquet files of text documents of about 1,000 bytes (byte-level
    tokens), `n_tokens` bytes of text in all (Parquet in row groups of 1,000 rows)."""
    if not begun(directory):
        return
    rng = np.random.default_rng(0)
    letters = np.frombuffer(b"abcdefghijklmnopqrstuvwxyz     ", np.uint8)
    texts = [letters[rng.integers(0, len(letters), 1000)].tobytes().decode() for _ in range(1024)]
    per_shard = [n_tokens // 1000 // shards + (i < n_tokens // 1000 % shards) for i in range(shards)]
    for i, n in enumerate(per_shard):
        rows = [texts[j % len(texts)] for j in range(max(n, 1))]
        if kind == "jsonl":
            with open(directory / f"part-{i:05d}.jsonl", "w") as f:
                for at in range(0, len(rows), 1024):
                    f.write("".join(json.dumps({"id": at + j, "text": t}) + "\n" for j, t in enumerate(rows[at:at + 1024])))
        else:
            import pyarrow as pa
            import pyarrow.parquet as pq

            pq.write_table(pa.table({"text": rows}), directory / f"part-{i:05d}.parquet", row_group_size=1000)
    (directory / ".complete").write_text("")


def train(data: pathlib.Path, out: pathlib.Path, steps: int, kind: str) -> tuple[float, float]:
    """(wall seconds, peak RSS in GiB) of `modern-jax train` on `data` in a fresh process."""
    shutil.rmtree(out, ignore_errors=True)
    command = [sys.executable, "-m", "modern_jax.cli", "train", "--config", str(ROOT / "configs/tiny.yaml"),
               "--data", str(data), "--output-dir", str(out), f"train.steps={steps}", "train.eval_every=0",
               "train.final_eval_windows=64", "train.warmup_steps=1", "train.plot=false", "train.samples=0", "train.progress=false",
               "train.checkpoint_every=0"] + {"arrayrecord": ["data.record_format=tokens"],
                                              "tokens": [f"data.doc_separator_id={SEPARATOR}"]}.get(kind, [])
    start = time.perf_counter()
    child = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             env={**os.environ, "MODERN_JAX_ALONE": "1"})
    _, status, usage = os.wait4(child.pid, 0)
    wall = time.perf_counter() - start
    if status:
        raise SystemExit(f"training on {data} failed:\n{child.stderr.read().decode()[-3000:]}")
    return wall, usage.ru_maxrss / 2**20  # ru_maxrss is in KiB on Linux


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", type=float, default=[1e8, 1e9, 1e10], help="tokens of each corpus")
    parser.add_argument("--root", type=pathlib.Path, default=pathlib.Path("/tmp/corpus_bench"))
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--keep", action="store_true", help="keep the corpora (default: removed at the end)")
    parser.add_argument("--format", choices=("tokens", "arrayrecord", "jsonl", "parquet"), default="tokens",
                        help="token files (.bin), ArrayRecord shards of token records, or JSON Lines or Parquet "
                             "shards of text")
    args = parser.parse_args()
    make = {"tokens": make_corpus, "arrayrecord": make_records,
            "jsonl": lambda d, n, k: make_text(d, n, k, "jsonl"),
            "parquet": lambda d, n, k: make_text(d, n, k, "parquet")}[args.format]
    free = shutil.disk_usage(args.root.parent).free
    need = sum(2 * int(n) for n in args.sizes)
    if need > free:
        raise SystemExit(f"the corpora take {need / 1e9:.1f} GB and {args.root.parent} has {free / 1e9:.1f} GB free: "
                         f"give smaller --sizes")
    baseline = args.root / f"baseline-{args.format}"
    make(baseline, 100_000, 1)
    for n in args.sizes:
        began = time.perf_counter()
        make(args.root / f"{args.format}-{int(n):d}", int(n), SHARDS)
        print(f"corpus of {n:.0e} tokens in {SHARDS} shards: ready in {time.perf_counter() - began:.0f} s", flush=True)
    train(baseline, args.root / "run-warm-up", args.steps, args.format)  # fills the compilation cache: every run below reads it
    rows = [("1e5 (1 shard, baseline)", *train(baseline, args.root / "run-baseline", args.steps, args.format))]
    for n in args.sizes:
        rows.append((f"{n:.0e}", *train(args.root / f"{args.format}-{int(n):d}", args.root / f"run-{int(n)}",
                                        args.steps, args.format)))
    first_wall, first_rss = rows[1][1], rows[1][2]
    print(f"\n{'tokens':>24} {'wall s':>8} {'x first':>8} {'peak RSS GiB':>13} {'x first':>8} {'beyond baseline GiB':>20}")
    for name, wall, rss in rows:
        print(f"{name:>24} {wall:8.1f} {wall / first_wall:8.2f} {rss:13.2f} {rss / first_rss:8.2f} "
              f"{rss - rows[0][2]:20.2f}")
    if not args.keep:
        shutil.rmtree(args.root, ignore_errors=True)


if __name__ == "__main__":
    main()
