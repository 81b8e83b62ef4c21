"""The wire codec on real Cap'n Proto bytes: every message kind, every dtype, quantization,
framing over fragmented streams and real TCP, and refusal of oversized or malformed input."""

from __future__ import annotations

import random
import struct
import tracemalloc

import ml_dtypes
import numpy as np
import pytest
import trio
import trio.testing

from pcp_tui import protocol
from pcp_tui.protocol._schema import Envelope

RNG = np.random.default_rng(0)
PARAMS = {
    "wte": RNG.standard_normal((64, 16)).astype(np.float32),
    "h.0.attn.bias": RNG.standard_normal(16).astype(np.float32),
}
BACKEND = protocol.BackendInfo(
    platform=protocol.Platform.CUDA,
    device_kind="NVIDIA H100 80GB HBM3",
    device_count=1,
    memory_bytes=80 * 2**30,
    jax_version="0.11.2",
    runtime=protocol.Runtime.IREE,  # not the default: the round trip shows it crossed the wire
    target="cuda",
)

# One realistic typed body (and tensors) per message kind; floats are float32-exact.
BODIES: dict[str, tuple[protocol.Body, dict]] = {
    "hello": (
        protocol.Hello(
            supported_versions=(2,),
            nonce=bytes(range(32)),
            run_id="run-7f3a",
            software="pcp-tui 0.1.0",
        ),
        {},
    ),
    "workerHello": (
        protocol.WorkerHello(
            supported_versions=(2,),
            worker_id="w-0c1d",
            hostname="gpu-box",
            backend=BACKEND,
            proof=b"\x01" * 32,
            software="pcp-tui 0.1.0",
            attach_index=3,
            attach_proof=b"\x02" * 32,
        ),
        {},
    ),
    "welcome": (
        protocol.Welcome(
            worker_index=2,
            run_id="run-7f3a",
            heartbeat_seconds=0.5,
            streams=4,
            session_key=b"\x03" * 32,
        ),
        {},
    ),
    "plan": (
        protocol.Plan(
            run_id="run-7f3a",
            model_name="gpt2-tiny",
            param_count=1040,
            graphs=(
                protocol.GraphInfo(
                    "train_chunk", (protocol.Platform.CPU, protocol.Platform.CUDA), "graph.tc"
                ),
            ),
            param_names=tuple(PARAMS),
            inner_steps=50,
            chunk_steps=10,
            batch_size=8,
            seq_len=128,
            seed=1234,
            shard_tensor="shard",
            shard_fingerprint="ab" * 32,
            worker_slot=1,
            compression=protocol.Quantization.INT8_BLOCK,
            batch_kind=protocol.BatchKind.WINDOWS,
            tokens_per_row=128,
            fragments=(
                protocol.Fragment(tuple(PARAMS)[:1]),
                protocol.Fragment(tuple(PARAMS)[1:]),
            ),
            overlap_steps=5,
            mix_alpha=0.5,
        ),
        {
            "graph.tc": np.frombuffer(b"stablehlo-bytes", np.uint8),
            "shard": np.arange(500, dtype=np.uint16),
        },
    ),
    "ready": (protocol.Ready(compile_seconds=12.25, platform=protocol.Platform.CPU), {}),
    "roundStart": (protocol.RoundStart(round=3, inner_steps=50, continued=False), PARAMS),
    "progress": (
        protocol.Progress(
            round=3,
            step=20,
            total_steps=50,
            loss=3.5,
            tokens_per_second=1024.0,
            phase=protocol.Phase.TRAINING,
            stats=protocol.WorkerStats(
                steps=70,
                tokens=71680,
                memory_in_use_bytes=3 << 30,
                memory_peak_bytes=5 << 30,
                memory_limit_bytes=80 << 30,
                gpu_utilization=0.75,
            ),
        ),
        {},
    ),
    "roundResult": (
        protocol.RoundResult(
            round=3,
            tokens=51200,
            losses=(4.0, 3.75, 3.5),
            compute_seconds=8.5,
            inner_steps=50,
            fragment=1,
        ),
        {name: -value for name, value in list(PARAMS.items())[1:]},
    ),
    "heartbeat": (protocol.Heartbeat(sent_at=1700000000.25), {}),
    "error": (protocol.Error(protocol.ErrorCode.BAD_RESULT, "pseudo-gradient has NaN"), {}),
    "goodbye": (protocol.Goodbye("training finished"), {}),
    "fragmentUpdate": (
        protocol.FragmentUpdate(round=3, fragment=1, change=True),
        dict(list(PARAMS.items())[1:]),
    ),
    "relayFrame": (
        protocol.RelayFrame(channel=12, op=protocol.RelayOp.KEEP, value=3, text=""),
        {"bytes": np.arange(256, dtype=np.uint8)},
    ),
    "fold": (
        protocol.Fold(
            round=7,
            fragment=1,
            radius=0.25,
            step_scale=0.01,
            measure=True,
            max_tokens=4096,
            bound=3.5,
            norm_typical=12.0,
            norm_factor=float("inf"),
            per_step=128,
            lr_steps=(8, 32),
            lr_sums=(0.004, 0.016),
            share_workers=("w-1",),
            shares=(0.5,),
            names=("w",),
            dims=(3, 2),
            ranks=(2,),
        ),
        {"w": np.arange(6, dtype=np.float32).reshape(3, 2)},
    ),
    "folded": (
        protocol.Folded(
            round=7,
            fragment=1,
            weight=6144.0,
            center_weight=1024.0,
            workers=("w-0", "w-1"),
            weights=(4096.0, 2048.0),
            scales=(1.0, 0.5),
            distances=(10.0, 50.0),
        ),
        {"w": np.ones((3, 2), np.float32)},
    ),
}


def wire(buffers) -> bytes:
    return b"".join(bytes(buffer) for buffer in buffers)


def assert_same(message: protocol.Message, body: protocol.Body, tensors: dict) -> None:
    assert message.kind == body.KIND
    assert message.version == protocol.PROTOCOL_VERSION
    assert message.body == body
    assert list(message.tensors) == list(tensors)
    for name, array in tensors.items():
        assert message.tensors[name].dtype == array.dtype
        np.testing.assert_array_equal(message.tensors[name], array)


def craft(
    kind: str = "heartbeat",
    body: dict | None = None,
    headers: list[dict] = (),
    version: int = protocol.PROTOCOL_VERSION,
) -> bytes:
    """A frame built by hand, so headers can say things `encode` would never write."""
    envelope = Envelope.new_message(**{kind: body or {}})
    envelope.version = version
    for target, header in zip(envelope.init("tensors", len(headers)), headers, strict=True):
        for key, value in header.items():
            setattr(target, key, value)
    return envelope.to_bytes()


def header(**changes) -> dict:
    return {"name": "t", "dtype": "float32", "shape": [4], "payloadBytes": 16, **changes}


# --------------------------------------------------------------------------- encode / decode


def test_every_kind_has_a_realistic_body():
    assert set(BODIES) == set(protocol.KINDS)


@pytest.mark.parametrize("kind", list(BODIES))
def test_every_kind_round_trips_through_bytes(kind):
    body, tensors = BODIES[kind]
    buffers = protocol.encode(body, tensors)
    message = protocol.decode(wire(buffers))
    assert_same(message, body, tensors)
    assert message.wire_bytes == len(wire(buffers))


def test_fields_a_peer_left_out_read_as_the_schema_defaults():
    message = protocol.decode(craft("progress", {"round": 1}))
    assert message.body == protocol.Progress(
        round=1, step=0, total_steps=0, loss=0.0, tokens_per_second=0.0, phase="compiling"
    )
    assert message.tensors == {}


@pytest.mark.parametrize("dtype", list(protocol.DTYPES))
@pytest.mark.parametrize("shape", [(), (0,), (5,), (3, 4), (2, 0, 3)])
def test_every_dtype_round_trips(dtype, shape):
    np_dtype = protocol.DTYPES[dtype]
    array = (RNG.standard_normal(shape) * 50).astype(np_dtype) if shape else np.asarray(7, np_dtype)
    message = protocol.decode(wire(protocol.encode(protocol.RoundStart(), {"x": array})))
    decoded = message.tensors["x"]
    assert decoded.dtype == np_dtype and decoded.shape == array.shape
    np.testing.assert_array_equal(decoded, array)


def test_payloads_are_zero_copy_views_of_contiguous_arrays():
    array = np.arange(1000, dtype=np.float32)
    frame, payload = protocol.encode(protocol.RoundStart(), {"w": array})
    assert isinstance(payload, memoryview)
    assert np.shares_memory(np.frombuffer(payload, np.uint8), array)
    assert isinstance(frame, bytes)


def test_non_contiguous_and_big_endian_arrays_are_sent_as_little_endian_c_order():
    base = np.arange(12, dtype=">f8").reshape(3, 4)
    message = protocol.decode(wire(protocol.encode(protocol.RoundStart(), {"t": base.T})))
    assert message.tensors["t"].dtype == np.dtype("<f8")
    np.testing.assert_array_equal(message.tensors["t"], base.T)


@pytest.mark.parametrize("bad", [np.zeros(2, np.complex64), np.array(["a"]), np.array([object()])])
def test_unsendable_dtypes_are_refused(bad):
    with pytest.raises(ValueError, match="cannot be sent"):
        protocol.encode(protocol.RoundStart(), {"t": bad})


@pytest.mark.parametrize(
    ("body", "options", "match"),
    [
        ("heartbeat", {}, "takes a message body"),
        ({"sentAt": 1.0}, {}, "takes a message body"),
        (protocol.Heartbeat(sent_at="soon"), {}, "cannot encode heartbeat"),
        (protocol.Progress(phase="sleeping"), {}, "cannot encode progress"),
        (protocol.Heartbeat(), {"quantization": "fp4"}, "unknown quantization"),
    ],
)
def test_encode_refuses_bad_input_with_value_error(body, options, match):
    with pytest.raises(ValueError, match=match):
        protocol.encode(body, **options)


# --------------------------------------------------------------------------- quantization


def quantized_round_trip(tensors, quantization, block_size=256) -> protocol.Message:
    return protocol.decode(
        wire(
            protocol.encode(
                protocol.RoundResult(round=1),
                tensors,
                quantization=quantization,
                block_size=block_size,
            )
        )
    )


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_bfloat16_keeps_dtype_and_8_bits_of_mantissa(dtype):
    array = RNG.standard_normal((33, 7)).astype(dtype)
    message = quantized_round_trip({"d": array}, "bfloat16")
    decoded = message.tensors["d"]
    assert decoded.dtype == dtype
    np.testing.assert_allclose(decoded, array, rtol=2**-8, atol=0)
    assert message.wire_bytes < array.nbytes // 2 + 400


@pytest.mark.parametrize("block_size", [1, 7, 256, 4096])
@pytest.mark.parametrize("count", [1, 255, 1000, 70_001])
def test_int8_block_error_is_within_half_a_step_of_the_block_max(block_size, count):
    array = (RNG.standard_normal(count) * RNG.uniform(1e-3, 1e3)).astype(np.float32)
    decoded = quantized_round_trip({"d": array}, "int8Block", block_size).tensors["d"]
    assert decoded.dtype == np.float32 and decoded.shape == array.shape
    padded = np.zeros(-(-count // block_size) * block_size, np.float32)
    padded[:count] = np.abs(array)
    block_max = np.repeat(padded.reshape(-1, block_size).max(axis=1), block_size)[:count]
    assert np.all(np.abs(decoded - array) <= block_max / 127 * 0.5 * (1 + 1e-5))


def test_int8_block_zero_blocks_decode_to_exact_zeros():
    array = np.zeros(1000, np.float32)
    array[300:310] = RNG.standard_normal(10)
    decoded = quantized_round_trip({"d": array, "z": np.zeros((4, 4))}, "int8Block", 64).tensors
    assert np.all(decoded["d"][:256] == 0) and np.all(decoded["d"][320:] == 0)
    assert decoded["z"].dtype == np.float64 and not decoded["z"].any()


@pytest.mark.parametrize("dtype", [np.float16, ml_dtypes.bfloat16, np.float64])
def test_int8_block_decodes_to_the_original_float_dtype(dtype):
    array = RNG.standard_normal(300).astype(dtype)
    decoded = quantized_round_trip({"d": array}, "int8Block").tensors["d"]
    assert decoded.dtype == np.dtype(dtype)
    tolerance = np.abs(array.astype(np.float32)).max() / 127
    np.testing.assert_allclose(decoded.astype(np.float32), array.astype(np.float32), atol=tolerance)


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_int8_block_refuses_non_finite_input(value):
    array = np.ones(10, np.float32)
    array[3] = value
    with pytest.raises(ValueError, match="non-finite"):
        protocol.encode(protocol.RoundResult(), {"d": array}, quantization="int8Block")


@pytest.mark.parametrize("quantization", ["bfloat16", "int8Block"])
def test_quantization_leaves_non_float_tensors_exact(quantization):
    tensors = {
        "ids": np.arange(-50, 50, dtype=np.int64),
        "mask": np.array([True, False]),
        "w": np.ones(10, np.float32),
    }
    message = quantized_round_trip(tensors, quantization)
    np.testing.assert_array_equal(message.tensors["ids"], tensors["ids"])
    np.testing.assert_array_equal(message.tensors["mask"], tensors["mask"])
    np.testing.assert_array_equal(message.tensors["w"], tensors["w"])


def test_int8_block_payload_is_a_quarter_plus_scales():
    array = RNG.standard_normal(10_000).astype(np.float32)
    _, payload = protocol.encode(
        protocol.RoundResult(), {"d": array}, quantization="int8Block", block_size=100
    )
    assert payload.nbytes == 10_000 + 4 * 100


# --------------------------------------------------------------------------- streams


class ChunkedStream(trio.abc.Stream):
    """Delivers fixed bytes in the given chunk sizes (then EOF), like a fragmenting network."""

    def __init__(self, data: bytes, sizes: list[int]):
        self._chunks, position = [], 0
        for size in [*sizes, len(data)]:
            if position < len(data):
                self._chunks.append(data[position : position + size])
                position += size
        self.sent = bytearray()

    async def receive_some(self, max_bytes=None) -> bytes:
        await trio.lowlevel.checkpoint()
        if not self._chunks:
            return b""
        chunk = self._chunks.pop(0)
        if max_bytes is not None and len(chunk) > max_bytes:
            chunk, rest = chunk[:max_bytes], chunk[max_bytes:]
            self._chunks.insert(0, rest)
        return chunk

    async def send_all(self, data) -> None:
        await trio.lowlevel.checkpoint()
        self.sent += data

    async def wait_send_all_might_not_block(self) -> None:
        await trio.lowlevel.checkpoint()

    async def aclose(self) -> None:
        await trio.lowlevel.checkpoint()


SMALL = (
    protocol.RoundStart(round=9, inner_steps=4),
    {"a": np.arange(3, dtype=np.float32), "b": np.array([[1, -2]], dtype=np.int16)},
)


async def receive_all(data: bytes, sizes: list[int], count: int) -> list[protocol.Message]:
    stream = protocol.MessageStream(ChunkedStream(data, sizes))
    messages = [await stream.receive() for _ in range(count)]
    with pytest.raises(protocol.ConnectionClosed, match="^peer closed the connection$"):
        await stream.receive()
    assert stream.bytes_received == len(data)
    return messages


async def test_small_message_survives_every_two_piece_split():
    data = wire(protocol.encode(*SMALL))

    for cut in range(1, len(data)):
        [message] = await receive_all(data, [cut], 1)
        assert_same(message, *SMALL)


async def test_back_to_back_messages_survive_random_fragmentation():
    one = wire(protocol.encode(*SMALL))
    data = one * 3
    rng = random.Random(1)

    for _ in range(60):
        sizes = [rng.choice([1, 1, 2, 3, 5, 8, 40, 200]) for _ in range(len(data))]
        for message in await receive_all(data, sizes, 3):
            assert_same(message, *SMALL)
            assert message.wire_bytes == len(one)


async def exchange_all_kinds(left: trio.abc.Stream, right: trio.abc.Stream) -> None:
    sender, receiver = protocol.MessageStream(left), protocol.MessageStream(right)
    big = {"big": RNG.standard_normal(1_500_000).astype(np.float32)}
    cases = [
        *BODIES.values(),
        (protocol.RoundStart(), big),
    ]
    sent = []

    async def send_all():
        for case in cases:
            sent.append(await sender.send(*case))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_all)
        received = [await receiver.receive() for _ in cases]
    for case, message, size in zip(cases, received, sent, strict=True):
        assert_same(message, *case)
        assert message.wire_bytes == size
    assert sender.bytes_sent == receiver.bytes_received == sum(sent)
    await sender.aclose()
    with pytest.raises(protocol.ConnectionClosed, match="^peer closed the connection$"):
        await receiver.receive()


async def test_every_kind_over_a_memory_stream():
    await exchange_all_kinds(*trio.testing.memory_stream_pair())


async def tcp_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    [listener] = await trio.open_tcp_listeners(0, host="127.0.0.1")
    port = listener.socket.getsockname()[1]
    client = await trio.open_tcp_stream("127.0.0.1", port)
    server = await listener.accept()
    await listener.aclose()
    return client, server


async def test_every_kind_over_real_tcp():
    await exchange_all_kinds(*await tcp_pair())


async def test_quantized_tensors_over_real_tcp():
    client, server = await tcp_pair()
    sender, receiver = protocol.MessageStream(client), protocol.MessageStream(server)
    array = RNG.standard_normal(3_000_000).astype(np.float32)  # above the thread-offload size
    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            lambda: sender.send(
                protocol.RoundResult(round=1), {"d": array}, quantization="int8Block"
            )
        )
        message = await receiver.receive()
    assert message.wire_bytes < array.nbytes / 3.9
    assert np.abs(message.tensors["d"] - array).max() <= np.abs(array).max() / 127
    await sender.aclose()
    await receiver.aclose()


async def test_concurrent_senders_do_not_interleave_frames():
    left, right = trio.testing.memory_stream_pair()
    sender, receiver = protocol.MessageStream(left), protocol.MessageStream(right)
    array = np.arange(200_000, dtype=np.float32)

    async def send_many(tag):
        for _ in range(5):
            await sender.send(protocol.Goodbye(tag), {"x": array})

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_many, "a")
        nursery.start_soon(send_many, "b")
        for _ in range(10):
            message = await receiver.receive()
            np.testing.assert_array_equal(message.tensors["x"], array)


@pytest.mark.parametrize("cut", [3, 12, 40, -5])
async def test_close_mid_frame_is_reported_as_truncation(cut):
    data = wire(protocol.encode(*SMALL))

    stream = protocol.MessageStream(ChunkedStream(data[:cut], []))
    with pytest.raises(protocol.ConnectionClosed, match="mid-frame.*truncated"):
        await stream.receive()
    with pytest.raises(protocol.ConnectionClosed, match="unusable after an earlier failure"):
        await stream.receive()


async def test_broken_connection_becomes_connection_closed():
    client, server = await tcp_pair()
    client.socket.setsockopt(trio.socket.SOL_SOCKET, trio.socket.SO_LINGER, struct.pack("ii", 1, 0))
    await client.send_all(wire(protocol.encode(*SMALL))[:10])
    await client.aclose()  # linger 0: the peer sees a reset, not a clean close
    with pytest.raises(protocol.ConnectionClosed):
        await protocol.MessageStream(server).receive()


async def test_send_error_reaches_the_peer_and_is_silent_once_it_is_gone():
    left, right = trio.testing.memory_stream_pair()
    sender, receiver = protocol.MessageStream(left), protocol.MessageStream(right)
    await sender.send_error("tooLarge", "frame too large")
    message = await receiver.receive()
    assert message.body == protocol.Error(protocol.ErrorCode.TOO_LARGE, "frame too large")
    await receiver.aclose()
    await sender.send_error("malformed", "nobody listens")


async def test_version_mismatch_over_a_stream_names_both_sides():
    left, right = trio.testing.memory_stream_pair()
    hello = protocol.Hello(supported_versions=(7, 8))
    for buffer in protocol.encode(hello, version=7):
        await left.send_all(buffer)
    with pytest.raises(protocol.VersionMismatch) as caught:
        await protocol.MessageStream(right).receive()
    assert caught.value.peer_versions == (7, 8)
    assert caught.value.supported == protocol.SUPPORTED_VERSIONS
    assert caught.value.code == "versionMismatch"
    assert "upgrade pcp-tui on the older side" in str(caught.value)


async def test_cancelled_mid_frame_receive_leaves_the_stream_unusable():
    left, right = trio.testing.memory_stream_pair()
    receiver = protocol.MessageStream(right)
    await left.send_all(wire(protocol.encode(*SMALL))[:20])
    with trio.move_on_after(0.05):
        await receiver.receive()
    with pytest.raises(protocol.ConnectionClosed, match="unusable"):
        await receiver.receive()


async def test_cancelled_receive_between_frames_keeps_the_stream_usable():
    left, right = trio.testing.memory_stream_pair()
    receiver = protocol.MessageStream(right)
    with trio.move_on_after(0.01):
        await receiver.receive()
    await left.send_all(wire(protocol.encode(*SMALL)))
    assert_same(await receiver.receive(), *SMALL)


# --------------------------------------------------------------------------- refusals


def segment_table(*words: int) -> bytes:
    table = struct.pack(f"<I{len(words)}I", len(words) - 1, *words)
    return table + b"\0" * (-len(table) % 8)


@pytest.mark.parametrize(
    "table",
    [
        segment_table(2**31),
        segment_table(2**32 - 1, 2**32 - 1),
        segment_table(*[1] * 65),
        struct.pack("<I", 2**32 - 1),
    ],
)
async def test_oversized_frames_are_refused_before_allocating(table):
    tracemalloc.start()
    try:
        with pytest.raises(protocol.FrameTooLarge):
            protocol.decode(table + b"\0" * 64)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20
    stream = ChunkedStream(table, [])  # sent only the table: refused without waiting for the body
    with pytest.raises(protocol.FrameTooLarge):
        await protocol.MessageStream(stream).receive()


@pytest.mark.parametrize(
    ("headers", "limits"),
    [
        ([header(shape=[2**30], payloadBytes=2**32)], protocol.Limits(max_tensor_bytes=2**31)),
        ([header(shape=[2**40], payloadBytes=2**42)], protocol.Limits()),
        ([header(name=f"t{i}") for i in range(3)], protocol.Limits(max_tensors=2)),
        (
            [header(name=f"t{i}", shape=[100], payloadBytes=400) for i in range(3)],
            protocol.Limits(max_total_tensor_bytes=1000),
        ),
    ],
)
def test_oversized_tensors_are_refused_before_allocating(headers, limits):
    frame = craft(headers=headers)
    tracemalloc.start()
    try:
        with pytest.raises(protocol.FrameTooLarge):
            protocol.decode(frame, limits)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20


def test_frame_beyond_max_message_bytes_is_refused():
    data = wire(protocol.encode(protocol.Goodbye("x" * 4096)))
    with pytest.raises(protocol.FrameTooLarge, match="limit is 4096"):
        protocol.decode(data, protocol.Limits(max_message_bytes=4096))


@pytest.mark.parametrize(
    ("headers", "match"),
    [
        ([header(dtype=99)], "unknown dtype value 99"),
        ([header(quantization=9)], "unknown quantization value 9"),
        ([header(), header()], "appears twice"),
        ([header(name="n" * 257)], "1..256 characters"),
        ([header(name="")], "1..256 characters"),
        ([header(payloadBytes=12)], "needs 16 payload bytes, header says 12"),
        ([header(dtype="int32", quantization="bfloat16", payloadBytes=8)], "quantized"),
        ([header(quantization="int8Block", blockSize=0, payloadBytes=8)], "blockSize 0"),
        ([header(shape=[1] * 33)], "dimensions"),
        ([header(shape=[2**64 - 1, 0], payloadBytes=0)], "beyond int64"),
        ([header(shape=[2**62, 2**2], payloadBytes=0)], "overflows"),
    ],
)
def test_bad_tensor_headers_are_malformed(headers, match):
    payload = b"\0" * 16
    with pytest.raises(protocol.MalformedMessage, match=match) as caught:
        protocol.decode(craft(headers=headers) + payload)
    assert caught.value.code == "malformed"


@pytest.mark.parametrize(
    ("data", "match"),
    [
        (b"", "truncated"),
        (b"\x00\x00\x00\x00\x02\x00\x00\x00" + b"\xff" * 16, "not a valid PCP envelope"),
        (wire(protocol.encode(*SMALL))[:-1], "truncated"),
        (wire(protocol.encode(*SMALL)) + b"\0", "1 extra bytes"),
        (craft("goodbye", {"reason": "ok"})[:-8], "truncated"),
    ],
)
def test_garbage_and_truncations_are_malformed(data, match):
    with pytest.raises(protocol.MalformedMessage, match=match):
        protocol.decode(data)


def test_unknown_message_kind_and_invalid_text_are_malformed():
    frame = bytearray(craft("heartbeat", {"sentAt": 1.0}))
    frame[18] = 200  # the union discriminant, right after the 16-bit version
    with pytest.raises(protocol.MalformedMessage, match="unknown message kind"):
        protocol.decode(bytes(frame))
    frame = bytearray(craft("goodbye", {"reason": "bye"}))
    frame[frame.index(b"bye")] = 0xFF
    with pytest.raises(protocol.MalformedMessage, match="utf-8"):
        protocol.decode(bytes(frame))


@pytest.mark.parametrize(
    ("kind", "body", "match"),
    [
        ("workerHello", {"workerId": "w" * 129}, r"workerHello.workerId is 129 characters"),
        ("workerHello", {"backend": {"deviceKind": "k" * 200}}, r"backend.deviceKind is 200"),
        ("workerHello", {"proof": b"p" * 65}, r"workerHello.proof is 65 bytes"),
        ("goodbye", {"reason": "r" * 4097}, r"goodbye.reason is 4097 characters"),
        ("plan", {"paramNames": ["n" * 257]}, r"plan.paramNames\[0\] is 257 characters"),
        ("plan", {"dataTensors": ["d"] * 65}, r"plan.dataTensors has 65 entries; the limit is 64"),
        ("roundResult", {"losses": [1.0] * 5}, r"roundResult.losses has 5 entries; the limit is 4"),
        ("roundResult", {"computeSeconds": float("nan")}, r"computeSeconds is nan; it must be"),
        ("progress", {"loss": float("inf")}, r"progress.loss is inf; it must be a finite"),
        ("progress", {"tokensPerSecond": float("-inf")}, r"tokensPerSecond is -inf"),
        ("ready", {"compileSeconds": float("nan")}, r"ready.compileSeconds is nan"),
        (
            "progress",
            {"stats": {"gpuUtilization": 1.5}},
            r"gpuUtilization is 1.5; it must be within",
        ),
        ("progress", {"stats": {"gpuUtilization": -2.0}}, r"stats.gpuUtilization is -2.0"),
        ("progress", {"stats": {"gpuUtilization": float("nan")}}, r"gpuUtilization is nan"),
    ],
)
def test_every_bounded_field_is_checked_at_decode_and_named(kind, body, match):
    with pytest.raises(protocol.MalformedMessage, match=match) as caught:
        protocol.decode(craft(kind, body), protocol.Limits(max_losses=4))
    assert caught.value.code == "malformed"


def test_bounds_are_inclusive():
    body = {"workerId": "w" * 128, "proof": b"p" * 64, "hostname": "h" * 128}
    assert protocol.decode(craft("workerHello", body)).body.worker_id == "w" * 128
    losses = protocol.decode(
        craft("roundResult", {"losses": [1.0] * 4}), protocol.Limits(max_losses=4)
    )
    assert losses.body.losses == (1.0,) * 4


@pytest.mark.parametrize(
    ("enum", "schema"),
    [
        (protocol.Phase, "Phase"),
        (protocol.Platform, "Platform"),
        (protocol.BatchKind, "BatchKind"),
        (protocol.ErrorCode, "ErrorCode"),
        (protocol.Quantization, "Quantization"),
    ],
)
def test_python_enums_are_the_schema_enums(enum, schema):
    from pcp_tui.protocol._schema import SCHEMA

    assert [member.value for member in enum] == list(getattr(SCHEMA, schema).schema.enumerants)


@pytest.mark.parametrize(
    ("kind", "field", "value"),
    [("progress", "phase", 3), ("ready", "platform", 4), ("plan", "batchKind", 1)],
)
def test_an_enum_value_beyond_the_schema_is_malformed_and_named(kind, field, value):
    envelope = Envelope.new_message()
    envelope.version = protocol.PROTOCOL_VERSION
    setattr(envelope.init(kind), field, value)
    frame = bytearray(envelope.to_bytes())
    frame[frame.rindex(bytes([value, 0]))] = 77  # the body, written last, holds only this value
    with pytest.raises(protocol.MalformedMessage, match=f"{kind}.{field} is 77, not a known"):
        protocol.decode(bytes(frame))


def test_unknown_enum_in_a_body_is_malformed():
    frame = bytearray(craft("error", {"code": "busy", "message": "x"}))
    frame[frame.index(bytes([9, 0]), 16)] = 250  # ErrorCode.busy == 9
    with pytest.raises(protocol.MalformedMessage):
        protocol.decode(bytes(frame))


@pytest.mark.parametrize(
    ("body", "peer"),
    [
        (protocol.Hello(supported_versions=(5,)), (5,)),
        (protocol.WorkerHello(supported_versions=(1,)), (1,)),
        (protocol.Heartbeat(sent_at=1.0), (7,)),
    ],
)
def test_wrong_version_is_refused_with_both_sides_named(body, peer):
    version = 7 if body.KIND == "heartbeat" else peer[0]
    with pytest.raises(protocol.VersionMismatch) as caught:
        protocol.decode(wire(protocol.encode(body, version=version)))
    assert caught.value.peer_versions == peer
    text = str(caught.value)
    assert (
        f"the peer speaks version(s) {peer[0]}" in text
        and f"this side speaks version(s) {protocol.PROTOCOL_VERSION}" in text
    )
    assert "upgrade pcp-tui on the older side" in text


def test_errors_form_one_hierarchy_with_schema_codes():
    for error in (
        protocol.VersionMismatch((2,), (1,)),
        protocol.FrameTooLarge("x"),
        protocol.MalformedMessage("x"),
        protocol.ConnectionClosed("x"),
    ):
        assert isinstance(error, protocol.ProtocolError)
        assert error.code in protocol.ERROR_CODES


def test_wrong_version_wins_over_an_unknown_kind():
    """A newer peer may add message kinds: it must hear 'version mismatch', not 'malformed'."""
    frame = bytearray(craft("heartbeat", {"sentAt": 1.0}, version=9))
    frame[18] = 200
    with pytest.raises(protocol.VersionMismatch) as caught:
        protocol.decode(bytes(frame))
    assert caught.value.peer_versions == (9,)


async def test_concurrent_receives_are_refused():
    _, right = trio.testing.memory_stream_pair()
    receiver = protocol.MessageStream(right)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(receiver.receive)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(trio.BusyResourceError):
            await receiver.receive()
        nursery.cancel_scope.cancel()


async def test_payload_gate_holds_tensor_bytes_on_the_wire_until_it_opens():
    """A receiver bounding memory: the gate sees the header's payload size before a
    byte of payload is read, small messages pass without it, and the message that
    waited arrives intact once the gate opens."""

    async def exchange(sender, receiver, big, gate, gate_open, seen):
        async with trio.open_nursery() as nursery:
            await sender.send(protocol.Heartbeat(sent_at=1.0))  # small: fits the socket buffers
            nursery.start_soon(sender.send, protocol.RoundResult(round=3, tokens=9), big)
            first = await receiver.receive(before_payload=gate)
            assert first.kind == "heartbeat" and seen == []
            received: list[protocol.Message] = []

            async def receive_big():
                received.append(await receiver.receive(before_payload=gate))

            nursery.start_soon(receive_big)
            await trio.testing.wait_all_tasks_blocked(cushion=0.05)
            assert seen == [("roundResult", big["w"].nbytes)]
            assert received == [] and receiver.bytes_received < big["w"].nbytes
            gate_open.set()
        [message] = received
        assert message.body.round == 3
        np.testing.assert_array_equal(message.tensors["w"], big["w"])

    client, server = await tcp_pair()
    sender, receiver = protocol.MessageStream(client), protocol.MessageStream(server)
    big = {"w": np.arange(4 * 2**20, dtype=np.float32)}  # 16 MiB: beyond socket buffers
    gate_open = trio.Event()
    seen: list[tuple[str, int]] = []

    async def gate(kind: str, nbytes: int) -> None:
        seen.append((kind, nbytes))
        await gate_open.wait()

    await exchange(sender, receiver, big, gate, gate_open, seen)
    await sender.aclose()
    await receiver.aclose()


async def test_last_activity_moves_with_bytes_inside_a_message():
    """Liveness is bytes, not whole messages: a big message arriving slowly keeps the
    receiver's `last_activity` moving while `receive` is still waiting for the end."""

    client, server = await tcp_pair()
    receiver = protocol.MessageStream(server)
    wire = b"".join(
        bytes(b)
        for b in protocol.encode(
            protocol.RoundResult(round=1, tokens=4), {"w": np.ones(64 * 1024, np.float32)}
        )
    )
    marks: list[float] = []
    received: list[protocol.Message] = []

    async def receive():
        received.append(await receiver.receive())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(receive)
        for start in range(0, len(wire), 64 * 1024):
            await client.send_all(wire[start : start + 64 * 1024])
            await trio.testing.wait_all_tasks_blocked(cushion=0.01)
            marks.append(receiver.last_activity)
    assert received and received[0].tensors["w"].sum() == 64 * 1024
    assert len(marks) >= 4 and marks == sorted(marks) and marks[-2] > marks[0]
    await client.aclose()
    await receiver.aclose()
