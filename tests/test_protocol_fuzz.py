"""Property tests of `protocol.decode` on hostile input.

Whatever the bytes, decoding ends in a Message or a ProtocolError subclass:
never another exception type, never a hang, never a huge allocation.
"""

from __future__ import annotations

import struct

import numpy as np
import trio
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from pcp_tui import protocol

FUZZ = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
SMALL_LIMITS = protocol.Limits(
    max_message_bytes=4096,
    max_segments=4,
    max_tensors=4,
    max_tensor_bytes=4096,
    max_total_tensor_bytes=8192,
    traversal_limit_words=512,
    nesting_limit=8,
)
RNG = np.random.default_rng(0)


def wire(buffers) -> bytes:
    return b"".join(bytes(buffer) for buffer in buffers)


VALID = [
    wire(protocol.encode(protocol.Hello(supported_versions=(2,), nonce=b"n" * 16, run_id="r"))),
    wire(
        protocol.encode(
            protocol.WorkerHello(worker_id="w", backend=protocol.BackendInfo(device_count=2))
        )
    ),
    wire(
        protocol.encode(
            protocol.Plan(
                run_id="r",
                graphs=(protocol.GraphInfo("g", (protocol.Platform.CPU,), "g"),),
                param_names=("a", "b"),
                compression=protocol.Quantization.BFLOAT16,
            ),
            {"g": np.frombuffer(b"graph", np.uint8)},
        )
    ),
    wire(
        protocol.encode(
            protocol.RoundStart(round=1),
            {
                "a": np.arange(6, dtype=np.float32).reshape(2, 3),
                "b": np.array(True),
                "c": np.zeros(0, np.int64),
            },
        )
    ),
    wire(
        protocol.encode(
            protocol.RoundResult(round=2, losses=(1.0, 0.5)),
            {"d": RNG.standard_normal(40).astype(np.float32)},
            quantization="int8Block",
            block_size=16,
        )
    ),
    wire(
        protocol.encode(
            protocol.RoundResult(round=2), {"d": RNG.standard_normal(9)}, quantization="bfloat16"
        )
    ),
    wire(
        protocol.encode(
            protocol.RoundResult(round=2),
            {"d": RNG.standard_normal(21).astype(np.float32)},
            quantization="int4Block",
            block_size=8,
        )
    ),
    wire(protocol.encode(protocol.Error(protocol.ErrorCode.BUSY, "later"))),
]


DEFAULT_LIMITS = protocol.Limits()


def decodes_or_refuses(
    data: bytes, limits: protocol.Limits = DEFAULT_LIMITS
) -> protocol.Message | None:
    try:
        message = protocol.decode(data, limits)
    except protocol.ProtocolError as exc:
        assert str(exc)  # every refusal says why
        return None
    assert message.kind in protocol.KINDS
    assert message.wire_bytes == len(data)
    return message


@FUZZ
@given(st.binary(max_size=600))
def test_random_bytes(data):
    decodes_or_refuses(data)
    decodes_or_refuses(data, SMALL_LIMITS)


@FUZZ
@given(st.sampled_from(VALID), st.data())
def test_truncations_of_valid_messages(valid, data):
    cut = data.draw(st.integers(0, len(valid) - 1))
    assert decodes_or_refuses(valid[:cut]) is None


@FUZZ
@given(st.sampled_from(VALID), st.data())
def test_mutations_of_valid_messages(valid, data):
    mutated = bytearray(valid)
    for _ in range(data.draw(st.integers(1, 6))):
        position = data.draw(st.integers(0, len(mutated) - 1))
        mutated[position] = data.draw(st.integers(0, 255))
    decodes_or_refuses(bytes(mutated))
    decodes_or_refuses(bytes(mutated), SMALL_LIMITS)


@FUZZ
@given(
    st.sampled_from(VALID),
    st.lists(st.integers(0, 2**32 - 1), min_size=1, max_size=5),
    st.booleans(),
)
def test_huge_length_fields(valid, fields, in_segment_table):
    """Arbitrary uint32s over the segment table, or over the first words of the root struct."""
    mutated = bytearray(valid)
    start = 0 if in_segment_table else 8
    for index, value in enumerate(fields):
        struct.pack_into("<I", mutated, start + 4 * index, value)
    decodes_or_refuses(bytes(mutated))


def pointer_words():
    """64-bit words biased towards Cap'n Proto pointers: struct, list, far and capability tags."""
    tagged = st.tuples(
        st.integers(-(2**29), 2**29 - 1), st.integers(0, 3), st.integers(0, 2**32 - 1)
    ).map(lambda parts: ((parts[0] << 2 | parts[1]) & 0xFFFFFFFF) | parts[2] << 32)
    return st.one_of(tagged, st.integers(0, 2**64 - 1), st.just(0xFFFFFFFC), st.just(0))


@FUZZ
@given(st.lists(pointer_words(), min_size=1, max_size=24), st.integers(0, 3))
def test_garbage_pointers_in_a_well_framed_segment(words, extra_segments):
    """A correct segment table around random (mostly pointer-shaped) words: loops, far pointers,
    deep nesting and out-of-bounds offsets must all end in MalformedMessage."""
    segments = [words] + [words[: 1 + i] for i in range(extra_segments)]
    table = struct.pack(f"<I{len(segments)}I", len(segments) - 1, *(len(s) for s in segments))
    table += b"\0" * (-len(table) % 8)
    body = b"".join(struct.pack(f"<{len(s)}Q", *s) for s in segments)
    decodes_or_refuses(table + body)
    decodes_or_refuses(table + body, SMALL_LIMITS)


def test_self_pointing_struct_is_refused():
    """A plan whose pointer leads back to the envelope itself: a cycle the reader must not follow forever."""

    def struct_pointer(offset: int) -> int:
        return ((offset << 2) & 0xFFFFFFFF) | 1 << 32 | 2 << 48  # 1 data word, 2 pointers

    plan = protocol.KINDS.index("plan")
    words = [struct_pointer(0), 1 | plan << 16, 0, struct_pointer(-3)]
    frame = struct.pack("<II", 0, len(words)) + struct.pack(f"<{len(words)}Q", *words)
    assert decodes_or_refuses(frame) is None


def arrays_of(dtype: np.dtype):
    shapes = hnp.array_shapes(min_dims=0, max_dims=3, min_side=0, max_side=5)
    if dtype == protocol.DTYPES["bfloat16"]:  # hypothesis cannot draw bfloat16: draw its bits
        return hnp.arrays(np.uint16, shapes).map(lambda bits: bits.view(dtype))
    return hnp.arrays(dtype, shapes)


tensor_arrays = st.sampled_from(list(protocol.DTYPES.values())).flatmap(arrays_of)


@settings(max_examples=60, deadline=None)
@given(
    st.dictionaries(st.text(min_size=1, max_size=8), tensor_arrays, max_size=4),
    st.lists(st.integers(1, 64), max_size=30),
)
def test_any_tensors_round_trip_through_a_fragmenting_stream(tensors, sizes):
    data = wire(protocol.encode(protocol.RoundStart(round=1), tensors))
    message = protocol.decode(data)
    for name, array in tensors.items():
        assert message.tensors[name].dtype == array.dtype
        assert message.tensors[name].shape == array.shape
        assert message.tensors[name].tobytes() == array.tobytes()

    async def main():
        left, right = trio.testing.memory_stream_pair()
        position = 0
        for size in [*sizes, len(data)]:
            await left.send_all(data[position : position + size])
            position += size
        streamed = await protocol.MessageStream(right).receive()
        assert streamed.wire_bytes == len(data)
        for name in tensors:
            assert streamed.tensors[name].tobytes() == message.tensors[name].tobytes()

    trio.run(main)


def test_nesting_deeper_than_the_limit_is_refused():
    """Envelope -> workerHello -> backend -> its hostnames list is 4 deep: a limit of 3 must
    refuse it, not crash."""
    data = wire(protocol.encode(protocol.WorkerHello(worker_id="w")))
    assert decodes_or_refuses(data, protocol.Limits(nesting_limit=3)) is None
    message = decodes_or_refuses(data, protocol.Limits(nesting_limit=4))
    assert message.body.backend.platform == protocol.Platform.CPU
