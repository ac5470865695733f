"""The tree as docs/architecture.md draws it is the tree on disk: every folder of queue_tinker/
and workers/ drawn with its count of modules, none drawn that is gone, and no folder over
MOST_MODULES (workers/sampling/ aside, until the sampling issue splits it by role)."""

from __future__ import annotations

import re
from pathlib import Path

from procs import REPO

MOST_MODULES = 12
NOT_YET_SPLIT = {"workers/sampling"}  # 20 modules; the sampling issue splits it by role
# A line of the drawing: its box-drawing indent, a folder name, and its module count.
DRAWN = re.compile(r"^(?P<indent>(?:[│ ] {3})*)(?:[├└]── )?(?P<name>[a-z_]+)/ +\((?P<count>\d+)\)")


def modules(folder: Path) -> int:
    return sum(1 for p in folder.glob("*.py") if p.name != "__init__.py")


def source_folders() -> dict[str, int]:
    """Every package folder under queue_tinker/ and workers/ (the links' real folders once,
    under workers/), with its module count."""
    found = {}
    for root in ("queue_tinker", "workers"):
        for init in sorted((REPO / root).rglob("__init__.py")):
            folder = init.parent
            relative = folder.relative_to(REPO)
            if relative.parts[:2] in (("queue_tinker", "workers"), ("queue_tinker", "migrations")):
                continue
            found[str(relative)] = modules(folder)
    return found


def drawn_folders() -> dict[str, int]:
    """The folders the tree in docs/architecture.md draws with a count, as paths."""
    text = (REPO / "docs" / "architecture.md").read_text()
    drawing = text.split("\n## The tree\n", 1)[1].split("```", 2)[1]
    found: dict[str, int] = {}
    top = ""
    parents: list[str] = []
    for line in drawing.splitlines():
        match = DRAWN.match(line)
        if match is None:
            continue
        if not line.startswith(("├", "└", "│", " ")):  # a top-level folder
            top, parents = match["name"], []
            found[top] = int(match["count"])
            continue
        depth = len(match["indent"]) // 4
        parents = [*parents[:depth], match["name"]]
        found["/".join([top, *parents])] = int(match["count"])
    return found


def test_no_folder_holds_more_than_twelve_modules() -> None:
    """Rooms of a readable size: a folder past MOST_MODULES is split by what its parts do."""
    crowded = {
        folder: count
        for folder, count in source_folders().items()
        if count > MOST_MODULES and folder not in NOT_YET_SPLIT
    }
    assert crowded == {}


def test_the_drawn_tree_is_the_tree_on_disk() -> None:
    """Every source folder with a module is drawn with its count (the package folders of
    queue_tinker/ and workers/); a folder drawn is there, with that many modules."""
    on_disk = {folder: n for folder, n in source_folders().items() if n}
    drawn = drawn_folders()
    assert {f: n for f, n in drawn.items() if f in on_disk} == {
        f: n for f, n in on_disk.items() if f in drawn
    }, "a count in docs/architecture.md's tree is stale"
    assert set(on_disk) - set(drawn) == set(), "folders missing from the drawn tree"
    assert set(drawn) - set(on_disk) == set(), "the drawn tree names folders that are gone"


def test_the_split_not_yet_made_is_still_needed() -> None:
    """An allowance is dropped once its folder is back under the limit."""
    folders = source_folders()
    assert all(folders[name] > MOST_MODULES for name in NOT_YET_SPLIT)
