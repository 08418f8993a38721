"""Benchmarks with EleutherAI's lm-evaluation-harness (`lm_eval`): our model as one of its `LM`s.

lm_eval keeps everything that makes a benchmark (its task registry and YAML files, prompts,
few-shot sampling, metrics, the result and sample files); `HarnessLM` answers its three
requests with the jit-compiled model on a mesh:

    loglikelihood          (context, continuation) -> (log p(continuation | context), is it the greedy one)
    loglikelihood_rolling  (document,) -> its log-likelihood over lm_eval's own windows of max_length tokens
    generate_until         (context, gen_kwargs) -> text up to a stop string, or max_gen_toks tokens (KV cache)

Tokens are made as lm_eval's `hf` backend makes them (a Hugging Face tokenizer with its special
tokens, the continuation split off the encoded whole, left truncation to the model's
`max_position_embeddings`), so the figures are those of `lm_eval --model hf` on the same weights.

    lm = HarnessLM(Scorer(states, params, batch_size=32, chunk=512), tokenizer)  # states: a Trainer's
    results = evaluate_tasks(lm, ["sums_choice"], include_path="configs/harness", limit=8)

Scoring: each request's input (its tokens but the last) is a segment of a packed row (positions
from 0, attention within the segment), longest first, in rows of twice the longest input's bucket
(powers of two up to max_length) filled to ~95%, `batch_size` rows a batch: one program a row
length. Generation: prompts sorted by length, left-padded to a few widths, a program each (a
width's few prompts join a longer width: `fewer_programs`). The rows of a batch split over the
mesh's data axes, so under a launch of several processes every process builds the same requests,
feeds the rows its devices hold and receives every score (process 0 alone writes the files).

Letters as in `modern_jax`: B batch, T length, D model, V vocabulary.
"""

from __future__ import annotations

import bisect
import functools
import json
import logging
import math
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from lm_eval.api.model import TemplateLM

from modern_jax.ops import vocab
from modern_jax.training.loss import vocab_parts
from modern_jax.training.placement import batch_sharding, from_whole

MIN_BUCKET = 16  # the shortest padded length
MARKS = 16  # the most segments of a packed row scored by their last position's distribution
HUB_FIX = ("copy its data to local files and point a copy of its YAML at them (dataset_path: json, "
           "dataset_kwargs: {data_files: {test: path/to/test.jsonl}}) in a directory given to --include-path")


def buckets(max_length: int) -> list[int]:
    """The padded lengths: powers of two from MIN_BUCKET, and `max_length` itself."""
    out = [n for n in (MIN_BUCKET << i for i in range(32)) if n < max_length]
    return out + [max_length]


def even_rows(n: int, batch_size: int, shards: int) -> int:
    """Rows a batch for `n` rows in as few batches of at most `batch_size` as that takes, as even as
    a multiple of `shards` rows allows (the last batch's empty rows are run too)."""
    batches = -(-n // batch_size)
    return -(-n // (batches * shards)) * shards


def fewer_programs(groups: dict[int, list], rows_per_batch: int) -> dict[int, list]:
    """`{length: members}` with a short length's members moved up to the next longer length in use
    wherever the padding that adds is at most one batch of the longer length (a program compiled
    for them costs more than a batch run): lengths in use, longest first, each one's own members
    before those moved up into it."""
    lengths, out, moving = sorted(groups), {}, []
    for short, long in zip(lengths, lengths[1:] + [None]):
        members = groups[short] + moving
        if long is not None and len(members) * (long - short) <= rows_per_batch * long:
            moving = members
        else:
            out[short], moving = members, []
    return dict(sorted(out.items(), reverse=True))


class Scorer:
    """Log-likelihoods of rows of tokens with one model on one mesh: `[(tokens, n)]` -> for each,
    the summed log-probability of its last `n` tokens given the ones before, and whether each of
    them is the model's argmax."""

    def __init__(self, states, params, batch_size: int, max_length: int | None = None, *, chunk: int):
        self.states, self.programs, self.batch_size, self.chunk = states, states.programs, batch_size, chunk
        self.max_length = max_length or states.model_cfg.max_position_embeddings
        self.shards = shards = self.programs.data_shards
        if batch_size % shards:
            raise ValueError(f"--batch-size {batch_size} does not split over the mesh's {shards} data shards "
                             f"({dict(self.programs.mesh.shape)}): give a multiple of {shards}")
        self.params_sharding = states.shardings["params"]
        leaves, shardings = jax.tree.leaves(params), jax.tree.leaves(self.params_sharding)
        placed = params is not None and len(leaves) == len(shardings) and all(  # read into them (a Hugging Face model)
            isinstance(x, jax.Array) and x.sharding == s for x, s in zip(leaves, shardings))
        self.params = params if params is None or placed else jax.device_put(  # None: set later (a training state's)
            jax.tree.map(np.asarray, params) if jax.process_count() > 1 else params, self.params_sharding)
        self.batches_run = 0

    @property
    def graphdef(self):
        return self.states.graphdef

    def _score(self, params, batch):
        """`(logp [B, T], greedy [B, T], logp [B, k, C], greedy [B, k, C])` of a batch of packed rows
        `[1, B, ...]` (the placement's layout): each target's log-probability and whether it is the
        argmax; then, at each marked position (the last input of an input that several final tokens
        share), those of each candidate final token."""
        model = self.states.model(params)
        inputs_BT, targets_BT = batch["inputs"][0], batch["targets"][0]
        h_BTD, _ = model.hidden_states(inputs_BT, positions=batch["positions"][0], segment_ids=batch["segment_ids"][0])
        parts = functools.partial(vocab_parts, chunk=self.chunk)
        head = model.head()

        def scored(h_BXD, targets_BX):  # each target's log-probability, and whether it is the argmax
            m_BX, s_BX, z_target_BX, _ = vocab.split_parts(parts, h_BXD, head, targets_BX)
            return z_target_BX - (m_BX + jnp.log(s_BX)), z_target_BX >= m_BX

        marks_Bk, candidates_BkC = batch["marks"][0], batch["candidates"][0]
        B, k, C = candidates_BkC.shape
        h_BkD = jnp.take_along_axis(h_BTD, marks_Bk[:, :, None], axis=1)
        logp_BX, greedy_BX = scored(jnp.repeat(h_BkD, C, axis=1),  # X = k * C: each mark once per candidate
                                    candidates_BkC.reshape(B, k * C))
        return (*scored(h_BTD, targets_BT), logp_BX.reshape(B, k, C), greedy_BX.reshape(B, k, C))

    def _decode(self, params, prompt_BT, length_B, rng, *, max_new: int, temperature: float, top_k, top_p, eos_id):
        """`max_new` tokens sampled after each left-padded prompt row (`generate.decode`)."""
        from modern_jax.generate import decode

        return decode(self.states.model(params), prompt_BT, rng, max_new_tokens=max_new, temperature=temperature,
                      top_k=top_k, top_p=top_p, eos_id=eos_id, length_B=length_B)

    def generate(self, prompts: list[list[int]], max_new: int, rng, *, temperature: float, top_k=None, top_p=None,
                 eos_id=None) -> list[np.ndarray]:
        """`max_new` tokens after each prompt (after eos, eos again): prompts sorted by length,
        right-aligned in rows of the bucket widths that fit the positions left, at most `batch_size`
        rows a batch (as few batches as that takes, as even as the data axes allow: 81 prompts are
        6 batches of 14, not 5 of 16 and one of 1 run as 16), each (width, rows, settings) compiled
        once; the rows split over the data axes."""
        from modern_jax.generate import left_padded

        room = self.max_length - max_new
        widths = [n for n in buckets(self.max_length) if n < room] + [room]
        out: list = [None] * len(prompts)
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
        groups: dict[int, list[int]] = {}
        for i in order:
            groups.setdefault(next(n for n in widths if n >= len(prompts[i])), []).append(i)
        groups = fewer_programs(groups, self.batch_size)
        settings = dict(max_new=max_new, temperature=temperature, top_k=top_k, top_p=top_p, eos_id=eos_id)
        # a program per settings (closed over) and width (its argument shape), compiled once each
        name = "harness_decode_" + "_".join(f"{k}={v}" for k, v in settings.items())
        sample = functools.partial(self._decode, **settings)
        rows_BT = self.programs.rows(2, rows_axis=0)  # split as a batch's rows
        n_batch = 0
        for width, members in groups.items():
            rows = even_rows(len(members), self.batch_size, self.shards)
            for start in range(0, len(members), rows):
                chunk = members[start:start + rows]
                padded = chunk + [chunk[0]] * (rows - len(chunk))  # a short batch: copies of a row
                prompt_BT, length_B = left_padded([prompts[i] for i in padded], width)
                args = [from_whole(prompt_BT, rows_BT), from_whole(length_B, rows_BT)]
                new_BT = np.asarray(jax.device_get(self.programs.program(
                    name, sample, self.params, *args, jax.random.fold_in(rng, n_batch),
                    out_shardings=self.programs.replicated)))
                n_batch += 1
                self.batches_run += 1
                for r, i in enumerate(chunk):
                    out[i] = new_BT[r]
        return out

    def row_length(self, longest: int) -> int:
        """The length of the packed rows for inputs of at most `longest` tokens: twice its bucket
        (room to pack), at most max_length."""
        return min(self.max_length, 2 * next(n for n in buckets(self.max_length) if n >= longest))

    def __call__(self, rows: list[tuple[list[int], int]], advance=None) -> list[tuple[float, bool]]:
        """For each `(tokens, n)` (at most max_length + 1 tokens, 1 <= n < len(tokens)): the
        log-probability of the last n tokens and whether greedy decoding gives them.

        The inputs (all tokens but the last) are packed, each its own segment with positions from 0,
        into rows of `row_length` tokens, in as few batches of at most `batch_size` rows as that takes,
        as even as the data shards allow (`even_rows`: 3 rows run as a batch of 3, 25 as two of 13):
        one program a row length and batch. Rows
        whose inputs are the same (a multiple choice's one-token answers) share one segment, as
        lm-eval's hf backend shares its logits: its last position is marked, and the distribution
        there scores each one's last token (at most `MARKS` marked segments a row, `C` candidates
        each: the most of any input, at least 4, a power of two)."""
        shared: dict[tuple, list[int]] = {}  # the inputs (all tokens but the last) -> the rows that have them
        for i, (tokens, n) in enumerate(rows):
            if not 1 <= n <= len(tokens) - 1 <= self.max_length:
                raise ValueError(f"a request of {len(tokens)} tokens scoring {n} does not fit the model's "
                                 f"{self.max_length} positions")
            shared.setdefault(tuple(tokens[:-1]), []).append(i)
        if not shared:
            return []
        unique = sorted(shared, key=len, reverse=True)
        finals = [sorted({rows[i][0][-1] for i in shared[inputs]}) for inputs in unique]
        C = max(4, 1 << (max(len(f) for f in finals) - 1).bit_length())
        L = self.row_length(len(unique[0]))
        packed = pack([len(x) for x in unique], [len(f) > 1 for f in finals], L, MARKS)
        B = even_rows(len(packed), self.batch_size, self.shards)  # 3 rows run as 3, not as a batch of 16
        results: list = [None] * len(rows)
        for start in range(0, len(packed), B):
            arrays, placed = self._packed_batch(packed[start:start + B], unique, finals, L, C, B)
            # one program, compiled once per row length and candidates; every process receives every row's figures
            logp, greedy, cand_logp, cand_greedy = jax.device_get(self.programs.program(
                "harness_score", self._score, self.params, self._on_mesh(arrays),
                out_shardings=self.programs.replicated))
            self.batches_run += 1
            for u, r, offset, mark in placed:
                end = offset + len(unique[u])  # the position after the input's last
                for i in shared[unique[u]]:
                    tokens, n = rows[i]
                    if mark is None:  # its n targets: the input's last n - 1 tokens and its final one
                        results[i] = (float(np.sum(logp[r, end - n:end], dtype=np.float64)),
                                      bool(np.all(greedy[r, end - n:end])))
                    else:  # n - 1 targets, then the final token among the candidates
                        c = finals[u].index(tokens[-1])
                        results[i] = (float(np.sum(logp[r, end - n:end - 1], dtype=np.float64) + cand_logp[r, mark, c]),
                                      bool(np.all(greedy[r, end - n:end - 1]) and cand_greedy[r, mark, c]))
                if advance is not None:
                    advance(len(shared[unique[u]]))
        return results

    def _packed_batch(self, chunk: list[list[int]], unique: list[tuple], finals: list[list[int]], L: int, C: int,
                      B: int):
        """`(arrays [1, B, ...], placed)`: the rows `chunk` (each a list of indices into `unique`)
        laid out in a batch of B rows, and where each input went, `(index, row, offset, mark or None)`."""
        arrays = {k: np.zeros((1, B, L), np.int32) for k in ("inputs", "targets", "positions", "segment_ids")}
        arrays["marks"] = np.zeros((1, B, MARKS), np.int32)
        arrays["candidates"] = np.zeros((1, B, MARKS, C), np.int32)
        placed = []
        for r, members in enumerate(chunk):
            offset, marks = 0, 0
            for segment, u in enumerate(members, start=1):
                inputs, T = unique[u], len(unique[u])
                span = slice(offset, offset + T)
                arrays["inputs"][0, r, span] = inputs
                arrays["targets"][0, r, offset:offset + T - 1] = inputs[1:]
                arrays["positions"][0, r, span] = np.arange(T)
                arrays["segment_ids"][0, r, span] = segment
                mark = None
                if len(finals[u]) > 1:  # scored by the distribution at its last position
                    mark, marks = marks, marks + 1
                    arrays["marks"][0, r, mark] = offset + T - 1
                    arrays["candidates"][0, r, mark, :len(finals[u])] = finals[u]
                else:  # its one final token is the last position's target
                    arrays["targets"][0, r, offset + T - 1] = finals[u][0]
                placed.append((u, r, offset, mark))
                offset += T
        return arrays, placed

    def _on_mesh(self, arrays: dict[str, np.ndarray]) -> dict[str, jax.Array]:
        """`[1, B, ...]` host arrays placed as a batch is (this process's rows from its own copy)."""
        return {k: from_whole(v, batch_sharding(self.programs.mesh, self.programs.rules) if v.ndim == 3 else
                              self.programs.rows(v.ndim))
                for k, v in arrays.items()}


def pack(lengths: list[int], marked: list[bool], room: int, marks: int) -> list[list[int]]:
    """Items of `lengths` (longest first) in rows of `room`: each row starts with the longest item
    left and is filled with the longest that still fit (of equal ones, the first given), at most
    `marks` `marked` ones a row."""
    left = {True: _Lengths(), False: _Lengths()}
    for i, (n, m) in enumerate(zip(lengths, marked)):
        if not 1 <= n <= room:
            raise ValueError(f"an input of {n} tokens does not fit a row of {room}")
        left[bool(m)].add(n, i)
    rows = []
    while left[True] or left[False]:
        row, space, used = [], room, 0
        while True:
            kinds = [m for m in (False, True) if not (m and used == marks) and left[m].longest(space)]
            if not kinds:
                break
            kind = max(kinds, key=lambda m: left[m].next(space))  # the longest; of those, the first given
            n, i = left[kind].take(space)
            row.append(i)
            space, used = space - n, used + kind
        rows.append(sorted(row))
    return rows


class _Lengths:
    """Items by length: the longest that fits a space, in O(log n)."""

    def __init__(self):
        self.items: dict[int, list[int]] = {}
        self.sizes: list[int] = []  # the lengths held, ascending

    def __bool__(self) -> bool:
        return bool(self.sizes)

    def add(self, n: int, i: int) -> None:
        if n not in self.items:
            bisect.insort(self.sizes, n)
        self.items.setdefault(n, []).insert(0, i)

    def longest(self, space: int) -> int:
        j = bisect.bisect_right(self.sizes, space) - 1
        return 0 if j < 0 else self.sizes[j]

    def next(self, space: int) -> tuple[int, int]:
        """`(length, -index)` of the item `take` would give."""
        n = self.longest(space)
        return n, -self.items[n][-1]

    def take(self, space: int) -> tuple[int, int]:
        n = self.longest(space)
        i = self.items[n].pop()
        if not self.items[n]:
            del self.items[n]
            self.sizes.remove(n)
        return n, i


def _hf_encoder(tokenizer):
    """The `tokenizers.Tokenizer` of a Hugging Face tokenizer (encoded with its special tokens, as
    transformers does), else None (our byte and character tokenizers have none to add)."""
    return getattr(tokenizer, "tok", None)


def _special_ids(tokenizer, hf) -> tuple[int | None, int | None]:
    """`(bos, eos)` as transformers reads them: those a Hugging Face tokenizer_config.json names
    (none for a token it does not name), else the tokenizer's own."""
    special = getattr(tokenizer, "special_tokens", None) or {}
    if hf is None or not special:
        return tokenizer.bos_id, tokenizer.eos_id
    named = [special.get(k) for k in ("bos_token", "eos_token")]
    bos, eos = (None if name is None else hf.token_to_id(name) for name in named)
    return bos, tokenizer.eos_id if eos is None else eos


class HarnessLM(TemplateLM):
    """lm_eval's `LM` over a `Scorer` and the tokenizer the model was trained with."""

    def __init__(self, scorer: Scorer, tokenizer, *, seed: int = 0, name: str = "modern_jax"):
        super().__init__()
        self.scorer, self.tokenizer_ours, self.seed, self.name = scorer, tokenizer, seed, name
        self.max_length = scorer.max_length
        self.batch_size = scorer.batch_size
        self._hf = _hf_encoder(tokenizer)
        self._bos, self._eos = _special_ids(tokenizer, self._hf)
        if self._eos is None and self._bos is None:
            raise ValueError("the tokenizer has neither <bos> nor <eos>: lm-eval scores a continuation of an empty "
                             "context and a document's first window after one of them")

    # ----- tokens, as lm_eval's hf backend makes them ----------------------------------

    @property
    def eot_token_id(self) -> int:
        return self._bos if self._eos is None else self._eos

    @property
    def prefix_token_id(self) -> int:  # before an empty context and a document's first window
        return self._eos if self._bos is None else self._bos

    def _token_text(self, token_id: int) -> str:
        if self._hf is not None:
            return self._hf.decode([token_id], skip_special_tokens=False)
        return self.tokenizer_ours.decode([token_id])

    def tok_encode(self, string: str, add_special_tokens: bool | None = None, **kwargs) -> list[int]:
        if self._hf is None:
            return [int(t) for t in self.tokenizer_ours.encode(string)]
        if add_special_tokens is None:  # a string that starts with the prefix token gets no second one
            prefix = self._token_text(self.prefix_token_id)
            add_special_tokens = not (prefix and string.startswith(prefix))
        return list(self._hf.encode(string, add_special_tokens=add_special_tokens).ids)

    def _encode_prompt(self, string: str) -> list[int]:
        """A generation prompt: special tokens added unless it starts with <bos> (the hf backend's batch encoding)."""
        if self._hf is None:
            return self.tok_encode(string)
        bos = None if self._bos is None else self._token_text(self._bos)
        return list(self._hf.encode(string, add_special_tokens=not (bos and string.startswith(bos))).ids)

    def tok_decode(self, tokens) -> str:
        return self.tokenizer_ours.decode(np.asarray(tokens, np.int64))

    @property
    def tokenizer_name(self) -> str:
        return self.name.replace("/", "__")

    def chat_template(self, chat_template=False) -> str | None:
        if not chat_template:
            return None
        template = getattr(self.tokenizer_ours, "chat_template", None)
        if template is None:
            raise ValueError("--apply-chat-template: the checkpoint's tokenizer has no chat template (its "
                             "tokenizer_config.json or chat_template.jinja)")
        return template

    def apply_chat_template(self, chat_history: list[dict], add_generation_prompt: bool = True) -> str:
        from modern_jax.data.chat import compile_template

        template = self.chat_template(True)
        special = dict(getattr(self.tokenizer_ours, "special_tokens", None) or {})
        text = compile_template(template).render(messages=chat_history, add_generation_prompt=add_generation_prompt,
                                                 tools=None, documents=None, **special)
        if not add_generation_prompt and chat_history:  # continue the last message: cut after its content
            content = chat_history[-1]["content"]
            end = text.rfind(content)
            if end >= 0:
                text = text[:end + len(content)]
        return text

    # ----- the three requests ---------------------------------------------------------

    def _rows(self, requests) -> list[tuple[list[int], int]]:
        """`(context, continuation)` token pairs as rows: the last max_length + 1 tokens (left truncated)."""
        rows = []
        for _, context, continuation in requests:
            if not continuation:
                raise ValueError("lm-eval asked for the log-likelihood of an empty continuation")
            rows.append(((list(context) + list(continuation))[-(self.max_length + 1):], len(continuation)))
        return rows

    def _loglikelihood_tokens(self, requests, disable_tqdm: bool = False, **kwargs) -> list[tuple[float, bool]]:
        results = self.scorer(self._rows(requests))
        for (strings, _, _), answer in zip(requests, results):
            if strings is not None:
                self.cache_hook.add_partial("loglikelihood", strings, answer)
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        windows, owners = [], []
        for n, (string,) in enumerate(req.args for req in requests):
            for context, continuation in map(make_disjoint_window, get_rolling_token_windows(
                    token_list=self.tok_encode(string), prefix_token=self.prefix_token_id,
                    max_seq_len=self.max_length, context_len=1)):
                windows.append((None, context, continuation))
                owners.append(n)
        totals = [0.0] * len(requests)
        for n, (logp, _) in zip(owners, self._loglikelihood_tokens(windows)):
            totals[n] += logp
        for req, total in zip(requests, totals):
            self.cache_hook.add_partial("loglikelihood_rolling", req.args, total)
        return totals

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        from lm_eval.models.utils import handle_stop_sequences, normalize_gen_kwargs, postprocess_generated_text

        results: list = [None] * len(requests)
        by_kwargs: dict[str, list[int]] = {}
        for i, req in enumerate(requests):
            by_kwargs.setdefault(json.dumps(req.args[1], sort_keys=True, default=str), []).append(i)
        eos_text = self._token_text(self.eot_token_id)
        for group, members in enumerate(by_kwargs.values()):
            kwargs = normalize_gen_kwargs(dict(requests[members[0]].args[1]), 256)
            until = handle_stop_sequences(kwargs.pop("until", None), eos=eos_text)
            max_new = int(kwargs.pop("max_gen_toks"))
            room = self.max_length - max_new
            if room <= 0:
                raise ValueError(f"max_gen_toks={max_new} leaves no room for a prompt in the model's "
                                 f"{self.max_length} positions: lower it (--gen-kwargs max_gen_toks=N)")
            sampled = bool(kwargs.get("do_sample")) and float(kwargs.get("temperature", 1.0)) > 0
            settings = dict(temperature=float(kwargs.get("temperature", 1.0)) if sampled else 0.0,
                            top_k=kwargs.get("top_k") if sampled else None,
                            top_p=kwargs.get("top_p") if sampled else None)
            prompts = [self._encode_prompt(requests[i].args[0])[-room:] for i in members]
            rng = jax.random.fold_in(jax.random.key(self.seed), group)
            for i, tokens in zip(members, self._generate(prompts, max_new, rng, **settings)):
                text = postprocess_generated_text(self.tok_decode(tokens), until, None)
                results[i] = text
                self.cache_hook.add_partial("generate_until", requests[i].args, text)
        return results

    def _generate(self, prompts: list[list[int]], max_new: int, rng, *, temperature: float, top_k, top_p):
        """New tokens after each prompt, cut at eos: prompts sorted by length and right-aligned
        (left padding) in rows of a few widths, `batch_size` rows a batch (`Scorer.generate`)."""
        from modern_jax.generate import cut_at_eos

        eos = self.eot_token_id
        out = self.scorer.generate(prompts, max_new, rng, temperature=temperature, top_k=top_k, top_p=top_p,
                                   eos_id=eos)
        return [cut_at_eos(tokens, eos) for tokens in out]

    def get_model_info(self) -> dict:
        params = jax.tree.leaves(self.scorer.params)
        return {"model_num_parameters": int(sum(math.prod(p.shape) for p in params)),
                "model_dtype": str(self.scorer.states.model_cfg.dtype)}


# ----- tasks and results ---------------------------------------------------------------


def quiet_lm_eval(level=logging.WARNING) -> None:
    """lm_eval logs each step at INFO: keep its warnings only."""
    for name in ("lm_eval", "lm-eval"):
        logging.getLogger(name).setLevel(level)


def task_manager(include_path: str | None = None, flag: str = "--include-path", tasks=()):
    """lm_eval's TaskManager: of the include path alone when it holds every task of `tasks` (indexing
    lm_eval's own ~15,000 task files takes seconds), else of both."""
    from lm_eval.tasks import TaskManager

    if include_path is not None and not pathlib.Path(include_path).is_dir():
        raise ValueError(f"{flag} {include_path} is not a directory: give a directory of task YAML files")
    if include_path is not None and tasks:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if set(tasks) <= set(local.all_tasks):
            return local
    return TaskManager(include_path=include_path)


def check_tasks(manager, tasks: list[str], flag: str = "--tasks", include: str = "--include-path") -> None:
    """Every task name known to lm_eval (its own, or a YAML under the include path); an unknown
    one names the include path's YAML files that lm_eval left out because it cannot read them."""
    known = set(manager.all_tasks)
    unknown = [t for t in tasks if t not in known]
    if unknown:
        import difflib

        close = {t: difflib.get_close_matches(t, known, n=3) for t in unknown}
        hints = "; ".join(f"{t!r}" + (f" (close: {', '.join(c)})" if c else "") for t, c in close.items())
        unread = _unread_task_files(getattr(manager, "include_path", None))
        if unread:
            raise ValueError(f"{flag}: no task named {hints}: {'; '.join(unread[:3])}, and lm-eval leaves out a "
                             f"task file it cannot read: fix it")
        raise ValueError(f"{flag}: no task named {hints}: give lm-eval's task names, or a directory of task YAML "
                         f"files with {include}")


def _unread_task_files(include_path) -> list[str]:
    """Each YAML file under `include_path` that lm_eval cannot read (its index skips them in
    silence), with its problem: the line and column of a YAML syntax error."""
    import yaml
    from lm_eval.tasks._yaml_loader import load_yaml

    from modern_jax.configfile import _yaml_problem

    paths = include_path if isinstance(include_path, (list, tuple)) else [include_path] if include_path else []
    unread = []
    for path in sorted(p for root in paths for p in pathlib.Path(root).glob("**/*.yaml")):
        try:
            load_yaml(path, resolve_func=False)
        except yaml.MarkedYAMLError as e:
            mark, problem = _yaml_problem(e)
            where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
            unread.append(f"{path}{where}: could not parse YAML ({problem})")
        except Exception as e:  # an include that is missing, a file that is not a mapping
            reason = str(e).strip().splitlines()[0] if str(e).strip() else ""
            unread.append(f"{path}: could not be read ({type(e).__name__}: {reason})")
    return unread


def load_tasks(manager, tasks: list[str]) -> None:
    """Build each task (its data read now), so that one whose data cannot be read is named with
    the fix in one line: a task of the hub without network most of all."""
    quiet_lm_eval(logging.ERROR)  # its notes on the task configs come again when the run loads them
    try:
        for name in tasks:
            try:
                manager.load([name])
            except Exception as e:  # datasets raises many kinds: offline, missing file, bad format
                raise ValueError(_unreadable(manager, name, e)) from None
    finally:
        quiet_lm_eval()


def _unreadable(manager, name: str, error: Exception) -> str:
    config = {}
    entry = manager.task_index.get(name) if hasattr(manager, "task_index") else None
    yaml_path = getattr(entry, "yaml_path", None) or (entry.get("yaml_path") if isinstance(entry, dict) else None)
    if yaml_path:
        try:
            from lm_eval.tasks._yaml_loader import load_yaml

            config = load_yaml(yaml_path, resolve_func=False) or {}
        except Exception:  # the message below still names the task
            config = {}
    path, files = config.get("dataset_path"), (config.get("dataset_kwargs") or {}).get("data_files")
    reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
    if files or path in ("json", "csv", "parquet", "text", "arrow"):
        return (f"task {name}: its local data could not be read ({type(error).__name__}: {reason}); data_files "
                f"{files!r} are read relative to the working directory: run from the directory they are relative "
                f"to, or give absolute paths")
    return (f"task {name}: its data come from the Hugging Face hub ({path or 'a dataset'}) and could not be read "
            f"({type(error).__name__}: {reason[:200]}): {HUB_FIX}")


def evaluate_tasks(lm: HarnessLM, tasks: list[str], *, include_path: str | None = None,
                   num_fewshot: int | None = None, limit: float | None = None, log_samples: bool = False,
                   apply_chat_template: bool | str = False, gen_kwargs: str | None = None, seed: int = 0,
                   model_args: dict | None = None, tracker=None, bootstrap_iters: int = 100000,
                   manager=None) -> dict | None:
    """lm_eval's `simple_evaluate` with our model: its results dict (with `samples` when
    `log_samples`). `manager`: a TaskManager whose tasks were checked and loaded already."""
    from lm_eval import simple_evaluate

    quiet_lm_eval()
    if manager is None:
        manager = task_manager(include_path, tasks=tasks)
        check_tasks(manager, tasks)
        load_tasks(manager, tasks)
    return simple_evaluate(model=lm, model_args=model_args, tasks=tasks, num_fewshot=num_fewshot, limit=limit,
                           log_samples=log_samples, apply_chat_template=apply_chat_template, gen_kwargs=gen_kwargs,
                           task_manager=manager, random_seed=seed, numpy_random_seed=seed, torch_random_seed=None,
                           fewshot_random_seed=seed, evaluation_tracker=tracker, bootstrap_iters=bootstrap_iters,
                           batch_size=lm.batch_size)


class Benchmarks:
    """train.harness_*: lm-eval's tasks on a training state's parameters. The tasks are checked
    and their data read when made (before the first step); each call scores them with the
    run's programs (compiled once) and returns `{task/metric: value}`."""

    def __init__(self, states, tokenizer, train_cfg):
        quiet_lm_eval()
        self.tasks, self.cfg, self.tokenizer = list(train_cfg.harness_tasks), train_cfg, tokenizer
        self.manager = task_manager(train_cfg.harness_include_path, "train.harness_include_path", self.tasks)
        check_tasks(self.manager, self.tasks, "train.harness_tasks", "train.harness_include_path")
        load_tasks(self.manager, self.tasks)
        self.scorer = Scorer(states, None, train_cfg.eval_batch_size, chunk=train_cfg.loss_vocab_chunk)

    def __call__(self, params) -> dict[str, float]:
        self.scorer.params = params
        lm = HarnessLM(self.scorer, self.tokenizer, seed=self.cfg.seed)
        limit = self.cfg.harness_limit
        results = evaluate_tasks(lm, self.tasks, limit=int(limit) if limit is not None and limit >= 1 else limit,
                                 seed=self.cfg.seed, manager=self.manager, bootstrap_iters=0)
        return {k: v for k, v in flat_metrics(results).items() if not k.endswith("/sample_len")}


def flat_metrics(results: dict) -> dict[str, float]:
    """`{task/metric: value}` of a results dict: each task's numbers (lm_eval's `acc,none` read
    as `acc`; stderrs left out)."""
    out = {}
    for task, values in (results.get("results") or {}).items():
        for key, value in values.items():
            metric, _, filt = key.partition(",")
            if key == "alias" or "_stderr" in metric or not isinstance(value, (int, float)):
                continue
            name = metric if filt in ("", "none") else f"{metric}_{filt}"
            out[f"{task}/{name}"] = float(value)
    return out


__all__ = ["Benchmarks", "HarnessLM", "Scorer", "buckets", "evaluate_tasks", "flat_metrics"]
