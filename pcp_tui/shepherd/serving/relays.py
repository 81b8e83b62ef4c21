"""Relays at the shepherd: a relay's workers arrive as channels of its one link.

A relay (`pcp-tui relay`, `pcp_tui/relay.py`) passes admission as a worker does
(TLS, the join token, --worker-keys: its id is its name) with `relay` set in its
hello. Once welcomed, its connection carries its workers' connections as
channels (`contract.channels`), and the shepherd serves each channel exactly as
it serves a socket (`WorkerPool.serve`): the worker's own handshake, its plan,
its rounds, its watchdogs. What the relay changes is what crosses the shepherd's
network: a round's parameters and each fragment's update go to the relay once
and are repeated to its workers there. The shepherd takes --relays relays at
once; more, or any while it is 0, are refused with a line that says so.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from functools import partial

import numpy as np
import trio

from pcp_tui import protocol
from pcp_tui.config import RunConfig
from pcp_tui.contract.channels import Channel, Channels
from pcp_tui.contract.connection import LINK_ERRORS
from pcp_tui.shepherd.run.events import RelayJoined, RelayLeft
from pcp_tui.shepherd.run.state import RunState
from pcp_tui.shepherd.serving.admission import Admitted, held

log = logging.getLogger(__name__)


@dataclass
class RelayView:
    """One relay as the dashboard and the API show it."""

    name: str
    peer: str
    channels: Channels = field(repr=False)
    fingerprint: str = ""  # the certificate its workers see (their key signatures cover it)
    # its control channel (the first it opens): the folds it is sent, its answers
    control: protocol.MessageStream | None = field(default=None, repr=False)
    # (round, fragment) -> its answer to that fold's close, once it came (`close_fold`)
    answers: dict[tuple[int, int], protocol.Message | None] = field(
        default_factory=dict, repr=False
    )
    answered: trio.Event = field(default_factory=trio.Event, repr=False)

    @property
    def workers(self) -> int:
        """Workers' connections it carries now (its control channel is none)."""
        return sum(not channel.control for channel in self.channels.channels.values())


class Relays:
    """The relays connected now; `serve` runs one until its link ends."""

    def __init__(
        self,
        config: RunConfig,
        state: RunState,
        *,
        run_id: str,
        serve_channel: Callable[[Channel, str], Awaitable[None]],
    ):
        self.config, self.state, self.run_id = config, state, run_id
        self.serve_channel = serve_channel  # the pool's: one worker's connection
        self.live: dict[str, RelayView] = {}
        self._sent_before = self._received_before = 0  # by relays' links that ended
        self._said_goodbye = False  # the run is over (or stopped): a relay leaving is its end

    @property
    def sent(self) -> int:
        """Bytes written to relays' links, the ended ones' too: what crossed the network."""
        return self._sent_before + sum(v.channels.link.bytes_sent for v in self.live.values())

    @property
    def received(self) -> int:
        return self._received_before + sum(
            v.channels.link.bytes_received for v in self.live.values()
        )

    def refusal(self, name: str) -> tuple[protocol.ErrorCode, str] | None:
        """(code, why) if relay `name` may not connect now; busy ones retry, others do not."""
        allowed = self.config.network.relays
        if not allowed:
            why = "this shepherd takes no relays: start it with --relays N to allow N"
            return protocol.ErrorCode.AUTH_FAILED, why
        if name in self.live:
            view = self.live[name]
            link = view.channels.link
            silent = link.clock() - link.last_activity
            return held(f"relay {name!r}", "relay", view.peer, silent, self.config.network)
        if len(self.live) >= allowed:
            why = f"{len(self.live)} relays are connected, the most --relays {allowed} allows"
            return protocol.ErrorCode.BUSY, why
        return None

    async def goodbye_all(self, reason: str, *, resumable: bool = False) -> None:
        """Tell every relay the run is over (or stopped to be resumed)."""
        self._said_goodbye = True
        async with trio.open_nursery() as nursery:
            for view in list(self.live.values()):
                nursery.start_soon(partial(view.channels.say_goodbye, reason, resumable=resumable))

    async def serve(self, admitted: Admitted) -> None:
        """Welcome the relay on `admitted` (`refusal` said it may connect), then serve its
        channels until its link ends."""
        name, stream = admitted.hello.worker_id, admitted.stream
        network = self.config.network
        await stream.send(protocol.Welcome(0, self.run_id, network.heartbeat_seconds))
        channels = Channels(stream, accepts=True, keeps=True)
        fingerprint = admitted.hello.relay_fingerprint
        self.live[name] = RelayView(name, admitted.peer, channels, fingerprint)
        joined = f"relay {name} joined from {admitted.peer}"
        security = self.config.security
        if security.weight_per == "address" and not security.worker_keys:
            joined += (  # the addresses a relay reports are its word (any token holder's)
                "; its workers share one address's weight (--weight-per address): for a "
                "site's own relay, weigh them by id (--weight-per id, or --worker-keys)"
            )
        self.state.emit(RelayJoined(joined, relay=name))
        why = "its link ended"
        try:
            async with trio.open_nursery() as nursery:  # its workers' connections end with it
                nursery.start_soon(self._accept, self.live[name], nursery)
                try:
                    await channels.run(network.heartbeat_seconds, network.heartbeat_timeout)
                    why = channels.ended or why
                except protocol.ProtocolError as exc:
                    why = f"it broke the protocol ({exc})"
                    with trio.move_on_after(1):
                        await stream.send_error(exc.code, str(exc))
                with trio.CancelScope(shield=True):
                    await trio.aclose_forcefully(stream.stream)
        finally:
            del self.live[name]
            self._sent_before += stream.bytes_sent
            self._received_before += stream.bytes_received
            if self._said_goodbye:
                left = f"relay {name} left: told the run is over"
            else:
                left = f"relay {name} left ({why}); its workers reconnect"
            self.state.emit(RelayLeft(left, relay=name))

    async def _accept(self, view: RelayView, nursery: trio.Nursery) -> None:
        async for channel in view.channels.accepted:
            if channel.control:
                nursery.start_soon(self._control, view, channel)
            else:
                nursery.start_soon(self.serve_channel, channel, view.name)

    async def _control(self, view: RelayView, channel: Channel) -> None:
        """Read the relay's answers to closed folds until its control channel ends."""
        stream = protocol.MessageStream(channel, clock=trio.current_time)
        view.control = stream
        try:
            while True:
                message = await stream.receive()
                body = message.body_as(protocol.Folded)
                key = (body.round, body.fragment)
                if key in view.answers and view.answers[key] is None:
                    view.answers[key] = message
                    view.answered.set()
                    view.answered = trio.Event()
        except LINK_ERRORS as exc:
            log.info("relay %s's control channel ended: %s", view.name, exc)
        finally:
            view.control = None
            view.answered.set()

    # -- folds: the relays fold their workers' results (`pcp_tui/relay.py` `Folds`) --------

    async def open_folds(
        self,
        folds: list[tuple[protocol.Fold, Mapping[str, np.ndarray] | None, list[str]]],
        opened: Mapping[str, trio.Event],
    ) -> None:
        """Send every relay a round's folds, one a fragment: (the fold, the clip's center, the
        relays it reached, which each joins once it has it: their workers' results of that
        fragment come folded then). `opened[relay]` is set once that relay's are on their
        way, or failed: its workers' round starts wait for it (a result must find its fold
        open), and the others' do not wait for a stalled relay."""
        messages = [
            (protocol.encode_once(order, center), order, reached)
            for order, center, reached in folds
        ]

        async def send(view: RelayView) -> None:
            try:
                for message, order, reached in messages:
                    if view.control is None:
                        return
                    with contextlib.suppress(*LINK_ERRORS):
                        await view.control.send_encoded(message)
                        view.answers.setdefault((order.round, order.fragment), None)
                        reached.append(view.name)
            finally:
                if (event := opened.get(view.name)) is not None:
                    event.set()

        async with trio.open_nursery() as nursery:
            for view in list(self.live.values()):
                nursery.start_soon(send, view)
            for name, event in opened.items():  # relays gone since: nothing to wait for
                if name not in self.live:
                    event.set()

    async def close_fold(
        self, number: int, fragment: int, relays: list[str], timeout: float
    ) -> dict[str, protocol.Message]:
        """Close round `number`'s fold of `fragment` on `relays`; each one's `Folded` answer
        (with Σ w·s·Δ as its tensors) that came within `timeout`. A relay that is gone, or
        answers late, has its results of the fragment lost: their notices counted nothing; one
        whose link lives on without an answer has its link ended (its workers fail over)."""
        key = (number, fragment)
        close = protocol.Fold(round=number, fragment=fragment, close=True)
        answers: dict[str, protocol.Message] = {}

        async def ask(view: RelayView) -> None:
            if view.control is None:
                return
            with contextlib.suppress(*LINK_ERRORS), trio.move_on_after(timeout):
                await view.control.send(close)
                while view.answers.get(key) is None and view.control is not None:
                    await view.answered.wait()
            answer = view.answers.pop(key, None)
            if answer is not None:
                answers[view.name] = answer
            elif view.control is not None and self.live.get(view.name) is view:
                # its link lives but its fold never came: stalled or withheld, it would cost
                # every round this wait and its workers' results; its workers fail over
                log.warning("relay %s did not answer a fold's close: ending its link", view.name)
                await trio.aclose_forcefully(view.channels.link.stream)

        async with trio.open_nursery() as nursery:
            for name in relays:
                if (view := self.live.get(name)) is not None:
                    nursery.start_soon(ask, view)
        return answers
