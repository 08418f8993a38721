"""lm-eval's own `hf` backend (transformers on PyTorch, CPU) on the local benchmark tasks: the
reference figures that tests/test_harness.py holds `modern-jax harness` to.

Runs in the reference environment of scripts/make_hf_fixtures.py, with lm-eval added (torch is
never a dependency of modern_jax):

    .hfvenv/bin/pip install lm_eval
    .hfvenv/bin/python scripts/make_harness_fixtures.py     # tests/fixtures/harness/hf_chat.json
    .hfvenv/bin/python scripts/make_harness_fixtures.py --model DIR --out FILE.json [--limit 12] [--tasks ...]

Writes one JSON file: the versions, the settings (model directory, tasks, include path, limit,
few-shot, batch size), lm-eval's metrics of each task (`task/metric`), every document's responses
(`samples[task]`: doc_id and resps, the log-likelihoods with their greedy flags, the generated
texts, the rolling log-likelihoods) and the wall time of `simple_evaluate`. The data paths of the
tasks are relative to the repository root, where this runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
TASKS = ("sums_choice", "sums_answer", "sums_text")
INCLUDE = "configs/harness"


def flat_metrics(results: dict) -> dict:
    out = {}
    for task, values in results["results"].items():
        for key, value in values.items():
            metric, _, filt = key.partition(",")
            if key != "alias" and "_stderr" not in metric and isinstance(value, (int, float)):
                out[f"{task}/{metric if filt in ('', 'none') else metric + '_' + filt}"] = float(value)
    return out


def run(model: str, tasks, limit, num_fewshot, batch_size: int) -> dict:
    import lm_eval
    import torch
    import transformers
    from lm_eval.tasks import TaskManager

    os.chdir(ROOT)
    start = time.perf_counter()
    results = lm_eval.simple_evaluate(model="hf", model_args={"pretrained": model, "dtype": "float32"},
                                      tasks=list(tasks), task_manager=TaskManager(include_path=INCLUDE), limit=limit,
                                      num_fewshot=num_fewshot, batch_size=batch_size, log_samples=True,
                                      device="cpu", random_seed=0, numpy_random_seed=0, torch_random_seed=0,
                                      fewshot_random_seed=0)
    wall = time.perf_counter() - start
    samples = {task: [{"doc_id": s["doc_id"], "resps": s["resps"]} for s in rows]
               for task, rows in results["samples"].items()}
    return {"lm_eval": lm_eval.__version__, "transformers": transformers.__version__, "torch": torch.__version__,
            "settings": {"model": model, "tasks": list(tasks), "include_path": INCLUDE, "limit": limit,
                         "num_fewshot": num_fewshot, "batch_size": batch_size},
            "metrics": flat_metrics(results), "samples": samples, "wall_s": wall}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tests/fixtures/hf_chat", help="a Hugging Face model directory")
    parser.add_argument("--out", type=Path, default=ROOT / "tests" / "fixtures" / "harness" / "hf_chat.json")
    parser.add_argument("--tasks", nargs="+", default=TASKS)
    parser.add_argument("--limit", type=float, default=12)
    parser.add_argument("--num-fewshot", type=int)
    parser.add_argument("--batch-size", type=int, default=8)
    args = parser.parse_args(argv)
    model = str(Path(args.model).resolve().relative_to(ROOT)) if Path(args.model).resolve().is_relative_to(ROOT) \
        else str(Path(args.model).resolve())
    out = run(model, args.tasks, int(args.limit) if args.limit >= 1 else args.limit, args.num_fewshot,
              args.batch_size)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps(out["metrics"], indent=1))
    print(f"wall_s: {out['wall_s']:.2f}")


if __name__ == "__main__":
    sys.exit(main())
