"""The package's shape: imports point down the layers, the model loads no launch-side library, and
every einsum speaks the one letter legend."""

from __future__ import annotations

import ast
import json
import pathlib
import re
import subprocess
import sys

import pytest

TESTS = pathlib.Path(__file__).parent
PACKAGE = TESTS.parent / "modern_jax"

# bottom to top; a module may import its own layer and the layers below it
LAYERS = [
    ("configfile", "paths", "config", "execution", "lora_config"),  # what a model is, how it runs, what a fine-tune adds
    ("sharding",),
    ("kernels",),
    ("ops",),
    ("layers",),
    ("model",),
    ("accounting", "generate", "multihost", "data"),  # what the model is measured, sampled, placed and fed with
    ("training",),
    ("harness",),  # lm-eval's benchmarks: by `modern-jax harness`, and in a run, given to `train` from above
    ("planner", "convert", "report"),
    ("cli",),
]
RANK = {name: i for i, names in enumerate(LAYERS) for name in names}


def _unit(module: str) -> str:
    """`modern_jax.layers.attention` -> `layers`, `modern_jax.model` -> `model`."""
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def _imports(path: pathlib.Path) -> set[str]:
    return _imported(ast.walk(ast.parse(path.read_text())))


def _imported(nodes) -> set[str]:
    found = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
            if node.module == "modern_jax":  # `from modern_jax import kernels`
                found.update(f"modern_jax.{a.name}" for a in node.names)
    return {m for m in found if m.startswith("modern_jax.")}


def _units() -> set[str]:
    """`config`, `layers`, ...: the package's modules and subpackages."""
    return {p.relative_to(PACKAGE).parts[0].removesuffix(".py") for p in PACKAGE.rglob("*.py")} - {"__init__"}


def _is_quick(node) -> bool:
    """`node` (a decorator or a `pytestmark` value) holds `pytest.mark.quick`."""
    return any(isinstance(n, ast.Attribute) and n.attr == "quick" for n in ast.walk(node))


def _quick_imports(source: str) -> set[str]:
    """The `modern_jax` modules a test file's quick tests import: the file's own imports and those
    inside its `quick`-marked tests (all of them when `pytestmark` has the mark); none when the
    file has no quick test."""
    tree = ast.parse(source)
    marked = any(isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets)
                 and _is_quick(node.value) for node in tree.body)
    quick = [node for node in tree.body if isinstance(node, (ast.FunctionDef, ast.ClassDef))
             and node.name.startswith(("test_", "Test")) and (marked or any(map(_is_quick, node.decorator_list)))]
    if not quick:
        return set()
    return _imported(tree.body) | _imported(n for node in quick for n in ast.walk(node))


def quick_units(tests=TESTS) -> set[str]:
    """The units of the package (`_unit`) that some test file's quick tests import."""
    return {_unit(m) for path in sorted(tests.glob("test_*.py")) for m in _quick_imports(path.read_text())}


@pytest.mark.quick
def test_every_module_has_a_layer():
    units = _units()
    assert units <= set(RANK), f"modules without a layer: {units - set(RANK)}"


@pytest.mark.quick
def test_every_module_has_a_quick_test():
    """`uv run pytest -m quick` reaches every module and subpackage: some test file imports it and
    marks a test `quick` (docs/testing.md). A file's own imports count, and the imports inside
    its quick tests."""
    missing = _units() - quick_units()
    assert not missing, (f"no quick test imports modern_jax.{{{', '.join(sorted(missing))}}}: mark a fast test "
                         f"of each `@pytest.mark.quick`")


@pytest.mark.quick
def test_the_quick_check_reads_marks_and_imports():
    source = """
import pytest
from modern_jax.config import ModelConfig
from modern_jax import sharding


def helper():
    from modern_jax.training import train


@pytest.mark.quick
def test_a():
    import modern_jax.kernels.norm


def test_b():
    from modern_jax.cli import main
"""
    assert {_unit(m) for m in _quick_imports(source)} == {"config", "sharding", "kernels"}
    assert _quick_imports(source.replace("@pytest.mark.quick", "")) == set()
    marked = source.replace("@pytest.mark.quick", "").replace("\ndef helper", "pytestmark = [pytest.mark.quick]\ndef helper")
    assert {_unit(m) for m in _quick_imports(marked)} == {"config", "sharding", "kernels", "cli"}


@pytest.mark.quick
def test_imports_point_down_the_layers():
    upward = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE)
        unit = rel.parts[0].removesuffix(".py")
        if unit == "__init__":
            continue
        for module in sorted(_imports(path)):
            target = _unit(module)
            if target in RANK and RANK[target] > RANK[unit]:
                upward.append(f"modern_jax/{rel.as_posix()} imports {module} ({target} is above {unit})")
    assert not upward, "\n".join(upward)


def test_importing_the_model_loads_no_checkpoint_optimiser_or_data_library():
    """`import modern_jax.model` (through the package) stays on the model side. Flax itself
    imports optax (for `nnx.Optimizer`), so optax is not ours to avoid."""
    code = ("import json, sys; import modern_jax.model; "
            "print(json.dumps(sorted(m for m in sys.modules if m.split('.')[0] in "
            "('orbax', 'grain', 'safetensors', 'tensorstore', 'tokenizers', 'matplotlib', 'tensorboardX') "
            "or m.split('.')[:2] in (['modern_jax', 'training'], ['modern_jax', 'data'], "
            "['modern_jax', 'convert'], ['modern_jax', 'multihost'], ['modern_jax', 'cli']))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"JAX_PLATFORMS": "cpu", "PATH": ""})
    assert json.loads(out.stdout.splitlines()[-1]) == []


def test_the_package_names_load_on_first_use():
    code = ("import sys, modern_jax; before = 'modern_jax.convert' in sys.modules; "
            "from modern_jax import ModelConfig, Transformer, from_hf; "
            "print(before, 'modern_jax.convert' in sys.modules, Transformer.__module__)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"JAX_PLATFORMS": "cpu", "PATH": ""})
    assert out.stdout.split() == ["False", "True", "modern_jax.model"]


def test_profiles_name_the_stages_blocks_attention_ffn_head_and_loss():
    """Every sub-block runs inside a `jax.named_scope`, so a profile (and the lowered program's
    locations) names it."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from modern_jax.config import ModelConfig
    from modern_jax.model import Transformer
    from modern_jax.training.loss import model_loss_sums

    cfg = ModelConfig(vocab_size=32, d_model=16, n_layers=2, n_heads=2, d_ff=32)
    graphdef, state = nnx.split(Transformer(cfg, rngs=nnx.Rngs(0)))
    tokens = jnp.zeros((1, 8), jnp.int32)
    batch = {"inputs": tokens, "targets": tokens, "positions": jnp.arange(8)[None], "weights": jnp.ones((1, 8)),
             "segment_ids": jnp.ones((1, 8), jnp.int32)}
    loss = lambda state: model_loss_sums(nnx.merge(graphdef, state), batch)["ce"]  # noqa: E731
    text = jax.jit(jax.grad(loss)).lower(state).as_text(debug_info=True)
    import re

    for name in ("loss", "stack", "block", "attention", "ffn", "norm", "head"):  # e.g. .../jvp(loss)/stack/...
        assert re.search(rf"[/(]{name}[/)]", text), name


def test_no_layer_names_a_mesh_axis_or_a_parallel_strategy():
    """Parallelism lives below the layers (`modern_jax.sharding`, `modern_jax.ops`): a layer or the
    model names logical axes only, never a mesh axis, a strategy of an axis, or the active mesh."""
    from modern_jax.sharding import AXES, Strategies
    import dataclasses

    banned = set(AXES) | {f.name for f in dataclasses.fields(Strategies)} | {"strategies", "active", "logical_rules",
                                                                           "shard_map", "Mesh", "mesh"}
    found = []
    for path in sorted([*(PACKAGE / "layers").glob("*.py"), PACKAGE / "model.py"]):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value in banned:
                found.append(f"{path.name}:{node.lineno} the string {node.value!r}")
            elif isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "nnx":
                continue  # flax's own names (`nnx.data` marks a pytree attribute, not the mesh axis)
            elif isinstance(node, (ast.Name, ast.Attribute, ast.alias, ast.arg)):
                name = getattr(node, "id", None) or getattr(node, "attr", None) or getattr(node, "name", None) \
                    or getattr(node, "arg", None)
                if name in banned:
                    found.append(f"{path.name}:{node.lineno} the name {name!r}")
    assert not found, found


def _names_in(path: pathlib.Path):
    """`(line, identifier)` of every name token in a module (strings and comments left out)."""
    import tokenize

    with path.open("rb") as f:
        for token in tokenize.tokenize(f.readline):
            if token.type == tokenize.NAME:
                yield token.start[0], token.string


def test_no_code_outside_an_objective_names_it():
    """The Trainer, the loop, the planner and the commands never ask which objective runs: no
    identifier spelling an objective's name (`dpo`, `run.dpo`, `DPOConfig`, `dpo_loss`) appears
    outside its own module (the registry holds section names as strings)."""
    import re

    from modern_jax.configfile import OBJECTIVES

    named = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for name in OBJECTIVES:
            if rel == f"training/objectives/{name}.py":
                continue
            named += [f"modern_jax/{rel}:{line}: {token}" for line, token in _names_in(path)
                      if re.fullmatch(rf"{name}(_\w*|config)?", token.lower())]
    assert not named, "\n".join(named)


# einsums built around another equation, not written out: LoRA's adapter follows its projection's
# letters and takes a free one for its rank (module, class)
BUILT = {("training/converters.py", "Adapter")}
EQUATION = re.compile(r"[A-Za-z.]*(?:,[A-Za-z.]*)*->[A-Za-z.]*")


def legend(source: str | None = None) -> list[tuple[str, str]]:
    """The package legend's rows `(letter, meaning)`, from the table in `modern_jax/__init__.py`'s docstring."""
    doc = ast.get_docstring(ast.parse(source if source is not None else (PACKAGE / "__init__.py").read_text()))
    return re.findall(r"^\| ([A-Z]) \| (.+?) \|$", doc or "", re.M)


def declared_letters(source: str) -> set[str] | None:
    """The letters a module's docstring says it uses: the single capitals of its paragraph that
    starts `Letters` (None without one)."""
    doc = ast.get_docstring(ast.parse(source)) or ""
    paragraph = next((p for p in doc.split("\n\n") if p.lstrip().startswith("Letters")), None)
    return None if paragraph is None else set(re.findall(r"(?<![A-Za-z_`])[A-Z](?![A-Za-z_])", paragraph))


def einsum_equations(source: str, skip_classes=()) -> list[tuple[int, str]]:
    """`(line, equation)` of every einsum the source writes out: the first argument of `einsum(...)`
    and of a projection's call (`q_proj("BTD,DNH->BTNH", x)`: a string that reads as an equation);
    an f-string gives its literal parts (what is formatted in is another equation's). An equation
    in a variable is checked where it is written; the classes `skip_classes` are left out."""
    tree = ast.parse(source)
    skipped = [range(node.lineno, node.end_lineno + 1) for node in ast.walk(tree)
               if isinstance(node, ast.ClassDef) and node.name in skip_classes]
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call) or not node.args or any(node.lineno in r for r in skipped):
            continue
        name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
        first = node.args[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            if name == "einsum" or EQUATION.fullmatch(first.value.replace(" ", "")):
                found.append((node.lineno, first.value))
        elif isinstance(first, ast.JoinedStr) and name == "einsum":
            found.append((node.lineno, "".join(v.value for v in first.values if isinstance(v, ast.Constant))))
    return found


def letter_errors(rel: str, source: str, letters: set[str]) -> list[str]:
    """What is wrong with the einsum letters of one module: a letter outside the legend, or outside
    the letters its docstring names (STYLE.md: one letter convention, stated in the module docstring)."""
    skip = {cls for module, cls in BUILT if module == rel}
    equations = einsum_equations(source, skip)
    if not equations:
        return []
    declared = declared_letters(source)
    if declared is None:
        return [f"modern_jax/{rel} writes einsums but its docstring has no `Letters` paragraph"]
    errors = [f"modern_jax/{rel}'s docstring names {sorted(declared - letters)}, not in the package legend"] \
        if declared - letters else []
    for line, equation in equations:
        used = set(re.findall(r"[A-Za-z]", equation))
        if used - letters:
            errors.append(f"modern_jax/{rel}:{line} {equation!r}: {sorted(used - letters)} not in the package legend")
        elif used - declared:
            errors.append(f"modern_jax/{rel}:{line} {equation!r}: {sorted(used - declared)} not in its docstring's "
                          f"Letters")
    return errors


@pytest.mark.quick
def test_the_legend_gives_each_letter_one_meaning():
    rows = legend()
    letters = [letter for letter, _ in rows]
    assert len(rows) >= 20 and len(letters) == len(set(letters)), sorted(letters)


@pytest.mark.quick
def test_every_einsum_uses_the_letters_of_the_legend():
    """Every einsum string written in the package uses letters of the one legend
    (`modern_jax/__init__.py`), and only those its module's docstring names."""
    letters = {letter for letter, _ in legend()}
    errors = []
    for path in sorted(PACKAGE.rglob("*.py")):
        errors += letter_errors(path.relative_to(PACKAGE).as_posix(), path.read_text(), letters)
    assert not errors, "\n".join(errors)


@pytest.mark.quick
def test_the_letter_check_finds_an_undeclared_letter():
    source = '''"""A layer.

Letters: B batch, T length, D model, F ffn width.
"""
import jax.numpy as jnp


def f(x, w, y, letters):
    a = jnp.einsum("BTD,DF->BTF", x, w)
    b = self.up_proj("BTD,DIF->BTIF", x)  # I: declared by the legend, not by this docstring
    c = jnp.einsum(f"{letters},DF->BTq", x, w)  # q: no letter of the legend
    d = jnp.einsum(equation, x, w)  # checked where it is written
    return "training {} -> {}".format(a, b)


class Adapter:
    def delta(self, a, b):
        return jnp.einsum("...ir,...ro->...io", a, b)
'''
    assert [eq for _, eq in einsum_equations(source)] == ["BTD,DF->BTF", "BTD,DIF->BTIF", ",DF->BTq",
                                                          "...ir,...ro->...io"]
    errors = letter_errors("training/converters.py", source, set("ABDFIT"))
    assert len(errors) == 2 and "'BTD,DIF->BTIF': ['I'] not in its docstring's Letters" in errors[0] \
        and "',DF->BTq': ['q'] not in the package legend" in errors[1], errors
    assert letter_errors("layers/ffn.py", source, set("ABDFIT"))[-1].endswith("['i', 'o', 'r'] not in the package legend")
    assert letter_errors("x.py", source.replace("Letters:", "Shapes:"), set("BDFT")) == [
        "modern_jax/x.py writes einsums but its docstring has no `Letters` paragraph"]


def test_the_model_knows_nothing_of_fine_tuning():
    """LoRA is a converter given to the Trainer (`training/converters.py`): the model, its layers and
    kernels import no fine-tuning module and name no adapter, and `Transformer` takes no LoRA argument."""
    import inspect
    import re

    from modern_jax.model import Transformer

    assert "lora" not in inspect.signature(Transformer).parameters
    found = []
    for path in [PACKAGE / "model.py", *sorted((PACKAGE / "layers").glob("*.py")),
                 *sorted((PACKAGE / "kernels").glob("*.py"))]:
        rel = path.relative_to(PACKAGE).as_posix()
        found += [f"{rel} imports {m}" for m in _imports(path) if m.startswith(("modern_jax.lora_config", "modern_jax.training"))]
        found += [f"{rel}:{line}: {token}" for line, token in _names_in(path)
                  if re.fullmatch(r"(?i)(lora\w*|\w*adapter\w*|adapt)", token)]
    assert not found, "\n".join(found)


# STYLE.md 17: one job a part, one screen a function
MAX_METHODS, MAX_ARGUMENTS, MAX_LINES = 20, 8, 80


def size_problems(rel: str, source: str) -> list[str]:
    """What is too big in one module: a class of over `MAX_METHODS` methods, a constructor of over
    `MAX_ARGUMENTS` arguments (self aside), a function of over `MAX_LINES` lines (def to last line;
    a kernel's aside: `kernels/`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ClassDef):
            methods = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
            if len(methods) > MAX_METHODS:
                found.append(f"{rel}: class {node.name} has {len(methods)} methods (at most {MAX_METHODS})")
            init = next((n for n in methods if n.name == "__init__"), None)
            if init is not None:
                a = init.args
                count = len(a.posonlyargs) + len(a.args) - 1 + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
                if count > MAX_ARGUMENTS:
                    found.append(f"{rel}: {node.name}.__init__ takes {count} arguments (at most {MAX_ARGUMENTS})")
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and not rel.startswith("kernels/"):
            lines = node.end_lineno - node.lineno + 1
            if lines > MAX_LINES:
                found.append(f"{rel}:{node.lineno}: {node.name} is {lines} lines (at most {MAX_LINES})")
    return found


@pytest.mark.quick
def test_no_class_function_or_constructor_is_too_big():
    """No class over 20 methods or 8 constructor arguments, no function over 80 lines outside the kernels."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        found += size_problems(path.relative_to(PACKAGE).as_posix(), path.read_text())
    assert not found, "\n".join(found)


@pytest.mark.quick
def test_the_size_check_counts_methods_arguments_and_lines():
    body = "\n".join(f"    def m{i}(self):\n        pass" for i in range(21))
    long = "def f():\n" + "    x = 1\n" * 80
    source = f"class Wide:\n{body}\n\n\nclass Many:\n    def __init__(self, a, b, c, d, e, f, g, *, h, i):\n" \
             f"        pass\n\n\n{long}"
    assert size_problems("training/x.py", source) == [
        "training/x.py: class Wide has 21 methods (at most 20)",
        "training/x.py: Many.__init__ takes 9 arguments (at most 8)",
        "training/x.py:51: f is 81 lines (at most 80)"]
    assert size_problems("kernels/x.py", long) == []
    assert size_problems("training/x.py", long.replace("    x = 1\n", "", 1)) == []


@pytest.mark.quick
def test_converters_and_trainers_are_built_in_one_place():
    """Only `training/converters.py` reads a run's `lora:` section (`run.lora`): the Trainer, the
    loop and the checkpoints ask the converter (`converter_of(run)`); a Trainer is built by
    `trainer_for` alone, in the package, the scripts and the tests (whose one helper,
    `common.make_trainer`, calls it)."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        text = path.read_text()
        if rel != "training/converters.py":
            found += [f"modern_jax/{rel}:{i}: reads run.lora" for i, line in enumerate(text.splitlines(), 1)
                      if re.search(r"\brun\.lora\b", line)]
    for path in sorted([*PACKAGE.rglob("*.py"), *TESTS.glob("*.py"), *(TESTS.parent / "scripts").glob("*.py")]):
        rel = path.relative_to(TESTS.parent).as_posix()
        if rel == "modern_jax/training/trainer.py":
            continue
        found += [f"{rel}:{line}: builds a Trainer by hand" for line, token, nxt in _calls(path)
                  if token == "Trainer" and nxt == "("]
    assert not found, "\n".join(found)


def _calls(path: pathlib.Path):
    """`(line, name, next token)` of every name token of a module (strings and comments left out)."""
    import tokenize

    with path.open("rb") as f:
        tokens = [t for t in tokenize.tokenize(f.readline) if t.type in (tokenize.NAME, tokenize.OP)]
    for token, nxt in zip(tokens, tokens[1:]):
        if token.type == tokenize.NAME:
            yield token.start[0], token.string, nxt.string
