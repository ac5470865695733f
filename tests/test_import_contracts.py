"""The layers' import contracts (pyproject's [tool.importlinter]) hold, and workers/ is in
layers that name every part of it."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from procs import REPO

LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
LAYERS_CONTRACT = (
    "workers in layers: main, runtime | executor, training | sampling, model, kernels, interface"
)


def lint_imports(config: Path, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(config), "--no-cache"],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=60,
    )


def contracts() -> list[dict[str, object]]:
    config = tomllib.loads((REPO / "pyproject.toml").read_text())
    return config["tool"]["importlinter"]["contracts"]


def test_import_contracts_are_kept() -> None:
    """lint-imports finds every contract in pyproject kept."""
    result = lint_imports(REPO / "pyproject.toml")
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"Contracts: {len(contracts())} kept, 0 broken." in result.stdout


def test_a_broken_contract_fails(tmp_path: Path) -> None:
    """An import that crosses a forbidden line is reported with its chain and fails the run
    (the client does reach Redis through the queue, so forbidding that must break)."""
    config = tmp_path / "broken.toml"
    config.write_text(
        "[tool.importlinter]\n"
        'root_packages = ["queue_tinker"]\n'
        "[[tool.importlinter.contracts]]\n"
        'name = "client without queue"\n'
        'type = "forbidden"\n'
        'source_modules = ["queue_tinker.client"]\n'
        'forbidden_modules = ["queue_tinker.queue"]\n'
    )
    result = lint_imports(config)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "client without queue BROKEN" in result.stdout
    assert "queue_tinker.client.holder -> queue_tinker.queue" in result.stdout


def workers_layers() -> dict[str, object]:
    (layers,) = [c for c in contracts() if c["name"] == LAYERS_CONTRACT]
    return layers


def test_the_workers_layers_name_every_part_of_workers() -> None:
    """Every module and folder at the top of workers/ is in a layer, and the contract is
    exhaustive, so lint-imports fails on one added without its place."""
    layers = workers_layers()
    assert layers["exhaustive"] is True
    named = {part.strip() for layer in layers["layers"] for part in str(layer).split("|")}
    workers = REPO / "workers"
    on_disk = {p.stem for p in workers.glob("*.py") if p.name != "__init__.py"}
    on_disk |= {p.name for p in workers.iterdir() if (p / "__init__.py").is_file()}
    assert named == on_disk


def test_a_part_of_workers_outside_the_layers_breaks_them(tmp_path: Path) -> None:
    """With a folder of workers/ left out of the layers (sampling), the exhaustive contract
    reports it and fails the run."""
    config = tmp_path / "layers.toml"
    layers = [str(layer).replace(" | sampling", "") for layer in workers_layers()["layers"]]
    config.write_text(
        "[tool.importlinter]\n"
        'root_packages = ["queue_tinker"]\n'
        "[[tool.importlinter.contracts]]\n"
        'name = "workers layers"\n'
        'type = "layers"\n'
        'containers = ["queue_tinker.workers"]\n'
        f"layers = {json.dumps(layers)}\n"
        "exhaustive = true\n"
    )
    result = lint_imports(config)
    assert result.returncode == 1, result.stdout + result.stderr
    assert "workers layers BROKEN" in result.stdout
    assert "queue_tinker.workers.sampling" in result.stdout


# Each boundary contract, and a module that crosses it: the contract must fail on a copy of
# the tree with that module added (so it cannot pass by naming nothing).
CROSSINGS = {
    "only queue/ imports redis": ("queue_tinker/gateway/leak.py", "import redis\n"),
    "workers/ reach Redis through runtime/queue_link.py alone": (
        "queue_tinker/workers/runtime/leak.py",
        "from queue_tinker.queue.connection import connect\n",
    ),
    "the client never writes Postgres": (
        "queue_tinker/client/leak.py",
        "from queue_tinker.store.record_writer import apply_records\n",
    ),
    "bench reaches workers/training only through bench/harness/engine.py": (
        "bench/leak.py",
        "from queue_tinker.workers.training.losses import device_batch_loss\n",
    ),
}


def contract_config(contract: dict[str, object]) -> str:
    """A config holding the one contract, with the repository's root packages."""
    lines = [
        "[tool.importlinter]",
        'root_packages = ["queue_tinker", "bench"]',
        "include_external_packages = true",
        "[[tool.importlinter.contracts]]",
        *(f"{key} = {json.dumps(value)}" for key, value in contract.items()),
    ]
    return "\n".join(lines) + "\n"


@pytest.mark.parametrize("name", list(CROSSINGS))
def test_each_boundary_contract_fails_on_a_module_that_crosses_it(
    tmp_path: Path, name: str
) -> None:
    """The contract holds on the tree as it is, and breaks, naming the module, once a module
    that crosses its line is added to a copy of the tree (workers/ copied in through its
    link, as it installs)."""
    (contract,) = [c for c in contracts() if c["name"] == name]
    config = tmp_path / "contract.toml"
    config.write_text(contract_config(contract))
    kept = lint_imports(config)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    tree = tmp_path / "tree"
    skip = shutil.ignore_patterns("__pycache__", "*.pyc")
    for package in ("queue_tinker", "bench"):
        shutil.copytree(REPO / package, tree / package, symlinks=False, ignore=skip)
    path, source = CROSSINGS[name]
    (tree / path).write_text(source)
    broken = lint_imports(config, cwd=tree)
    assert broken.returncode == 1, broken.stdout + broken.stderr
    assert f"{name} BROKEN" in broken.stdout
    assert path.removesuffix(".py").replace("/", ".") + " ->" in broken.stdout
