"""Many connections over one: a relay's workers as channels of its link to the shepherd.

A relay (`pcp-tui relay`) accepts workers and carries each one's connection to
the shepherd as a channel of its own single connection there, byte for byte:
the worker and the shepherd speak PCP end to end (the handshake's proof, the
plan, the rounds), so the shepherd admits, plans and times each worker exactly
as it does one that dialled it directly. Both ends of the link run `Channels`:
the relay opens a channel per worker (`open`), the shepherd serves each one it
is offered (`accepted`) as it serves a socket (`Channel` is a trio stream).

Every frame is a PCP `relayFrame` message (`protocol.RelayOp` says what it
does); a frame's bytes ride as one uint8 tensor.

- **Flow control per channel.** A side sends a channel's data only as far as the
  other side granted (`credit`, `WINDOW` bytes to start, renewed as its reader
  takes them), so a worker whose reader is slow, or a shepherd pausing one
  worker's connection while it folds that worker's result, holds up its own
  channel and never the link: the link's reader hands a frame to its channel's
  buffer without waiting, and no buffer grows past its window.
- **One copy of what the shepherd sends to many.** A message encoded once and
  written to many workers (a round's parameters, a fragment's update:
  `protocol.Encoded`) goes to the relay once: the shepherd sends a big buffer's
  bytes the first time to be kept (`keep`, on no channel: channel 0) and, to every
  channel it is for, only its number (`repeat`); the relay writes the kept bytes
  into that channel. Buffers are recognised by identity, which an `Encoded`
  guarantees unchanged until sent; the relay holds at most `KEEP_BYTES`, the
  shepherd telling it what to drop (`forget`) before it keeps more. A repeat is
  charged to its channel's credit as data is, but sent whole once any credit is
  left (its bytes are the kept buffer's, not a copy): a worker that reads slowly
  holds up its own sends and no one else's.
- **One frame per message, each whole.** A message's buffers go together
  (`Channel.send_parts`): its small bytes in one data frame that names each kept
  buffer at its place among them, so a round start is one frame, not one per
  tensor. A frame is written whole or not at all: a send cut off mid-frame (a
  worker's send deadline, a closing fragment) would garble the link for every
  channel, so a cancel takes effect between frames only.

What the peer sends that breaks these rules (an unknown channel or buffer, data
past the window, a relay opening channels to a relay) ends the link with a
`ProtocolError`; every channel then ends as a lost connection does.
"""

from __future__ import annotations

import collections
import contextlib
import math

import numpy as np
import trio

from pcp_tui import protocol

WINDOW = 4 * 2**20  # bytes a side may send a channel before the other grants more
PIECE_BYTES = 2**20  # the most bytes one frame carries
# buffers this big or bigger are kept for repeats (`_stream` joins smaller ones per send)
KEEP_MIN_BYTES = 64 * 1024
KEEP_BYTES = 4 * 2**30  # the most kept bytes the relay holds for the shepherd
MAX_CHANNELS = 2**16  # channels open on one link at once
# the address a relay's first channel names: not a worker's connection but the shepherd's
# folds and the relay's answers (`pcp_tui/relay.py` `Folds`, `shepherd/serving/relays.py`)
CONTROL = "control"
GOODBYE_SECONDS = 2.0  # the run's end waits this long for a link to take its goodbye

Op = protocol.RelayOp
FRAME_LIMITS = protocol.Limits(
    max_message_bytes=8 * 1024,
    max_tensors=1,
    max_tensor_bytes=PIECE_BYTES,
    max_total_tensor_bytes=PIECE_BYTES,
)


class Channel(trio.abc.Stream):
    """One worker's connection carried over a relay's link; a trio stream of its bytes.

    `peer`: the worker's address as the relay saw it. Receives end (b"") when
    the other side closes the channel or the link ends; sends then raise
    `trio.BrokenResourceError`.
    """

    def __init__(self, channels: Channels, number: int, peer: str):
        self._channels, self.number, self.peer = channels, number, peer
        self._buffer: collections.deque[memoryview] = collections.deque()
        self._buffered = 0  # bytes in `_buffer`, all charged to the window
        self._taken = 0  # bytes taken since credit was last granted
        self._credit = WINDOW  # bytes this side may still send
        self._arrived = trio.Event()
        self._credited = trio.Event()
        self.ended: str | None = None  # why the channel ended (peer's close, link lost)
        self._closed = False
        self._send_lock = trio.Lock()

    @property
    def control(self) -> bool:
        """Whether this is a relay's control channel (its first, named `CONTROL`), not a
        worker's connection."""
        return self.number == 1 and self.peer == CONTROL

    @property
    def held_up(self) -> bool:
        """Whether this side may send the channel nothing more now: the other side has taken
        none of its window (a shepherd pausing a worker's reads, or behind on them)."""
        return self._credit <= 0 and self.ended is None

    def link_silence(self) -> float:
        """Seconds since the relay's link last carried a byte: a relay heartbeats its workers
        and ends a silent one's channel, so a channel is alive while its link is."""
        link = self._channels.link
        return link.clock() - link.last_activity

    # -- reading ----------------------------------------------------------------------

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        while not self._buffer:
            if self._closed:
                raise trio.ClosedResourceError("this channel was closed")
            if self.ended is not None:
                return b""
            self._arrived = trio.Event()
            await self._arrived.wait()
        first = self._buffer[0]
        size = first.nbytes if max_bytes is None else min(first.nbytes, max_bytes)
        data = bytes(first[:size])
        if size == first.nbytes:
            self._buffer.popleft()
        else:
            self._buffer[0] = first[size:]
        await self._took(size)
        return data

    async def _took(self, nbytes: int) -> None:
        self._buffered -= nbytes
        self._taken += nbytes
        if self._taken >= WINDOW // 2 and self.ended is None:
            granted = self._taken
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await self._channels.send_frame(Op.CREDIT, self.number, granted)
            self._taken -= granted  # only once sent: a read cancelled here grants it next time

    def deliver(self, pieces: list[memoryview], *, own: int, kept: bool) -> None:
        """One frame's bytes for the reader (the link's reader calls this; it never waits),
        charged to the window: the frame's own bytes (`own`) within what is left of it, kept
        buffers' (`kept`: any size) only while some of it is left, as their sender waits for
        credit before each frame; MalformedMessage past that."""
        nbytes = sum(piece.nbytes for piece in pieces)
        if self._buffered + own > WINDOW or (kept and self._buffered >= WINDOW):
            raise protocol.MalformedMessage(
                f"channel {self.number}: {self._buffered + nbytes} bytes unread, "
                f"more than the {WINDOW} granted"
            )
        self._buffered += nbytes
        self._buffer.extend(piece for piece in pieces if piece.nbytes)
        self._arrived.set()

    # -- writing ----------------------------------------------------------------------

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        await self.send_parts([data])

    async def send_parts(self, parts: list[bytes | bytearray | memoryview]) -> None:
        """Send `parts` in order in as few frames as it takes: one message's buffers
        (`protocol.MessageStream.send_encoded`). A big one is kept at the relay (its bytes
        cross the link once) and goes into the frame as its number, at its place among the
        frame's own bytes: a round start (its header, its small tensors, every big one's
        number) is one frame."""
        channels = self._channels
        async with self._send_lock:
            self._check_open()
            data = bytearray()  # small parts not sent yet
            kept: list[tuple[int, _Kept]] = []  # (where in `data`, kept buffer) to go in
            try:
                for part in parts:
                    view = memoryview(part).cast("B")
                    held = None
                    if channels.keeps and view.nbytes >= KEEP_MIN_BYTES:
                        held = await channels.keep(part, view)
                    if held is not None:
                        held.users += 1  # not forgotten before its frame is sent
                        kept.append((len(data), held))
                    elif view.nbytes >= PIECE_BYTES:  # big, and not kept: as it is, no copy
                        await self._send_data(data, kept)
                        data, kept = bytearray(), self._sent(kept)
                        await self._send_data(view, [])
                    else:
                        data += view
                await self._send_data(data, kept)
            finally:
                self._sent(kept)

    @staticmethod
    def _sent(kept: list[tuple[int, _Kept]]) -> list[tuple[int, _Kept]]:
        for _, held in kept:
            held.users -= 1
        return []

    async def _send_data(
        self, data: bytes | bytearray | memoryview, kept: list[tuple[int, _Kept]]
    ) -> None:
        """`data` and the kept buffers that go among it (`kept`: (offset in `data`, buffer),
        in order), in frames sent once some credit is left, each within it for its own bytes;
        the kept buffers' bytes are charged after them."""
        view = memoryview(data).cast("B")
        start, first = 0, True
        while (first and kept) or start < view.nbytes:
            first = False
            await self._await_credit()
            end = start + min(view.nbytes - start, self._credit, PIECE_BYTES)
            # each kept buffer goes with the frame whose bytes it follows (at 0: the first)
            here = [(at, held) for at, held in kept if start < at <= end or at == start == 0]
            await self._channels.send_frame(
                Op.DATA if end > start else Op.REPEAT,
                self.number,
                0,
                view[start:end] if end > start else None,
                kept=[held.number for _, held in here],
                kept_at=[at - start for at, _ in here],
            )
            self._credit -= end - start + sum(held.nbytes for _, held in here)
            start = end

    async def _await_credit(self) -> None:
        """Until the other side has room for more of this channel (BrokenResourceError if
        the channel ends first)."""
        while self._credit <= 0:
            self._check_open()
            self._credited = trio.Event()
            await self._credited.wait()
        self._check_open()

    def credit(self, nbytes: int) -> None:
        self._credit += nbytes
        self._credited.set()

    async def wait_send_all_might_not_block(self) -> None:
        while self._credit <= 0 and self.ended is None:
            self._credited = trio.Event()
            await self._credited.wait()

    def _check_open(self) -> None:
        if self._closed:
            raise trio.ClosedResourceError("this channel was closed")
        if self.ended is not None:
            raise trio.BrokenResourceError(f"channel ended: {self.ended}")

    # -- ending -----------------------------------------------------------------------

    def end(self, why: str) -> None:
        """The other side (or the link) ended it: reads drain what arrived, then b""."""
        if self.ended is None:
            self.ended = why
        self._arrived.set()
        self._credited.set()

    async def aclose(self) -> None:
        if self._closed:
            return
        self._closed = True
        was_open = self.ended is None
        self.end("closed by this side")
        self._channels.forget_channel(self.number)
        if was_open:
            with (
                trio.CancelScope(shield=True),
                trio.move_on_after(5),
                contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError),
            ):
                await self._channels.send_frame(Op.CLOSE, self.number, 0, text="closed")
        await trio.lowlevel.checkpoint()


class _Kept:
    """A buffer the shepherd sent the relay to keep: its number there, once all sent."""

    def __init__(self, owner: object, number: int, nbytes: int):
        self.owner, self.number, self.nbytes = owner, number, nbytes
        self.complete = False
        self.users = 0  # repeats of it waiting for their channel's credit: not forgotten
        self.done = trio.Event()


class Channels:
    """Both ends of a relay's link: its channels, their frames, the kept buffers.

    `accepts`: this end takes channels the other opens (the shepherd's); they
    come out of `accepted`. `keeps`: this end sends big buffers once and repeats
    them (the shepherd's, to the relay). Run `run` (the link's reader) in a task.
    """

    def __init__(self, link: protocol.MessageStream, *, accepts: bool, keeps: bool):
        self.link = link
        link.limits = FRAME_LIMITS
        self.accepts, self.keeps = accepts, keeps
        self.channels: dict[int, Channel] = {}
        self._highest = 0  # the highest channel number seen: below it, a closed one's
        opened_send, self.accepted = trio.open_memory_channel[Channel](math.inf)
        self._opened = opened_send
        # the shepherd's: id(buffer) -> what it is kept as, least recently repeated first
        self._kept_out: collections.OrderedDict[int, _Kept] = collections.OrderedDict()
        self._kept_out_bytes = 0
        self._next_kept = 1
        self._kept_in: dict[int, list[memoryview]] = {}  # the relay's: number -> its pieces
        self._kept_in_bytes = 0
        self.bytes_repeated = 0  # bytes not sent again thanks to repeats (sender side)
        self.ended: str | None = None
        self.goodbye: protocol.Goodbye | None = None  # the shepherd's, ending the link
        self._writing = trio.Lock()  # one frame at a time, each whole (`send_frame`)
        self.stall_seconds = math.inf  # a frame the link takes nothing of this long ends it

    async def open(self, peer: str) -> Channel:
        """A new channel for a worker connected from `peer` (the relay's end)."""
        if self.ended is not None:
            raise trio.BrokenResourceError(f"the link ended: {self.ended}")
        self._highest += 1
        channel = self.channels[self._highest] = Channel(self, self._highest, peer)
        await self.send_frame(Op.OPEN, channel.number, 0, text=peer)
        return channel

    async def send_frame(
        self,
        op: Op,
        number: int,
        value: int,
        data: memoryview | None = None,
        *,
        text: str = "",
        kept: list[int] | tuple[int, ...] = (),
        kept_at: list[int] | tuple[int, ...] = (),
    ) -> None:
        """One frame, whole: a send cancelled mid-frame (a worker's send deadline, a closing
        fragment) would garble the link for every channel, so a cancel takes effect only
        before the frame's turn or after its last byte; a frame the link takes no byte of for
        `stall_seconds` ends the link (BrokenResourceError)."""
        tensors = {"bytes": np.frombuffer(data, np.uint8)} if data is not None else None
        body = protocol.RelayFrame(number, op, value, text[:1024], tuple(kept), tuple(kept_at))
        message = protocol.encode_once(body, tensors)
        async with self._writing:  # waiting for its turn can be cancelled
            with trio.CancelScope(shield=True):
                with trio.move_on_after(self.stall_seconds) as stalled:
                    try:
                        await self.link.send_encoded(message)
                    except trio.ClosedResourceError:  # this side closed the link: it is gone
                        raise trio.BrokenResourceError(f"the link ended: {self.ended}") from None
                if stalled.cancelled_caught:
                    why = f"the link took no frame for {self.stall_seconds:.0f} s"
                    self.end(why)
                    await trio.aclose_forcefully(self.link.stream)
                    raise trio.BrokenResourceError(why)

    async def keep(self, owner: object, view: memoryview) -> _Kept | None:
        """`owner`'s buffer as kept at the relay, sent there now unless it is already.

        Sends of one buffer to several channels at once (a round's starts) wait for the
        first to have kept it (claimed before anything awaits); if that one fails part-way,
        the relay forgets its pieces and the next keeps it again. Old buffers are forgotten
        before a new one is kept, so the relay never holds more than KEEP_BYTES; None where
        it cannot be kept (bigger than that, or the rest is in use).
        """
        while True:
            kept = self._kept_out.get(id(owner))
            if kept is None or kept.owner is not owner:
                break
            await kept.done.wait()
            if kept.complete and self._kept_out.get(id(owner)) is kept:
                self._kept_out.move_to_end(id(owner))
                self.bytes_repeated += view.nbytes
                return kept
        if view.nbytes > KEEP_BYTES:
            return None
        kept = _Kept(owner, self._next_kept, view.nbytes)  # claimed: others wait for it
        self._next_kept += 1
        self._kept_out[id(owner)] = kept
        self._kept_out_bytes += view.nbytes
        pieces = 0
        try:
            if not await self._make_room():
                return None
            for start in range(0, view.nbytes, PIECE_BYTES):
                piece = view[start : start + PIECE_BYTES]
                await self.send_frame(Op.KEEP, 0, kept.number, piece)
                pieces += 1
            kept.complete = True
        finally:
            kept.done.set()
            if not kept.complete:
                del self._kept_out[id(owner)]
                self._kept_out_bytes -= view.nbytes
                if pieces and self.ended is None:  # the relay holds its first pieces
                    with (
                        trio.CancelScope(shield=True),
                        contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError),
                    ):
                        await self.send_frame(Op.FORGET, 0, kept.number)
        return kept

    async def _make_room(self) -> bool:
        """Forget the least recently repeated buffers until those kept fit in KEEP_BYTES;
        False if they cannot (buffers being kept or waiting for their frames hold the rest)."""
        while self._kept_out_bytes > KEEP_BYTES:
            old = next(
                (kept for kept in self._kept_out.values() if kept.complete and not kept.users),
                None,
            )
            if old is None:
                return False
            del self._kept_out[id(old.owner)]
            self._kept_out_bytes -= old.nbytes
            await self.send_frame(Op.FORGET, 0, old.number)
        return True

    async def say_goodbye(self, reason: str, *, resumable: bool = False) -> None:
        """The shepherd's last word on the link (the run is over, or stopped to be resumed);
        a link that takes it not within GOODBYE_SECONDS is closed instead."""
        with (
            trio.move_on_after(GOODBYE_SECONDS) as late,
            contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError),
        ):
            await self.link.send(protocol.Goodbye(reason[:1024], resumable=resumable))
        if late.cancelled_caught:
            self.end(f"the other side took no goodbye in {GOODBYE_SECONDS:g} s")
            await trio.aclose_forcefully(self.link.stream)

    def forget_channel(self, number: int) -> None:
        self.channels.pop(number, None)

    async def run(self, heartbeat_seconds: float = math.inf, timeout: float = math.inf) -> None:
        """Read the link's frames until it ends; every channel ends with it.

        Sends an empty credit every `heartbeat_seconds` and ends the link after
        `timeout` seconds without a byte from the other side (a relay's workers may
        all be quiet, its machine gone). ProtocolError for a peer that broke the rules.
        """
        broke: protocol.ProtocolError | None = None
        self.stall_seconds = timeout
        async with trio.open_nursery() as nursery:
            if heartbeat_seconds < math.inf:
                nursery.start_soon(self._keep_alive, heartbeat_seconds, timeout)
            try:
                await self._read()
            except protocol.ProtocolError as exc:
                broke = exc
                self.end(f"the other side broke the protocol: {exc}")
            finally:
                nursery.cancel_scope.cancel()
        if broke is not None:
            raise broke

    async def _read(self) -> None:
        why = "the link ended"
        try:
            while True:
                try:
                    message = await self.link.receive()
                except protocol.ConnectionClosed as exc:
                    why = f"the link closed ({exc})"
                    return
                if isinstance(message.body, protocol.Goodbye):
                    self.goodbye = message.body
                    why = f"the other side said goodbye ({message.body.reason})"
                    return
                self._take(message.body_as(protocol.RelayFrame), _bytes_of(message))
        except (trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            why = f"the link broke ({exc})"
        finally:
            self.end(why)

    async def _keep_alive(self, interval: float, timeout: float) -> None:
        while self.ended is None:
            silent = self.link.clock() - self.link.last_activity
            if silent > timeout:
                self.end(f"the link was silent for {silent:.0f} s")
                await trio.aclose_forcefully(self.link.stream)
                return
            with contextlib.suppress(trio.BrokenResourceError, trio.ClosedResourceError):
                await self.send_frame(Op.CREDIT, 0, 0)
            await trio.sleep(interval)

    def end(self, why: str) -> None:
        if self.ended is not None:
            return
        self.ended = why
        for channel in list(self.channels.values()):
            channel.end(why)
        self._opened.close()
        self._kept_in.clear()

    def _take(self, frame: protocol.RelayFrame, data: memoryview | None) -> None:
        op, number = frame.op, frame.channel
        if (data is not None) != (op in (Op.DATA, Op.KEEP)):
            raise protocol.MalformedMessage(
                f"a {op.value} frame carries bytes only if data or keep"
            )
        if op is Op.OPEN:
            self._accept(number, frame.text)
            return
        if op is Op.CREDIT and number == 0:
            return  # the other side's keep-alive
        if op is Op.FORGET:
            pieces = None if self.keeps else self._kept_in.pop(frame.value, None)
            if pieces is None:
                raise protocol.MalformedMessage(f"forget of unknown buffer {frame.value}")
            self._kept_in_bytes -= sum(piece.nbytes for piece in pieces)
            return
        if (op in (Op.KEEP, Op.REPEAT) or frame.kept) and self.keeps:
            raise protocol.MalformedMessage(f"only the shepherd sends {op.value} frames")
        if op is Op.KEEP:
            assert data is not None
            if number != 0:
                raise protocol.MalformedMessage(f"a keep frame for channel {number}, not 0")
            self._kept_in_bytes += data.nbytes
            if self._kept_in_bytes > KEEP_BYTES:
                raise protocol.MalformedMessage(f"more than {KEEP_BYTES} bytes to keep")
            self._kept_in.setdefault(frame.value, []).append(data)
            return
        channel = self.channels.get(number)
        if channel is None:
            if not 0 < number <= self._highest:
                raise protocol.MalformedMessage(f"a {op.value} frame for unknown channel {number}")
            return  # a channel this side closed already: its last frames were on their way
        if op is Op.DATA or op is Op.REPEAT:
            self._deliver(channel, data if data is not None else memoryview(b""), frame)
        elif op is Op.CREDIT:
            channel.credit(frame.value)
        elif op is Op.CLOSE:
            channel.end(frame.text or "closed by the other side")
            self.channels.pop(number, None)

    def _deliver(self, channel: Channel, data: memoryview, frame: protocol.RelayFrame) -> None:
        """A data or repeat frame's bytes, with the kept buffers it names in their places."""
        at = frame.kept_at
        if len(at) != len(frame.kept) or any(
            not b <= a <= data.nbytes for b, a in zip((0, *at), at, strict=False)
        ):
            raise protocol.MalformedMessage("a frame's kept buffers are not in order within it")
        pieces, start = [], 0
        for offset, number in zip(at, frame.kept, strict=True):
            kept = self._kept_in.get(number)
            if kept is None:
                raise protocol.MalformedMessage(f"repeat of unknown buffer {number}")
            pieces += [data[start:offset], *kept]
            start = offset
        pieces.append(data[start:])
        channel.deliver(pieces, own=data.nbytes, kept=bool(frame.kept))

    def _accept(self, number: int, peer: str) -> None:
        if not self.accepts:
            raise protocol.MalformedMessage("only a relay opens channels")
        if number != self._highest + 1:
            raise protocol.MalformedMessage(
                f"channel {number} opened out of order (expected {self._highest + 1})"
            )
        if not peer.isprintable():  # it reaches logs, events and the dashboard
            raise protocol.MalformedMessage(f"channel {number}'s address is not printable text")
        if len(self.channels) >= MAX_CHANNELS:
            raise protocol.MalformedMessage(f"more than {MAX_CHANNELS} channels open at once")
        self._highest = number
        channel = self.channels[number] = Channel(self, number, peer)
        self._opened.send_nowait(channel)


def _bytes_of(message: protocol.Message) -> memoryview | None:
    """A frame's bytes (its one uint8 tensor `bytes`), or None; MalformedMessage otherwise."""
    if not message.tensors:
        return None
    data = message.tensors.get("bytes")
    if len(message.tensors) != 1 or data is None or data.dtype != np.uint8 or data.ndim != 1:
        raise protocol.MalformedMessage("a relay frame carries one 1-D uint8 tensor, `bytes`")
    return data.data
