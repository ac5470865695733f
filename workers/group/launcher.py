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
import select
import signal
import socket
import subprocess
import sys
from types import FrameType

log = logging.getLogger("queue_tinker.worker.group")
# How long the other ranks get to end after rank 0 has stopped and told them to.
STOP_GRACE_S = 30.0


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
        f"--launcher={os.getpid()}",
    ]


def run_group(*, ranks: int, base_model: str, device: str) -> int:
    """Run the group until it stops; its exit code: rank 0's, or a failed rank's."""
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
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
    return watch_ranks(procs)


def watch_ranks(procs: list[subprocess.Popen[bytes]], grace_s: float = STOP_GRACE_S) -> int:
    """Wait for the ranks (rank 0 first in `procs`); the group's exit code. Rank 0 ending
    with 0 has told the others to stop: they get `grace_s` to end by themselves. Any other
    end of a rank while others run (a failure, or rank 0 gone: nobody leads them) ends the
    group at once."""
    # A pidfd a rank: select wakes when one ends, and only our ranks are reaped.
    ends = {os.pidfd_open(p.pid): p for p in procs}
    try:
        while True:
            waiting = [fd for fd, p in ends.items() if p.returncode is None]
            ready, _, _ = select.select(waiting, [], [])  # resumed after a signal's handler
            for fd in ready:
                proc = ends[fd]
                proc.wait()
                code = _ended(procs, proc, grace_s)
                if code is not None:
                    return code
    finally:
        for fd in ends:
            os.close(fd)


def _ended(
    procs: list[subprocess.Popen[bytes]], proc: subprocess.Popen[bytes], grace_s: float
) -> int | None:
    """The group's exit code if `proc`'s end ends the group; None while it goes on."""
    running = [p for p in procs if p.returncode is None]
    rank = procs.index(proc)
    if not running:
        return _exit_code(next((p.returncode for p in procs if p.returncode), 0))
    if rank == 0 and proc.returncode == 0:
        return _stopped(running, grace_s)
    if proc.returncode != 0 or rank == 0:
        log.error(
            "rank %d (pid %d) ended with %s: ending the group", rank, proc.pid, proc.returncode
        )
        for other in running:
            other.kill()
            other.wait()
        return _exit_code(proc.returncode)
    return None  # a follower that rank 0 told to stop


def _stopped(running: list[subprocess.Popen[bytes]], grace_s: float) -> int:
    code = 0
    for proc in running:
        try:
            code = code or _exit_code(proc.wait(timeout=grace_s))
        except subprocess.TimeoutExpired:
            log.error("rank pid %d did not stop after rank 0 did: killed", proc.pid)
            proc.kill()
            proc.wait()
            code = 1
    return code


def _exit_code(returncode: int) -> int:
    """A process's return code as an exit status: killed by signal N is 128 + N, as shells say."""
    return 128 - returncode if returncode < 0 else returncode
