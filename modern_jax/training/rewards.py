"""Reward functions for reinforcement learning, with TRL's signature:

    def exact_answer(prompts, completions, answer, **kwargs) -> list[float | None]

`prompts` and `completions` are texts (or, for conversations, lists of messages: the
completion is `[{"role": "assistant", "content": text}]`), `completion_ids` the sampled token
ids, and every other field of the prompts' records arrives as a keyword of its own name, one
value per completion. `None` means the function does not score that completion. A run file
names them as `grpo.rewards: [path/to/file.py:function, package.module:function]`; a module is
read from the working directory where it holds the file (`package/module.py`), as Python run
there would import it, and a note says which file each function came from. A function that
raises, or returns anything but a list of one number or None per completion, is one error
naming it (and the line it raised at).
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import math
import os
import pathlib
import sys
import traceback
import warnings

import numpy as np


def load(spec: str, where: str):
    """The function `spec` names: `path/to/file.py:function` (relative to the working directory)
    or `package.module:function`, read from `package/module.py` of the working directory where it
    holds one (as Python run there would import it), else imported; anything else is a ValueError
    naming `where` and the fix."""
    if not isinstance(spec, str) or spec.count(":") != 1 or not all(spec.split(":")):
        raise ValueError(f"{where}={spec!r}: expected 'path/to/file.py:function' or 'package.module:function'")
    source, name = spec.split(":")
    if source.endswith(".py"):
        path = pathlib.Path(source)
        if not path.is_file():
            raise ValueError(f"{where}={spec!r}: no file {source!r} (a path relative to the working directory "
                             f"{pathlib.Path.cwd()})")
        module = _from_file(path, f"{where}={spec!r}: {source}")
    else:
        local = _in_working_directory(source)
        module = _imported(source, where, spec) if local is None else _from_file(local, f"{where}={spec!r}: {local}")
    function = getattr(module, name, None)
    if not callable(function):
        found = sorted(n for n, v in vars(module).items() if inspect.isfunction(v) and not n.startswith("_"))
        raise ValueError(f"{where}={spec!r}: {source} has no function {name!r}; its functions: "
                         f"{', '.join(found) or 'none'}")
    return function


def _in_working_directory(source: str) -> pathlib.Path | None:
    """`package/module.py` (or `package/module/__init__.py`) of the working directory, if it is there."""
    base = pathlib.Path(*source.split("."))
    return next((p for p in (base.with_name(base.name + ".py"), base / "__init__.py") if p.is_file()), None)


def _from_file(path: pathlib.Path, named: str):
    """The module of the file `path` (run once a process), the working directory first on the path
    of its own imports; `named`: the start of an error."""
    module_name = f"modern_jax_rewards_{abs(hash(str(path.resolve())))}"
    module = sys.modules.get(module_name)
    if module is None:
        loader = importlib.util.spec_from_file_location(module_name, path)
        module = importlib.util.module_from_spec(loader)
        cwd = os.getcwd()
        sys.path.insert(0, cwd)
        try:
            loader.loader.exec_module(module)
        except (Exception, SystemExit) as e:
            raise ValueError(_import_failure(named, e)) from None
        finally:
            if cwd in sys.path:
                sys.path.remove(cwd)
        sys.modules[module_name] = module
    return module


def _imported(source: str, where: str, spec: str):
    try:
        return importlib.import_module(source)
    except ImportError as e:
        raise ValueError(f"{where}={spec!r}: cannot import {source!r} ({e}); a file is named with its .py") from None
    except (Exception, SystemExit) as e:
        raise ValueError(_import_failure(f"{where}={spec!r}: {source}", e)) from None


def _import_failure(named: str, e: BaseException) -> str:
    if isinstance(e, SystemExit):
        return (f"{named} calls sys.exit({e.code!r}) when imported: a reward module must only define its functions "
                f"when imported; put the rest under if __name__ == '__main__'")
    return f"{named} fails to import ({type(e).__name__}: {e})"


class Rewards:
    """The run's reward functions and their weights: `score` gives each completion's reward per
    function (NaN where one returned None). Made, it says which file each function was read from."""

    def __init__(self, specs, weights=None):
        self.functions = [load(spec, f"grpo.rewards[{i}]") for i, spec in enumerate(specs)]
        self.names = tuple(f.__name__ for f in self.functions)
        self.weights = np.ones(len(specs), np.float32) if weights is None else np.asarray(weights, np.float32)
        files = [inspect.getsourcefile(f) if inspect.isfunction(f) else None for f in self.functions]
        warnings.warn("reward functions: " + "; ".join(f"{name} from {pathlib.Path(file).absolute() if file else 'no file'}"
                                                       for name, file in zip(self.names, files)))

    def score(self, prompts: list, completions: list, completion_ids: list, columns: dict) -> np.ndarray:
        """`[completions, functions]` float32 rewards; a function that raises, or returns anything
        but one number or None per completion, is a ValueError naming it."""
        out = np.full((len(completions), len(self.functions)), np.nan, np.float32)
        for f, (function, name) in enumerate(zip(self.functions, self.names)):
            try:
                values = function(prompts=prompts, completions=completions, completion_ids=completion_ids, **columns)
            except Exception as e:
                raise ValueError(_call_failure(name, e, columns)) from None
            if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__iter__") or np.ndim(values) != 1:
                raise ValueError(f"reward function {name} returned {type(values).__name__} {str(values)[:60]}, not a "
                                 f"list: return a list of {len(completions)} rewards, a number (or None) for each "
                                 f"completion")
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


def _call_failure(name: str, e: Exception, columns: dict) -> str:
    """What a reward function's exception says: its arguments, if the call itself failed (a
    TypeError raised before its first line), else the exception and the line it came from."""
    frames = traceback.extract_tb(e.__traceback__)[1:]  # [0]: the call in `score`
    if isinstance(e, TypeError) and not frames:
        return (f"reward function {name} cannot take the arguments it is given ({e}): it receives prompts=, "
                f"completions=, completion_ids= and the records' fields {', '.join(columns) or '(none)'} as "
                f"keywords; end its parameters with **kwargs")
    reason = str(e).strip().splitlines()[0] if str(e).strip() else "(no message)"
    where = f" ({frames[-1].filename}, line {frames[-1].lineno})" if frames else ""
    return f"reward function {name} raised {type(e).__name__}: {reason}{where}"
