"""`modern-jax prepare`: tokenize a text corpus once into token shards with their index.

    modern-jax prepare --data corpus/*.jsonl --out shards/ [--documents-per-shard 10000] [data.tokenizer_path=...]

Run by several processes (`--num-processes N --process-id I`, or JAX_NUM_PROCESSES and
JAX_PROCESS_ID from a launcher), each tokenizes its share of the shards; started again after a
kill, it skips the shards already written (`modern_jax.data.prepare`). Train on the output
with `--data shards/`.
"""

from __future__ import annotations

import os

from modern_jax.cli.shared import _check_flags, _overrides, _positive


def add_parser(subparsers) -> None:
    prepare = subparsers.add_parser("prepare", help="tokenize a text corpus once into token shards with their index")
    prepare.add_argument("--data", required=True, help="the corpus: a file, directory or glob (any data.source)")
    prepare.add_argument("--out", required=True, help="the directory of the shards (new, or one prepare began)")
    prepare.add_argument("--documents-per-shard", type=int, default=10_000, help="documents in each shard")
    prepare.add_argument("--num-processes", type=int, help="processes sharing the work (default JAX_NUM_PROCESSES, 1)")
    prepare.add_argument("--process-id", type=int, help="this process's index (default JAX_PROCESS_ID, 0)")
    _overrides(prepare, "data.text_field=content data.tokenizer_path=tokenizer.json")
    prepare.set_defaults(func=run)


def run(args) -> None:
    from modern_jax.configfile import apply_overrides
    from modern_jax.data.config import DataConfig
    from modern_jax.data.prepare import prepare

    count = args.num_processes if args.num_processes is not None else int(os.environ.get("JAX_NUM_PROCESSES", 1))
    index = args.process_id if args.process_id is not None else int(os.environ.get("JAX_PROCESS_ID", 0))
    args.num_processes, args.process_id = count, index
    _check_flags(args, _positive("--documents-per-shard"), _positive("--num-processes"))
    if not 0 <= index < count:
        raise ValueError(f"--process-id {index} is not one of the {count} processes: give 0 to {count - 1}")
    raw = apply_overrides({"data": {"path": str(args.data)}}, args.overrides, sections=("data",))
    prepare(DataConfig.from_dict(raw["data"]), args.out, documents_per_shard=args.documents_per_shard,
            process_id=index, num_processes=count)
