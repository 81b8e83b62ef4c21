"""The chunked, multi-threaded decode of a received tensor against `dequantize`, to the bit.

The oracle is `_tensors.dequantize`, the one-pass, one-thread decode every
receive used before. `dequantize_chunked` must give the same bytes for every
quantization and dtype, on sizes that are no multiple of a block or a chunk
(so chunks start on odd values, int4 chunks on a high nibble, and the last
block is short), on one thread and several; and for payloads no honest sender
writes but a peer may: every int8 level (-128 too), every int4 nibble (-8
too), subnormal, zero and huge scales (level x scale overflowing to inf), and
bfloat16 bit patterns of every kind (NaN payloads, ±inf, ±0, subnormals).
The same holds for a whole message received over a real TCP socket.
"""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
import trio
import trio.testing

from pcp_tui import protocol
from pcp_tui.protocol import _chunked, _codec
from pcp_tui.protocol._dequantize import dequantize_chunked
from pcp_tui.protocol._tensors import TensorSpec, dequantize, payload_size, prepare

RNG = np.random.default_rng(13)
MANY = 4 * _chunked.CHUNK + 1001  # over threads; no multiple of 2, 7, 256 or a chunk
SIZES = (1, 3, 7, 255, 257, MANY)
BIG = _codec.OFFLOAD_BYTES // 4 + 1001  # float32 values a receive decodes in a thread


def spec_of(dtype: str, count: int, quantization: str, block_size: int) -> TensorSpec:
    block_size = block_size if quantization in ("int8Block", "int4Block") else 0
    size = payload_size(dtype, count, quantization, block_size or 1)
    return TensorSpec("w", dtype, (count,), quantization, size, block_size)


def random_payload(spec: TensorSpec) -> np.ndarray:
    """Bytes a peer may send: random levels and bfloat16 bits, scales of every kind."""
    payload = RNG.integers(0, 256, spec.payload_bytes, dtype=np.uint8)
    if spec.quantization in ("int8Block", "int4Block"):
        blocks = -(-spec.count // spec.block_size)
        kinds = np.array([0.0, 1e-45, 1e-40, 1.2e-38, 3e-3, 1.0, 2.5e36, 3.4e38], np.float32)
        scales = kinds[RNG.integers(0, kinds.size, blocks)]
        payload[spec.payload_bytes - 4 * blocks :] = scales.view(np.uint8)
    return payload


def assert_same(payload: np.ndarray, spec: TensorSpec, threads: int) -> None:
    with np.errstate(over="ignore", invalid="ignore"):  # casts of inf and NaN
        want = dequantize(payload, spec)
    got = dequantize_chunked(payload, spec, threads)
    assert got.dtype == want.dtype and got.shape == want.shape
    assert got.tobytes() == want.tobytes()


@pytest.mark.parametrize("count", SIZES)
@pytest.mark.parametrize(
    ("quantization", "block_size"),
    [("int8Block", 256), ("int8Block", 7), ("int4Block", 256), ("int4Block", 7), ("bfloat16", 1)],
)
def test_any_payload_decodes_to_the_one_pass_bits(quantization, block_size, count):
    spec = spec_of("float32", count, quantization, block_size)
    payload = random_payload(spec)
    for threads in (1, 3):
        assert_same(payload, spec, threads)


@pytest.mark.parametrize(
    ("dtype", "quantization"),
    [
        (dtype, quantization)
        for dtype in ("float64", "float16", "bfloat16")
        for quantization in ("int8Block", "int4Block")
    ]
    + [("float64", "bfloat16")],  # a sender only quantizes float32 and float64 to bfloat16
)
def test_other_dtypes_decode_to_the_one_pass_bits(dtype, quantization):
    spec = spec_of(dtype, MANY, quantization, 7)
    assert_same(random_payload(spec), spec, threads=3)


@pytest.mark.parametrize("quantization", ["int8Block", "int4Block", "bfloat16"])
def test_encoded_tensors_round_trip_to_the_one_pass_bits(quantization):
    """What an honest sender encodes: subnormals, ±0, values near float32's max, odd shapes."""
    array = RNG.standard_normal(MANY, dtype=np.float32)
    array[:6] = [0.0, -0.0, 1e-40, -1e-40, 3.4e38, -3.4e38]
    array[300:556] = 1e-42  # a block of subnormals: a subnormal scale
    if quantization == "bfloat16":
        array[6:9] = [np.nan, np.inf, -np.inf]
    spec, payload = prepare("w", array.reshape(1, -1, 1), quantization, 256)
    assert_same(np.frombuffer(payload, np.uint8).copy(), spec, threads=3)


def test_one_block_larger_than_a_chunk_and_an_empty_tensor():
    spec = spec_of("float32", MANY, "int4Block", MANY - 5)  # two blocks, the second of 5
    assert_same(random_payload(spec), spec, threads=3)
    empty = spec_of("float32", 0, "int8Block", 256)
    assert dequantize_chunked(np.empty(0, np.uint8), empty).shape == (0,)


@pytest.mark.parametrize("quantization", ["int8Block", "int4Block"])
def test_a_bad_scale_is_refused_before_any_value_is_decoded(quantization):
    spec = spec_of("float32", MANY, quantization, 256)
    payload = random_payload(spec)
    payload[-4:] = np.array([np.nan], np.float32).view(np.uint8)
    with pytest.raises(protocol.MalformedMessage, match="NaN, infinite or negative block scale"):
        dequantize_chunked(payload, spec, threads=3)


def test_a_message_over_tcp_decodes_to_the_one_pass_bits():
    """A whole round result (int8 and int4 tensors big enough to go to threads, and small
    ones) through real `MessageStream`s on a loopback socket: the received tensors are the
    one-pass decode of the sent payloads, on several decode threads and on one."""
    tensors = {  # the big ones decode in a thread while the next payload arrives
        "wte": RNG.standard_normal((BIG // 768 + 1, 768), dtype=np.float32),
        "bias": RNG.standard_normal(769, dtype=np.float32),
        "odd": RNG.standard_normal((3, BIG // 3), dtype=np.float32),
    }
    for quantization in ("int8Block", "int4Block"):
        want = {
            name: dequantize(np.frombuffer(payload, np.uint8), spec)
            for name, (spec, payload) in (
                (n, prepare(n, a, quantization, 256)) for n, a in tensors.items()
            )
        }
        for threads in (3, 1):
            got = trio.run(receive_over_tcp, tensors, quantization, threads)
            assert list(got) == list(want)
            for name in want:
                assert got[name].tobytes() == want[name].tobytes(), name


async def tcp_pair() -> tuple[trio.SocketStream, trio.SocketStream]:
    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    client = await trio.testing.open_stream_to_socket_listener(listener)
    server = await listener.accept()
    await listener.aclose()
    return client, server


async def receive_over_tcp(tensors: dict, quantization: str, threads: int) -> dict:
    sender, receiver = map(protocol.MessageStream, await tcp_pair())
    receiver.decode_threads = threads
    body = protocol.RoundResult(round=1)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: sender.send(body, tensors, quantization=quantization))
        message = await receiver.receive()
    await sender.aclose()
    await receiver.aclose()
    assert message.body == body
    return message.tensors


async def test_a_bad_scale_in_a_tensor_decoded_behind_the_reading_ends_that_connection_only():
    """The first big tensor's last scale is NaN: the error surfaces from the decode thread as
    the plain MalformedMessage (no exception group), after the rest was read, and the stream
    refuses further use; a second connection in the same run receives normally."""
    tensors = {
        "a": RNG.standard_normal(BIG, dtype=np.float32),
        "b": RNG.standard_normal(BIG, dtype=np.float32),
    }
    body = protocol.RoundResult(round=2)
    wire = bytearray(
        b"".join(bytes(b) for b in protocol.encode(body, tensors, quantization="int8Block"))
    )
    first = len(wire) - 2 * (BIG + 4 * -(-BIG // 256))  # where tensor a's payload starts
    scales_end = first + BIG + 4 * -(-BIG // 256)
    wire[scales_end - 4 : scales_end] = np.array([np.nan], np.float32).tobytes()

    bad_client, bad_server = await tcp_pair()
    good_client, good_server = await tcp_pair()
    bad, good = protocol.MessageStream(bad_server), protocol.MessageStream(good_server)
    async with trio.open_nursery() as nursery:
        nursery.start_soon(bad_client.send_all, bytes(wire))
        with pytest.raises(protocol.MalformedMessage, match="tensor 'a'.*block scale"):
            await bad.receive()
    with pytest.raises(protocol.ConnectionClosed, match="unusable"):
        await bad.receive()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(lambda: protocol.MessageStream(good_client).send(body, tensors))
        message = await good.receive()
    assert all(message.tensors[n].tobytes() == tensors[n].tobytes() for n in tensors)
    for stream in (bad_client, bad_server, good_client, good_server):
        await stream.aclose()


def test_bfloat16_wire_bits_of_every_kind_decode_as_ml_dtypes_casts_them():
    """All 65536 bfloat16 patterns, widened to float32 and float64, as `astype` does."""
    every = np.arange(2**16, dtype=np.uint16).view(np.uint8)
    for dtype in ("float32", "float64"):
        spec = spec_of(dtype, 2**16, "bfloat16", 0)
        got = dequantize_chunked(every.copy(), spec, threads=3)
        with np.errstate(invalid="ignore"):
            want = every.view(ml_dtypes.bfloat16).astype(dtype)
        assert got.tobytes() == want.tobytes()


def test_a_worker_adds_a_decoded_change_in_place_to_the_bits_of_last_plus_change():
    """Streaming DiLoCo's new global value, last + decoded change: written over the decoded
    change (no model-sized temporary) where it can be, a new array where it cannot."""
    from pcp_tui.worker.rounds import add_changes

    last = RNG.standard_normal(MANY, dtype=np.float32)
    last[:4] = [-0.0, 0.0, 1e-40, 1.0]
    spec, payload = prepare("w", RNG.standard_normal(MANY, dtype=np.float32), "int4Block", 7)
    change = dequantize_chunked(np.frombuffer(payload, np.uint8).copy(), spec, threads=3)
    change[:4] = [-0.0, -0.0, -1e-40, 3.4e38]  # +0, -0 (sign bits), a subnormal, a huge one
    wide = change[:300].astype(np.float64)
    want = last + change
    new = add_changes({"w": last, "b": last[:300]}, {"w": change, "b": wide})
    assert new["w"] is change and new["w"].tobytes() == want.tobytes()
    assert new["b"].dtype == np.float64 and new["b"].tobytes() == (last[:300] + wide).tobytes()
