"""Streaming DiLoCo: the partition and schedule, and a real 2-worker run against the one-page reference.

The run trains two real workers (`Worker`, in this process) through real sockets with F = 2,
τ = 1, α = 0.5 and outer Nesterov (one optax state per fragment); the
shepherd's final parameters must equal `reference.streaming_diloco` on the
same batches. Both sides compute in float32 with the same operations, except
that the shepherd forms a mean as (Σ n_k Δ_k) · float32(1 / Σ n_k) where the
reference divides, and XLA runs the worker's SGD step where the reference runs
jax.grad op by op: measured, the two differ by at most an ulp (1.2e-7 on a
layer-norm scale of about 1), hence rtol 1e-6, atol 1e-7.
"""

from __future__ import annotations

import math

import numpy as np
import optax
import pytest
import trio
import trio.testing

from pcp_tui import protocol
from pcp_tui.config import ConfigError
from pcp_tui.contract import plan as contract
from pcp_tui.diloco import reference, streaming
from pcp_tui.shepherd.coordinator import Shepherd
from pcp_tui.shepherd.rounds.engine import inner_optimizer
from pcp_tui.testing import (
    local_workers,
    pause_after_round,
    run_shepherd,
    until,
    worker_batches,
)
from pcp_tui.training.build import build_workload
from pcp_tui.training.shards import sample_batches

from .conftest import small_config

SHAPES = {"wte": (256, 128), "wpe": (128, 128), "h.0.w": (128, 512), "h.0.b": (512,), "ln": (128,)}


def test_partition_covers_every_tensor_once_and_balances_sizes():
    fragments = streaming.partition(SHAPES, 2)
    assert contract.partition_problem(fragments, list(SHAPES)) is None
    sizes = [sum(int(np.prod(SHAPES[n])) for n in f) for f in fragments]
    assert fragments[0] == ("h.0.w",)  # the largest tensor alone, everything else beside it
    assert sizes == [65536, 32768 + 16384 + 512 + 128]
    assert streaming.partition(dict(reversed(SHAPES.items())), 2) == fragments  # order-free
    assert sorted(len(f) for f in streaming.partition(SHAPES, 5)) == [1] * 5
    with pytest.raises(ValueError, match="between 1 and the model's tensor count"):
        streaming.partition(SHAPES, 6)


def test_partition_problem_names_what_is_wrong():
    names = list(SHAPES)
    assert "more than one" in contract.partition_problem([names, ["wte"]], names)
    assert "missing ['wte']" in contract.partition_problem([names[1:]], names)
    assert "no tensor" in contract.partition_problem([names, []], names)


def test_schedule_staggers_fragments_and_overlaps_tau_steps():
    schedule = streaming.Schedule(inner_steps=12, fragments=3, overlap=2)
    send, merge = streaming.Event.SEND, streaming.Event.MERGE
    assert schedule.events() == [
        (2, send, 0),
        (4, merge, 0),
        (6, send, 1),
        (8, merge, 1),
        (10, send, 2),
        (12, merge, 2),
    ]
    assert streaming.Schedule(4, 2, 0).events() == [
        (2, send, 0),
        (2, merge, 0),
        (4, send, 1),
        (4, merge, 1),
    ]


@pytest.mark.parametrize(
    ("changes", "message"),
    [
        (dict(inner_steps=10, streaming_fragments=3), "multiple of --streaming-fragments"),
        (dict(inner_steps=8, streaming_fragments=4, overlap_steps=2), "below --inner-steps"),
        (dict(mix_alpha=1.5, streaming_fragments=2), "--mix-alpha must be in"),
    ],
)
def test_config_refuses_unschedulable_streaming(changes, message):
    with pytest.raises(ConfigError, match=message):
        small_config(**changes).validate()


def test_chunks_end_at_every_send_and_merge_point():
    assert small_config(inner_steps=40, chunk_steps=10).inner.chunk == 10  # plain: unchanged
    assert (
        small_config(
            inner_steps=40, chunk_steps=10, streaming_fragments=4, overlap_steps=5
        ).inner.chunk
        == 5
    )
    assert (
        small_config(
            inner_steps=40, chunk_steps=10, streaming_fragments=4, overlap_steps=0
        ).inner.chunk
        == 10
    )


def test_mix_keeps_alpha_of_the_local_value():
    local, global_ = np.array([1.0, 3.0], np.float32), np.array([3.0, 7.0], np.float32)
    np.testing.assert_array_equal(streaming.mix(local, global_, 0.5), [2.0, 5.0])
    np.testing.assert_array_equal(streaming.mix(local, global_, 0.0), global_)


def test_carry_keeps_the_overlap_steps_progress_on_the_new_global_value():
    sent, global_ = np.array([1.0, 3.0], np.float32), np.array([3.0, 7.0], np.float32)
    local = sent + np.float32(0.25)  # τ overlap steps moved every value by 0.25
    np.testing.assert_array_equal(streaming.carry(local, global_, sent, 0.0), global_ + 0.25)
    np.testing.assert_array_equal(streaming.carry(local, global_, sent, 0.5), [2.25, 5.25])
    np.testing.assert_array_equal(streaming.carry(sent, global_, sent, 0.0), global_)  # τ = 0


def test_worker_refuses_a_plan_whose_fragments_are_not_its_parameters():
    plan = protocol.Plan(
        param_names=("a", "b"),
        inner_steps=4,
        chunk_steps=1,
        fragments=(protocol.Fragment(("a",)), protocol.Fragment(("a", "b"))),
        overlap_steps=1,
    )
    assert "more than one fragment" in contract.fragments_problem(plan)
    assert "no fragments" in contract.fragments_problem(protocol.Plan(param_names=("a",)))
    fine = protocol.Plan(
        param_names=("a", "b"),
        inner_steps=4,
        chunk_steps=1,
        fragments=(protocol.Fragment(("a",)), protocol.Fragment(("b",))),
        overlap_steps=2,
    )
    assert "--overlap-steps 2" in contract.fragments_problem(fine)


LR = 0.1
ROUNDS = 2
H = 4


@pytest.mark.parametrize("merge", ["mix", "carry"])
def test_two_workers_streaming_equal_the_reference(merge):
    config = small_config(
        rounds=ROUNDS,
        inner_steps=H,
        chunk_steps=1,
        inner_optimizer="sgd",
        inner_lr=LR,
        warmup_steps=0,
        grad_clip=0.0,
        outer_optimizer="nesterov",
        aggregate="mean",
        workers=2,
        eval_every=ROUNDS,
        streaming_fragments=2,
        overlap_steps=1,
        mix_alpha=0.5,
        overlap_merge=merge,
    )
    workload = build_workload(config, shards=2)
    shepherd = Shepherd(config, workload)

    run_shepherd(shepherd, local_workers(2))
    history = shepherd.state.history
    assert [r.fragment_results for r in history] == [(2, 2)] * ROUNDS
    tokens = float(H * config.data.batch_size * config.data.seq_len)
    rounds = [
        [(worker_batches(workload, config, slot, number, H), tokens) for slot in range(2)]
        for number in range(1, ROUNDS + 1)
    ]
    expected = reference.streaming_diloco(
        workload.loss_fn,
        workload.params,
        rounds,
        inner=optax.sgd(LR),
        outer=reference.outer_optimizer("nesterov"),
        fragments=shepherd.engine.fragments,
        overlap=1,
        alpha=0.5,
        merge=merge,
    )
    moved = 0.0
    for name, value in expected.items():
        np.testing.assert_allclose(shepherd.params[name], value, rtol=1e-6, atol=1e-7, err_msg=name)
        moved = max(moved, float(np.abs(value - workload.params[name]).max()))
    assert moved > 1e-3  # the parameters really changed: the check is not vacuous


def chunk_batches(workload, config, slot: int, number: int, steps: int) -> list:
    """The batches worker `slot` trains on in round `number`, sampled a compiled chunk at a time."""
    k = config.inner.chunk
    chunks = [
        sample_batches(
            workload.shards[slot],
            steps=k,
            batch_size=config.data.batch_size,
            seq_len=config.data.seq_len,
            seed=config.model.seed,
            stream=(slot, number, c),
        )
        for c in range(steps // k)
    ]
    return [batch for chunk in chunks for batch in chunk]


def test_streaming_through_warm_up_equals_the_reference_and_syncs_every_fragment():
    """AdamW warming up over round 1 with F = 4, τ = 5, chunks of 5 and the mean: fragment 0's
    first result covers 5 steps at nearly zero learning rate, its later ones 40 steps at full
    rate. Norms compared as they were refused every later result of fragment 0 ("over 10x the
    median") and it never moved again; per unit of learning rate they are alike."""
    h, rounds = 40, 3
    config = small_config(
        rounds=rounds,
        inner_steps=h,
        chunk_steps=5,
        inner_lr=2e-3,
        warmup_steps=h,
        aggregate="mean",
        workers=2,
        eval_every=rounds,
        streaming_fragments=4,
        overlap_steps=5,
        mix_alpha=0.5,
    )
    workload = build_workload(config, shards=2)
    shepherd = Shepherd(config, workload)

    run_shepherd(shepherd, local_workers(2))
    events = [(e.kind, e.message) for e in shepherd.state.events]
    assert [r.fragment_results for r in shepherd.state.history] == [(2, 2, 2, 2)] * rounds, events
    assert not [e for e in shepherd.state.events if e.kind == "bad_result"]
    inner = inner_optimizer(config)
    tokens = float(h * config.data.batch_size * config.data.seq_len)
    batches = [
        [(chunk_batches(workload, config, slot, number, h), tokens) for slot in range(2)]
        for number in range(1, rounds + 1)
    ]
    expected = reference.streaming_diloco(
        workload.loss_fn,
        workload.params,
        batches,
        inner=optax.chain(
            inner.direction(), optax.scale_by_schedule(lambda t: -inner.schedule()(t))
        ),
        outer=reference.outer_optimizer("nesterov", config.outer.lr, config.outer.momentum),
        fragments=shepherd.engine.fragments,
        overlap=5,
        alpha=0.5,
        merge=config.inner.overlap_merge,
    )
    for name, value in expected.items():
        np.testing.assert_allclose(shepherd.params[name], value, rtol=1e-6, atol=1e-7, err_msg=name)


def test_streaming_run_with_int8_trains_syncs_every_fragment_and_resumes(tmp_path):
    """F = 2, τ = 2, int8 pseudo-gradients, AdamW, centered clip: the loss falls, each round
    syncs both fragments from both workers, a result is about half the model; the checkpoint
    keeps each fragment's outer state and clip history, and a shepherd resumed from round 2's
    checkpoint, given round 3's results, takes exactly the uninterrupted run's round 3 (its
    norm cap from those results, not the checkpoint's: `CenteredClip.restart_inner`; neither
    cap scales a result here)."""
    config = small_config(
        rounds=3,
        inner_steps=8,
        chunk_steps=2,
        inner_lr=3e-3,
        warmup_steps=0,
        workers=2,
        compression="int8Block",
        aggregate="centered-clip",
        streaming_fragments=2,
        overlap_steps=2,
        checkpoint_dir=str(tmp_path),
        checkpoint_every=1,
    )
    workload = build_workload(config, shards=2)
    shepherd = Shepherd(config, workload)
    rounds = [_record_rounds(clip) for clip in shepherd.engine.aggregates]

    run_shepherd(shepherd, local_workers(2))
    history = shepherd.state.history
    assert [r.fragment_results for r in history] == [(2, 2)] * 3
    assert history[-1].eval_loss < history[0].eval_loss < shepherd.evaluate(workload.params)
    assert all(
        r.tokens == 2 * 8 * config.data.batch_size * config.data.seq_len for r in history[1:]
    )
    model_bytes = sum(p.size for p in workload.params.values())  # int8: a byte a parameter
    largest = max(int(np.prod(workload.params[n].shape)) for n in workload.params)
    assert largest < max(r.largest_result_bytes for r in history) < 0.7 * model_bytes

    resumed = Shepherd(config.replace(resume=str(tmp_path), rounds=4), workload)
    saved = shepherd.engine.outer.state_arrays()
    assert saved and set(resumed.engine.outer.state_arrays()) == set(saved)
    for name, value in saved.items():
        np.testing.assert_array_equal(
            resumed.engine.outer.state_arrays()[name], value, err_msg=name
        )
    assert resumed.start_round == 4

    again = Shepherd(config.replace(resume=str(tmp_path / "round-000002")), workload)
    for p, clip in enumerate(again.engine.aggregates):
        third = rounds[p][2]  # what fragment p's aggregate held and got in round 3
        restored = clip.state_arrays()
        assert set(restored) == set(third["before"]) >= {"aggregate.round_distances"}
        assert restored.pop("aggregate.round_norms").size == 0  # the workers start afresh
        for name, value in restored.items():
            np.testing.assert_array_equal(value, third["before"][name], err_msg=f"[{p}]{name}")
        _replay(again, p, third)
    for name, value in shepherd.params.items():
        np.testing.assert_array_equal(again.params[name], value, err_msg=name)


def _record_rounds(clip) -> list[dict]:
    """Record, round by round, what `clip` held at the round's start, was given and returned."""
    rounds: list[dict] = []
    reset, add, finish = clip.reset, clip.add, clip.finish

    def recording_reset():
        before = {n: np.array(v, copy=True) for n, v in clip.state_arrays().items()}
        rounds.append({"before": before, "results": []})
        reset()

    def recording_add(pseudo_gradient, weight, key="", share=1.0):
        copy = {n: np.array(v, np.float32, copy=True) for n, v in pseudo_gradient.items()}
        rounds[-1]["results"].append((copy, weight, key))
        add(pseudo_gradient, weight, key, share)

    def recording_finish():
        scales = finish()
        rounds[-1].update(scales=list(scales), step_scale=clip.step_scale, radius=clip.radius)
        return scales

    clip.reset, clip.add, clip.finish = recording_reset, recording_add, recording_finish
    return rounds


def _replay(shepherd: Shepherd, p: int, recorded: dict) -> None:
    """Fragment p's round from `recorded` results, as `RoundEngine._sync` takes it."""
    engine = shepherd.engine
    clip = engine.aggregates[p]
    clip.step_scale = recorded["step_scale"]
    clip.reset()
    assert math.isfinite(clip.radius)  # clipped from the restored history, not the round's own
    for result, weight, key in recorded["results"]:
        clip.add(result, weight, key)
    assert clip.finish() == recorded["scales"] and clip.radius == recorded["radius"]
    engine._step(p, 3, clip, None, None)  # the outer step; int8: what the workers form


def _decoded(body: protocol.Body, tensors: dict) -> protocol.Message:
    """`body` and `tensors` as a peer's bytes decode them."""
    return protocol.decode(b"".join(bytes(b) for b in protocol.encode(body, tensors)))


def test_shepherd_refuses_fragment_headers_that_are_not_the_fragment():
    shapes = {"a": (2,), "b": (3,)}
    fragments = (("a",), ("b",))
    good = _decoded(protocol.RoundResult(fragment=1), {"b": np.zeros(3, np.float32)})
    specs = [
        protocol.TensorSpec(n, "float32", t.shape, "none", t.nbytes, 0)
        for n, t in good.tensors.items()
    ]
    assert contract.fragment_header_problem(shapes, fragments, good.body, specs) is None
    assert "does not exist" in contract.fragment_header_problem(
        shapes, fragments, protocol.RoundResult(fragment=2), specs
    )
    assert "missing ['a']" in contract.fragment_header_problem(
        shapes, fragments, protocol.RoundResult(fragment=0), specs
    )


async def test_worker_holds_fragment_updates_until_their_merge_and_refuses_strangers():
    from pcp_tui.worker.rounds import FragmentUpdates

    updates = FragmentUpdates((("a",), ("b",)))
    a = np.arange(2, dtype=np.float32)
    with pytest.raises(protocol.MalformedMessage, match="fragment 2"):
        updates.deliver(_decoded(protocol.FragmentUpdate(round=1, fragment=2), {"a": a}))
    with pytest.raises(protocol.MalformedMessage, match="exactly its fragment's tensors"):
        updates.deliver(_decoded(protocol.FragmentUpdate(round=1, fragment=1), {"a": a}))

    async with trio.open_nursery() as nursery:
        taken = []

        async def merge():
            taken.append(await updates.take(1, 0))

        nursery.start_soon(merge)
        await trio.testing.wait_all_tasks_blocked()
        assert not taken  # waits for its update
        updates.deliver(_decoded(protocol.FragmentUpdate(round=1, fragment=0), {"a": a}))
    np.testing.assert_array_equal(taken[0].tensors["a"], a)
    for round_number in range(1, 5):  # nobody takes them: a flood ends the connection
        updates.deliver(_decoded(protocol.FragmentUpdate(round=round_number, fragment=0), {"a": a}))
    with pytest.raises(protocol.MalformedMessage, match="nobody asked for"):
        updates.deliver(_decoded(protocol.FragmentUpdate(round=9, fragment=0), {"a": a}))


@pytest.mark.e2e
def test_streaming_survives_a_lost_worker_and_a_newcomer_starts_from_the_global_parameters(
    spawn_worker,
):
    """A worker killed mid-round is missing only from the fragments it did not send; a worker
    that joins later gets the full parameters (a continued roundStart would be refused) and
    then syncs every fragment each round."""
    config = small_config(
        workers=2,
        rounds=5,
        inner_steps=40,
        chunk_steps=10,
        streaming_fragments=2,
        overlap_steps=10,
        compression="bfloat16",
    )
    shepherd = Shepherd(config, build_workload(config, shards=2))

    async def scenario(port):
        pause_after_round(shepherd, 2)  # held until the newcomer has compiled
        spawn_worker(port, "--id", "steady")
        victim = spawn_worker(port, "--id", "victim")
        workers = shepherd.state.workers
        await until(lambda: "victim" in workers and workers["victim"].round == 2)
        victim.kill()
        await until(lambda: any(e.kind == "lost" for e in shepherd.state.events))
        await until(lambda: shepherd.state.status == "paused" and len(shepherd.state.history) == 2)
        spawn_worker(port, "--id", "late")
        await until(lambda: "late" in workers and workers["late"].state == "idle")
        shepherd.resume()

    run_shepherd(shepherd, scenario)
    history = shepherd.state.history
    assert [r.round for r in history] == [1, 2, 3, 4, 5]
    assert history[0].fragment_results == (2, 2)
    assert history[-1].fragment_results == (2, 2)
    assert set(history[-1].worker_ids) == {"steady", "late"}
    assert not any(e.kind == "bad_result" for e in shepherd.state.events)
    assert all(np.isfinite(p).all() for p in shepherd.params.values())


def test_a_worker_refuses_a_broken_fragment_update_and_the_run_goes_on(monkeypatch):
    """A shepherd that sends a fragment update holding NaN (tampered here, once) hears from the
    worker why it hung up ("fragmentUpdate refused: ..."), and the worker rejoins and finishes."""
    from pcp_tui.shepherd.rounds import engine

    honest = engine._send_update
    tampered = []

    async def send_update(link, update, failed):
        if not tampered:
            body = update.body
            tampered.append(body.fragment)
            update = protocol.encode_once(
                protocol.FragmentUpdate(round=body.round, fragment=body.fragment),
                {name: np.full_like(value, np.nan) for name, value in update.tensors.items()},
            )
        await honest(link, update, failed)

    monkeypatch.setattr(engine, "_send_update", send_update)
    config = small_config(
        rounds=3,
        inner_steps=4,
        chunk_steps=1,
        workers=1,
        eval_every=3,
        streaming_fragments=2,
        overlap_steps=1,
        round_timeout=30,  # a worker that never says why would leave the round waiting
    )
    shepherd = Shepherd(config, build_workload(config, shards=1))
    run_shepherd(shepherd, local_workers(1))
    lost = [e.message for e in shepherd.state.events if e.kind == "lost"]
    assert tampered == [0]
    assert any("fragmentUpdate refused" in m and "NaN" in m for m in lost), lost
    assert [r.round for r in shepherd.state.history][-1] == 3  # the run went on to its end
