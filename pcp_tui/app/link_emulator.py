"""`pcp-tui emulate-link`: a TCP proxy that behaves like a slow, far link (bandwidth, latency, jitter, cuts).

The kernel's `netem` is not available everywhere (not on these machines), so
WAN conditions are emulated in user space. Each direction of each proxied
connection is a `ShapedPipe`: bytes read from one side are stamped with the
time they would finish crossing a link of `bandwidth` (one after another, like
a serial wire) plus the one-way latency (half the round-trip time, with
optional jitter), and written to the other side no earlier than that. A small
queue between reading and writing holds about one bandwidth-delay product, so
a sender that outruns the link is held back by TCP flow control, as on a real
bottleneck, instead of filling the proxy's memory.

`--window BYTES` caps the bytes of each connection direction in flight: read
from the sender but not yet acknowledged, where a byte counts as acknowledged
once it was delivered and the acknowledgement crossed back (the reverse
direction's delay). That is what a TCP receive window does: one stream then
moves at most window / RTT, whatever the bandwidth (4 MiB at 100 ms is about
335 Mbit/s), which is why long fat pipes need several streams. Each connection
gets its own `--bandwidth` (a link per worker connection) unless `--shared`
puts all of them on one wire, as several streams of one machine share its link.

    pcp-tui emulate-link --listen 127.0.0.1:9000 --to 127.0.0.1:8080 --bandwidth 1Gbit --rtt 50ms
    pcp-tui worker --connect 127.0.0.1:9000 ...
"""

from __future__ import annotations

import collections
import contextlib
import functools
import math
import random
import re
from dataclasses import dataclass

import trio

from pcp_tui.config import ConfigError

CHUNK_BYTES = 64 * 1024  # largest piece read and scheduled at once
_UNITS_BITS = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}
_UNITS_SECONDS = {"s": 1.0, "ms": 1e-3, "us": 1e-6}


@dataclass(frozen=True)
class LinkProfile:
    """One direction of a link: bytes per second (inf: unlimited), one-way delay and its jitter,
    and the window: bytes one connection may have unacknowledged (inf: unbounded)."""

    bytes_per_second: float = math.inf
    delay: float = 0.0
    jitter: float = 0.0
    window: float = math.inf

    def queue_chunks(self) -> int:
        """Chunks in flight that keep the link busy for its delay plus 100 ms of queue."""
        if math.isinf(self.bytes_per_second):
            return 64
        in_flight = self.bytes_per_second * (self.delay + self.jitter + 0.1)
        return max(4, math.ceil(in_flight / CHUNK_BYTES) + 2)


def parse_bandwidth(text: str) -> float:
    """'1Gbit', '100Mbit', '500kbit' (bits), '10MB' (bytes) or 'unlimited' -> bytes per second."""
    if text.strip().lower() in ("unlimited", "inf"):
        return math.inf
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgGtT]?)((?i:bit|bps)|B|Bps)?\s*", text)
    if not match:
        raise ConfigError(
            f"--bandwidth {text!r}: write a rate such as 1Gbit, 100Mbit (bits) or 10MB (bytes) "
            "per second, or 'unlimited'"
        )
    number, prefix, unit = match.groups()
    scaled = float(number) * _UNITS_BITS[prefix.lower()]
    rate = scaled if unit in ("B", "Bps") else scaled / 8
    if rate <= 0:
        raise ConfigError(f"--bandwidth {text!r} must be positive (or 'unlimited')")
    return rate


def parse_duration(text: str, option: str) -> float:
    """'50ms', '0.05s', '200us' or a plain number of milliseconds -> seconds."""
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*(s|ms|us)?\s*", text, re.I)
    if not match:
        raise ConfigError(f"{option} {text!r}: write a duration such as 50ms or 0.2s")
    number, unit = match.groups()
    return float(number) * (_UNITS_SECONDS[unit.lower()] if unit else 1e-3)


class Wire:
    """The serial line of one direction: when it finishes the bytes scheduled so far.

    A pipe has its own wire, or shares one with the other connections' pipes of the
    same direction (`--shared`): then their bytes queue one after another on it.
    """

    def __init__(self) -> None:
        self.free_at = 0.0


class ShapedPipe:
    """Copies one direction of a connection through a link of the given profile.

    `ack_delay` is how long an acknowledgement takes back (the reverse direction's
    delay): a windowed pipe gets a delivered byte's room back only then.
    `peak_in_flight` is the most bytes it ever held unacknowledged. `wire`: a
    shared `Wire`, or None for a line of its own.
    """

    def __init__(
        self,
        profile: LinkProfile,
        rng: random.Random | None = None,
        *,
        ack_delay: float = 0.0,
        wire: Wire | None = None,
    ):
        self.profile = profile
        self.bytes = 0
        self.peak_in_flight = 0
        self._rng = rng or random.Random()
        self._ack_delay = ack_delay
        self._wire = wire or Wire()
        self._last_delivery = 0.0
        self._in_flight = 0
        self._acks: collections.deque[tuple[float, int]] = collections.deque()  # (when, bytes)
        self._delivered = trio.Event()

    def _delivery_time(self, arrived: float, size: int) -> float:
        """When `size` bytes read at `arrived` reach the far side (never before earlier bytes)."""
        profile = self.profile
        wire = self._wire
        wire.free_at = max(arrived, wire.free_at) + size / profile.bytes_per_second
        jitter = self._rng.uniform(-profile.jitter, profile.jitter) if profile.jitter else 0.0
        delivery = max(wire.free_at + profile.delay + jitter, self._last_delivery)
        self._last_delivery = delivery
        return delivery

    async def _room(self) -> int:
        """Bytes the window lets us read now; waits for acknowledgements while it is full."""
        window = self.profile.window
        if math.isinf(window):
            return CHUNK_BYTES
        while True:
            now = trio.current_time()
            while self._acks and self._acks[0][0] <= now:
                self._in_flight -= self._acks.popleft()[1]
            room = int(window) - self._in_flight
            if room > 0:
                return min(room, CHUNK_BYTES)
            if self._acks:
                await trio.sleep_until(self._acks[0][0])
            else:
                self._delivered = trio.Event()
                await self._delivered.wait()

    async def run(self, source: trio.abc.ReceiveStream, sink: trio.abc.SendStream) -> None:
        """Copy until `source` ends, then close `sink`'s sending side (or the whole stream).

        A `source` that breaks (a reset) ends the copy as its end would: what it sent before
        is on the wire and still arrives. A `sink` that breaks raises: nothing more can."""
        send, receive = trio.open_memory_channel[tuple[float, bytes | bytearray]](
            self.profile.queue_chunks()
        )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._write, receive, sink)
            async with send:
                with contextlib.suppress(trio.BrokenResourceError):
                    await self._read(source, send)

    async def _read(self, source: trio.abc.ReceiveStream, send: trio.MemorySendChannel) -> None:
        while chunk := await source.receive_some(await self._room()):
            self._in_flight += len(chunk)
            self.peak_in_flight = max(self.peak_in_flight, self._in_flight)
            await send.send((self._delivery_time(trio.current_time(), len(chunk)), chunk))

    async def _write(self, queue: trio.MemoryReceiveChannel, sink: trio.abc.SendStream) -> None:
        async with queue:
            async for delivery, chunk in queue:
                await trio.sleep_until(delivery)
                await sink.send_all(chunk)
                self.bytes += len(chunk)
                self._acks.append(
                    (max(delivery, trio.current_time()) + self._ack_delay, len(chunk))
                )
                self._delivered.set()
        if isinstance(sink, trio.SocketStream):
            await sink.send_eof()
        else:
            await sink.aclose()


@dataclass(frozen=True)
class LinkEmulator:
    """Listens on `listen`, proxies each connection to `target` through two shaped pipes."""

    target: tuple[str, int]
    upstream: LinkProfile  # client -> target
    downstream: LinkProfile  # target -> client
    cut_after: float = 0.0  # >0: each connection is cut this many seconds after it opened
    shared: bool = False  # all connections share one wire per direction (else one each)

    async def serve(self, listeners, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        wires = (Wire(), Wire()) if self.shared else None
        handle = functools.partial(self.handle, wires=wires)
        await trio.serve_listeners(handle, listeners, task_status=task_status)

    async def handle(
        self, client: trio.SocketStream, *, wires: tuple[Wire, Wire] | None = None
    ) -> None:
        """Proxy one connection until both directions end, never ending the emulator.

        Each direction ends on its own: one whose far side broke stops, while the other
        still delivers what its sender sent before (a wire carries the bytes on it whatever
        happens behind them: a shepherd's goodbye reaches its worker though the worker's
        next heartbeat met the closed shepherd). `wires`: (upstream, downstream) shared
        with other connections, or None for own ones."""
        up_wire, down_wire = wires or (None, None)
        try:
            server = await trio.open_tcp_stream(*self.target)
        except OSError:
            await trio.aclose_forcefully(client)
            return
        with trio.move_on_after(self.cut_after or math.inf):
            async with trio.open_nursery() as nursery:
                up = ShapedPipe(self.upstream, ack_delay=self.downstream.delay, wire=up_wire)
                down = ShapedPipe(self.downstream, ack_delay=self.upstream.delay, wire=down_wire)
                nursery.start_soon(_one_way, up, client, server)
                nursery.start_soon(_one_way, down, server, client)
        await trio.aclose_forcefully(client)
        await trio.aclose_forcefully(server)


async def _one_way(pipe: ShapedPipe, source: trio.SocketStream, sink: trio.SocketStream) -> None:
    """One direction of a proxied connection, until its source ends or its sink breaks."""
    try:
        await pipe.run(source, sink)
    except* (trio.BrokenResourceError, trio.ClosedResourceError):
        pass  # its far side went away: this direction is over, the other goes on


def parse_window(text: str) -> float:
    """'4MiB', '1MB', '65536' (bytes) or 'unbounded' -> bytes one connection may have in flight."""
    if text.strip().lower() in ("unbounded", "unlimited", "inf"):
        return math.inf
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([kKmMgG]i?)?B?\s*", text)
    scale = {"": 1, "k": 1e3, "m": 1e6, "g": 1e9, "ki": 2**10, "mi": 2**20, "gi": 2**30}
    if not match or float(match.group(1)) * scale[(match.group(2) or "").lower()] < 1:
        raise ConfigError(
            f"--window {text!r}: write a size in bytes such as 4MiB, 1MB or 65536, or 'unbounded'"
        )
    return float(int(float(match.group(1)) * scale[(match.group(2) or "").lower()]))


def profiles(
    bandwidth: str, rtt: str, jitter: str, window: str = "unbounded"
) -> tuple[LinkProfile, LinkProfile]:
    """The two directions of a symmetric link with `rtt` split evenly between them."""
    rate = parse_bandwidth(bandwidth)
    one_way = parse_duration(rtt, "--rtt") / 2
    spread = parse_duration(jitter, "--jitter")
    profile = LinkProfile(
        bytes_per_second=rate, delay=one_way, jitter=spread, window=parse_window(window)
    )
    return profile, profile


def add_parser(commands) -> None:
    """The `emulate-link` subcommand's options."""
    parser = commands.add_parser(
        "emulate-link",
        allow_abbrev=False,
        help="a TCP proxy that behaves like a slow, far link (rehearse a WAN run on one machine)",
    )
    parser.add_argument(
        "--listen", required=True, metavar="HOST:PORT", help="where workers connect"
    )
    parser.add_argument("--to", required=True, metavar="HOST:PORT", help="the shepherd's address")
    parser.add_argument(
        "--bandwidth",
        default="1Gbit",
        help="per direction, e.g. 1Gbit, 100Mbit, 10MB, unlimited (default: 1Gbit)",
    )
    parser.add_argument(
        "--rtt",
        default="50ms",
        help="round-trip time, split evenly between directions (default: 50ms)",
    )
    parser.add_argument(
        "--jitter", default="0ms", help="random +- spread of each direction's delay (default: 0ms)"
    )
    parser.add_argument(
        "--window",
        default="unbounded",
        metavar="BYTES",
        help="bytes one connection may have in flight per direction, as a TCP receive window "
        "(one stream then moves at most window/RTT), e.g. 1MiB (default: unbounded)",
    )
    parser.add_argument(
        "--shared",
        action="store_true",
        help="all connections share one --bandwidth per direction, as the streams of one "
        "machine share its link (default: each connection gets its own)",
    )
    parser.add_argument(
        "--cut-after",
        default="0s",
        metavar="DURATION",
        help="cut every connection this long after it opened, as a flaky link does (default: never)",
    )


def run(args) -> int:
    """Serve until interrupted; exit 1 with a reason when the listening address is unusable."""
    from pcp_tui.config.worker import parse_connect

    listen_host, listen_port = parse_connect(args.listen)
    upstream, downstream = profiles(args.bandwidth, args.rtt, args.jitter, args.window)
    emulator = LinkEmulator(
        parse_connect(args.to),
        upstream,
        downstream,
        parse_duration(args.cut_after, "--cut-after"),
        shared=args.shared,
    )

    async def serve() -> int:
        try:
            listeners = await trio.open_tcp_listeners(listen_port, host=listen_host)
        except OSError as exc:
            print(f"pcp-tui: error: cannot listen on {args.listen} ({exc.strerror or exc})")
            return 1
        # a closed stdout (the launching process went away) must not stop the link
        with contextlib.suppress(OSError):
            print(
                f"emulating a {args.bandwidth} link with {args.rtt} RTT"
                f"{'' if args.window == 'unbounded' else f' and a {args.window} window'}: "
                f"connect to {args.listen}, forwarded to {args.to}",
                flush=True,
            )
        await emulator.serve(listeners)
        return 0

    return trio.run(serve)
