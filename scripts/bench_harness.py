"""Wall time of `modern-jax harness` beside lm-eval's own `hf` backend (transformers on PyTorch),
on the same model, tasks and CPU, side by side; and whether their figures agree.

    uv run python scripts/bench_harness.py --hf-python .hfvenv/bin/python
    uv run python scripts/bench_harness.py --hf-python .hfvenv/bin/python --model tests/fixtures/hf_chat \\
        --tasks sums_choice sums_answer sums_text --limit 81 --batch-size 16 --repeats 2

Each side runs as a whole command in a fresh process (imports, reading and converting the
model, compiling, scoring, writing lm-eval's files), alternately, `--repeats` times; the best
of each is printed with their ratio. Ours runs twice a round: cold, with an empty compilation
cache (MODERN_JAX_COMPILE_CACHE), as a first run anywhere; and warm, reading the programs the
first cold run kept, as the same command again does. The reference interpreter needs lm-eval, torch and
transformers (see scripts/make_hf_fixtures.py); `--threads` pins both to the same CPU threads.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from modern_jax.cli.shared import COMPILE_CACHE_ENV

ROOT = Path(__file__).resolve().parent.parent


def timed(command: list[str], env: dict) -> float:
    start = time.perf_counter()
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        sys.exit(f"{' '.join(command[:4])} ... failed:\n{done.stderr[-3000:]}")
    return wall


def metrics(out: Path) -> dict:
    results = json.loads(Path(sorted(glob.glob(str(out / "*" / "results_*.json")))[-1]).read_text())
    return {f"{task}/{k.split(',')[0]}": v for task, values in results["results"].items() for k, v in values.items()
            if k != "alias" and "stderr" not in k and isinstance(v, (int, float))}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--hf-python", required=True, help="an interpreter with lm-eval, torch and transformers")
    parser.add_argument("--model", default="tests/fixtures/hf_chat")
    parser.add_argument("--tasks", nargs="+", default=["sums_choice", "sums_answer", "sums_text"])
    parser.add_argument("--include-path", default="configs/harness")
    parser.add_argument("--limit", type=int, help="documents per task (default: all)")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, help="CPU threads for both (default: what each takes)")
    args = parser.parse_args(argv)
    env = {**os.environ, "HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    env.pop("JAX_COMPILATION_CACHE_DIR", None)  # jax's own would take the place of ours
    if args.threads:
        env.update(OMP_NUM_THREADS=str(args.threads), MKL_NUM_THREADS=str(args.threads),
                   XLA_FLAGS=f"{env.get('XLA_FLAGS', '')} --xla_cpu_multi_thread_eigen=true "
                             f"intra_op_parallelism_threads={args.threads}".strip())
    limit = [] if args.limit is None else ["--limit", str(args.limit)]
    with tempfile.TemporaryDirectory() as tmp:
        ours_out, theirs_out = Path(tmp) / "ours", Path(tmp) / "theirs"
        ours = [sys.executable, "-m", "modern_jax.cli", "harness", "--hf", args.model, "--tasks", *args.tasks,
                "--include-path", args.include_path, "--batch-size", str(args.batch_size), *limit,
                "--output-path", str(ours_out)]
        theirs = [args.hf_python, "-m", "lm_eval", "run", "--model", "hf", "--model_args", f"pretrained={args.model}",
                  "dtype=float32", "--device", "cpu", "--tasks", *args.tasks, "--include_path", args.include_path,
                  "--batch_size", str(args.batch_size), *limit, "--output_path", str(theirs_out)]
        cold, warm, hf = "modern-jax harness, cold", "modern-jax harness, warm", "lm-eval hf backend"
        walls = {cold: [], warm: [], hf: []}
        kept = Path(tmp) / "kept"  # the programs of the first cold run, read by every warm one
        for i in range(args.repeats):
            walls[cold].append(timed(ours, {**env, COMPILE_CACHE_ENV: str(kept if i == 0 else Path(tmp) / f"cold{i}")}))
            walls[warm].append(timed(ours, {**env, COMPILE_CACHE_ENV: str(kept)}))
            walls[hf].append(timed(theirs, env))
        ours_m, theirs_m = metrics(ours_out), metrics(theirs_out)
    print(f"model {args.model}, tasks {' '.join(args.tasks)}, limit {args.limit}, batch size {args.batch_size}, "
          f"{os.cpu_count()} CPUs")
    for name, values in walls.items():
        print(f"{name:26s} best {min(values):7.2f} s   ({', '.join(f'{v:.2f}' for v in values)})")
    for name in (cold, warm):
        print(f"ratio ({name.split(', ')[1]} / lm-eval hf): {min(walls[name]) / min(walls[hf]):.2f}")
    worst = max(abs(ours_m[k] - v) / max(abs(v), 1e-12) for k, v in theirs_m.items() if k in ours_m)
    print(f"metrics: {len(theirs_m)} of lm-eval's, largest relative difference {worst:.2e}")


if __name__ == "__main__":
    main()
