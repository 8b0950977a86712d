"""The commands in the README run as written: every ``sarathi-lite`` command parses (no renamed or missing
flag), states how long it takes (a server runs until stopped; the first ``generate`` is run by
``test_smollm2``), and the fast ones, those stated to take under a minute, run here and exit 0."""

from __future__ import annotations

import re
import shlex
import shutil
from pathlib import Path

import pytest

from sarathi_lite.cli import build_parser, main

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
# What ``sarathi-lite profile --out profile.json`` (the command before the sims that read it) writes.
PROFILE = ROOT / "benchmarks" / "results" / "sim_profile_smollm2_2026-12-06.json"
_TIME = re.compile(r"~?(\d+(?:\.\d+)?)(?:-\d+)? ?(s|min)\b")


def readme_commands() -> list[tuple[list[str], str]]:
    """Every ``sarathi-lite`` (or ``python3 -m sarathi_lite``) command in the README's bash blocks, continued
    lines joined: its arguments and its comment."""
    found = []
    for block in re.findall(r"```bash\n(.*?)```", README.read_text(), re.S):
        for line in block.replace("\\\n", " ").splitlines():
            code, _, comment = line.partition("  #")
            for part in code.split("&&"):
                words = shlex.split(part)
                if words[:1] == ["sarathi-lite"]:
                    found.append((words[1:], comment.strip()))
                elif words[:3] == ["python3", "-m", "sarathi_lite"]:
                    found.append((words[3:], comment.strip()))
    return found


def stated_seconds(comment: str) -> float | None:
    """The time a command's comment states (``~5 s``, ``~4 min``, ``2-6 min``), in seconds."""
    m = _TIME.search(comment)
    return None if m is None else float(m.group(1)) * (60 if m.group(2) == "min" else 1)


COMMANDS = readme_commands()


def test_the_readme_has_the_commands_this_checks():
    kinds = [argv[0] for argv, _ in COMMANDS]
    assert {"generate", "profile", "sim", "serve", "plan"} <= set(kinds) and kinds.count("sim") >= 3


@pytest.mark.parametrize("argv, comment", COMMANDS, ids=[" ".join(a[:3]) for a, _ in COMMANDS])
def test_every_readme_command_parses_and_states_its_time(argv, comment):
    build_parser().parse_args(argv)  # a renamed or misspelt flag exits here
    if argv[0] not in ("serve", "generate"):
        assert stated_seconds(comment) is not None, f"state how long it takes: sarathi-lite {shlex.join(argv)}"


FAST = [(argv, comment) for argv, comment in COMMANDS if (stated_seconds(comment) or 1e9) < 60]


@pytest.mark.parametrize("argv, comment", FAST, ids=[" ".join(a[:3]) for a, _ in FAST])
def test_the_fast_readme_commands_run_as_written(argv, comment, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    shutil.copy(PROFILE, tmp_path / "profile.json")
    assert main(argv) == 0
    assert "config" in capsys.readouterr().out  # the comparison or capacity table
    assert sorted(p.name for p in tmp_path.iterdir()) == ["profile.json"]  # and nothing written unasked
