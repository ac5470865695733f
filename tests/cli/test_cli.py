"""The command line: config shows the effective settings; migrate drives alembic."""

from __future__ import annotations

import json
import subprocess
import sys

from procs import REPO

from queue_tinker.settings import Settings


def run_cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "queue_tinker.cli", *args],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_config_prints_effective_settings_with_their_env_vars() -> None:
    """Values come from QT_* variables; every setting lists its variable and description."""
    env = {
        "PATH": "/usr/bin:/bin",
        "QT_REDIS_URL": "redis://example:6379/3",
        "QT_LEASE_TTL_MS": "1234",
    }
    shown = json.loads(run_cli("config", env=env).stdout)
    assert shown["redis_url"]["value"] == "redis://example:6379/3"
    described = Settings.model_fields["lease_ttl_ms"].description
    assert shown["lease_ttl_ms"] == {
        "value": "1234",
        "env": "QT_LEASE_TTL_MS",
        "description": described,
    }
    assert set(shown) == set(Settings.model_fields)
    assert all(row["description"] for row in shown.values())


def test_config_refuses_bad_values() -> None:
    """A malformed setting stops the command with the variable's name in the error."""
    result = run_cli("config", env={"PATH": "/usr/bin:/bin", "QT_LEASE_TTL_MS": "-5"})
    assert result.returncode != 0
    assert "lease_ttl_ms" in result.stderr


def test_config_refuses_unknown_variables() -> None:
    """A misspelt QT_* variable stops the command, naming it and the setting it resembles;
    the test suite's own QT_TEST_* variables are not settings and pass."""
    result = run_cli("config", env={"PATH": "/usr/bin:/bin", "QT_REDIS_ULR": "redis://x:1/0"})
    assert result.returncode != 0
    assert "QT_REDIS_ULR: not a queue-tinker setting; did you mean QT_REDIS_URL?" in (result.stderr)
    passed = run_cli(
        "config", env={"PATH": "/usr/bin:/bin", "QT_TEST_REDIS_URL": "redis://x", "QT_WORKERS": "2"}
    )
    assert passed.returncode == 0, passed.stderr


def test_migrate_up_down_up(empty_database_url: str) -> None:
    """`queue-tinker migrate` builds the schema, `--downgrade` removes it, and again."""
    env = {"PATH": "/usr/bin:/bin", "QT_DATABASE_URL": empty_database_url}
    for args in (["migrate"], ["migrate", "--downgrade"], ["migrate"]):
        result = run_cli(*args, env=env)
        assert result.returncode == 0, result.stderr
    from queue_tinker.store.migrate import current_revision

    assert current_revision(empty_database_url) is not None


def test_migrate_wait_passes_once_another_process_migrated(empty_database_url: str) -> None:
    """`migrate --wait-s` migrates nothing: on a database never migrated it gives up after the
    time given (exit 1, saying why); one still waiting passes once a `migrate` has run."""
    env = {"PATH": "/usr/bin:/bin", "QT_DATABASE_URL": empty_database_url}
    gave_up = run_cli("migrate", "--wait-s", "1", env=env)
    assert gave_up.returncode == 1
    assert "after 1 s: the database was never migrated" in gave_up.stderr
    from queue_tinker.store.migrate import current_revision, head

    assert current_revision(empty_database_url) is None
    waiter = subprocess.Popen(
        [sys.executable, "-m", "queue_tinker.cli", "migrate", "--wait-s", "60"],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        migrated = run_cli("migrate", env=env)
        assert migrated.returncode == 0, migrated.stderr
        out, err = waiter.communicate(timeout=30)
    finally:
        waiter.kill()
    assert waiter.returncode == 0, err
    assert out.strip() == f"the schema is at head ({head()})"
