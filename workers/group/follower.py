"""Ranks 1..N-1 of a worker group: run each engine call rank 0 sends, in order, and drop the
results (rank 0 alone publishes). Until rank 0 says stop, a rank dies and the launcher ends
the group, or the ranks come out of a call differently (RanksPartedError ends this rank)."""

from __future__ import annotations

import logging

from queue_tinker.errors import UserInputError
from queue_tinker.workers.group.channel import STOP, Channel, collective_failed, outcome
from queue_tinker.workers.interface import Engine

log = logging.getLogger(__name__)


def follow(engine: Engine, channel: Channel) -> None:
    while True:
        call = channel.call()
        if call == STOP:
            return
        part = getattr(engine, call.part)
        try:
            came_to = getattr(part, call.method)(*call.args)
        except Exception as error:
            if collective_failed(error):
                raise  # the ranks cannot meet again: this rank ends, and the launcher the group
            # Bad input fails alike on rank 0, which reports it; a failure of this rank alone
            # is found out here: RanksPartedError ends this rank, and the launcher the group.
            if not isinstance(error, UserInputError):
                log.warning(
                    "rank %d: %s.%s failed", channel.rank, call.part, call.method, exc_info=True
                )
            channel.agree(call, outcome(error), failed=True)
            continue
        channel.agree(call, outcome(came_to))
