"""A process that ran trio leaves no thread still busy with a job when it exits.

trio's cached threads are daemon threads: one hands its job's result back and
then drops its own reference to it. If that was the last one, the objects are
freed on that thread, possibly after `trio.run` has returned (measured: about
1 run in 4 of `trio.to_thread.run_sync` of an object whose freeing takes
0.2 s). With jaxlib's arrays that freeing is C++ that may give up the GIL, and a
daemon thread that wants the GIL back while the interpreter finalizes is ended
by pthread_exit, which aborts the process when it unwinds a C++ destructor
(CPython gh-87135): a finished worker exited with -6 so. `settle_threads`, at
the end of every `run_unwrapped`, waits for them.
"""

from __future__ import annotations

import threading
import time

import trio

from pcp_tui.app.launch import run_unwrapped


def test_a_run_returns_only_once_its_threads_are_back_from_their_jobs():
    """The thread is still busy after it has handed the result back (here in `deliver`,
    as after a job it drops the job's objects): the run waits for it."""
    finished: list[str] = []

    async def main() -> None:
        token, handed_back = trio.lowlevel.current_trio_token(), trio.Event()

        def deliver(_result: object) -> None:  # on the job's thread
            token.run_sync_soon(handed_back.set)
            time.sleep(0.3)  # still busy after the result is back
            finished.append(threading.current_thread().name)

        trio.lowlevel.start_thread_soon(lambda: None, deliver)
        await handed_back.wait()

    assert run_unwrapped(main, ()) is None
    assert finished == [finished[0]] and finished[0].startswith("Trio thread")
