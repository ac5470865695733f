"""Ranks 1..N-1 of a worker group: run each engine call rank 0 sends, in order, and drop the
results (rank 0 alone publishes). Until rank 0 says stop, or a rank dies and the launcher ends
the group."""

from __future__ import annotations

import logging

from queue_tinker.errors import UserInputError
from queue_tinker.workers.group.channel import STOP, Channel, collective_failed
from queue_tinker.workers.interface import Engine

log = logging.getLogger(__name__)


def follow(engine: Engine, channel: Channel) -> None:
    while True:
        call = channel.call()
        if call == STOP:
            return
        part = getattr(engine, call.part)
        try:
            getattr(part, call.method)(*call.args)
        except UserInputError:
            pass  # bad input fails alike on rank 0, which reports it
        except Exception as error:
            if collective_failed(error):
                raise  # the ranks cannot meet again: this rank ends, and the launcher the group
            # Rank 0 runs the same call on the same state and should fail the same way; a
            # failure of this rank alone would part the ranks, so it is left in the log.
            log.warning(
                "rank %d: %s.%s failed", channel.rank, call.part, call.method, exc_info=True
            )
