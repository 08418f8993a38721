"""Reward functions for reinforcement learning, with TRL's signature:

    def exact_answer(prompts, completions, answer, **kwargs) -> list[float | None]

`prompts` and `completions` are texts (or, for conversations, lists of messages: the
completion is `[{"role": "assistant", "content": text}]`), `completion_ids` the sampled token
ids, and every other field of the prompts' records arrives as a keyword of its own name, one
value per completion. `None` means the function does not score that completion. A run file
names them as `grpo.rewards: [path/to/file.py:function, package.module:function]`.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import pathlib
import sys

import numpy as np


def load(spec: str, where: str):
    """The function `spec` names: `path/to/file.py:function` (relative to the working directory)
    or `package.module:function`; anything else is a ValueError naming `where` and the fix."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError(f"{where}={spec!r}: expected 'path/to/file.py:function' or 'package.module:function'")
    source, name = spec.split(":")
    if source.endswith(".py"):
        path = pathlib.Path(source)
        if not path.is_file():
            raise ValueError(f"{where}={spec!r}: no file {source!r} (a path relative to the working directory "
                             f"{pathlib.Path.cwd()})")
        module_name = f"modern_jax_rewards_{abs(hash(str(path.resolve())))}"
        module = sys.modules.get(module_name)
        if module is None:
            loader = importlib.util.spec_from_file_location(module_name, path)
            module = importlib.util.module_from_spec(loader)
            try:
                loader.loader.exec_module(module)
            except Exception as e:
                raise ValueError(f"{where}={spec!r}: {source} fails to import ({type(e).__name__}: {e})") from None
            sys.modules[module_name] = module
    else:
        try:
            module = importlib.import_module(source)
        except ImportError as e:
            raise ValueError(f"{where}={spec!r}: cannot import {source!r} ({e}); a file is named with its .py") from None
    function = getattr(module, name, None)
    if not callable(function):
        found = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))
        raise ValueError(f"{where}={spec!r}: {source} has no function {name!r}; its functions: "
                         f"{', '.join(found) or 'none'}")
    return function


class Rewards:
    """The run's reward functions and their weights: `score` gives each completion's reward per
    function (NaN where one returned None)."""

    def __init__(self, specs, weights=None):
        self.functions = [load(spec, f"grpo.rewards[{i}]") for i, spec in enumerate(specs)]
        self.names = tuple(f.__name__ for f in self.functions)
        self.weights = np.ones(len(specs), np.float32) if weights is None else np.asarray(weights, np.float32)

    def score(self, prompts: list, completions: list, completion_ids: list, columns: dict) -> np.ndarray:
        """`[completions, functions]` float32 rewards."""
        out = np.full((len(completions), len(self.functions)), np.nan, np.float32)
        for f, (function, name) in enumerate(zip(self.functions, self.names)):
            try:
                values = function(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
            except TypeError as e:
                if "argument" not in str(e):
                    raise
                raise ValueError(f"reward function {name} cannot take the arguments it is given ({e}): it receives "
                                 f"prompts=, completions=, completion_ids= and the records' fields "
                                 f"{', '.join(columns) or '(none)'} as keywords; end its parameters with **kwargs"
                                 ) from None
            values = list(values)
            if len(values) != len(completions):
                raise ValueError(f"reward function {name} returned {len(values)} rewards for {len(completions)} "
                                 f"completions: return one per completion (None for one it does not score)")
            for i, value in enumerate(values):
                if value is None:
                    continue
                if isinstance(value, bool) or not isinstance(value, (int, float, np.floating, np.integer)) or \
                        not math.isfinite(float(value)):
                    raise ValueError(f"reward function {name} returned {value!r} for completion {i}: return a finite "
                                     f"number, or None for a completion it does not score")
                out[i, f] = float(value)
        return out
