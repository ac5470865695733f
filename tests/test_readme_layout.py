"""The README's layout table lists exactly the repository's folders: every top-level folder and
every folder below that holds Python files (data folders such as queue/lua are described in
their package's row). tests/ mirrors the source: its folders named after a source folder
(tests/queue for queue_tinker/queue, tests/workers/runtime for workers/runtime) are the tests/
row's; any other folder there needs a row of its own."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

from procs import REPO

ROW = re.compile(r"^\| `([^`]+)` \|")


def table_folders() -> set[str]:
    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## Layout\n", 1)[1].split("\n## ", 1)[0]
    return {m.group(1).rstrip("/") for line in section.splitlines() if (m := ROW.match(line))}


def ignored(paths: list[Path]) -> set[Path]:
    """The paths git ignores (.venv, build/, caches, egg-info, ...)."""
    done = subprocess.run(
        ["git", "check-ignore", "--stdin"],
        cwd=REPO,
        input="\n".join(str(p.relative_to(REPO)) for p in paths),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert done.returncode in (0, 1), done.stderr  # 1: none ignored
    return {REPO / line for line in done.stdout.splitlines()}


def disk_folders() -> set[str]:
    """Top-level folders, and folders below them with Python files; hidden, ignored and
    linked folders (queue_tinker/workers -> workers/) are left out."""
    found: set[Path] = set()
    level = [p for p in REPO.iterdir() if p.is_dir()]
    top = True
    while level:
        level = [
            p
            for p in level
            if not p.name.startswith(".") and p.name != "__pycache__" and not p.is_symlink()
        ]
        level = sorted(set(level) - ignored(level))
        found |= {p for p in level if top or any(p.glob("*.py"))}
        level = [child for p in level for child in p.iterdir() if child.is_dir()]
        top = False
    return {str(p.relative_to(REPO)) for p in found}


def source_folder(tests_folder: str) -> str | None:
    """The source folder a folder of tests/ mirrors, if there is one."""
    rest = tests_folder.removeprefix("tests/")
    for candidate in (rest, f"queue_tinker/{rest}"):
        if (REPO / candidate / "__init__.py").is_file():
            return candidate
    return None


def mirrors() -> set[str]:
    """The folders of tests/ that mirror a source folder."""
    return {
        folder
        for folder in disk_folders()
        if folder.startswith("tests/") and source_folder(folder) is not None
    }


def test_layout_table_matches_the_folders_on_disk() -> None:
    """A folder added without a row, or a row for a folder that is gone, fails here."""
    on_disk, in_table = disk_folders() - mirrors(), table_folders()
    assert on_disk - in_table == set(), "folders missing from README's layout table"
    assert in_table - on_disk == set(), "README's layout table names folders that are gone"


def test_layout_table_names_every_subpackage() -> None:
    """queue_tinker's subpackages are all there, the linked workers and migrations as their
    real top-level folders."""
    subpackages = {
        f"queue_tinker/{p.name}"
        for p in (REPO / "queue_tinker").iterdir()
        if (p / "__init__.py").is_file() and not p.is_symlink()
    }
    assert subpackages <= table_folders()
    assert {"workers", "migrations", "queue_tinker"} <= table_folders()


def test_the_folders_of_tests_mirror_the_source() -> None:
    """tests/ holds the source's shape: tests/queue, tests/gateway, tests/workers/sampling ...
    (a folder of tests/ that mirrors nothing needs a row of the layout table, as any folder)."""
    assert {"tests/queue", "tests/gateway", "tests/workers/sampling"} <= mirrors()
    assert source_folder("tests/workers/runtime") == "workers/runtime"
    assert source_folder("tests/scripts") is None  # its own row: programs the tests run


def test_the_configuration_table_names_every_setting() -> None:
    """README's Configuration section names every QT_* setting, and none that is gone (a knob
    added to queue_tinker/config/ without its row, or a row left for one removed, fails)."""
    from queue_tinker.settings import Settings

    readme = (REPO / "README.md").read_text()
    section = readme.split("\n## Configuration\n", 1)[1].split("\n## ", 1)[0]
    table = section.split("\n\n")[1]
    named = set(re.findall(r"`(QT_[A-Z0-9_]+)`", table))
    settings = {f"QT_{name.upper()}" for name in Settings.model_fields}
    assert settings - named == set(), "settings missing from README's Configuration table"
    assert named - settings == set(), "README's Configuration table names no such setting"
