"""The layers' import contracts (pyproject's [tool.importlinter]) hold, and every module of
workers/ is classed as an engine or as part of the worker's I/O loop."""

from __future__ import annotations

import subprocess
import sys
import tomllib
from pathlib import Path

from procs import REPO

LINT_IMPORTS = Path(sys.executable).with_name("lint-imports")
ENGINES_CONTRACT = "the engines know no Redis, no SQL and no settings"
# The worker's I/O loop: leases, reading the streams, heartbeats, publishing, and what it runs
# next (scheduling.py, pure, but over leases the loop holds). Every other
# module of workers/ is an engine and goes in the engines contract's source_modules.
IO_LOOP = {
    "main",
    "runtime.arrivals",
    "runtime.compute",
    "runtime.fenced",
    "runtime.owned",
    "runtime.ownership",
    "runtime.presence",
    "runtime.scheduling",
    "runtime.stepped",
    "runtime.turns",
    "runtime.worker",
}


def lint_imports(config: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(LINT_IMPORTS), "--config", str(config), "--no-cache"],
        cwd=REPO,
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


def test_every_worker_module_is_an_engine_or_the_io_loop() -> None:
    """A new module of workers/ must be placed: in the engines contract (knows no Redis) or in
    IO_LOOP here, so the engines' contract cannot silently miss it."""
    (engines,) = [c for c in contracts() if c["name"] == ENGINES_CONTRACT]
    prefix = "queue_tinker.workers."
    source = engines["source_modules"]
    assert isinstance(source, list)
    engine_modules = {name.removeprefix(prefix) for name in source}
    on_disk = {
        ".".join(p.relative_to(REPO / "workers").with_suffix("").parts)
        for p in (REPO / "workers").rglob("*.py")
        if p.name != "__init__.py"
    }
    assert engine_modules.isdisjoint(IO_LOOP)
    assert on_disk == engine_modules | IO_LOOP
