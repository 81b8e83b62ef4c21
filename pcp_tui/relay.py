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

import dataclasses
import logging
import math
import platform
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from functools import partial

import numpy as np
import trio

from pcp_tui import protocol
from pcp_tui.config.relay import RelayConfig
from pcp_tui.contract import keys
from pcp_tui.contract.channels import CONTROL, PIECE_BYTES, Channel, Channels
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
from pcp_tui.contract.plan import result_header_problem
from pcp_tui.contract.tls import ClientTLS, ServerTLS, shown_fingerprint
from pcp_tui.diloco.partial import Partial
from pcp_tui.diloco.screening import BadResult, NormGuard, ResultScreen
from pcp_tui.shepherd.rounds.claims import ResultClaims
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
        self.folds = Folds()  # the shepherd's folds on that link
        self.heartbeat_seconds = 2.0  # the run's, as the shepherd's welcome says
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
        channels = Channels(messages, accepts=False, keeps=False)
        folds = self.folds = Folds()
        interval = self.heartbeat_seconds = max(welcome.heartbeat_seconds, 0.5)
        try:
            control = await channels.open(CONTROL)  # the first channel, before any worker's
            self.channels = channels
            async with trio.open_nursery() as nursery:
                nursery.start_soon(_control, folds, control)
                try:
                    await channels.run(interval, silence_timeout(interval))
                except protocol.ProtocolError as exc:
                    self.say(f"the shepherd broke the relay protocol ({exc}); reconnecting")
                finally:
                    nursery.cancel_scope.cancel()
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
        channels, folds, peer = self.channels, self.folds, peer_name(raw)
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
            reader = protocol.StreamReader(stream, trio.current_time)
            planned, writing, asked = trio.Event(), trio.Lock(), Asked()
            interval = self.heartbeat_seconds
            async with trio.open_nursery() as nursery:  # any of these ending ends them all
                done = nursery.cancel_scope
                nursery.start_soon(_until, done, peer, folds.carry_up, reader, channel, asked)
                nursery.start_soon(
                    _until, done, peer, carry_down, channel, stream, writing, planned, asked
                )
                nursery.start_soon(_until, done, peer, beat, stream, writing, planned, interval)
                timeout = silence_timeout(interval)
                nursery.start_soon(_until, done, peer, watch, reader, channel, planned, timeout)
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


class Fold:
    """One fold the shepherd opened on this relay (`protocol.Fold`): a round's fragment results
    of this relay's workers, screened as the shepherd screens them and folded into one partial
    with the round's center, radius and step scale (`diloco.partial`)."""

    def __init__(self, order: protocol.Fold, center: dict[str, np.ndarray] | None):
        shapes, dims = {}, iter(order.dims)
        for name, rank in zip(order.names, order.ranks, strict=True):
            shapes[name] = tuple(next(dims) for _ in range(rank))
        self.order = order
        self.lr = dict(zip(order.lr_steps, order.lr_sums, strict=True))
        norms = NormGuard(factor=order.norm_factor)
        norms.typical = order.norm_typical  # the round's baseline, fixed by the shepherd
        self.screen = ResultScreen(shapes, order.max_tokens, norms, bound=order.bound)
        self.screen.lr_sum = lambda tokens: self.lr[self.steps(tokens)]
        self.shares = dict(zip(order.share_workers, order.shares, strict=True))
        self.partial = Partial(
            tuple(shapes),
            center=center,
            radius=order.radius,
            norm_cap=order.norm_cap,
            step_scale=order.step_scale,
            measure=order.measure,
        )

    def steps(self, tokens: int) -> int:
        return max(tokens // max(self.order.per_step, 1), 1)

    def fold(
        self, worker_id: str, body: protocol.RoundResult, tensors: dict[str, np.ndarray]
    ) -> protocol.RoundResult | None:
        """Fold `worker_id`'s result in; what the shepherd is told instead of it, or None where
        this relay cannot judge it (a screen refuses it, its length has no lr sum, it is a
        second one): it then goes on whole and the shepherd decides, as it does flat."""
        if self.steps(body.tokens) not in self.lr or worker_id in self.partial.results:
            return None
        try:
            norm = self.screen.check(tensors, body.tokens)
        except BadResult:
            return None
        weight = body.tokens * self.shares.get(worker_id, 1.0)
        scale = self.partial.add(worker_id, tensors, weight)
        entry = self.partial.results[worker_id]
        return dataclasses.replace(
            body, folded=True, weight=weight, scale=scale, distance=entry.distance, norm=norm
        )

    def answer(self) -> protocol.Encoded:
        """The `Folded` that closes it: Σ w·s·Δ (none if nothing was folded), Σ w, Σ w (1 - s)
        and whose results they are."""
        partial = self.partial
        body = protocol.Folded(
            round=self.order.round,
            fragment=self.order.fragment,
            weight=partial.weight,
            center_weight=partial.center_weight,
            workers=tuple(partial.results),
            weights=tuple(e.weight for e in partial.results.values()),
            scales=tuple(e.scale for e in partial.results.values()),
            distances=tuple(e.distance for e in partial.results.values()),
            norms=tuple(e.norm for e in partial.results.values()),
        )
        return protocol.encode_once(body, partial.sums if partial.results else None)


class Folds:
    """The folds open on this relay, by (round, fragment), and the lock that keeps a result's
    fold and its notice to the shepherd ahead of the fold's answer on the link."""

    def __init__(self) -> None:
        self.open: dict[tuple[int, int], Fold] = {}
        self.lock = trio.Lock()

    async def serve(self, control: Channel) -> None:
        """Take the shepherd's folds on the control channel until it ends; answer each close."""
        stream = protocol.MessageStream(control, clock=trio.current_time)
        while True:
            message = await stream.receive()
            order = message.body_as(protocol.Fold)
            key = (order.round, order.fragment)
            if not order.close:
                center = dict(message.tensors) if order.measure else None
                self.open[key] = await trio.to_thread.run_sync(Fold, order, center)
                continue
            async with self.lock:  # every notice of a result folded in is on its way
                fold = self.open.pop(key, None)
                nothing = protocol.Folded(round=order.round, fragment=order.fragment)
                await stream.send_encoded(fold.answer() if fold else protocol.encode_once(nothing))
            for stale in [k for k in self.open if k[0] < order.round]:
                del self.open[stale]  # a round the shepherd closed without asking

    async def carry_up(self, reader: protocol.StreamReader, channel: Channel, asked: Asked) -> None:
        """A worker's messages to the shepherd: each passed on as it came, but a result of an
        open fold, which is folded in here and replaced by its notice (`Fold.fold`), and its
        heartbeats, which end here (the relay vouches for its workers: `watch`). A result is
        folded only where the shepherd will take its notice (`Asked.takes`): after the plan,
        which says the shepherd took the worker's one hello, whose id it is folded under."""
        out = protocol.MessageStream(channel, clock=trio.current_time)
        worker_id = ""
        async for frame, body, specs in _heads(reader):
            if isinstance(body, protocol.WorkerHello):
                if worker_id:
                    raise protocol.MalformedMessage("a worker says hello once")
                worker_id = body.worker_id
            if isinstance(body, protocol.RoundResult) and body.folded:
                raise protocol.MalformedMessage("a worker's result is never a relay's notice")
            if isinstance(body, protocol.Heartbeat) and not specs:
                continue
            fold = None
            if isinstance(body, protocol.RoundResult) and asked.takes(body):
                fold = self.open.get((body.round, body.fragment))
            if fold is None or result_header_problem(fold.screen.shapes, specs) is not None:
                await channel.send_all(frame)  # as it came: the shepherd judges it
                await _pass_on(reader, channel, sum(spec.payload_bytes for spec in specs))
                continue
            assert isinstance(body, protocol.RoundResult)
            tensors, payloads = {}, []
            for spec in specs:  # the plan's shapes: at most the model's bytes
                payload = np.empty(spec.payload_bytes, np.uint8)
                await reader.read_into(payload.data)
                payloads.append(payload)
                tensors[spec.name] = protocol.dequantize_chunked(payload, spec, 1)
            async with self.lock:
                if self.open.get((body.round, body.fragment)) is fold:
                    notice = await trio.to_thread.run_sync(fold.fold, worker_id, body, tensors)
                    if notice is not None:
                        await out.send(notice)
                        continue
            await channel.send_parts([frame, *(payload.data for payload in payloads)])


async def _heads(
    reader: protocol.StreamReader,
) -> AsyncIterator[tuple[bytearray, protocol.Body, list[protocol.TensorSpec]]]:
    """Each message's frame, body and tensor specs as `reader` reaches it, until the stream
    ends; the caller takes its payloads before the next."""
    while True:
        reader.start_frame()
        try:
            frame, body, _, specs = await protocol.read_head(reader, PASSING_LIMITS)
        except protocol.ConnectionClosed:
            return
        yield frame, body, specs


async def _pass_on(reader: protocol.StreamReader, sink: trio.abc.Stream, nbytes: int) -> None:
    """The next `nbytes` of `reader` into `sink`, a piece at a time."""
    while nbytes > 0:
        piece = bytearray(min(nbytes, PIECE_BYTES))
        await reader.read_into(memoryview(piece))
        await sink.send_all(piece)
        nbytes -= len(piece)


async def carry_down(
    channel: Channel,
    worker: trio.abc.Stream,
    writing: trio.Lock,
    planned: trio.Event,
    asked: Asked,
) -> None:
    """The shepherd's messages to a worker, each passed on as it came, whole under `writing`
    (this relay's heartbeats go between them); `planned` is set once the plan has gone, and
    `asked` notes the plan and each roundStart before they go."""
    reader = protocol.StreamReader(channel, trio.current_time)
    async for frame, body, specs in _heads(reader):
        asked.note(body)
        async with writing:
            await worker.send_all(frame)
            await _pass_on(reader, worker, sum(spec.payload_bytes for spec in specs))
        if isinstance(body, protocol.Plan):
            planned.set()


class Asked:
    """What the shepherd asked of one carried worker, as its plan and roundStarts went down:
    the rounds, and what its results may claim (`ResultClaims`, the shepherd's own ledger of
    the connection). The shepherd ends a connection whose result claims more and drops a
    result of a round it did not ask for, so it takes no notice of either: such a result
    is never folded (a fold holding a result without its notice is refused whole) but goes
    on as it came, for the shepherd to judge."""

    def __init__(self) -> None:
        self.claims: ResultClaims | None = None  # once the plan has gone
        self.inner_steps = 0
        self.rounds: set[int] = set()

    def note(self, body: protocol.Body) -> None:
        if isinstance(body, protocol.Plan):
            self.inner_steps = body.inner_steps
            self.claims = ResultClaims(
                tokens_per_step=body.batch_size * body.tokens_per_row,
                fragments=len(body.fragments),
            )
        elif isinstance(body, protocol.RoundStart) and self.claims is not None:
            self.claims.ask(body.inner_steps or self.inner_steps)
            self.rounds.add(body.round)

    def takes(self, body: protocol.RoundResult) -> bool:
        """Count `body`'s claims, as the shepherd will; whether it may be folded."""
        if self.claims is None:
            return False
        try:
            self.claims.check(body)
        except ConnectionLost:
            return False
        return body.round in self.rounds


async def beat(
    worker: trio.abc.Stream, writing: trio.Lock, planned: trio.Event, interval: float
) -> None:
    """Heartbeat a worker every `interval` once it has its plan, as the shepherd does a worker
    that dialled it: the shepherd sends a relay's workers none (it hears their relay's link)."""
    await planned.wait()
    while True:
        await trio.sleep(interval)
        async with writing:
            for buffer in protocol.encode(protocol.Heartbeat(time.time())):
                await worker.send_all(buffer)


async def watch(
    reader: protocol.StreamReader, channel: Channel, planned: trio.Event, timeout: float
) -> None:
    """Return (ending the worker's connection here, and so at the shepherd) once a worker
    with its plan has sent nothing for `timeout` seconds: its heartbeats end at this relay.
    Seconds its `channel` was held up count for nothing: the relay read nothing of the
    worker while the shepherd took nothing of it (a result it folds, slots it waits for)."""
    await planned.wait()
    held_up = -math.inf  # the last time the shepherd was seen taking nothing of the channel
    while True:
        now = trio.current_time()
        if channel.held_up:
            held_up = now
        silent = now - max(reader.last_activity, held_up)
        if silent > timeout:
            log.info("a worker was silent for %.0f s (heartbeat timeout %.0f s)", silent, timeout)
            return
        await trio.sleep(min(1.0, timeout / 4))


# what a relay reads of a worker's and of the shepherd's messages: their frames and headers
# (the shepherd checks a worker's against the plan again); payloads pass through in pieces
PASSING_LIMITS = protocol.Limits()


async def _control(folds: Folds, control: Channel) -> None:
    """The link's control channel (the first this relay opens): the shepherd's folds."""
    try:
        await folds.serve(control)
    except LINK_ERRORS as exc:
        log.info("the control channel ended: %s", exc)


async def _until(done: trio.CancelScope, peer: str, task, *args) -> None:
    """Run one of a carried worker's tasks; when it ends (a side closed, a worker broke the
    protocol or fell silent), end the others."""
    try:
        await task(*args)
    except LINK_ERRORS as exc:
        log.info("worker %s: %s", peer, exc)
    finally:
        done.cancel()
