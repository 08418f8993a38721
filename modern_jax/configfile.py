"""What the config sections share: the field error, unknown keys, reading YAML / JSON files
and dotted overrides.

Each section is a frozen dataclass validated at construction (`ModelConfig` in
`modern_jax.config`, `TrainConfig`, `DataConfig`, `ParallelConfig`); they all fail with
`fail(Section, field, value, allowed)` -> `Section.field=value is invalid: allowed`, reject
unknown keys with `check_keys`, and are read from run files by `load_config_file`.
"""

from __future__ import annotations

import difflib
import functools
from typing import Any


class MovedSetting(UserWarning):
    """A setting read in the place it used to live (the notice says where it lives now)."""


def fail(section: str, field_name: str, value: Any, allowed: str) -> None:
    """Raise the one error every config field gives: `Section.field=value is invalid: allowed`."""
    raise ValueError(f"{section}.{field_name}={value!r} is invalid: {allowed}")


def check_keys(section: str, values: dict, allowed: list[str]) -> None:
    """Reject unknown keys with the closest allowed names."""
    for key in values:
        if key not in allowed:
            close = difflib.get_close_matches(key, allowed, n=3)
            hint = f"; did you mean {', '.join(close)}?" if close else ""
            raise ValueError(f"unknown key {section}.{key}{hint} (allowed: {', '.join(allowed)})")


# the sections that choose a training objective, each a module of `modern_jax.training.objectives`
OBJECTIVES = ("dpo", "grpo")
RUN_SECTIONS = ("model", "execution", "train", "data", "parallel", "lora", *OBJECTIVES)  # the sections of a run file
OPTIONAL_SECTIONS = ("lora", *OBJECTIVES)  # sections an override `SECTION=null` drops


@functools.cache
def _yaml_loader():
    """PyYAML's safe loader, made strict: a key given twice in one mapping is an error,
    and `1e-5` (no dot) reads as a float as in YAML 1.2, not as a string."""
    import re

    import yaml

    class DuplicateKey(yaml.YAMLError):
        def __init__(self, key, first, second):
            self.key, self.first, self.second = key, first, second

        def __str__(self):
            return f"duplicate key {self.key!r} (lines {self.first} and {self.second}): give each key once"

    class StrictLoader(yaml.SafeLoader):
        def construct_mapping(self, node, deep=False):
            if isinstance(node, yaml.MappingNode):
                seen = {}
                for key_node, _ in node.value:
                    if key_node.tag == "tag:yaml.org,2002:merge":
                        continue
                    key = self.construct_object(key_node, deep=True)
                    line = key_node.start_mark.line + 1
                    try:
                        first = seen.get(key)
                    except TypeError:  # an unhashable key: the base class reports it
                        continue
                    if first is not None:
                        raise DuplicateKey(key, first, line)
                    seen[key] = line
            return super().construct_mapping(node, deep)

    StrictLoader.DuplicateKey = DuplicateKey
    StrictLoader.add_implicit_resolver(
        "tag:yaml.org,2002:float", re.compile(r"^[-+]?[0-9][0-9_]*[eE][-+]?[0-9]+$"), list("-+0123456789"))
    return StrictLoader


def parse_yaml(text: str):
    """Parse YAML text with the strict loader (duplicate keys are errors); raises yaml.YAMLError."""
    import yaml

    return yaml.load(text, Loader=_yaml_loader())


def _yaml_problem(e):
    """`(mark, one-line problem)` of a PyYAML syntax error (its own text spans lines, naming `<unicode string>`)."""
    mark = e.problem_mark or e.context_mark
    problem = e.problem or e.context or "invalid YAML"
    if "'\\t'" in problem:
        problem += ": indent with spaces, YAML does not allow tabs"
    if e.context and e.problem and e.context_mark is not None and e.context_mark.line != mark.line:
        problem += f"; {e.context} at line {e.context_mark.line + 1}"
    return mark, problem


def read_yaml(path):
    """The contents of a YAML file; every problem is a ValueError naming the file (and the line)."""
    import yaml

    from modern_jax import paths

    path = paths.as_path(path)
    if path.is_dir():
        inside = path / "config.yaml"
        hint = f"; did you mean {inside}?" if inside.is_file() else ""
        raise ValueError(f"{path} is a directory, not a YAML file{hint}")
    if not path.is_file():
        raise ValueError(f"config file {str(path)!r} does not exist")
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as e:
        raise ValueError(f"{path} cannot be read ({e.strerror or e}): check its permissions") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}): is it a YAML file?") from None
    try:
        return parse_yaml(text)
    except yaml.MarkedYAMLError as e:
        mark, problem = _yaml_problem(e)
        where = f", line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        raise ValueError(f"{path}{where}: could not parse YAML ({problem})") from None
    except _yaml_loader().DuplicateKey as e:
        raise ValueError(f"{path}: {e}") from None
    except yaml.reader.ReaderError as e:
        raise ValueError(f"{path}: could not parse YAML (character {e.character!r} at offset {e.position}: "
                         f"{e.reason})") from None
    except yaml.YAMLError as e:
        raise ValueError(f"{path}: could not parse YAML ({e})") from None


def read_json(path, expect: type | None = dict):
    """The contents of a JSON file (a mapping, unless `expect` says otherwise); every problem is a
    ValueError naming the file (and the line)."""
    import json

    from modern_jax import paths

    path = paths.as_path(path)  # on the local disk or object storage
    if path.is_dir():
        raise ValueError(f"{path} is a directory, not a JSON file")
    if not path.is_file():
        raise ValueError(f"{path} does not exist")
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise ValueError(f"{path} cannot be read ({e.strerror or e}): check its permissions") from None
    except UnicodeDecodeError as e:
        raise ValueError(f"{path}: not UTF-8 text (byte {e.start}): is it a JSON file?") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"{path}, line {e.lineno}, column {e.colno}: could not parse JSON ({e.msg})") from None
    if expect is not None and not isinstance(value, expect):
        kind = {dict: "an object {...}", list: "an array [...]"}.get(expect, expect.__name__)
        raise ValueError(f"{path}: expected {kind}, got {type(value).__name__} {str(value)[:60]}")
    return value


def check_sections(raw: dict, where: str, sections=RUN_SECTIONS) -> None:
    """Every top-level key is a known section, and each section is a mapping (or empty)."""
    for key, value in raw.items():
        if key not in sections:
            close = difflib.get_close_matches(str(key), sections, n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ValueError(f"{where}: unknown section {key!r}{hint} (sections: {', '.join(sections)})")
        if value is not None and not isinstance(value, dict):
            raise ValueError(f"{where}: section {key!r} must be a mapping, got {value!r}")


def apply_overrides(raw: dict, overrides: list[str], sections=None) -> dict:
    """Apply dotted `section.key=value` overrides (values parsed as YAML) to a config dict.
    With `sections`, an override of any other section is an error."""
    import yaml

    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items()}
    for item in overrides:
        key, sep, text = item.partition("=")
        if sep and key in OPTIONAL_SECTIONS and text.strip() in ("null", "~"):  # `lora=null`: the section dropped
            raw.pop(key, None)
            continue
        if not sep or "." not in key:
            raise ValueError(f"bad override {item!r}: expected section.key=value, e.g. model.n_layers=4 (or "
                             f"SECTION=null to drop an optional section: {', '.join(OPTIONAL_SECTIONS)})")
        if sections is not None:
            check_sections({key.split(".")[0]: {}}, f"bad override {item!r}", sections)
        try:
            value = parse_yaml(text)
        except yaml.MarkedYAMLError as e:
            mark, problem = _yaml_problem(e)
            where = f"at character {mark.column + 1}: " if mark is not None and mark.line == 0 else ""
            raise ValueError(f"bad override {item!r}: the value is not valid YAML ({where}{problem})") from None
        except yaml.YAMLError as e:
            raise ValueError(f"bad override {item!r}: the value is not valid YAML ({e})") from None
        *path, leaf = key.split(".")
        node = raw
        for part in path:
            if node.get(part) is None:  # absent, or an empty section (`train:`)
                node[part] = {}
            node = node[part]
            if not isinstance(node, dict):
                raise ValueError(f"bad override {item!r}: {part} is not a section")
        node[leaf] = value
    return raw


def load_config_file(path, overrides: list[str] = (), sections=RUN_SECTIONS) -> dict:
    """Read a YAML config (the sections of a run file), then apply dotted overrides."""
    raw = read_yaml(path)
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ValueError(f"{path}: expected a mapping of sections (model:, train:, ...), got {raw!r}"[:300])
    if sections is not None:
        check_sections(raw, str(path), sections)
    return apply_overrides(raw, list(overrides), sections)


