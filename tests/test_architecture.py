"""The package's shape: imports point down the layers, and the model loads no launch-side library."""

from __future__ import annotations

import ast
import json
import pathlib
import subprocess
import sys

import pytest

TESTS = pathlib.Path(__file__).parent
PACKAGE = TESTS.parent / "modern_jax"

# bottom to top; a module may import its own layer and the layers below it
LAYERS = [
    ("configfile", "config", "execution", "lora"),  # what a model is, how it runs, what a fine-tune adds
    ("sharding",),
    ("kernels",),
    ("ops",),
    ("layers",),
    ("model",),
    ("accounting", "generate", "multihost", "data"),  # what the model is measured, sampled, placed and fed with
    ("training",),
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

    for name in ("loss", "stage", "block", "attention", "ffn", "norm", "head"):  # e.g. .../jvp(loss)/stage/...
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
