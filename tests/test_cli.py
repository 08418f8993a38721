"""The `modern-jax` command's shape (`modern_jax/cli/`): each command is one module that owns its
parser (`add_parser`) and runs it (`run`), `build_parser` only composes them, and no function
is over a screen. What the commands do is tested beside what they run (docs/testing.md's table);
their refusals in test_reliability_cli.py."""

import argparse
import ast
import importlib
import pathlib
import subprocess
import sys

import pytest

from modern_jax.cli import build_parser
from modern_jax.cli.shared import COMPUTING, _launch_flags

CLI = pathlib.Path(__file__).parent.parent / "modern_jax" / "cli"
SHARED = {"__init__", "__main__", "shared"}  # the package's parts that are not a command
LONGEST = 80  # lines of a function, its def line through its last


def command_modules() -> list[str]:
    return sorted(p.stem for p in CLI.glob("*.py") if p.stem not in SHARED)


def own_parser(name: str) -> argparse.ArgumentParser:
    """The parser that `modern_jax.cli.<name>` adds, alone."""
    subparsers = argparse.ArgumentParser(prog="modern-jax").add_subparsers(dest="command")
    importlib.import_module(f"modern_jax.cli.{name}").add_parser(subparsers)
    assert list(subparsers.choices) == [name], f"modern_jax/cli/{name}.py adds {list(subparsers.choices)}"
    return subparsers.choices[name]


def options(parser: argparse.ArgumentParser) -> list[tuple]:
    return [(tuple(a.option_strings), a.dest, a.help, a.default) for a in parser._actions]


@pytest.mark.quick
def test_every_command_is_one_module_that_owns_its_parser():
    """Every command of `build_parser()` is the module of its name, which adds that parser and
    no other and runs it; the package adds only the launch flags of the commands that join one."""
    commands = build_parser().commands
    assert sorted(commands) == command_modules()
    for name in command_modules():
        module = importlib.import_module(f"modern_jax.cli.{name}")
        own = own_parser(name)
        assert own.get_default("func") is module.run and commands[name].get_default("func") is module.run
        if name in COMPUTING:
            _launch_flags(own)
        assert options(commands[name]) == options(own), name


def long_functions(path: pathlib.Path) -> list[str]:
    return [f"{path.name}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)"
            for node in ast.walk(ast.parse(path.read_text()))
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= LONGEST]


@pytest.mark.quick
def test_no_function_of_the_command_is_over_a_screen():
    found = [f for path in sorted(CLI.glob("*.py")) for f in long_functions(path)]
    assert not found, f"functions over {LONGEST} lines in modern_jax/cli/ (split them): {found}"


@pytest.mark.quick
def test_the_length_check_finds_a_long_function(tmp_path):
    body = "".join(f"    x{i} = {i}\n" for i in range(LONGEST - 2))
    path = tmp_path / "long.py"
    path.write_text(f"def fits():\n{body}    return 0\n\n\ndef over():\n{body}    y = 0\n    return y\n")
    assert long_functions(path) == [f"long.py:{LONGEST + 3} over ({LONGEST + 1} lines)"]


@pytest.mark.quick
def test_python_dash_m_runs_the_command():
    """`python -m modern_jax.cli` is the `modern-jax` command (plan re-runs itself so, launch starts
    its processes so)."""
    done = subprocess.run([sys.executable, "-m", "modern_jax.cli", "launch", "--help"], capture_output=True,
                          text=True)
    assert done.returncode == 0 and done.stdout.startswith("usage: modern-jax launch "), done.stderr
