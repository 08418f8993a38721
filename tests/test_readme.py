"""README.md stays true: every config field and every preset is documented."""

import dataclasses
import pathlib
import re

from modern_jax.config import ModelConfig
from modern_jax.data import DataConfig
from modern_jax.training import TrainConfig

ROOT = pathlib.Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()


def test_every_model_config_field_is_documented():
    missing = [f.name for f in dataclasses.fields(ModelConfig) if f"| `{f.name}` |" not in README]
    assert not missing, f"README.md lacks rows for ModelConfig fields: {missing}"


def test_every_preset_is_documented():
    missing = [p.name for p in (ROOT / "configs").glob("*.yaml") if f"`{p.name}`" not in README]
    assert not missing, f"README.md does not mention configs: {missing}"


def test_every_train_and_data_field_is_documented():
    """A row of the run config's tables names each field (`| `name` |` or `| `a`, `name` |`)."""
    cells = {name for row in re.findall(r"^\| (`[^|]*`) \|", README, re.M) for name in re.findall(r"`(\w+)`", row)}
    missing = [f"{cls.__name__}.{f.name}" for cls in (TrainConfig, DataConfig) for f in dataclasses.fields(cls)
               if f.name not in cells]
    assert not missing, f"README.md lacks rows for: {missing}"
