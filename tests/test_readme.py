"""README.md stays true: every config field and every preset is documented."""

import dataclasses
import pathlib

from modern_jax.config import ModelConfig

ROOT = pathlib.Path(__file__).parent.parent
README = (ROOT / "README.md").read_text()


def test_every_model_config_field_is_documented():
    missing = [f.name for f in dataclasses.fields(ModelConfig) if f"| `{f.name}` |" not in README]
    assert not missing, f"README.md lacks rows for ModelConfig fields: {missing}"


def test_every_preset_is_documented():
    missing = [p.name for p in (ROOT / "configs").glob("*.yaml") if f"`{p.name}`" not in README]
    assert not missing, f"README.md does not mention configs: {missing}"
