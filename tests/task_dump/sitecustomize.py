"""Loaded by scripts that tests.procs.run_script starts: on SIGUSR1, print every asyncio task of
every event loop in the process, with the line each one waits on. faulthandler's dump shows only
threads, and a script hung inside a client library's background loop shows that loop idle in
select; the tasks say which await never finished."""

from __future__ import annotations

import asyncio
import gc
import signal
import sys
import threading


def _dump_tasks(signum: int, frame: object) -> None:
    del signum, frame
    loops = [o for o in gc.get_objects() if isinstance(o, asyncio.AbstractEventLoop)]
    for loop in loops:
        print(f"--- event loop {loop!r} (running: {loop.is_running()})", file=sys.stderr)
        try:
            tasks = asyncio.all_tasks(loop)
        except RuntimeError as error:  # the set changed under us: the loop runs on
            print(f"    tasks unreadable: {error}", file=sys.stderr)
            continue
        for task in tasks:
            print(f"    {task!r}", file=sys.stderr)
            task.print_stack(limit=8, file=sys.stderr)
    sys.stderr.flush()


if threading.current_thread() is threading.main_thread():
    signal.signal(signal.SIGUSR1, _dump_tasks)
