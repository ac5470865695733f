"""Every package the code imports, anywhere (a function-level import too: the vision path
imports PIL on its first image), is brought by the extras that run that code, and the image's
lock pins it: a user who installs `queue-tinker[worker]`, or runs the image, never meets a
ModuleNotFoundError the first time an op or a route reaches one."""

from __future__ import annotations

import ast
import re
import sys
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

from packaging.requirements import Requirement
from procs import REPO

# Imported only where installed, by design: name -> why no extra that runs it requires it.
OPTIONAL = {
    "liger_kernel": "the `gpu` extra: QT_LIGER_KERNELS=auto uses it where installed",
    "triton": "torch's CUDA wheels bring it, where the segment GEMM compiles; a CPU worker "
    "never launches it (kernels.grouped_matmul), the tests run it interpreted (dev extra)",
}
# What the image installs (Dockerfile; scripts/lock resolves requirements-image.lock for them).
IMAGE_EXTRAS = ("worker", "server")
# torch is installed before the lock, on its own (a CPU or a CUDA build).
INSTALLED_BEFORE_THE_LOCK = {"torch"}


def python_files(paths: Iterable[Path]) -> list[Path]:
    return sorted(f for p in paths for f in ([p] if p.is_file() else p.rglob("*.py")))


def imported(paths: Iterable[Path]) -> dict[str, set[str]]:
    """Top-level third-party names the files under `paths` import -> the files."""
    found: dict[str, set[str]] = {}
    for path in python_files(paths):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for top in {name.split(".")[0] for name in names}:
                if top not in sys.stdlib_module_names and top != "queue_tinker":
                    found.setdefault(top, set()).add(path.name)
    return found


def normalised(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def brought_by(extras: Iterable[str]) -> set[str]:
    """The distributions `pip install queue-tinker[extras]` installs: the requirements of the
    project and those extras, and theirs in turn, read from the installed metadata."""
    wanted: list[tuple[str, frozenset[str]]] = [("queue-tinker", frozenset(extras))]
    seen: set[tuple[str, frozenset[str]]] = set()
    while wanted:
        name, with_extras = wanted.pop()
        if (normalised(name), with_extras) in seen:
            continue
        seen.add((normalised(name), with_extras))
        for line in metadata.requires(name) or []:
            requirement = Requirement(line)
            marker = requirement.marker
            if marker is None or any(marker.evaluate({"extra": e}) for e in (*with_extras, "")):
                wanted.append((requirement.name, frozenset(requirement.extras)))
    return {name for name, _ in seen}


def distributions(module: str) -> set[str]:
    return {normalised(d) for d in metadata.packages_distributions().get(module, [module])}


def not_brought(paths: Iterable[Path], extras: Iterable[str]) -> dict[str, set[str]]:
    """What the files under `paths` import that `extras` do not install -> who imports it."""
    brought = brought_by(extras)
    return {
        module: files
        for module, files in imported(paths).items()
        if module not in OPTIONAL and not distributions(module) & brought
    }


def image_code() -> list[Path]:
    """What the image's processes run: the package but the embedded servers (queue_tinker/local,
    the `embedded` extra `up` uses), the worker and the migrations."""
    package = REPO / "queue_tinker"
    return [
        *(p for p in package.iterdir() if not p.is_symlink() and p.name != "local"),
        REPO / "workers",
        REPO / "migrations",
    ]


def test_the_worker_extra_brings_what_the_worker_imports() -> None:
    assert not_brought([REPO / "workers"], ["worker"]) == {}


def test_the_image_and_its_lock_bring_what_its_processes_import() -> None:
    assert not_brought(image_code(), IMAGE_EXTRAS) == {}
    lock = (REPO / "requirements-image.lock").read_text()
    locked = {normalised(name) for name in re.findall(r"^([A-Za-z0-9_.-]+)==", lock, re.M)}
    needed = {
        dist
        for module in imported(image_code()).keys() - OPTIONAL.keys()
        for dist in distributions(module)
    }
    assert needed - INSTALLED_BEFORE_THE_LOCK - locked == set()


def test_an_import_no_extra_brings_is_named(tmp_path: Path) -> None:
    """The check can fail: a worker module importing a server-only package, in a function."""
    (tmp_path / "uses.py").write_text("def route():\n    import fastapi\n")
    assert not_brought([tmp_path], ["worker"]) == {"fastapi": {"uses.py"}}
    assert not_brought([tmp_path], IMAGE_EXTRAS) == {}
