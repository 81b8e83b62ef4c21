"""`pcp-tui relay`: workers join a relay, which carries them to the shepherd over one link.

    pcp-tui shepherd --workers 64 --relays 4 ...
    pcp-tui relay --connect SHEPHERD:8080 --token T --port 8081   # on each site's gateway
    pcp-tui worker --connect RELAY:8081 --token T                   # on the site's machines

The relay joins the shepherd as a worker does (the token's proof, --key under
--worker-keys, TLS with --tls-ca / --tls-fingerprint) and says it is a relay.
Each worker that connects to it becomes a channel of that one link
(`contract.channels`), carried byte for byte: the worker and the shepherd speak
PCP end to end, so the shepherd admits, plans and times each worker as if it had
dialled directly, and the worker checks the shepherd's hello and plan as it
always does. What a relay saves is the shepherd's network and sockets: one
connection per site instead of one per worker, and a round's parameters and
each fragment's update cross the shepherd's link once and are repeated to the
site's workers here.

A worker that connects while the relay has no link to the shepherd (or carries its
--max-workers) is told so (unavailable) and tries its next --connect address, or this
one again within its --give-up-after; one the shepherd is too busy to take now (its
handshake cap) is told busy, and tries this relay again, not the shepherd directly.
When the link is lost every worker's connection ends, as a lost shepherd connection
does, and the relay reconnects within its own --give-up-after. The shepherd's goodbye
at the end of the run ends the relay (exit 0), unless the run can be resumed.
"""

from __future__ import annotations

import logging
import platform
import sys
from collections.abc import Awaitable, Callable, Sequence
from functools import partial

import trio

from pcp_tui import protocol
from pcp_tui.config.relay import RelayConfig
from pcp_tui.contract import keys
from pcp_tui.contract.channels import PIECE_BYTES, Channel, Channels
from pcp_tui.contract.connection import (
    LINK_ERRORS,
    ConnectionEnded,
    ConnectionLost,
    IdInUse,
    Refused,
    RunOver,
    expect,
    expect_hello,
    goodbye_ended,
    silence_timeout,
)
from pcp_tui.contract.tls import ClientTLS, ServerTLS, shown_fingerprint
from pcp_tui.shepherd.serving.admission import peer_name
from pcp_tui.shepherd.serving.listening import (
    advertised,
    join_command,
    open_files_for,
    open_listeners,
)
from pcp_tui.worker.reconnect import Reconnect, dial

log = logging.getLogger(__name__)
TLS_SECONDS = 10.0  # a worker's TLS handshake with the relay


class Relay:
    """One relay process: its listeners, its link to the shepherd, the workers it carries."""

    def __init__(
        self,
        config: RelayConfig,
        *,
        token: str,
        server_tls: ServerTLS | None = None,
        client_tls: ClientTLS | None = None,
        say=None,
    ):
        connection = config.connection
        self.config, self.token = config, token
        self.host, self.port = connection.address
        self.name = connection.worker_id or f"relay-{platform.node() or 'host'}"
        self.key = keys.load_private_key(connection.key) if connection.key else None
        self.server_tls, self.client_tls = server_tls, client_tls
        self.say = say or (lambda line: print(f"pcp-tui relay: {line}", file=sys.stderr))
        self.channels: Channels | None = None  # the link to the shepherd, while there is one
        self.carried = 0  # workers' connections carried now
        self.listening_port = 0
        self.joined = False  # welcomed by the shepherd once: an idInUse after is its old link

    @property
    def join_command(self) -> str:
        """The command its workers join with: this relay, then the shepherd to fail over to
        when it dies (`--connect RELAY,SHEPHERD`). Under TLS the relay's certificate is not the
        shepherd's, and one worker trusts one: the shepherd is then left out."""
        relay = advertised(self.config.listen.host, self.listening_port)
        tls = self.server_tls or self.client_tls
        address = relay if tls else f"{relay},{self.config.connection.connect.strip()}"
        return join_command(address, "<TOKEN>", self.server_tls)

    async def _dial(self, deadline: float) -> trio.abc.Stream:
        """A new stream to the shepherd (TCP, TLS if set) by `deadline` (`run`'s `dial`)."""
        source = self.config.connection.source_address
        return await dial(self.host, self.port, self.client_tls, deadline, source)

    async def run(
        self,
        *,
        listeners: Sequence[trio.abc.Listener[trio.abc.Stream]] | None = None,
        dial: Callable[[float], Awaitable[trio.abc.Stream]] | None = None,
        task_status=trio.TASK_STATUS_IGNORED,
    ) -> None:
        """Serve workers until the shepherd ends the run; ConnectionLost once --give-up-after
        passes without a link, Refused if the shepherd will not take this relay.

        `listeners`: where workers connect, instead of TCP on --host/--port; `dial(deadline)`:
        a new stream to the shepherd, instead of TCP (and TLS) to --connect (both for
        `pcp_tui.testing.simulate`'s in-memory links)."""
        listen = self.config.listen
        if listeners is None:
            warning = open_files_for(listen.max_workers, 1)
            if warning:
                self.say(f"warning: {warning}")
            listeners, self.listening_port = await open_listeners(listen.host, listen.port)
        task_status.started(self.listening_port)
        connection = self.config.connection
        reconnect = Reconnect(
            give_up_after=connection.give_up_after,
            retry=connection.reconnect,
            on_wait=lambda why, seconds: self.say(f"{why}; retrying in {seconds:.1f} s"),
        )
        ended: ConnectionEnded | None = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(partial(trio.serve_listeners, self._carry, list(listeners)))
            lost = False
            try:
                while not await reconnect.run(partial(self._link, dial or self._dial), rejoin=lost):
                    lost = True
            except (ConnectionLost, Refused) as exc:  # raised bare, not in the nursery's group
                ended = exc
            nursery.cancel_scope.cancel()
        if ended is not None:
            raise ended

    # -- the link to the shepherd ---------------------------------------------------------

    async def _link(
        self, dial: Callable[[float], Awaitable[trio.abc.Stream]], deadline: float
    ) -> bool:
        """One link to the shepherd: True when the run is over, False when it was lost."""
        where = f"{self.host}:{self.port}"
        stream = await dial(deadline)
        # trio's clock, as the shepherd's links: a silent link is timed in virtual time too
        messages = protocol.MessageStream(stream, clock=trio.current_time)
        try:
            with trio.fail_at(deadline):
                welcome = await self._join(messages, where)
        except trio.TooSlowError:
            await trio.aclose_forcefully(stream)
            raise ConnectionLost(f"no welcome from {where} in time") from None
        except IdInUse as exc:  # its own old link, if it was welcomed before; else a twin
            await trio.aclose_forcefully(stream)
            if not self.joined:
                raise
            raise ConnectionLost(str(exc)) from None
        except (ConnectionLost, Refused):
            await trio.aclose_forcefully(stream)
            raise
        except (*LINK_ERRORS, protocol.ProtocolError) as exc:
            await trio.aclose_forcefully(stream)
            raise ConnectionLost(f"connection to {where} lost ({exc})") from None
        self.joined = True
        self.say(
            f"relay {self.name} joined the shepherd at {where}; workers join with: "
            + self.join_command
        )
        channels = self.channels = Channels(messages, accepts=False, keeps=False)
        interval = max(welcome.heartbeat_seconds, 0.5)
        try:
            await channels.run(interval, silence_timeout(interval))
        except protocol.ProtocolError as exc:
            self.say(f"the shepherd broke the relay protocol ({exc}); reconnecting")
        finally:
            self.channels = None
            with trio.CancelScope(shield=True):
                await trio.aclose_forcefully(stream)
        if channels.goodbye is not None:
            ended = goodbye_ended(channels.goodbye)
            if isinstance(ended, RunOver):
                self.say(f"the shepherd ended the run ({ended}); exiting")
                return True
            self.say(f"the shepherd stopped ({ended}); reconnecting")
        else:
            self.say(f"link to the shepherd lost ({channels.ended}); reconnecting")
        return False

    async def _join(self, stream: protocol.MessageStream, where: str) -> protocol.Welcome:
        """The relay's handshake: the shepherd's hello, the relay's, the welcome."""
        hello = (await expect_hello(stream, where)).body_as(protocol.Hello)
        await stream.send(
            keys.signed_hello(
                self.token,
                self.key,
                hello.nonce,
                self.name,
                channel=shown_fingerprint(stream.stream),
                relay=True,
                relay_fingerprint=self.server_tls.fingerprint if self.server_tls else "",
            )
        )
        return (await expect(stream, "welcome", who="relay")).body_as(protocol.Welcome)

    # -- one worker ------------------------------------------------------------------------

    async def _carry(self, raw: trio.abc.Stream) -> None:
        """Carry one worker's connection to the shepherd until either side ends it."""
        channels, peer = self.channels, peer_name(raw)
        if channels is None or self.carried >= self.config.listen.max_workers:
            why = (
                f"relay {self.name} has no link to its shepherd (yet)"
                if channels is None
                else f"relay {self.name} carries its --max-workers already"
            )
            log.info("turned %s away: %s", peer, why)
            await self._turn_away(raw, why)  # the worker tries its next --connect address
            return
        self.carried += 1
        stream: trio.abc.Stream = raw
        channel: Channel | None = None
        try:
            if self.server_tls is not None:
                with trio.fail_after(TLS_SECONDS):
                    stream = await self.server_tls.accept(raw)
            channel = await channels.open(peer)
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_pump, stream, channel, nursery.cancel_scope)
                nursery.start_soon(_pump, channel, stream, nursery.cancel_scope)
        except (*LINK_ERRORS, trio.TooSlowError) as exc:
            log.info("worker %s: %s", peer, exc)
        finally:
            self.carried -= 1
            with trio.CancelScope(shield=True):
                if channel is not None:
                    await channel.aclose()
                await trio.aclose_forcefully(stream)

    async def _turn_away(self, raw: trio.abc.Stream, why: str) -> None:
        """Tell a worker why this relay cannot carry it now (unavailable: it tries its next
        --connect address, or this one again within its --give-up-after), then close."""
        stream: trio.abc.Stream = raw
        with trio.move_on_after(TLS_SECONDS):
            try:
                if self.server_tls is not None:
                    stream = await self.server_tls.accept(raw)
                await protocol.MessageStream(stream).send_error(
                    protocol.ErrorCode.UNAVAILABLE, f"{why}: retrying"
                )
            except LINK_ERRORS as exc:
                log.info("worker %s: %s", peer_name(raw), exc)
        await trio.aclose_forcefully(stream)


async def _pump(source: trio.abc.Stream, sink: trio.abc.Stream, done: trio.CancelScope) -> None:
    """Copy `source`'s bytes to `sink` until either ends; then end the other direction too."""
    try:
        while data := await source.receive_some(PIECE_BYTES):
            await sink.send_all(data)
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass
    finally:
        done.cancel()
