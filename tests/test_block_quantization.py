"""Block quantization on the wire (int8Block, int4Block): bounds, edge cases, hostile headers,
and admission of workers of another protocol version."""

from __future__ import annotations

import numpy as np
import pytest
import trio
import trio.testing
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pcp_tui import protocol
from pcp_tui.contract import auth
from pcp_tui.protocol._schema import Envelope
from pcp_tui.shepherd.run.state import RunState
from pcp_tui.shepherd.serving.admission import Admission

RNG = np.random.default_rng(0)
LEVELS = {"int8Block": 127, "int4Block": 7}
SMALLEST_SUBNORMAL = float(np.float32(2**-149))


def wire(buffers) -> bytes:
    return b"".join(bytes(buffer) for buffer in buffers)


def round_trip(array, quantization: str, block_size: int = 256) -> protocol.Message:
    body = protocol.RoundResult(round=1)
    return protocol.decode(
        wire(protocol.encode(body, {"d": array}, quantization=quantization, block_size=block_size))
    )


def block_bound(array: np.ndarray, block_size: int, top: int) -> np.ndarray:
    """Each value's error bound: half a step of its block's max, max / (2 top).

    The relative 1e-4 covers float32 rounding of x / scale and level x scale, and
    the one-ulp lower scale of blocks whose max is near float32's largest; the
    absolute `top` subnormal spacings cover blocks whose scale is subnormal.
    """
    count = array.size
    padded = np.zeros(-(-count // block_size) * block_size, np.float64)
    padded[:count] = np.abs(array.astype(np.float64))
    peak = np.repeat(padded.reshape(-1, block_size).max(axis=1), block_size)[:count]
    return peak / (2 * top) * (1 + 1e-4) + top * SMALLEST_SUBNORMAL


@settings(max_examples=150, deadline=None)
@given(
    array=hnp.arrays(
        np.float32,
        st.integers(0, 700),
        elements=st.floats(width=32, allow_nan=False, allow_infinity=False),
    ),
    block_size=st.integers(1, 300),
    quantization=st.sampled_from(["int8Block", "int4Block"]),
)
def test_block_round_trip_is_within_half_a_step_of_the_block_max(array, block_size, quantization):
    message = round_trip(array, quantization, block_size)
    decoded = message.tensors["d"]
    assert decoded.dtype == np.float32 and decoded.shape == array.shape
    assert np.isfinite(decoded).all()  # even a block whose max is float32's largest
    error = np.abs(decoded.astype(np.float64) - array.astype(np.float64))
    assert np.all(error <= block_bound(array, block_size, LEVELS[quantization]))


@pytest.mark.parametrize("count", [1, 2, 3, 255, 257, 1001])
@pytest.mark.parametrize("block_size", [1, 7, 256])
def test_int4_block_payload_is_half_a_byte_a_value_plus_scales(count, block_size):
    array = RNG.standard_normal(count).astype(np.float32)
    _, payload = protocol.encode(
        protocol.RoundResult(), {"d": array}, quantization="int4Block", block_size=block_size
    )
    assert payload.nbytes == (count + 1) // 2 + 4 * -(-count // block_size)


def test_int4_block_carries_its_levels_exactly_and_packs_low_nibble_first():
    levels = np.array([-7, -3, 0, 1, 7, 5, -1], np.float32)  # odd count: a padding nibble
    _, payload = protocol.encode(protocol.RoundResult(), {"d": levels}, quantization="int4Block")
    assert bytes(payload[:4]) == bytes([0xD9, 0x10, 0x57, 0x0F])  # two's complement nibbles
    np.testing.assert_array_equal(round_trip(levels, "int4Block").tensors["d"], levels)


def test_int4_block_zero_blocks_stay_zero_and_a_huge_value_costs_only_its_block():
    array = RNG.standard_normal(1000).astype(np.float32)
    array[:64] = 0
    array[100] = 1e30  # block 1 (64..127): everything else in it rounds to 0
    decoded = round_trip(array, "int4Block", 64).tensors["d"]
    assert not decoded[:64].any()
    assert decoded[100] == np.float32(1e30) and not np.delete(decoded[64:128], 36).any()
    rest = slice(128, None)
    assert np.all(np.abs(decoded[rest] - array[rest]) <= block_bound(array[rest], 64, 7))


@pytest.mark.parametrize("dtype", [np.float16, np.float64])
def test_int4_block_decodes_to_the_original_float_dtype_and_leaves_integers_exact(dtype):
    tensors = {"d": RNG.standard_normal(301).astype(dtype), "ids": np.arange(-5, 6)}
    message = protocol.decode(
        wire(protocol.encode(protocol.RoundResult(), tensors, quantization="int4Block"))
    )
    decoded = message.tensors
    assert decoded["d"].dtype == np.dtype(dtype)
    peak = np.abs(tensors["d"].astype(np.float64)).max()
    # 1%: float16's own rounding of the decoded value adds up to 2**-11 of the peak
    assert np.abs(decoded["d"].astype(np.float64) - tensors["d"]).max() <= peak / 14 * 1.01
    np.testing.assert_array_equal(decoded["ids"], tensors["ids"])


@pytest.mark.parametrize("value", [np.nan, np.inf, -np.inf])
def test_int4_block_refuses_non_finite_input(value):
    array = np.ones(11, np.float32)
    array[3] = value
    with pytest.raises(ValueError, match="int4Block cannot quantize non-finite"):
        protocol.encode(protocol.RoundResult(), {"d": array}, quantization="int4Block")


# --------------------------------------------------------------------------- hostile headers


def crafted(count: int, payload: bytes, block_size: int = 4, quantization: str = "int4Block"):
    """A roundResult whose one tensor header says what the test wants, followed by `payload`."""
    envelope = Envelope.new_message(roundResult={"round": 1})
    envelope.version = protocol.PROTOCOL_VERSION
    (header,) = envelope.init("tensors", 1)
    for key, value in {
        "name": "d",
        "dtype": "float32",
        "shape": [count],
        "quantization": quantization,
        "payloadBytes": len(payload),
        "blockSize": block_size,
    }.items():
        setattr(header, key, value)
    return envelope.to_bytes() + payload


@pytest.mark.parametrize(
    ("count", "payload", "block_size", "match"),
    [
        (5, b"\0" * 3 + b"\0" * 8, 4, None),  # well formed: 3 packed bytes, 2 scales
        (5, b"\0" * 2 + b"\0" * 8, 4, "needs 11 payload bytes, header says 10"),
        (5, b"\0" * 5 + b"\0" * 8, 4, "needs 11 payload bytes, header says 13"),
        (5, b"\0" * 3 + b"\0" * 8, 0, "int4Block with blockSize 0"),
        (5, b"\0" * 3 + np.array([1, np.nan], "<f4").tobytes(), 4, "NaN, infinite or negative"),
        (5, b"\0" * 3 + np.array([np.inf, 1], "<f4").tobytes(), 4, "NaN, infinite or negative"),
        (5, b"\0" * 3 + np.array([1, -1], "<f4").tobytes(), 4, "max\\|x\\| / 7"),
    ],
)
def test_malformed_int4_block_tensors_are_refused(count, payload, block_size, match):
    data = crafted(count, payload, block_size)
    if match is None:
        assert not protocol.decode(data).tensors["d"].any()
        return
    with pytest.raises(protocol.MalformedMessage, match=match):
        protocol.decode(data)


async def test_a_nan_scale_on_a_stream_is_a_protocol_error_that_ends_the_connection():
    """What the shepherd's connection sees: a ProtocolError it answers by closing that connection."""

    left, right = trio.testing.memory_stream_pair()
    payload = b"\x77" * 3 + np.array([1, np.nan], "<f4").tobytes()
    await left.send_all(crafted(5, payload))
    with pytest.raises(protocol.MalformedMessage, match="block scale"):
        await protocol.MessageStream(right).receive()


# --------------------------------------------------------------------------- versions


def worker_hello(nonce: bytes, versions: tuple[int, ...]) -> bytes:
    body = protocol.WorkerHello(
        supported_versions=versions, worker_id="w1", proof=auth.proof("t", nonce, "w1")
    )
    return wire(protocol.encode(body, version=min(versions)))


@pytest.mark.parametrize(
    ("versions", "admitted"),
    [((protocol.PROTOCOL_VERSION,), True), ((2, 3, 4, 5), False), ((7,), False)],
)
async def test_a_worker_of_another_protocol_version_is_refused_at_admission(versions, admitted):
    """One protocol version until a release: a worker of another is told which side to
    upgrade, at admission, before any plan."""
    state = RunState(run_id="r", rounds_total=1, settings={})
    admission = Admission(state, token="t", run_id="r")
    server_side, client_side = trio.testing.memory_stream_pair()
    answers = []

    async def worker():
        stream = protocol.MessageStream(client_side)
        hello = await stream.receive()
        await client_side.send_all(worker_hello(hello.body.nonce, versions))
        if not admitted:
            answers.append(await stream.receive())

    async with trio.open_nursery() as nursery:
        nursery.start_soon(worker)
        result = await admission.admit(server_side)
    assert (result is not None) == admitted
    if not admitted:
        (answer,) = answers
        assert answer.body.code == protocol.ErrorCode.VERSION_MISMATCH
        older = "this worker" if max(versions) < protocol.PROTOCOL_VERSION else "this shepherd"
        assert f"upgrade pcp-tui on {older}" in answer.body.message
