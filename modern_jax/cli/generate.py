"""`modern-jax generate`: sample text from a checkpoint with the KV cache.

    modern-jax generate --checkpoint runs/tiny --prompt "def " [--temperature 0.8 --top-k 50 --top-p 0.95]
"""

from __future__ import annotations

import math

from modern_jax.cli.shared import _check_flags, _checkpoint_tokenizer, _note, _positive, _scoring_trainer, \
    _warnings_as_notes

TEMPERATURE = 0.8  # --temperature when not given


def add_parser(subparsers) -> None:
    ge = subparsers.add_parser("generate", help="sample text from a checkpoint with the KV cache")
    ge.add_argument("--checkpoint", required=True, help="a run directory, a step directory, or params/ + config.yaml")
    ge.add_argument("--prompt", default="", help="text to continue (default: start from <bos>)")
    ge.add_argument("--max-new-tokens", type=int, default=200)
    ge.add_argument("--num-samples", type=int, default=1)
    ge.add_argument("--temperature", type=float, help=f"default {TEMPERATURE}")
    ge.add_argument("--top-k", type=int)
    ge.add_argument("--top-p", type=float)
    ge.add_argument("--greedy", action="store_true", help="argmax decoding (temperature 0)")
    ge.add_argument("--seed", type=int, default=0)
    ge.set_defaults(func=run)


def run(args) -> int:
    _check_flags(args, _positive("--max-new-tokens"), _positive("--num-samples"), _positive("--top-k"),
                 ("--top-p", lambda p: 0 < p <= 1, "a probability in (0, 1]"),
                 ("--temperature", lambda t: 0 <= t < math.inf, "a finite number >= 0 (0: greedy)"))
    if args.greedy:  # the most likely token each time: no sampling setting applies, one sequence a prompt
        for flag in ("--temperature", "--top-k", "--top-p"):
            value = getattr(args, flag[2:].replace("-", "_"))
            if value is not None:
                raise ValueError(f"--greedy takes the most likely token each time, so {flag} {value} would not be "
                                 f"used: give one of them")
        if args.num_samples > 1:
            raise ValueError(f"--greedy gives one sequence, so --num-samples {args.num_samples} would print it "
                             f"{args.num_samples} times: leave out --greedy to sample {args.num_samples}")
    try:
        args.prompt.encode("utf-8")
    except UnicodeEncodeError as e:  # a byte of the shell's argv that is not UTF-8 (surrogate-escaped)
        byte = ord(args.prompt[e.start]) - 0xDC00 if 0xDC80 <= ord(args.prompt[e.start]) <= 0xDCFF else None
        shown = f"the byte 0x{byte:02x}" if byte is not None else f"{args.prompt[e.start]!r}"
        raise ValueError(f"--prompt is not UTF-8 text: {shown} at character {e.start}; give the prompt as "
                         f"UTF-8 (check the terminal's or the file's encoding)") from None
    from modern_jax.accounting import DoesNotFit
    from modern_jax.generate import sample_texts
    from modern_jax.convert.conversions import load_model_params
    from modern_jax.training import TrainConfig
    from modern_jax.training.metrics import Progress

    import jax

    cfg, params, raw, run_dir = load_model_params(args.checkpoint, log=_note if jax.process_index() == 0 else None)
    tokenizer = _checkpoint_tokenizer(run_dir, cfg)
    if args.top_k is not None and args.top_k > cfg.vocab_size:
        raise ValueError(f"--top-k {args.top_k} exceeds the model's vocabulary of {cfg.vocab_size:,} tokens, so it "
                         f"would keep every token: give at most {cfg.vocab_size:,}, or leave it out (no top-k)")
    try:
        tokenizer.encode(args.prompt)
    except ValueError as e:
        raise ValueError(f"--prompt cannot be encoded: {e}") from None
    graphdef = _scoring_trainer(cfg, raw, TrainConfig(warmup_steps=0)).states.graphdef
    temperature = 0.0 if args.greedy else TEMPERATURE if args.temperature is None else args.temperature
    try:
        with _warnings_as_notes(), Progress(None, enabled=jax.process_index() == 0) as progress, \
                progress.phase(f"sampling {args.num_samples} x {args.max_new_tokens} tokens"):
            texts = sample_texts(graphdef, params, tokenizer, args.prompt, n=args.num_samples,
                                 max_new_tokens=args.max_new_tokens, seed=args.seed, temperature=temperature,
                                 top_k=args.top_k, top_p=args.top_p)
    except DoesNotFit as e:
        raise ValueError(e.describe({"max_new_tokens": "--max-new-tokens", "rows": "--num-samples"})) from None
    if jax.process_index() != 0:  # every process of a launch samples; process 0 prints
        return 0
    for i, text in enumerate(texts):
        if len(texts) > 1:
            print(f"--- sample {i} ---")
        print(text)
    return 0
