"""A shepherd's run beside the local worker processes of a demo, which end with it.

`pcp-tui demo` (headless and in the dashboard) and `pcp_tui.train()` run one.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

import trio

from pcp_tui.app.api import run_with_api

if TYPE_CHECKING:
    from pcp_tui.shepherd.coordinator import Shepherd

LEAVE_SECONDS = 5.0


async def run_with_local_workers(
    shepherd: Shepherd,
    spawn: Callable[[trio.Nursery, int], Awaitable[object]],
    *,
    task_status=trio.TASK_STATUS_IGNORED,
) -> None:
    """The shepherd's run beside the local workers `spawn` starts; they end with it.

    Workers the shepherd told goodbye leave by themselves. One that had not joined
    yet (the run was stopped while it was still starting, or it was still
    compiling) hears no goodbye and would retry for its --give-up-after, 30
    minutes, holding the demo open: LEAVE_SECONDS after the run, the ones still
    running are terminated (trio sends SIGTERM, then SIGKILL).
    """
    async with trio.open_nursery() as workers:
        async with trio.open_nursery() as run:
            port = await run.start(run_with_api, shepherd)
            task_status.started(await spawn(workers, port))
        workers.cancel_scope.deadline = trio.current_time() + LEAVE_SECONDS
