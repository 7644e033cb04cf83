"""The README and docs/ show what works. Every fenced block is `bash` (commands, or train.py's flags alone),
`console` (`$ ` commands and what they print) or `text` (what a command prints). In every command:
- train.py's flags are its own (its own parser, train.parse_args);
- ckpt.py's, data.py's and bench/'s arguments are what their argparse parsers accept, spelled out (the script
  runs up to its parser and no further);
- pip's extras are pyproject.toml's, and the repository's files it names exist;
- the install line shown before it (else the quick start's) brings every extra it needs, as train.py decides
  that (train.extras_needed) and refuses a run without one.
Every relative link resolves, every `train.NAME` (data., ckpt., olmo3., shard.) a page names exists, the
README stays a front door, and .ci/run runs the README's test command."""

import argparse
import importlib
import os
import re
import runpy
import shlex
import sys
import tomllib
from pathlib import Path

import pytest

import train

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.MULTILINE | re.DOTALL)
LANGUAGES = ("bash", "console", "text")
EXTRAS = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
PYTHON = re.compile(r"(\S*/)?python3?")
MODULES = ("train", "data", "ckpt", "olmo3", "shard")


def name(page: Path) -> str:
    return str(page.relative_to(ROOT))


def fenced_blocks(page: Path) -> list[tuple[int, str, str]]:
    """(line of the opening fence, language, text) of each fenced block of a page."""
    text = page.read_text()
    return [(text.count("\n", 0, m.start()) + 1, m[1], m[2]) for m in FENCE.finditer(text)]


def command_lines(language: str, text: str) -> list[str]:
    """A bash block's lines and a console block's `$ ` lines, each joined to what its backslash continues."""
    lines, out = text.splitlines(), []
    while lines:
        line = lines.pop(0)
        while line.endswith("\\") and lines:
            line = line[:-1] + " " + lines.pop(0).strip()
        if language == "bash" and line.strip():
            out.append(line)
        elif language == "console" and line.startswith("$ "):
            out.append(line[2:])
    return out


def simple_commands(line: str) -> list[list[str]]:
    """The words of each command of a line: split at &&, ||, ; and |, and an argument holding a command of its
    own (gcloud's --command="...") is one more."""
    out, words = [], []
    for word in shlex.split(line, comments=True):
        if word in ("&&", "||", ";", "|"):
            out, words = out + [words], []
            continue
        words.append(word)
        if " " in word:
            out += simple_commands(word.partition("=")[2] if word.startswith("-") else word)
    return [w for w in out + [words] if w]


def all_commands() -> list:
    found = []
    for page in PAGES:
        for line, language, text in fenced_blocks(page):
            for command in command_lines(language, text):
                found += [
                    pytest.param(w, id=f"{name(page)}:{line} {shlex.join(w)[:70]}")
                    for w in simple_commands(command)
                ]
    return found


@pytest.fixture
def untouched(monkeypatch):
    """The process as it was before the test: what a script does before its parser (sys.path, os.environ,
    sys.argv) is undone."""
    monkeypatch.setattr(sys, "path", list(sys.path))
    monkeypatch.setattr(sys, "argv", list(sys.argv))
    environ = dict(os.environ)
    yield monkeypatch
    os.environ.clear()
    os.environ.update(environ)


class Parsed(Exception):
    """Raised in place of running a script, once its parser has accepted the arguments."""


def argparse_accepts(script: str, argv: list[str], monkeypatch) -> None:
    """Run `script` as `python script argv` up to its argparse parser: its own parser, its own subcommands."""
    init, parse = argparse.ArgumentParser.__init__, argparse.ArgumentParser.parse_args

    def spelled_out(self, *args, **kwargs):  # a flag's prefix works, until a new flag shares it
        init(self, *args, **kwargs | {"allow_abbrev": False})

    def parse_only(self, args=None, namespace=None):
        parse(self, args, namespace)  # a refused argument exits 2 here, with argparse's own message
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "__init__", spelled_out)
    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_only)
    monkeypatch.setattr(sys, "argv", [script, *argv])
    sys.path.insert(0, str((ROOT / script).parent))  # as `python script` puts it first
    try:
        runpy.run_path(str(ROOT / script), run_name="__main__")
    except Parsed:
        return
    except SystemExit as e:
        pytest.fail(f"python {script} {shlex.join(argv)}: refused (exit {e.code}; its message is above)")
    pytest.fail(f"python {script} {shlex.join(argv)}: ended without parsing its arguments")


def train_accepts(argv: list[str]) -> None:
    try:
        train.parse_args(argv)  # an unknown flag or a bad value: train.FlagError, naming it
    except SystemExit as e:  # --help
        assert e.code == 0, f"python train.py {shlex.join(argv)}: exit {e.code}"


def repository_files(words: list[str]) -> None:
    """The repository's own files a command names (scripts, tests, pages) exist."""
    for word in words:
        relative = not re.match(r"/|\w+://", word)
        if relative and (
            word.endswith((".py", ".md")) or word.startswith(("tests/", "bench/")) and "*" not in word
        ):
            assert list(ROOT.glob(word.split("::")[0])), f"{word}: no such file in the repository"


def pip_extras(words: list[str]) -> None:
    for word in words:
        if word.startswith(".["):
            unknown = set(word[2:-1].split(",")) - set(EXTRAS)
            assert not unknown, f"pip install -e '{word}': no extra {unknown} in pyproject.toml"


def without_more(words: list[str]) -> list[str]:
    """A bare `...` stands for "more flags"; after a flag that takes a value, it is the value."""
    return [w for i, w in enumerate(words) if w != "..." or (i and re.fullmatch(r"--\w+", words[i - 1]))]


def check(words: list[str], monkeypatch) -> None:
    words = without_more(words)
    if words[0].startswith("--"):  # a line of train.py's flags alone
        return train_accepts(words)
    at = next((i for i, w in enumerate(words) if PYTHON.fullmatch(w)), None)
    if at is None:
        if words[0].endswith("pip"):
            pip_extras(words)
        repository_files(words[1:])
        return
    script, *argv = words[at + 1 :]
    if script == "-c":
        compile(argv[0], "<python -c>", "exec")
        return
    if script == "-m":  # pytest, venv
        repository_files(argv[1:])
        return
    repository_files([script, *argv])
    if script == "train.py":
        train_accepts(argv)
    else:
        argparse_accepts(script, argv, monkeypatch)


@pytest.mark.parametrize("words", all_commands())
def test_every_command_shown_parses(words, untouched):
    check(words, untouched)


def requirements(extras) -> set[str]:
    """What installing the project with `extras` brings beyond its core, an extra's own extras
    (`olmo3-jax[gcs,s3]`) opened."""
    out = set()
    for extra in extras:
        for requirement in EXTRAS[extra]:
            own = re.fullmatch(r"olmo3-jax\[(.+)\]", requirement)
            out |= requirements(own[1].split(",")) if own else {requirement}
    return out


def project_install(words: list[str]) -> set[str] | None:
    """The extras a `pip install -e .` or `-e '.[a,b]'` of this project names; None for any other command."""
    ours = [w for w in words if w == "." or w.startswith(".[")]
    if not words[0].endswith("pip") or not ours:
        return None
    return set() if ours[0] == "." else set(ours[0][2:-1].split(","))


def extras_needed(words: list[str]) -> dict[str, str]:
    """The extras a `python SCRIPT ...` command needs, each with the line its absence is refused in:
    train.py's from its config, as train.py refuses them (train.extras_needed); another script's by the URLs
    it is given (train.URL_EXTRAS: the storage layer's)."""
    at = next((i for i, w in enumerate(words) if PYTHON.fullmatch(w)), None)
    if at is None or words[at + 1] in ("-c", "-m"):
        return {}
    script, *argv = words[at + 1 :]
    if script == "train.py":
        return {} if {"-h", "--help"} & set(argv) else train.extras_needed(train.parse_args(argv))
    return {
        extra: f"{word}: {scheme}:// needs the [{extra}] extra"
        for word in argv
        for scheme, (extra, _) in train.URL_EXTRAS.items()
        if re.search(rf"\b{scheme}://", word)
    }


def after_installs(lines: list[tuple[int, str]]) -> list[tuple[int, list[str], set[str]]]:
    """Each command of `lines` (a page's, in order, each with where it is) with the extras that the nearest
    install line before it installs: where there is none, the quick start's core install. An install of the
    test extra sets up the tests, not the runs a page shows after it."""
    found, installed = [], set()
    for at, line in lines:
        for words in map(without_more, simple_commands(line)):
            if (extras := project_install(words)) is not None:
                installed = installed if "test" in extras else extras
            elif not words[0].startswith("--"):  # a line of flags alone is no command
                found.append((at, words, installed))
    return found


def refused(words: list[str], installed: set[str]) -> list[str]:
    """The lines train.py (or the storage layer) would refuse `words` in, after installing `installed`."""
    have = requirements(installed)
    return [why for extra, why in extras_needed(words).items() if not requirements([extra]) <= have]


def commands_after_their_install() -> list:
    found = []
    for page in PAGES:
        lines = [(at, c) for at, lang, text in fenced_blocks(page) for c in command_lines(lang, text)]
        for at, words, installed in after_installs(lines):
            shown = f"{shlex.join(words)[:70]} after [{','.join(sorted(installed))}]"
            found.append(pytest.param(words, installed, id=f"{name(page)}:{at} {shown}"))
    return found


@pytest.mark.parametrize("words,installed", commands_after_their_install())
def test_every_command_shown_works_after_the_install_shown_with_it(words, installed):
    """`--preset 7b` needs the eval extra (its tasks), a dry run for a TPU the tpu extra, a gs:// path the
    gcs extra, ...: each as train.py refuses its absence, installed by the install line the reader just ran."""
    assert refused(words, installed) == [], f"after installing [{','.join(sorted(installed))}]"


def test_a_command_without_its_extra_is_caught():
    """The README's stage 1 as it was: after the quick start's core install, and the tests' install."""
    lines = [
        ".venv/bin/pip install -e .",
        "python train.py --preset tiny",
        "pip install -e '.[test]' && python -m pytest",
        "python train.py --preset 7b --data mix.txt",
        "python train.py --preset 7b --dry_run --topology v5p-512",
        "python ckpt.py list gs://bucket/run",
        "pip install -e '.[wandb,gcs]' && python train.py --preset tiny --wandb p --run_dir gs://b/r",
    ]
    assert [refused(words, installed) for _, words, installed in after_installs(enumerate(lines))] == [
        [],
        [],
        ["--tasks (26 tasks): downstream tasks need olmo_eval: pip install -e '.[eval]', or --tasks ''"],
        ["--topology v5p-512: compiling for a TPU needs libtpu: pip install -e '.[tpu]'"],
        ["gs://bucket/run: gs:// needs the [gcs] extra"],
        [],
    ]


@pytest.mark.parametrize(
    "line",
    [
        "python train.py --preset tiny --no_such_flag 3",
        "python train.py --preset tiny --steps many",
        "python ckpt.py to-hf runs/tiny out --no_such_flag",
        "python data.py check FILES",  # --vocab_size is required
        "python bench/compare.py REF CANDIDATE --data x.npy --seq_len 1",
        "python bench/ckpt_speed.py --place local",  # --places, abbreviated
        "python bench/no_such_script.py",
        "pip install -e '.[no_such_extra]'",
    ],
)
def test_a_command_that_would_fail_is_caught(line, untouched):
    with pytest.raises((train.FlagError, AssertionError, pytest.fail.Exception)):
        check(simple_commands(line)[0], untouched)


def test_every_block_says_what_it_holds():
    """Fenced, and tagged: an untagged or indented block would hold commands nobody checks."""
    wrong = [
        f"{name(p)}:{line} ```{lang}"
        for p in PAGES
        for line, lang, _ in fenced_blocks(p)
        if lang not in LANGUAGES
    ]
    for page in PAGES:
        outside = FENCE.sub(lambda m: "\n" * m[0].count("\n"), page.read_text()).splitlines()
        wrong += [
            f"{name(page)}:{i + 1} an indented code block"
            for i in range(1, len(outside))
            if outside[i].startswith("    ") and not outside[i - 1].strip()
        ]
    assert wrong == []


def slug(heading: str) -> str:
    """The anchor GitHub gives a heading."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_link_resolves():
    broken = []
    for page in PAGES:
        for target in re.findall(r"\]\(([^)\s]+)\)", page.read_text()):
            if re.match(r"\w+:", target):  # https:, mailto:
                continue
            path, _, anchor = target.partition("#")
            file = (page.parent / path).resolve() if path else page
            if not file.exists():
                broken.append(f"{name(page)}: {target}")
            elif anchor and anchor not in map(slug, re.findall(r"^#+ (.*)$", file.read_text(), re.MULTILINE)):
                broken.append(f"{name(page)}: {target} (no such heading)")
    assert broken == []


def test_every_name_a_page_gives_exists():
    """`train.lr_at`, `data.GlobalOrder`, ...: what a reader is sent to edit is where the page says."""
    missing = []
    for page in PAGES:
        for module, path in re.findall(rf"`({'|'.join(MODULES)})\.([A-Za-z_][\w.]*)`", page.read_text()):
            if path == "py":
                continue
            found = importlib.import_module(module)
            for part in path.split("."):
                found = getattr(found, part, None)
            if found is None:
                missing.append(f"{name(page)}: {module}.{path}")
    assert missing == []


def test_the_readme_is_a_front_door_whose_test_command_ci_runs():
    readme = (ROOT / "README.md").read_text()
    assert len(readme.splitlines()) <= 200
    ci = [
        line
        for line in (ROOT / ".ci/run").read_text().splitlines()
        if line and not line.startswith(("#", "set ", "cd "))
    ]
    shown = [
        line
        for _, lang, text in fenced_blocks(ROOT / "README.md")
        if lang == "bash"
        for line in text.splitlines()
    ]
    assert ci[-1] in shown, ci[-1]
