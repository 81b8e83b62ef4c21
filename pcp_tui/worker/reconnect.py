"""How a worker gets back to its shepherd: exponential back-off with jitter, in a total budget.

`Reconnect.run(attempt)` calls `attempt(deadline)` until it returns or raises
something other than ConnectionLost. Between attempts it waits about 1 s, then
twice as long each time up to `max_backoff`, each wait drawn from [w/2, w] so that
workers cut off together do not come back together (and the waits still grow).
`give_up_after` is the total time spent trying: the waits are cut to fit it, and
`deadline` (trio's clock) tells the attempt when its connect and handshake must
give up too, so a black-holed address cannot stretch the budget (an attempt gets at
least LAST_TRY_SECONDS, so the last one, at the end of the budget, is a real try:
that is the most the budget can be overrun by). Once it is spent
the last attempt's ConnectionLost is raised, saying so and naming --give-up-after.

The retry loop is tenacity's `AsyncRetrying` with `sleep=trio.sleep`: a well-kept
library whose stop, wait and before-sleep hooks take plain callables, so the budget
rule above and the per-attempt log line are a few lines each. stamina (built on
tenacity, trio-aware) was the other candidate; it was not chosen because its
instrumentation is process-global (it registers retry counters in
`prometheus_client`'s default registry when that is installed, as it is here for
the shepherd's metrics) and its waits add jitter instead of drawing within a
doubling range, which lets a later wait be shorter than an earlier one.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import random
import socket
from collections.abc import Awaitable, Callable
from typing import TypeVar

import tenacity
import trio

from pcp_tui.contract.connection import ConnectionLost, Refused
from pcp_tui.contract.tls import ClientTLS, TLSRefused

FIRST_WAIT = 1.0  # seconds, at most, before the second attempt; doubles after each failure
LAST_TRY_SECONDS = 2.0  # the least time an attempt gets to connect and be welcomed
DOUBLINGS = 8  # 2**8 s is far above any sensible max_backoff

log = logging.getLogger(__name__)
T = TypeVar("T")


class Reconnect:
    """Retries of one worker's connection: the policy, and a hook to show each wait.

    `on_wait(reason, seconds)` is called before each wait (the worker's status line
    shows it). With `retry=False` (--no-reconnect) the first ConnectionLost is final.
    """

    def __init__(
        self,
        *,
        give_up_after: float,
        max_backoff: float = 30.0,
        retry: bool = True,
        on_wait: Callable[[str, float], None] | None = None,
    ):
        self.give_up_after = give_up_after
        self.max_backoff = max_backoff
        self.retry = retry
        self._on_wait = on_wait

    async def run(self, attempt: Callable[[float], Awaitable[T]], *, rejoin: bool = False) -> T:
        """`await attempt(deadline)` until it returns; what it returns.

        `rejoin`: after losing a connection that worked: wait as before a second attempt
        first (so that a shepherd that drops every worker is not hammered). A first join
        that gives up says to check the address instead of that the run may have ended.
        Raises ConnectionLost once the budget is spent (or at once without retries),
        and whatever else `attempt` raises (a final refusal, say) unchanged.
        """
        started = trio.current_time()
        if rejoin:
            await trio.sleep(FIRST_WAIT * random.uniform(0.5, 1.0))
        deadline = started + self.give_up_after

        def wait(state: tenacity.RetryCallState) -> float:
            cap = min(self.max_backoff, FIRST_WAIT * 2 ** min(state.attempt_number - 1, DOUBLINGS))
            return max(0.0, min(cap * random.uniform(0.5, 1.0), deadline - trio.current_time()))

        def spent(state: tenacity.RetryCallState) -> bool:
            return not self.retry or trio.current_time() >= deadline

        def before_sleep(state: tenacity.RetryCallState) -> None:
            failed, action = state.outcome, state.next_action
            assert failed is not None and action is not None, "tenacity sets both before a sleep"
            reason, seconds = str(failed.exception()), action.sleep
            log.info(
                "%s; retrying in %.1f s (attempt %d, %.0f of --give-up-after %g s spent)",
                *(reason, seconds, state.attempt_number + 1),
                *(trio.current_time() - started, self.give_up_after),
            )
            if self._on_wait is not None:
                self._on_wait(reason, seconds)

        retrying = tenacity.AsyncRetrying(
            sleep=trio.sleep,
            retry=tenacity.retry_if_exception_type(ConnectionLost),
            stop=spent,
            wait=wait,
            before_sleep=before_sleep,
        )

        async def attempt_in_budget() -> T:
            return await attempt(max(deadline, trio.current_time() + LAST_TRY_SECONDS))

        try:
            return await retrying(attempt_in_budget)
        except tenacity.RetryError as exc:
            last = exc.last_attempt.exception()
            assert last is not None, "only a failed attempt (ConnectionLost) is retried"
            if not self.retry:
                raise last from None
            why = (
                "the run may have ended while this worker was cut off"
                if rejoin
                else "is the shepherd up, and is --connect the address its join command printed?"
            )
            raise ConnectionLost(
                f"{last}; gave up after {trio.current_time() - started:.0f} s of retrying "
                f"without getting in ({why}; --give-up-after sets the limit)"
            ) from last


async def dial(
    host: str, port: int, tls: ClientTLS | None, deadline: float, source: str | None = None
) -> trio.abc.Stream:
    """A TCP (or TLS) stream to the shepherd at `host:port` by `deadline`, from local address
    `source` if given, for a worker or a relay; ConnectionLost saying why not (worth
    retrying), Refused for a certificate that cannot be trusted."""
    if source is not None:
        _check_source(source, host)
    try:
        with trio.fail_at(deadline):
            tcp = await trio.open_tcp_stream(host, port, local_address=source)
            return tcp if tls is None else await tls.connect(tcp, host)
    except TLSRefused as exc:
        raise Refused(str(exc)) from None
    except socket.gaierror as exc:
        raise ConnectionLost(
            f"the shepherd's name {host!r} did not resolve ({exc.strerror})"
        ) from None
    except (OSError, trio.TooSlowError) as exc:
        why = "timed out" if isinstance(exc, trio.TooSlowError) else connect_failure(exc)
        where = f" from --source-address {source}" if source is not None else ""
        raise ConnectionLost(f"cannot reach {host}:{port}{where} ({why})") from None


def _check_source(source: str, host: str) -> None:
    """Refused unless `source` (--source-address) is an address of this machine, of the
    shepherd's family where `host` is an address (a name may resolve to either)."""
    try:
        version = ipaddress.ip_address(source).version
    except ValueError:
        raise Refused(
            f"--source-address {source!r} is not an IP address: name one that `ip addr` "
            "lists, or leave it out"
        ) from None
    with contextlib.suppress(ValueError):  # a name: trio tries its addresses of that family
        if (target := ipaddress.ip_address(host).version) != version:
            raise Refused(
                f"--source-address {source} is IPv{version} and the shepherd's address {host} "
                f"is IPv{target}: name an IPv{target} address of this machine, or leave it out"
            )
    try:
        with socket.socket(socket.AF_INET6 if version == 6 else socket.AF_INET) as probe:
            probe.bind((source, 0))
    except OSError as exc:
        raise Refused(
            f"--source-address {source} is not an address of this machine ({exc.strerror}): "
            "name one that `ip addr` lists, or leave it out"
        ) from None


def connect_failure(exc: OSError) -> str:
    """Why a TCP connect failed, in words: trio's own error says only "all attempts to
    connect to HOST:PORT failed" and keeps each address's reason in its cause."""
    cause: BaseException = exc
    while isinstance(cause.__cause__, OSError | BaseExceptionGroup):
        cause = cause.__cause__
        while isinstance(cause, BaseExceptionGroup):
            cause = cause.exceptions[-1]
    if isinstance(cause, ConnectionRefusedError):
        return "connection refused: no shepherd listens on that port (yet)"
    if isinstance(cause, OSError) and cause.errno is not None:
        return os.strerror(cause.errno).lower()
    return str(exc)
