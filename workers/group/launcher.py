"""`queue-tinker worker --ranks N`: start the N ranks of a worker group and watch them as one
worker. A rank that ends while the others run ends the group: the others are killed (their
collectives could never complete again), rank 0's lease lapses, and another worker takes its
models over and replays them, as after any worker's death. SIGTERM/SIGINT go to rank 0, which
hands its models back and then tells the others to stop.

Imports no torch: the ranks load it, each in its own process.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
from types import FrameType

log = logging.getLogger("queue_tinker.worker.group")


def free_port() -> int:
    """A loopback port for the ranks' rendezvous (rank 0 listens on it)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_command(rank: int, ranks: int, port: int, base_model: str, device: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "queue_tinker.workers.group.rank",
        f"--rank={rank}",
        f"--ranks={ranks}",
        f"--port={port}",
        f"--base-model={base_model}",
        f"--device={device}",
    ]


def run_group(*, ranks: int, base_model: str, device: str) -> int:
    """Run the group until it stops; its exit code: rank 0's, or a failed rank's."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    if device == "auto":
        device = "cpu"  # no torch here to ask; a GPU group says --device cuda
    port = free_port()
    procs = [
        subprocess.Popen(rank_command(rank, ranks, port, base_model, device))
        for rank in range(ranks)
    ]
    log.info("worker group of %d ranks on %s: pids %s", ranks, device, [p.pid for p in procs])

    def stop_rank_0(signum: int, frame: FrameType | None) -> None:
        if procs[0].poll() is None:
            procs[0].send_signal(signal.SIGTERM)

    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, stop_rank_0)
    return watch(procs)


def watch(procs: list[subprocess.Popen[bytes]]) -> int:
    """Wait for the ranks; the first that ends while others run with an error (or rank 0,
    whatever its code: nobody leads the others any more) ends the group."""
    by_pid = {p.pid: p for p in procs}
    failed: int | None = None
    while any(p.returncode is None for p in procs):
        pid, status = os.wait()  # blocks until a child ends (signals interrupt and resume it)
        proc = by_pid.get(pid)
        if proc is None:
            continue
        proc.returncode = os.waitstatus_to_exitcode(status)
        rank = procs.index(proc)
        running = [p for p in procs if p.returncode is None]
        if running and failed is None and (proc.returncode != 0 or rank == 0):
            failed = proc.returncode or 1
            log.error(
                "rank %d (pid %d) ended with %s: ending the group", rank, pid, proc.returncode
            )
            for other in running:
                other.kill()
    if failed is not None:
        return failed
    return procs[0].returncode or 0
