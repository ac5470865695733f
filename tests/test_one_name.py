"""One name, one thing: no public class, function or constant is defined under the same name in
two modules of queue_tinker/ and workers/ (a reader who meets `LossFn` or `target_logprobs`
should not have to ask which one). The few names the layout defines in many places on purpose
are listed with why."""

from __future__ import annotations

import ast
from collections import defaultdict

from procs import REPO

# name -> why it may stand in several modules
ALLOWED = {
    "router": "each route module of the gateway has its own FastAPI router",
    "main": "an entry point: the CLI's, a worker group rank's process",
    "free_port": "two layers that share no module: the embedded launcher and a worker group",
    "FAMILY": "each model family's module declares its own; the families registry gathers them",
}


def public_definitions() -> dict[str, list[str]]:
    """Top-level public names (classes, functions, assignments) -> the modules defining them."""
    found: dict[str, list[str]] = defaultdict(list)
    for root in (REPO / "queue_tinker", REPO / "workers"):
        for path in sorted(root.rglob("*.py")):
            relative = path.relative_to(REPO)
            if relative.parts[:2] in (("queue_tinker", "workers"), ("queue_tinker", "migrations")):
                continue  # the links: their files are read once, under workers/
            if "proto" in relative.parts and relative.name.endswith("_pb2.py"):
                continue  # generated code
            for node in ast.parse(path.read_text()).body:
                names: list[str] = []
                if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                    names = [node.name]
                elif isinstance(node, ast.Assign):
                    names = [t.id for t in node.targets if isinstance(t, ast.Name)]
                elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                    names = [node.target.id]
                for name in names:
                    if not name.startswith("_") and name not in ("log", "T", "P", "M", "R"):
                        found[name].append(str(relative))
    return found


def test_no_public_name_means_two_things() -> None:
    """A public name defined in two modules fails here, naming both (rename one, or define
    it once and import it)."""
    twice = {
        name: modules
        for name, modules in public_definitions().items()
        if len(modules) > 1 and name not in ALLOWED
    }
    assert twice == {}


def test_the_allowed_repeats_still_repeat() -> None:
    """An allowance nobody needs any more is taken out."""
    found = public_definitions()
    assert all(len(found[name]) > 1 for name in ALLOWED)
