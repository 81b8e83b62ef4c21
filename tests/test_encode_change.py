"""`protocol.encode_change` against the op-by-op round trip it replaces, to the bit and the byte.

The oracle is what the shepherd's `RoundEngine._step` did before: the change
`new - old`, `protocol.encode`, `protocol.decode` of the joined bytes, and
`old + decoded` written over `new`. The chunked path must give the same wire
bytes and the same float32 bits for every quantization, on sizes that are no
multiple of a block or a chunk, on one thread and several, with subnormals,
±0, values near float32's max, and (where the encoder takes them) inf and NaN.
"""

from __future__ import annotations

import numpy as np
import pytest
import trio
import trio.testing

from pcp_tui import protocol
from pcp_tui.protocol import _change

QUANTIZATIONS = ("int8Block", "int4Block", "bfloat16", "none")
BODY = protocol.FragmentUpdate(round=7, fragment=1, change=True)
TINY = np.float32(1e-40)  # subnormal
BIG = np.float32(3.4e38)  # near float32's max: top x scale would round to inf


def op_by_op(targets: dict, bases: dict, quantization: str, block_size: int) -> bytes:
    """The oracle: change, encode, decode the joined bytes, add; returns the wire."""
    change = {n: targets[n] - bases[n] for n in targets}
    buffers = protocol.encode(BODY, change, quantization=quantization, block_size=block_size)
    wire = b"".join(bytes(b) for b in buffers)
    decoded = protocol.decode(wire).tensors
    for name in targets:
        np.add(bases[name], decoded[name], out=targets[name])
    return wire


def chunked(targets: dict, bases: dict, quantization: str, block_size: int, threads: int):
    message = protocol.encode_change(
        BODY, targets, bases, quantization=quantization, block_size=block_size, threads=threads
    )
    return b"".join(bytes(b) for b in message.buffers)


def special_values() -> tuple[np.ndarray, np.ndarray]:
    """(base, target) of 64 values, block by block (blocks of 7 or 256 cut them anywhere):
    signed zeros whose change rounds to a -0.0 level, subnormal changes and values, a block
    near float32's max, exact zeros."""
    base = np.zeros(64, np.float32)
    target = np.zeros(64, np.float32)
    base[:8] = -0.0
    target[:8] = [-1e-7, -0.0, 0.0, 1.0, -1e-6, -0.0, -3e-8, 2e-9]  # x / scale rounds to -0
    base[8:16] = [TINY, -TINY, 0.0, -0.0, TINY, 1e-38, -1e-38, 0.0]
    target[8:16] = [0.0, TINY, -TINY, TINY, 3 * TINY, -1e-38, 1e-38, -0.0]  # subnormal changes
    target[16:24] = [BIG, -BIG, 1.0, -1.0, 0.0, BIG / 3, -0.0, 7.0]
    base[24:40] = np.linspace(-1, 1, 16, dtype=np.float32)
    target[24:40] = base[24:40]  # no change at all
    target[40:] = np.float32(0.25) * np.arange(24, dtype=np.float32) - 2
    return base, target


def tensors(rng) -> tuple[dict, dict]:
    """(targets, bases): a tensor over four chunks and a bit, the special values, a 0-d one."""
    count = 4 * _change.CHUNK + 1001  # threads take it; no multiple of 7, 256 or a chunk
    base = rng.standard_normal(count, dtype=np.float32) * np.float32(0.02)
    target = base + rng.standard_normal(count, dtype=np.float32) * np.float32(1e-3)
    target[::4099] *= 50  # blocks of very different scales
    special_base, special_target = special_values()
    bases = {"w": base, "special": special_base, "scalar": np.array(-0.0, np.float32)}
    targets = {"w": target, "special": special_target, "scalar": np.array(0.5, np.float32)}
    return targets, bases


def copies(arrays: dict) -> dict:
    return {name: np.array(value, copy=True) for name, value in arrays.items()}


def assert_same_bits(got: dict, expected: dict) -> None:
    for name, value in expected.items():
        assert got[name].dtype == value.dtype, name
        assert got[name].tobytes() == value.tobytes(), f"{name}: bits differ"


@pytest.mark.parametrize("block_size", [256, 7])
@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_encode_change_gives_the_op_by_op_bytes_and_bits(quantization, block_size):
    targets, bases = tensors(np.random.default_rng(3))
    expected = copies(targets)
    wire = op_by_op(expected, bases, quantization, block_size)
    assert (
        np.abs(expected["w"] - bases["w"]).max() > 1e-4
    )  # the round trip changed the values: the comparison means something
    for threads in (1, 3):
        got = copies(targets)
        assert chunked(got, bases, quantization, block_size, threads) == wire, threads
        assert_same_bits(got, expected)
    if quantization in ("int8Block", "int4Block"):
        # -1e-7 next to 1.0 rounds to a level of -0.0, sent as 0: -0.0 + 0.0 is +0.0
        assert not np.signbit(expected["special"][0])


def test_tensors_outside_the_chunked_path_take_the_op_by_op_way():
    """float64, float16 (not quantized to bfloat16), a strided target, an empty one: the same."""
    rng = np.random.default_rng(5)
    wide = rng.standard_normal(1000)
    bases = {
        "f64": wide,
        "f16": wide.astype(np.float16),
        "strided": rng.standard_normal(300, dtype=np.float32),
        "empty": np.zeros((0, 3), np.float32),
    }
    targets = {
        "f64": wide * 1.5,
        "f16": (wide * 2).astype(np.float16),
        "strided": np.zeros((300, 2), np.float32)[:, 0],
        "empty": np.zeros((0, 3), np.float32),
    }
    for quantization in QUANTIZATIONS:
        expected = copies(targets)
        got = copies(targets) | {"strided": np.zeros((300, 2), np.float32)[:, 0]}
        wire = op_by_op(expected, bases, quantization, 256)
        assert chunked(got, bases, quantization, 256, 2) == wire, quantization
        assert_same_bits(got, expected)


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # inf - inf
@pytest.mark.parametrize("quantization", QUANTIZATIONS)
def test_a_non_finite_change_is_refused_or_carried_as_the_encoder_does(quantization):
    """int8Block and int4Block refuse inf and NaN (ValueError, the same words); bfloat16 and
    none carry them, and the new values hold the very NaN and inf bits of the old way."""
    count = 4 * _change.CHUNK + 5000  # over threads: the first error ends them all
    base = np.linspace(-1, 1, count, dtype=np.float32)
    target = base * np.float32(1.01)
    target[[10, 2000, count - 1]] = [np.inf, np.nan, -np.inf]
    base[3 * _change.CHUNK] = np.inf  # inf - inf: NaN
    bases, targets = {"w": base}, {"w": target}
    if quantization in ("int8Block", "int4Block"):
        with pytest.raises(ValueError, match="non-finite") as old_way:
            op_by_op(copies(targets), bases, quantization, 256)
        with pytest.raises(ValueError) as new_way:
            chunked(copies(targets), bases, quantization, 256, 3)
        assert str(new_way.value) == str(old_way.value)
        return
    expected, got = copies(targets), copies(targets)
    wire = op_by_op(expected, bases, quantization, 256)
    assert chunked(got, bases, quantization, 256, 3) == wire
    assert_same_bits(got, expected)
    assert np.isnan(got["w"][[2000, 3 * _change.CHUNK]]).all()
    assert np.isinf(got["w"][[10, count - 1]]).all()


def test_encode_change_refuses_what_encode_refuses_and_a_missing_base():
    target = {"w": np.ones(4, np.float32)}
    with pytest.raises(ValueError, match="unknown quantization"):
        protocol.encode_change(BODY, target, target, quantization="int2")
    with pytest.raises(ValueError, match="block_size"):
        protocol.encode_change(BODY, target, target, quantization="int8Block", block_size=0)
    with pytest.raises(ValueError, match="no base of its shape"):
        protocol.encode_change(BODY, target, {"w": np.ones(5, np.float32)}, quantization="none")
    with pytest.raises(ValueError, match="no base"):
        protocol.encode_change(BODY, target, {}, quantization="none")


async def test_one_encoding_reaches_two_workers_over_tcp_as_the_same_bytes_and_global_value():
    """The shepherd encodes a fragment update once and sends it to two real TCP peers: each
    decodes the same tensors from the same number of bytes, and forms (last global + change,
    as `worker/rounds.py` does) exactly the value the shepherd kept."""
    rng = np.random.default_rng(11)
    old = {"w": rng.standard_normal(70_001, dtype=np.float32)}
    params = {"w": old["w"] + rng.standard_normal(70_001, dtype=np.float32) * np.float32(0.01)}
    update = protocol.encode_change(BODY, params, old, quantization="int8Block")
    received = []

    async def receive(stream):
        received.append(await stream.receive())

    listeners = await trio.open_tcp_listeners(0, host="127.0.0.1")
    links = []
    for _ in range(2):
        client = await trio.testing.open_stream_to_socket_listener(listeners[0])
        links.append((protocol.MessageStream(client), await listeners[0].accept()))
    async with trio.open_nursery() as nursery:
        for shepherd_side, worker_side in links:
            nursery.start_soon(shepherd_side.send_encoded, update)
            nursery.start_soon(receive, protocol.MessageStream(worker_side))
    for shepherd_side, worker_side in links:
        await shepherd_side.aclose()
        await worker_side.aclose()
    for listener in listeners:
        await listener.aclose()
    assert [m.wire_bytes for m in received] == [update.wire_bytes] * 2
    for message in received:
        assert message.body == BODY
        formed = old["w"] + message.tensors["w"]
        assert formed.tobytes() == params["w"].tobytes()
    assert update.wire_bytes < params["w"].nbytes / 3  # int8: the change, not the values


async def test_a_worker_link_sends_an_encoded_update_within_its_deadline_or_cuts_the_link():
    """`WorkerLink.send_encoded` keeps `send`'s rule: a peer that reads gets the whole update;
    one that does not read is cut off past --upload-grace + bytes / --min-upload-rate, and its
    link ends (the update is 64 MB: more than a loopback socket holds unread)."""
    from pcp_tui.shepherd.run.state import RunState, WorkerView
    from pcp_tui.shepherd.serving.connection import SendTooSlow, WorkerLink

    values = np.arange(16 * 2**20, dtype=np.float32)
    update = protocol.encode_once(protocol.FragmentUpdate(round=1, fragment=0), {"w": values})
    outcomes = {}

    async def send(link, name):
        try:
            outcomes[name] = await link.send_encoded(update)
        except SendTooSlow as exc:
            outcomes[name] = str(exc)

    listener = (await trio.open_tcp_listeners(0, host="127.0.0.1"))[0]
    state = RunState(run_id="r", rounds_total=1, settings={})
    links, peers = [], []
    for index, (grace, rate) in enumerate([(float("inf"), float("inf")), (0.2, 1e9)]):
        peers.append(await trio.testing.open_stream_to_socket_listener(listener))
        view = WorkerView(worker_id=f"w{index}", index=index, host="here")
        stream = protocol.MessageStream(await listener.accept())
        links.append(
            WorkerLink(
                stream, view, state, protocol.Platform.CPU, min_send_rate=rate, send_grace=grace
            )
        )
    # a bound, not a timing: a link without its deadline would wait on the deaf peer for ever
    async with trio.open_nursery() as nursery:
        nursery.start_soon(send, links[0], "reads")
        nursery.start_soon(send, links[1], "deaf")
        outcomes["received"] = await protocol.MessageStream(peers[0]).receive()
    for stream in [*peers, listener]:
        await stream.aclose()
    outcomes["deaf closed"] = links[1].closed
    assert outcomes["reads"] == update.wire_bytes == outcomes["received"].wire_bytes
    assert outcomes["received"].tensors["w"].tobytes() == values.tobytes()
    assert "download too slow" in outcomes["deaf"] and f"{values.nbytes}-byte" in outcomes["deaf"]
    assert outcomes["deaf closed"]
