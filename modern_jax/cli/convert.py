"""`modern-jax convert`: a Hugging Face checkpoint <-> a modern_jax (Orbax) checkpoint, and a LoRA
run's adapters in PEFT's format.

    modern-jax convert --from-hf HF_DIR --out CKPT  |  --to-hf CKPT --out HF_DIR [--model-type llama]
"""

from __future__ import annotations

from modern_jax.cli.shared import _note


def add_parser(subparsers) -> None:
    co = subparsers.add_parser("convert", help="Hugging Face checkpoint <-> modern_jax (Orbax) checkpoint")
    co.add_argument("--from-hf", help="a Hugging Face model directory (config.json + safetensors) or a hub name "
                                      "(org/name, from the local cache)")
    co.add_argument("--to-hf", help="a converted checkpoint, a run directory or a step directory (a LoRA run: "
                                    "its adapters merged into the base)")
    co.add_argument("--to-peft", help="a LoRA run or a step of one: write its adapters in PEFT's format")
    co.add_argument("--out", required=True, help="the directory to write: new or empty (see --overwrite)")
    co.add_argument("--overwrite", action="store_true",
                    help="replace --out if it holds an earlier conversion of the same kind (never a training run)")
    co.add_argument("--model-type", help="--to-hf / --to-peft: the Hugging Face family to write (default: the "
                                         "source's)")
    co.add_argument("--dtype", choices=("float32", "bfloat16"), help="parameter dtype (default: float32 / as stored)")
    co.set_defaults(func=run)


def run(args) -> int:
    from modern_jax.convert import convert_from_hf, convert_to_hf
    from modern_jax.convert.conversions import convert_to_peft

    from modern_jax.training import outputs

    if sum(map(bool, (args.from_hf, args.to_hf, args.to_peft))) != 1:
        raise ValueError("give exactly one of --from-hf HF_DIR, --to-hf CHECKPOINT or --to-peft RUN")
    if args.from_hf:  # Orbax writes object storage itself, each process its shards
        convert_from_hf(args.from_hf, args.out, dtype=args.dtype or "float32", overwrite=args.overwrite, log=_note)
    else:  # safetensors files are written on a local disk (staged there when --out is on object storage)
        kind, command = (outputs.PEFT, "convert --to-peft") if args.to_peft else (outputs.HF, "convert --to-hf")
        with outputs.staged(args.out, kind, "output directory", overwrite=args.overwrite, command=command) as out:
            if args.to_peft:
                convert_to_peft(args.to_peft, out, model_type=args.model_type, overwrite=args.overwrite, log=_note)
            else:
                convert_to_hf(args.to_hf, out, model_type=args.model_type, dtype=args.dtype,
                              overwrite=args.overwrite, log=_note)
    from modern_jax.multihost import distributed

    if distributed.is_main():  # of a launch of several processes, said once
        print(f"wrote {args.out}")
    return 0
