"""A small arithmetic set for reinforcement learning with a verifiable reward (configs/grpo.yaml):
one record per sum `a + b` of two numbers in [0, --largest], the question as a conversation
(a system message, then the user's question) or as text, and `answer`, the sum as a number,
which `configs/rewards.py:exact_answer` checks.

    uv run python scripts/make_arithmetic.py --out data/arithmetic.jsonl            # in words
    uv run python scripts/make_arithmetic.py --out data/arithmetic.jsonl --digits   # 3 plus 4

In words (the default) the questions use the vocabulary of the tiny chat model in
tests/fixtures/hf_chat ("what is two plus four"); with --digits they are written in digits.
The records come in a fixed order (--seed shuffles them reproducibly).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import random

WORDS = ("zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
         "seventeen eighteen").split()


def records(largest: int, digits: bool, seed: int) -> list[dict]:
    name = str if digits else WORDS.__getitem__
    rows = [{"prompt": [{"role": "system", "content": "you are a calculator"},
                        {"role": "user", "content": f"what is {name(a)} plus {name(b)}"}],
             "answer": a + b} for a in range(largest + 1) for b in range(largest + 1)]
    random.Random(seed).shuffle(rows)
    return rows


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, required=True, help="the .jsonl file to write (a new one)")
    parser.add_argument("--largest", type=int, default=9, help="the largest term (default 9: sums up to 18)")
    parser.add_argument("--digits", action="store_true", help="write the numbers in digits, not words")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if not 0 <= args.largest <= (10**6 if args.digits else 9):
        parser.error(f"--largest {args.largest}: expected 0 to {10**6 if args.digits else 9} (in words the sums end "
                     f"at eighteen)")
    if args.out.exists():
        parser.error(f"--out {args.out} exists: give a new file")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    rows = records(args.largest, args.digits, args.seed)
    args.out.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"{args.out}: {len(rows)} sums")


if __name__ == "__main__":
    main()
