"""The documentation stays true: README.md is the front page and docs/ holds the reference. Every
config field, preset and script is documented."""

import dataclasses
import pathlib
import re


from modern_jax.config import ModelConfig
from modern_jax.data import DataConfig
from modern_jax.execution import ExecutionConfig
from modern_jax.parallel import ParallelConfig
from modern_jax.training import TrainConfig

ROOT = pathlib.Path(__file__).parent.parent
DOCS = ROOT / "docs"
CONFIGURATION = (DOCS / "configuration.md").read_text()


def table_cells(text: str) -> set[str]:
    """The names in the first column of the tables' rows (`| `name` |` or `| `a`, `name` |`)."""
    return {name for row in re.findall(r"^\| (`[^|]*`) \|", text, re.M) for name in re.findall(r"`(\w+)`", row)}


def test_every_model_config_field_is_documented():
    missing = [f.name for f in dataclasses.fields(ModelConfig) if f"| `{f.name}` |" not in CONFIGURATION]
    assert not missing, f"docs/configuration.md lacks rows for ModelConfig fields: {missing}"


def test_every_run_config_field_is_documented():
    """A row of the run config's tables names each field of `execution:`, `train:`, `data:`, `parallel:`."""
    cells = table_cells(CONFIGURATION)
    missing = [f"{cls.__name__}.{f.name}" for cls in (ExecutionConfig, TrainConfig, DataConfig, ParallelConfig)
               for f in dataclasses.fields(cls) if f.name not in cells]
    assert not missing, f"docs/configuration.md lacks rows for: {missing}"


def test_every_preset_is_documented():
    missing = [p.name for p in (ROOT / "configs").glob("*.yaml") if f"| `{p.name}` |" not in CONFIGURATION]
    assert not missing, f"docs/configuration.md's presets table does not name: {missing}"


def test_every_script_is_documented():
    testing = (DOCS / "testing.md").read_text()
    missing = [p.name for p in (ROOT / "scripts").glob("*.py") if f"| `scripts/{p.name}` |" not in testing]
    assert not missing, f"docs/testing.md's scripts table does not name: {missing}"


def test_the_front_page_keeps_the_commands_ci_runs():
    """.ci/run builds the environment as the README says and runs its test command."""
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = "uv run pytest -n 2"
    assert test_command in ci and f"\n{test_command} " in readme
    assert "\nuv run modern-jax train " in readme
    for page in ("configuration", "training", "parallelism", "kernels", "huggingface", "reliability",
                 "experiments", "testing", "model"):
        assert f"](docs/{page}.md)" in readme, f"README.md's contents do not link docs/{page}.md"
