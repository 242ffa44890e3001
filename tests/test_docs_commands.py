"""The commands that README.md and docs/ show in their code blocks name what exists: `alignrl` command lines parse
(its own options, or a command with flags of its own such as `train dpo`), scripts run with python or bash are
files of the repository or modules that import, and `make` targets are the Makefile's. Whole runs of these commands
are the entry-point tests' business (test_seed000, test_seed004_cli, test_ray_scripts, test_verl_shim, ...)."""

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]


def shell_commands() -> list[tuple[str, list[str]]]:
    """(page, argv) of every simple command in the pages' shell code blocks."""
    out = []
    for page in PAGES:
        for lang, body in re.findall(r"```(\w*)\n(.*?)```", page.read_text(), re.S):
            if lang not in ("", "bash", "sh", "shell", "console"):
                continue
            text = re.sub(r"\\\n\s*", " ", body)
            for line in text.splitlines():
                line = line.strip().removeprefix("$ ")
                if not line or line.startswith("#"):
                    continue
                for part in re.split(r"&&|\|\||;|\|", line):
                    try:
                        argv = shlex.split(part, comments=True)
                    except ValueError:
                        continue
                    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=.*", argv[0]):  # VAR=value before a command
                        argv = argv[1:]
                    if argv:
                        out.append((page.relative_to(ROOT).as_posix(), argv))
    return out


COMMANDS = shell_commands()


def test_the_pages_show_commands():
    assert sum(a[0].endswith("alignrl") for _, a in COMMANDS) >= 10


@pytest.mark.parametrize("page,argv", [(p, a) for p, a in COMMANDS if a[0].endswith("alignrl")],
                         ids=lambda x: " ".join(x) if isinstance(x, list) else x)
def test_alignrl_command_lines_parse(page, argv):
    from alignrl import cli

    words = [w for w in argv[1:] if "<" not in w and "..." not in w]  # placeholders stand for a user's values
    if cli._passthrough(words) is not None:  # a command with flags of its own: its words name it
        return
    try:
        cli._parse(cli._in_alignrl_words(words))  # a line in TRL's spelling, translated as `main` does
    except SystemExit as e:  # argparse's error (or --help, which exits 0)
        assert e.code == 0, f"{page}: `{' '.join(argv)}` does not parse"


INTERPRETERS = ("python", "python3", ".venv/bin/python", "bash")


@pytest.mark.parametrize("page,argv", [(p, a) for p, a in COMMANDS if a[0] in INTERPRETERS and len(a) > 1],
                         ids=lambda x: " ".join(x) if isinstance(x, list) else x)
def test_scripts_and_modules_exist(page, argv):
    if argv[1] == "-m":
        module = argv[2]
        if module.startswith("alignrl"):
            assert importlib.util.find_spec(module) is not None, f"{page}: no module {module}"
        elif module.startswith(("src.", "verl.")):  # run from the repository root (the checkout's verl/ shim)
            assert (ROOT / (module.replace(".", "/") + ".py")).is_file(), f"{page}: no module {module}"
        return
    if argv[1].startswith("-") or "<" in argv[1] or "$" in argv[1]:
        return
    path = argv[1]
    candidates = [ROOT / path, ROOT / "src" / path]
    assert any(c.is_file() for c in candidates), f"{page}: `{' '.join(argv)}` names no file of the repository"


@pytest.mark.parametrize("page,argv", [(p, a) for p, a in COMMANDS if a[0].startswith("./")],
                         ids=lambda x: " ".join(x) if isinstance(x, list) else x)
def test_scripts_run_by_path_exist(page, argv):
    path = ROOT / argv[0]
    assert path.is_file() or (ROOT / "src" / "alignrl" / argv[0]).is_file(), f"{page}: no {argv[0]}"


def test_make_targets_exist():
    targets = set(re.findall(r"^([a-z][\w-]*):", (ROOT / "Makefile").read_text(), re.M))
    shown = {(p, a[1]) for p, a in COMMANDS if a[0] == "make" and len(a) > 1 and "=" not in a[1]}
    missing = [f"{p}: make {t}" for p, t in sorted(shown) if t not in targets]
    assert not missing, missing
