"""`queue-tinker up` brings the whole stack up from nothing and Ctrl-C takes all of it down."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from queue_tinker.local.embedded import free_port
from queue_tinker.local.processes import ProcessGroup, pid_alive
from queue_tinker.local.up import crashed_child

HEALTHY_WITHIN_S = 90.0  # embedded Postgres initdb + migrations + gateway import, on 2 slow cores
# SIGTERM to exit: the children hand their work back and leave (no interpreter teardown), then
# Postgres and Redis stop. Measured 0.9 s here, 1.3 s beside a 2-thread CPU hog, and 3.3 s once
# under the whole suite's load on 2 cores; a child left to up's SIGKILL takes 15 s
# (CHILD_STOP_TIMEOUT_S), and the log then says so, which the test reads first.
STOPPED_WITHIN_S = 5.0


@pytest.fixture
def scratch_dir() -> Iterator[Path]:
    """A directory outside /tmp/pytest-of-<user>. As root, pgserver runs Postgres as the user
    `pgserver`, and every pytest start (another run in parallel, say) chmods that root to 0700,
    locking Postgres out of its own data mid-run."""
    path = Path(tempfile.mkdtemp(prefix="qt-test-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


def _descendants(root: int) -> set[int]:
    """Every live process below `root`, read from /proc (children, grandchildren, ...)."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, IndexError, ValueError):
            continue
        children.setdefault(ppid, []).append(int(entry.name))
    found: set[int] = set()
    todo = [root]
    while todo:
        for pid in children.get(todo.pop(), []):
            if pid not in found:
                found.add(pid)
                todo.append(pid)
    return found


def _up_command() -> list[str]:
    script = Path(sys.executable).with_name("queue-tinker")
    if script.exists():
        return [str(script), "up", "--workers", "1"]
    return [sys.executable, "-m", "queue_tinker.cli", "up", "--workers", "1"]


def _wait_healthy(proc: subprocess.Popen[bytes], url: str, log: Path) -> None:
    deadline = time.monotonic() + HEALTHY_WITHIN_S
    with httpx.Client(timeout=2.0) as client:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                pytest.fail(f"`queue-tinker up` exited with {proc.returncode}:\n{log.read_text()}")
            try:
                if client.get(url).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.25)
    pytest.fail(f"{url} did not answer 200 within {HEALTHY_WITHIN_S:.0f} s:\n{log.read_text()}")


@pytest.mark.slow
@pytest.mark.timeout(180)
@pytest.mark.parametrize("stop", [signal.SIGTERM, signal.SIGINT], ids=["sigterm", "ctrl-c"])
def test_up_serves_healthz_and_a_stop_signal_stops_everything(
    scratch_dir: Path, stop: signal.Signals
) -> None:
    """With no URLs set, `up` starts embedded Redis+Postgres, gateway and a worker; SIGTERM
    (or Ctrl-C's SIGINT) exits 0 within 2 s and leaves no redis-server, postgres, gateway or
    worker running."""
    data_dir = scratch_dir / "data"
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("QT_")}
    env.update(QT_DATA_DIR=str(data_dir), QT_GATEWAY_PORT=str(port))
    log = scratch_dir / "up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(_up_command(), env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        _wait_healthy(proc, f"http://127.0.0.1:{port}/healthz", log)
        owned = _descendants(proc.pid)
        postmaster = int((data_dir / "postgres" / "postmaster.pid").read_text().split()[0])
        owned |= {postmaster, *_descendants(postmaster)}
        assert len(owned) >= 4, f"expected redis, postgres, gateway, worker; got {owned}"

        began = time.monotonic()
        proc.send_signal(stop)
        try:
            code = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            pytest.fail(f"`up` did not stop within 30 s:\n{log.read_text()}")
        took = time.monotonic() - began
        assert code == 0, log.read_text()
        assert "queue-tinker: killed" not in log.read_text(), log.read_text()
        assert took <= STOPPED_WITHIN_S, f"stopped in {took:.2f} s:\n{log.read_text()}"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()

    # pg_ctl stop returns when the postmaster is gone; its helpers may trail by a few ms.
    deadline = time.monotonic() + 5
    while (left := {pid for pid in owned if pid_alive(pid)}) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not left, f"processes left running after `up` exited: {sorted(left)}"


def test_a_drained_worker_does_not_stop_the_stack() -> None:
    """A worker that exits 0 (drained from the dashboard) is let go while the gateway runs
    on; a worker that fails, or the gateway exiting at all, is a crash that stops `up`."""

    def child(code: int, linger_s: float = 0.0) -> list[str]:
        return [sys.executable, "-c", f"import sys, time; time.sleep({linger_s}); sys.exit({code})"]

    with ProcessGroup() as group:
        gateway = group.start("gateway", child(0, 60))
        drained = group.start("worker-0", child(0))
        drained.proc.wait(timeout=30)
        assert crashed_child(group) is None
        assert drained not in group.children and gateway.proc.poll() is None
        failed = group.start("worker-1", child(3))
        failed.proc.wait(timeout=30)
        assert crashed_child(group) is failed
        group.forget(failed)
        gateway.proc.terminate()
        gateway.proc.wait(timeout=30)
        assert crashed_child(group) is gateway


CLIENT_IN_ANOTHER_SHELL = """
import queue_tinker as tinker
from queue_tinker import types
service = tinker.ServiceClient()
training = service.create_lora_training_client(base_model="queue-tinker/tiny-llama", rank=4)
tokens = training.encode("Q: 2+2?\\nA: 4\\n")
datum = types.Datum(
    model_input=types.ModelInput.from_ints(tokens[:-1]),
    loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * (len(tokens) - 1)},
)
print("loss", training.forward_backward([datum], "cross_entropy").result(timeout=120).loss)
service.close()
"""


def test_a_client_and_the_cli_in_another_shell_find_a_running_up(scratch_dir: Path) -> None:
    """`up` on the default data directory; in another process with no QT_* set, the README's
    client snippet trains a step and `queue-tinker status` answers, both saying which
    deployment they found; `up --env` prints it for eval; once `up` is gone, nothing is
    found."""
    port = free_port()
    bare = {k: v for k, v in os.environ.items() if not k.startswith("QT_")}
    log = scratch_dir / "up.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(
            _up_command(), env={**bare, "QT_GATEWAY_PORT": str(port)}, cwd=scratch_dir,
            stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    try:
        _wait_healthy(proc, f"http://127.0.0.1:{port}/healthz", log)

        def run(*argv: str) -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                argv, env=bare, cwd=scratch_dir, capture_output=True, text=True, timeout=180
            )

        client = run(sys.executable, "-c", CLIENT_IN_ANOTHER_SHELL)
        assert client.returncode == 0, client.stderr + log.read_text()
        assert client.stdout.startswith("loss ")
        assert "using the deployment `queue-tinker up` runs" in client.stderr
        status = run(*_up_command()[:-3], "status")
        assert status.returncode == 0, status.stderr
        assert "queue-tinker/tiny-llama" in status.stdout
        env = run(*_up_command()[:-3], "up", "--env")
        assert env.returncode == 0 and "export QT_REDIS_URL=" in env.stdout, env.stdout
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=30)
    assert not (scratch_dir / ".qt-data" / "up.json").exists()
    gone = subprocess.run(
        [*_up_command()[:-3], "up", "--env"], env=bare, cwd=scratch_dir, capture_output=True,
        text=True, timeout=60,
    )  # fmt: skip
    assert gone.returncode == 1 and "no `queue-tinker up` runs" in gone.stdout


def test_a_file_left_by_a_killed_up_is_not_taken(scratch_dir: Path) -> None:
    """A kill -9 leaves up.json behind: a process that is gone is not followed."""
    from queue_tinker.settings import Settings, running_up, up_file, with_running_up

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    up_file(scratch_dir).write_text(f'{{"pid": {dead.pid}, "redis_url": "redis://gone:1/0"}}')
    assert running_up(scratch_dir) is None
    settings = Settings(data_dir=scratch_dir)
    assert with_running_up(settings).redis_url is None
    up_file(scratch_dir).write_text(f'{{"pid": {os.getpid()}, "redis_url": "redis://here:1/0"}}')
    assert with_running_up(settings).redis_url == "redis://here:1/0"
