"""The launcher's watch over a group's ranks (workers/group/launcher.py), with stand-in rank
processes (`sleep`, `sh`): one rank's end ends the group as the group's failure, and a stop
that rank 0 leads is waited for."""

from __future__ import annotations

import subprocess

from queue_tinker.workers.group.launcher import watch_ranks


def ranks(*commands: str) -> list[subprocess.Popen[bytes]]:
    return [subprocess.Popen(["sh", "-c", command]) for command in commands]


def test_a_rank_that_fails_ends_the_others_with_its_code() -> None:
    """Rank 1 exits 3 while rank 0 runs: rank 0 is killed and the group exits 3."""
    group = ranks("exec sleep 60", "exit 3")
    assert watch_ranks(group) == 3
    assert group[0].returncode == -9


def test_a_rank_killed_by_a_signal_ends_the_group_as_shells_say() -> None:
    """Rank 0 is killed (kill -9): its follower is killed too; the group exits 128 + 9."""
    group = ranks("kill -9 $$", "exec sleep 60")
    assert watch_ranks(group) == 137
    assert group[1].returncode == -9


def test_a_stop_led_by_rank_0_waits_for_the_others() -> None:
    """Rank 0 exits 0 first (it told the others to stop): the others get time to end by
    themselves, and the group exits 0."""
    group = ranks("exit 0", "sleep 0.3; exit 0")
    assert watch_ranks(group) == 0
    assert group[1].returncode == 0


def test_a_rank_that_does_not_stop_after_rank_0_is_killed() -> None:
    """A rank still running when the grace after rank 0's stop is over is killed: exit 1."""
    group = ranks("exit 0", "exec sleep 60")
    assert watch_ranks(group, grace_s=0.2) == 1
    assert group[1].returncode == -9
