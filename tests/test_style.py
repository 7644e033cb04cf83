"""The code as the project keeps it: `ruff format` and `ruff check` clean (pyproject.toml's rules), and a
repository that stands alone (nothing points outside it)."""

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("command", [["format", "--check"], ["check"]])
def test_ruff_is_clean(command):
    out = subprocess.run(
        [sys.executable, "-m", "ruff", *command, "."], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]


def test_nothing_points_outside_the_repository():
    tracked = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True).stdout.split()
    files = [ROOT / f for f in tracked if f.endswith((".py", ".md", ".toml"))] or list(ROOT.rglob("*.py"))
    notes = ("../" + "shared", "shared/" + "docs")  # the team's planning notes, which a clone does not have
    outside = [f"{f.relative_to(ROOT)}" for f in files if any(n in f.read_text() for n in notes)]
    assert outside == []


FILES = ("olmo3.py", "train.py", "data.py", "ckpt.py", "shard.py")


def imported(file: str) -> set[str]:
    """Every module `file` imports, at the top or inside a function."""
    tree = ast.parse((ROOT / file).read_text())
    names = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


def test_ckpt_never_imports_train_and_olmo3_never_jax_sharding():
    assert "train" not in imported("ckpt.py")
    assert not {m for m in imported("olmo3.py") if m.startswith("jax.sharding")}


def test_orbax_is_imported_by_ckpt_alone():
    assert [f for f in FILES if any(m.startswith("orbax") for m in imported(f))] == ["ckpt.py"]


def test_train_py_reads_as_the_recipe_first():
    """Config, schedule, optimizer, loss, train step, loop and main, in that order and within 650 lines of the
    top; below the heading that says nothing there changes what a step computes, no function reads a field of
    the optimizer's state (its Adam carry-over and skip window are the recipe's: adam_of, carried_over,
    skip_window_of above the heading)."""
    text = (ROOT / "train.py").read_text()
    lines = text.split("\n")
    marker = next(
        i for i, line in enumerate(lines) if "Nothing below changes what a train step computes" in line
    )
    tree = ast.parse(text)
    tops = {n.name: n.lineno for n in tree.body if isinstance(n, ast.FunctionDef | ast.ClassDef)}
    recipe = [
        "lr_at",
        "with_one_epoch",
        "init_opt",
        "carried_over",
        "loss_sums",
        "instances_kept",
        "train_step",
    ]
    recipe += ["train_loop", "main"]
    assert [tops[name] for name in recipe] == sorted(tops[name] for name in recipe)
    assert tops["main"] < marker < 650, (tops["main"], marker)
    fields = {
        n.target.id
        for n in ast.walk(tree)
        if isinstance(n, ast.ClassDef) and n.name == "OptState"
        for n in n.body
        if isinstance(n, ast.AnnAssign)
    }
    below = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.lineno > marker]
    called = {
        id(n.func) for n in ast.walk(tree) if isinstance(n, ast.Call)
    }  # methods (str.count) are no fields
    reads = [
        f"{function.name}: {ast.unparse(node)}"
        for function in below
        for node in ast.walk(function)
        if isinstance(node, ast.Attribute)
        and node.attr in fields
        and id(node) not in called
        or isinstance(node, ast.Subscript)
        and isinstance(node.slice, ast.Constant)
        and node.slice.value in fields
    ]
    assert fields >= {"mu", "nu", "count", "losses"} and reads == []


def test_no_function_is_longer_than_50_lines():
    long = []
    for file in FILES:
        for node in ast.walk(ast.parse((ROOT / file).read_text())):
            if (
                isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
                and node.end_lineno - node.lineno >= 50
            ):
                long.append(f"{file}:{node.lineno} {node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert long == []
