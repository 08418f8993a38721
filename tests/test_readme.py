"""The documentation stays true: README.md is the front page and docs/ holds the reference. Every
config field, preset and script is documented, and every relative link points at a file and
heading that exist."""

import dataclasses
import pathlib
import re

import pytest

from modern_jax.config import ModelConfig
from modern_jax.data import DataConfig
from modern_jax.execution import ExecutionConfig
from modern_jax.lora_config import LoRAConfig
from modern_jax.sharding import ParallelConfig
from modern_jax.training import TrainConfig
from modern_jax.training.objectives.dpo import DPOConfig

ROOT = pathlib.Path(__file__).parent.parent
DOCS = ROOT / "docs"
CONFIGURATION = (DOCS / "configuration.md").read_text()
PAGES = [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def table_cells(text: str) -> set[str]:
    """The names in the first column of the tables' rows (`| `name` |` or `| `a`, `name` |`)."""
    return {name for row in re.findall(r"^\| (`[^|]*`) \|", text, re.M) for name in re.findall(r"`(\w+)`", row)}


def test_every_model_config_field_is_documented():
    missing = [f.name for f in dataclasses.fields(ModelConfig) if f"| `{f.name}` |" not in CONFIGURATION]
    assert not missing, f"docs/configuration.md lacks rows for ModelConfig fields: {missing}"


@pytest.mark.quick
def test_every_run_config_field_is_documented():
    """A row of the run config's tables names each field of `execution:`, `train:`, `data:`, `parallel:`,
    `lora:` and `dpo:`."""
    cells = table_cells(CONFIGURATION)
    missing = [f"{cls.__name__}.{f.name}" for cls in (ExecutionConfig, TrainConfig, DataConfig, ParallelConfig,
                                                      LoRAConfig, DPOConfig)
               for f in dataclasses.fields(cls) if f.name not in cells]
    assert not missing, f"docs/configuration.md lacks rows for: {missing}"


def test_every_preset_is_documented():
    missing = [p.name for p in (ROOT / "configs").glob("*.yaml") if f"| `{p.name}` |" not in CONFIGURATION]
    assert not missing, f"docs/configuration.md's presets table does not name: {missing}"


def test_every_script_is_documented():
    testing = (DOCS / "testing.md").read_text()
    missing = [p.name for p in (ROOT / "scripts").glob("*.py") if f"| `scripts/{p.name}` |" not in testing]
    assert not missing, f"docs/testing.md's scripts table does not name: {missing}"


def module_rows(text: str) -> dict[str, list[str]]:
    """docs/testing.md's tests by module: `modern_jax/...py` -> the test files its row names."""
    return {module: re.findall(r"`(test_\w+\.py)`", tests)
            for module, tests in re.findall(r"^\| `(modern_jax/[\w/]+\.py)` \| (.*) \|$", text, re.M)}


@pytest.mark.quick
def test_every_module_has_its_tests_in_the_table():
    """A newcomer finds a module's tests in one step: docs/testing.md's table has a row for every
    module of the package, naming test files that exist, and no row for a module that is gone."""
    rows = module_rows((DOCS / "testing.md").read_text())
    modules = {p.relative_to(ROOT).as_posix() for p in (ROOT / "modern_jax").rglob("*.py")}
    assert not modules - set(rows), f"docs/testing.md's tests by module lack rows for: {sorted(modules - set(rows))}"
    assert not set(rows) - modules, f"docs/testing.md's tests by module name modules that are gone: " \
                                    f"{sorted(set(rows) - modules)}"
    missing = [f"{m}: {t}" for m, tests in rows.items() for t in tests if not (ROOT / "tests" / t).exists()]
    assert not missing, f"docs/testing.md's rows name test files that do not exist: {missing}"


@pytest.mark.quick
def test_the_front_page_keeps_the_commands_ci_runs():
    """.ci/run builds the environment as the README says and runs its test command."""
    readme = (ROOT / "README.md").read_text()
    ci = (ROOT / ".ci" / "run").read_text()
    test_command = "uv run pytest -n 2"
    assert test_command in ci and f"\n{test_command} " in readme
    quick = f"{test_command} -m quick"  # the day-to-day subset, beside it and in docs/testing.md
    assert f"\n{quick} " in readme and f"\n{quick}\n" in (ROOT / "docs" / "testing.md").read_text()
    assert "\nuv run modern-jax train " in readme
    for page in ("configuration", "training", "parallelism", "kernels", "huggingface", "reliability",
                 "experiments", "testing", "model"):
        assert f"](docs/{page}.md)" in readme, f"README.md's contents do not link docs/{page}.md"


def slug(heading: str) -> str:
    """GitHub's anchor of a heading: lower case, punctuation but `-` and `_` dropped, spaces to `-`."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def anchors(text: str) -> set[str]:
    """The anchors of a Markdown file's headings (outside code blocks; repeats get -1, -2, ...)."""
    seen: dict[str, int] = {}
    out = set()
    fenced = False
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            fenced = not fenced
        elif not fenced and (m := re.match(r"#{1,6} (.+)", line)):
            name = slug(m.group(1))
            out.add(name if name not in seen else f"{name}-{seen[name]}")
            seen[name] = seen.get(name, 0) + 1
    return out


def relative_links(text: str) -> list[str]:
    """The targets of a Markdown file's links and images, outside code blocks and code spans,
    that are not absolute URLs."""
    prose = re.sub(r"```.*?```", "", text, flags=re.S)
    prose = re.sub(r"`[^`\n]*`", "", prose)
    targets = re.findall(r"\]\(([^)\s]+)\)", prose)
    return [t for t in targets if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def broken_links(page: pathlib.Path) -> list[str]:
    broken = []
    for target in relative_links(page.read_text()):
        path, _, anchor = target.partition("#")
        file = (page.parent / path).resolve() if path else page
        if not file.exists():
            broken.append(f"{target} (no file {file})")
        elif anchor and (file.suffix != ".md" or anchor not in anchors(file.read_text())):
            broken.append(f"{target} (no heading #{anchor} in {file.name})")
    return broken


@pytest.mark.quick
@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_points_at_a_file_and_heading_that_exist(page):
    broken = broken_links(page)
    assert not broken, f"{page.relative_to(ROOT)} has broken links: {broken}"


def test_the_link_check_finds_a_broken_file_and_a_broken_heading(tmp_path):
    (tmp_path / "a.md").write_text("# Title\n\n## Some `code`: here\n\n```\n# not a heading\n```\n")
    page = tmp_path / "b.md"
    page.write_text("[ok](a.md#some-code-here) [ok](#local) [bad](a.md#not-a-heading) [gone](c.md) "
                    "[web](https://example.com/x.md) `[code](nowhere.md)`\n\n## Local\n")
    broken = broken_links(page)
    assert [b.split(" ")[0] for b in broken] == ["a.md#not-a-heading", "c.md"], broken


def test_every_docs_page_starts_with_a_summary_and_its_contents():
    for page in sorted(DOCS.glob("*.md")):
        text = page.read_text()
        title, summary, rest = text.split("\n\n", 2)
        assert title.startswith("# ") and not summary.startswith(("#", "-", "|")), page.name
        assert rest.startswith("Contents:"), f"{page.name}: no contents list after its summary"
