"""Ranks that come out of one call differently (workers/group/channel.py agree): a failure on
one rank alone ends the group, as a crash would, instead of leaving ranks whose states no
longer match to compute the next ops together."""

from __future__ import annotations

from pathlib import Path

from group_ranks import run_parting_rank, spawned_ranks
from procs import free_port

from queue_tinker.workers.group.leader import PARTED_EXIT
from queue_tinker.workers.model.base_model import ensure_builtin_model


def test_a_checkpoint_one_rank_cannot_load_ends_the_group(tmp_path: Path) -> None:
    """Rank 0 saves a checkpoint its follower cannot read (storage of its own) and loads it:
    the load fails on rank 1 alone, before a collective rank 0 then waits at (gathering the
    adapter's shards for a snapshot). Rank 1 waits its failed_wait_s to compare outcomes and
    ends, naming the call and its error; rank 0's collective fails with it gone, and rank 0
    ends with PARTED_EXIT before it could report the load done."""
    ensure_builtin_model("queue-tinker/tiny-llama", tmp_path / "models")
    for rank in range(2):
        (tmp_path / f"rank-{rank}").mkdir()
        (tmp_path / f"rank-{rank}" / "models").symlink_to(tmp_path / "models")
    port = free_port()
    args = [(rank, str(tmp_path), port) for rank in range(2)]
    with spawned_ranks(run_parting_rank, args) as ranks:
        for process in ranks:
            process.join(timeout=120)
    reports = [(tmp_path / f"rank-{rank}" / "report").read_text().splitlines() for rank in range(2)]
    assert [p.exitcode for p in ranks] == [PARTED_EXIT, 1], reports
    [saved] = reports[0]  # and not "went on past the load"
    assert saved.startswith("saved tinker://")
    [ended] = reports[1]
    assert ended.startswith(
        "ended: ops.execute: this rank failed (UserInputError) and the other ranks did not come "
        "to compare within 3 s"
    ), ended
