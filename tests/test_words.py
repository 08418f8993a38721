"""Words stay true (STYLE.md 17): every dotted name of ours that a comment, a docstring or a docs
page mentions resolves to something that exists in `modern_jax`.

What is read: the comments and docstrings (any string standing alone as a statement) of
`modern_jax/`, `tests/` and `scripts/`, and every line of README.md and docs/*.md, code blocks
included.

What is a dotted name: identifiers joined by dots (`generate.decode`, `Trainer.compile`,
`modern_jax.training.trainer.trainer_for`), not part of a path (`training/trainer.py`), an address or
a longer key (`model.layers.{i}.mlp`, `model.layers.0`), and not a file's name (its last part is a
file extension: `config.json`, `model.py`). A name with a placeholder part (`model.KEY=VALUE`) is
left out; one that ends in `*` (`train.harness_*`) names the attributes that start so, and resolves
when there is one.

What is ours: a name whose first part is

- `modern_jax`;
- the last part of one of the package's modules or subpackages, at any depth (`generate`,
  `distributed`, `layout`, `objectives`, `training`): it resolves when, for some module whose
  dotted path ends with the name's leading parts (`training.layout` -> `modern_jax.training.layout`,
  `config` -> any of the four `config` modules), the rest of the name walks from that module;
- a class defined at the top level of one of the package's modules (`Trainer`, `Visibility`);
- a run file's section (`train`, `model`, `data`, `lora`, `dpo`, ...): such a name is a setting
  (`train.seq_len`, `parallel.tensor`) and resolves as a field of that section's config class
  (`model.remat`, read from `model:` where it used to live, counts too); a section that is
  also a module's name (`model`, `data`, `lora`, `execution`) resolves either way;
- `model`, the name the docs give an instance of `Transformer` (`model.logits(h)`).

A first part that is also a well-known library's (`EXTERNAL`: `tokenizers` is Hugging Face's too) is
not ours; `jax.lax.scan`, `nnx.Param`, `optax.adamw`, `np.float32` never are (no module of ours is
called `jax`, `nnx`, `optax` or `np`).

How a name walks: from a module, to a module-level name or a submodule; from a class, to a class
attribute, method or property, or to an instance attribute: a dataclass field, an annotation in
the class body, or `self.x = ...` in one of its methods (of it or a base class of ours). Past a
function, an instance attribute or any other value, the rest of the name is the value's type's,
which is not known here: it is not checked.
"""

from __future__ import annotations

import ast
import collections
import dataclasses
import functools
import importlib
import inspect
import io
import pathlib
import re
import tokenize
import types

import pytest

pytestmark = [pytest.mark.quick]

ROOT = pathlib.Path(__file__).parent.parent
PACKAGE = ROOT / "modern_jax"
SOURCES = [*sorted(PACKAGE.rglob("*.py")), *sorted((ROOT / "tests").glob("*.py")),
           *sorted((ROOT / "scripts").glob("*.py"))]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# first parts that are ours by name and another well-known library's too: left out
EXTERNAL = {"tokenizers"}  # Hugging Face's `tokenizers.Tokenizer`, not `modern_jax.data.tokenizers`
# the last part of a file's name, not an attribute
EXTENSIONS = {"py", "md", "json", "jsonl", "yaml", "yml", "toml", "txt", "png", "svg", "safetensors", "parquet",
              "csv", "npz", "npy", "gz", "zip", "lock", "sh", "log", "html", "bin"}
PLACEHOLDERS = {"KEY", "VALUE", "NAME", "SECTION", "FIELD"}  # `model.KEY=VALUE`
# a name: not inside a path or an address (`/`, a dot or a word before it; `/`, a word, or a dot
# and more of a key after it)
NAME = re.compile(r"(?<![\w./@$\\])([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+\*?)(?![\w/]|\.[\w{*\[])")


# -- what is read --------------------------------------------------------------------------------

def python_words(source: str):
    """`(line, text)` of every comment and every string standing alone as a statement (docstrings)."""
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            yield token.start[0], token.string
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            for i, line in enumerate(node.value.value.splitlines()):
                yield node.lineno + i, line


def page_words(text: str):
    yield from enumerate(text.splitlines(), 1)


def dotted_names(words):
    """`(line, name)` of every dotted name in `words` (`(line, text)` pairs), files' names and
    placeholders left out."""
    for line, text in words:
        for match in NAME.finditer(text):
            parts = match.group(1).split(".")
            if parts[-1] not in EXTENSIONS and not PLACEHOLDERS & set(parts):
                yield line, match.group(1)


# -- what is ours --------------------------------------------------------------------------------

@functools.cache
def module_files() -> dict[str, pathlib.Path]:
    """The dotted path of every module and package of `modern_jax` -> its file."""
    found = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(ROOT).with_suffix("").parts
        found[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return found


def modules() -> tuple[str, ...]:
    return tuple(module_files())


@functools.cache
def classes() -> dict[str, tuple[str, ...]]:
    """Each class name defined at the top level of a module -> the modules that define it."""
    found = collections.defaultdict(list)
    for module, path in module_files().items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                found[node.name].append(module)
    return {name: tuple(where) for name, where in found.items()}


@functools.cache
def sections() -> dict[str, type]:
    """A run file's sections -> their config classes."""
    from modern_jax.config import ModelConfig
    from modern_jax.configfile import OBJECTIVES, RUN_SECTIONS
    from modern_jax.data import DataConfig
    from modern_jax.execution import ExecutionConfig
    from modern_jax.lora_config import LoRAConfig
    from modern_jax.sharding import ParallelConfig
    from modern_jax.training import TrainConfig

    found = {"model": ModelConfig, "execution": ExecutionConfig, "train": TrainConfig, "data": DataConfig,
             "parallel": ParallelConfig, "lora": LoRAConfig,
             **{name: importlib.import_module(f"modern_jax.training.objectives.{name}").Config for name in OBJECTIVES}}
    assert set(found) == set(RUN_SECTIONS), f"give the sections {set(RUN_SECTIONS) ^ set(found)} their class here"
    return found


def is_ours(name: str) -> bool:
    first = name.split(".")[0]
    if first == "modern_jax":
        return True
    if first in EXTERNAL:
        return False
    return first in {m.split(".")[-1] for m in modules()} or first in classes() or first in sections()


# -- how a name resolves -------------------------------------------------------------------------

def instance_attributes(cls: type) -> set[str]:
    """The attributes an instance of `cls` has beyond its class's: dataclass fields, annotations of
    the class body, and `self.x = ...` in a method (of `cls` or a base class of ours)."""
    found = {f.name for f in dataclasses.fields(cls)} if dataclasses.is_dataclass(cls) else set()
    for klass in cls.__mro__:
        if not klass.__module__.startswith("modern_jax"):
            continue
        found |= set(inspect.get_annotations(klass))
        try:
            tree = ast.parse(inspect.getsource(klass).strip())  # a nested class's source is indented
        except (OSError, TypeError):
            continue
        for node in ast.walk(tree):
            targets = node.targets if isinstance(node, ast.Assign) else \
                [node.target] if isinstance(node, (ast.AnnAssign, ast.AugAssign)) else []
            for target in targets:
                for t in ast.walk(target):
                    if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name) and t.value.id == "self":
                        found.add(t.attr)
    return found


def has(obj, part: str) -> bool:
    """`obj` (a module, a class or a value) has the attribute `part`, or one starting so when `part`
    ends in `*`: a class's instances' attributes count (`instance_attributes`)."""
    if not part.endswith("*"):
        return hasattr(obj, part) or (isinstance(obj, type) and part in instance_attributes(obj))
    names = set(dir(obj)) | (instance_attributes(obj) if isinstance(obj, type) else set())
    return any(name.startswith(part[:-1]) for name in names)


def walk(start, rest: list[str], where: str) -> str | None:
    """None when `rest` walks from `start` (a module or a class, named `where`); else what is missing."""
    obj = start
    for i, part in enumerate(rest):
        here = ".".join([where, *rest[:i]])
        if isinstance(obj, types.ModuleType):
            if hasattr(obj, part):
                obj = getattr(obj, part)
                continue
            if part.endswith("*"):
                if has(obj, part):
                    return None
                return f"module {here} has nothing named `{part}`"
            try:
                obj = importlib.import_module(f"{obj.__name__}.{part}")
                continue
            except ModuleNotFoundError as e:
                if e.name != f"{obj.__name__}.{part}":
                    raise
                return f"module {here} has no `{part}`"
        elif isinstance(obj, type):
            if hasattr(obj, part):
                obj = getattr(obj, part)
                continue
            if has(obj, part):
                return None  # an instance's attribute (or a family of them), of a type not known here
            return f"class {here} has no `{part}`"
        else:
            return None  # a function's or a value's attribute: not known here
    return None


def resolve(name: str) -> list[str]:
    """What is missing where `name` was looked for: empty when it resolves somewhere."""
    parts = name.split(".")
    missing = []
    for module in modules():
        path = module.split(".")
        for k in range(1, min(len(path), len(parts)) + 1):
            if path[-k:] == parts[:k]:
                why = walk(importlib.import_module(module), parts[k:], module)
                if why is None:
                    return []
                missing.append(why)
    for module in classes().get(parts[0], ()):
        why = walk(getattr(importlib.import_module(module), parts[0]), parts[1:], f"{module}.{parts[0]}")
        if why is None:
            return []
        missing.append(why)
    if parts[0] in sections():
        from modern_jax.config import MOVED

        cls = sections()[parts[0]]
        if parts[0] == "model" and len(parts) == 2 and parts[1] in MOVED:
            return []
        if has(cls, parts[1]):
            return []
        missing.append(f"the `{parts[0]}:` section ({cls.__name__}) has no field `{parts[1]}`")
    if parts[0] == "model":  # an instance of the Transformer
        from modern_jax.model import Transformer

        why = walk(Transformer, parts[1:], "modern_jax.model.Transformer")
        if why is None:
            return []
        missing.append(why)
    return missing


def stale(files, words) -> list[str]:
    """`file:line: name: what is missing` of every name of ours in `files` (`(label, text)`) that
    does not resolve; `words(label, text)` reads a file's `(line, text)`."""
    found = []
    for label, text in files:
        for line, name in sorted(dotted_names(words(label, text))):
            if is_ours(name):
                missing = resolve(name)
                if missing:
                    found.append(f"{label}:{line}: `{name}`: {'; '.join(dict.fromkeys(missing))}")
    return found


def read(label: str, text: str):
    return python_words(text) if label.endswith(".py") else page_words(text)


# -- the tests -----------------------------------------------------------------------------------

def _files(paths):
    return [(path.relative_to(ROOT).as_posix(), path.read_text()) for path in paths]


def test_every_name_in_a_comment_or_docstring_resolves():
    found = stale(_files(SOURCES), read)
    assert not found, "names of ours that no longer resolve (rename them, or point them at what exists):\n" + \
        "\n".join(found)


def test_every_name_on_a_docs_page_resolves():
    found = stale(_files(PAGES), read)
    assert not found, "names of ours that no longer resolve (rename them, or point them at what exists):\n" + \
        "\n".join(found)


def test_the_check_finds_a_stale_name_and_passes_a_true_one():
    source = '''"""Sampling: `generate.decode` writes the rows; `generate.sample_rows` does not exist.

The model's `Transformer.logits` and `model.logits(h)`, `training.layout.to_model`, `train.seq_len`,
`model.remat` (moved), `jax.lax.scan` and `tokenizers.Tokenizer.save` are fine; `train.seq_length` is not.
"""
import jax  # `distributed.Joined.lost` (stale), `training/trainer.py` and `config.json` (files), `jnp.ones`
x = 1  # `model.layers.{i}.mlp` (a checkpoint's key), `model.KEY=VALUE` (a placeholder), `Trainer.nothing`
'''
    names = [name for _, name in dotted_names(python_words(source))]
    globbed = "# `train.harness_*`, `execution.*` (no name), `train.harnesses_*`"
    assert [name for _, name in dotted_names(python_words(globbed))] == ["train.harness_*",
                                                                          "train.harnesses_*"]
    assert [line.split(": ")[1] for line in stale([("x.py", globbed)], read)] == ["`train.harnesses_*`"]
    assert "training/trainer.py" not in names and "config.json" not in names and "model.layers" not in names
    assert not is_ours("jax.lax.scan") and not is_ours("tokenizers.Tokenizer.save") and not is_ours("jnp.ones")
    found = stale([("x.py", source)], read)
    assert [line.split(": ")[0] for line in found] == ["x.py:1", "x.py:4", "x.py:6", "x.py:7"], found
    assert "module modern_jax.generate has no `sample_rows`" in found[0], found
    assert "the `train:` section (TrainConfig) has no field `seq_length`" in found[1], found
    assert "`distributed.Joined.lost`: module modern_jax.multihost.distributed has no `Joined`" in found[2], found
    assert "`Trainer.nothing`: class modern_jax.training.trainer.Trainer has no `nothing`" in found[3], found
    page = "Build with `trainer_for` (`modern_jax.training.trainer.trainer_for`), not `modern_jax.training.trainer.make`.\n" \
           "```bash\nmodern-jax train configs/tiny.yaml train.seq_len=8 --parallel.tensor 2 lora.rnk=4\n```\n"
    found = stale([("page.md", page)], read)
    assert [line.split(": ")[0] for line in found] == ["page.md:1", "page.md:3"], found
    assert "`lora.rnk`" in found[1], found
