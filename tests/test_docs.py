"""The documentation: the user guide builds strictly (no broken link, no page left out of the
nav), its flag reference holds every flag of the parser, and the README stays short, names what
CI runs and links only to files that exist. A work period is never named by number anywhere in
the project: a date, a commit or a document section says when instead."""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from pathlib import Path

from baton.cli import build_parser

REPO_ROOT = Path(__file__).resolve().parents[1]
README = REPO_ROOT / "README.md"
MAX_README_LINES = 150
# Folders of tools and build outputs, not of the project's own text.
SKIPPED_DIRS = {
    ".git",
    ".benchmarks",
    ".pytest_cache",
    ".ruff_cache",
    ".venv",
    "__pycache__",
    "build",
    "dist",
    "site",
}
TEXT_SUFFIXES = {".py", ".md", ".txt", ".toml", ".yml", ".yaml", ".sh", ".c", ".h", ".cfg", ".json"}
WORK_PERIOD = re.compile(r"\bsessions?[\s_-]*\d+", re.IGNORECASE)
MARKDOWN_LINK = re.compile(r"\]\(([^)\s]+)\)")


def test_the_user_guide_builds_strictly_with_every_flag(tmp_path: Path) -> None:
    site = tmp_path / "site"
    result = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--quiet", "-d", str(site)],
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
    )
    assert result.returncode == 0, result.stdout + result.stderr
    flags_page = (site / "reference" / "flags" / "index.html").read_text()
    assert "<!-- flag-reference -->" not in flags_page  # the hook replaced its marker
    for name in ("launch", "generate"):
        for option in _options(name):
            assert f"<code>{option}</code>" in flags_page, f"baton {name} {option}"


def _options(command: str) -> list[str]:
    parser = build_parser()
    commands = next(
        action for action in parser._actions if isinstance(action, argparse._SubParsersAction)
    )
    subcommand = commands.choices[command]
    return [
        option
        for action in subcommand._actions
        if not isinstance(action, argparse._HelpAction)
        for option in action.option_strings
    ]


def test_the_readme_is_short_and_runs_what_ci_runs() -> None:
    readme = README.read_text()
    assert len(readme.splitlines()) <= MAX_README_LINES
    ci_command = (REPO_ROOT / ".ci" / "run").read_text().strip().splitlines()[-1]
    assert f"\n{ci_command}\n" in readme


def test_the_readme_links_to_files_that_exist() -> None:
    for target in MARKDOWN_LINK.findall(README.read_text()):
        if "://" in target or target.startswith("#"):
            continue
        path = target.split("#")[0]
        assert (REPO_ROOT / path).exists(), f"README links to {target}, which does not exist"


def test_no_work_period_is_named_by_number() -> None:
    found = []
    for directory, subdirectories, files in os.walk(REPO_ROOT):
        subdirectories[:] = [
            name
            for name in subdirectories
            if name not in SKIPPED_DIRS and not name.endswith(".egg-info")
        ]
        for name in files:
            path = Path(directory, name)
            relative = path.relative_to(REPO_ROOT)
            if WORK_PERIOD.search(str(relative)):
                found.append(f"{relative} (its name)")
            if path.suffix not in TEXT_SUFFIXES:
                continue
            for number, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if WORK_PERIOD.search(line):
                    found.append(f"{relative}:{number}: {line.strip()}")
    assert not found, "name a date, a commit or a section instead:\n" + "\n".join(found)
