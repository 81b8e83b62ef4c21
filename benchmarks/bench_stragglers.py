"""What a fast liar costs an honest worker under the straggler window.

The liar is a peer that holds the token and answers every roundStart at once
with a well-formed result of zeros (steps, tokens and compute time within what
the shepherd's claims ledger allows). Beside it trains one real `pcp-tui worker`
slowed by the `pace` fault (every compiled chunk takes at least --pace seconds),
so an honest round takes longer than --straggler-min-seconds. Scenarios:

- ``honest alone``: the baseline, no liar;
- ``+ fast liar``: a plain DiLoCo run;
- ``+ fast liar, streaming``: --streaming-fragments 2 (the liar answers both
  fragments at once).

For each: the honest worker's results counted (fragment results in streaming)
against the baseline's, the rounds the liar closed alone, and the run's seconds.
Before the fifth red-team pass the liar's first answer made the window the
floor, the honest worker's first round was dropped, and the liar alone closed
every later round within milliseconds (docs/faults.md, fifth pass).

    python benchmarks/bench_stragglers.py [--pace 0.3] [--floor 1] [--rounds 6] [--inner-steps 8]
        [--smoke]

(`--smoke` leaves out the plain liar and the undefended staller below: the streaming
liar and the defended staller go through the same code.)

Then the slow-progress staller (issue 25), the `drag` fault of a real worker: each
round it reports "step 1 of H" --drag-first s in and answers zeros --drag-answer s
in (3 and 40 s: the issue's peer). Beside the paced honest worker, at the CLI's
window settings (--straggler-factor 4, --straggler-min-seconds 60): the run's
seconds against the same run with that peer honest (paced alike), undefended
(`--validate off`: its zeros count, and every round waits for them, as before) and
with the defaults (its zeros refused; the rounds after wait for it only the quorum's
pace x 4; it loses its shard after 3 rounds without a counted result).

Ends with `ratio_honest_streaming_liar_vs_alone=<x>` (the liar table's last row's
"vs alone") and `ratio_drag_defended_vs_honest=<x>`.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import trio

from pcp_tui import protocol
from pcp_tui.contract import auth
from pcp_tui.shepherd.coordinator import Shepherd
from pcp_tui.testing import (
    WorkerProcesses,
    faulty_worker_command,
    parse_with_smoke,
    run_shepherd,
    small_config,
    until,
)
from pcp_tui.training.build import build_workload

TOKEN = "test-token"  # the harness's (`faulty_worker_command`, `small_config`)
PEER_ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError, protocol.ProtocolError)


async def fast_liar(port: int, tokens_per_step: int) -> None:
    """Join, say ready, and answer every roundStart at once with zeros (every fragment)."""
    stream = protocol.MessageStream(await trio.open_tcp_stream("127.0.0.1", port))
    nonce = (await stream.receive()).body.nonce
    await stream.send(
        protocol.WorkerHello(
            worker_id="liar",
            proof=auth.proof(TOKEN, nonce, "liar"),
            backend=protocol.BackendInfo(platform=protocol.Platform.CPU),
            supported_versions=protocol.SUPPORTED_VERSIONS,
        )
    )
    await stream.receive()  # welcome
    plan = (await stream.receive()).body
    fragments = [fragment.tensors for fragment in plan.fragments]
    await stream.send(protocol.Ready(compile_seconds=0.1))
    zeros: dict[str, np.ndarray] = {}
    async with stream.stream:
        try:
            while True:
                start = await stream.receive()
                if start.kind == "roundStart":
                    zeros = zeros or {n: np.zeros_like(v) for n, v in start.tensors.items()}
                    await _answer(stream, start.body, zeros, fragments, tokens_per_step)
        except PEER_ERRORS:
            return


async def _answer(stream, start, zeros, fragments, tokens_per_step: int) -> None:
    steps = start.inner_steps // len(fragments)  # plain DiLoCo: one fragment, every tensor
    for p, names in enumerate(fragments):
        body = protocol.RoundResult(
            round=start.round,
            fragment=p,
            tokens=steps * tokens_per_step,
            losses=(3.0,) * steps,
            compute_seconds=0.01,
            inner_steps=steps,
        )
        await stream.send(body, {n: zeros[n] for n in names})


def scenario(args, *, liar: bool, fragments: int) -> dict:
    """One run; what the honest worker got counted, and what the liar closed alone."""
    config = small_config(
        workers=2 if liar else 1,
        rounds=args.rounds,
        inner_steps=args.inner_steps,
        chunk_steps=1,
        streaming_fragments=fragments,
        overlap_steps=1 if fragments > 1 else 0,
        straggler_min_seconds=args.floor,
        straggler_factor=4.0,
    )
    shepherd = Shepherd(config, build_workload(config, shards=2))
    tokens_per_step = config.data.batch_size * config.data.seq_len
    began = time.monotonic()

    async def drive(port):
        with WorkerProcesses() as workers:
            command = faulty_worker_command(port, "pace", "--id", "honest", seconds=args.pace)
            workers.start(command)
            async with trio.open_nursery() as peers:
                if liar:
                    peers.start_soon(fast_liar, port, tokens_per_step)
                await until(lambda: shepherd.state.status == "done", polls=20 * 600)
                peers.cancel_scope.cancel()

    run_shepherd(shepherd, drive)
    history = shepherd.state.history
    return {
        "honest": sum("honest" in r.worker_ids for r in history),
        "liar alone": sum(r.worker_ids == ("liar",) for r in history),
        "rounds": len(history),
        "seconds": time.monotonic() - began,
        "stragglers": sum(e.kind == "stragglers" for e in shepherd.state.events),
    }


def drag_scenario(args, *, peer: str, validate: str = "loss-delta") -> dict:
    """The paced honest worker and a second id, `peer` ("honest": paced alike; "drag": the
    staller), at the CLI's straggler settings; the run's seconds and whom its rounds counted."""
    config = small_config(
        workers=2,
        rounds=args.rounds,
        inner_steps=args.inner_steps,
        chunk_steps=1,
        validate=validate,
    )
    shepherd = Shepherd(config, build_workload(config, shards=2))
    began = time.monotonic()

    async def drive(port):
        with WorkerProcesses() as workers:
            for worker_id in ("honest", "other"):
                if worker_id == "other" and peer == "drag":
                    first, answer = args.drag_first, args.drag_answer
                    command = faulty_worker_command(
                        port, "drag", "--id", worker_id, first=first, answer=answer
                    )
                else:
                    command = faulty_worker_command(
                        port, "pace", "--id", worker_id, seconds=args.pace
                    )
                workers.start(command)
            await until(lambda: shepherd.state.status == "done", polls=20 * 1200)

    run_shepherd(shepherd, drive)
    history = shepherd.state.history
    lost = [e for e in shepherd.state.events if e.kind == "lost"]
    return {
        "seconds": time.monotonic() - began,
        "other counted": sum("other" in r.worker_ids for r in history),
        "rounds": len(history),
        "lost": len(lost),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--pace", type=float, default=0.3, help="least seconds a chunk takes")
    parser.add_argument("--floor", type=float, default=1.0, help="--straggler-min-seconds")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--inner-steps", type=int, default=8, help="H (chunks of one step)")
    parser.add_argument("--drag-first", type=float, default=3.0, help="its progress, s in")
    parser.add_argument("--drag-answer", type=float, default=40.0, help="its zeros, s in")
    args = parse_with_smoke(
        parser, pace=0.1, floor=0.3, rounds=2, inner_steps=4, drag_first=0.3, drag_answer=1.0
    )
    liars = [
        ("honest alone", dict(liar=False, fragments=1)),
        ("+ fast liar", dict(liar=True, fragments=1)),
        ("+ fast liar, streaming", dict(liar=True, fragments=2)),
    ]
    if args.smoke:  # the streaming liar goes through the same code
        del liars[1]
    rows = [(name, scenario(args, **options)) for name, options in liars]
    baseline = rows[0][1]["honest"]
    print(
        f"pace {args.pace} s a chunk x H {args.inner_steps}, --straggler-min-seconds "
        f"{args.floor}, {args.rounds} rounds"
    )
    print(
        "| scenario | rounds with an honest result | vs alone | liar-only rounds | stragglers | s |"
    )
    print("| --- | ---: | ---: | ---: | ---: | ---: |")
    for name, row in rows:
        print(
            f"| {name} | {row['honest']}/{row['rounds']} | {row['honest'] / baseline:.2f} | "
            f"{row['liar alone']} | {row['stragglers']} | {row['seconds']:.1f} |"
        )
    print(f"ratio_honest_streaming_liar_vs_alone={rows[-1][1]['honest'] / baseline:.2f}")
    staller = [
        ("that peer honest", dict(peer="honest")),
        ("drag, --validate off (undefended)", dict(peer="drag", validate="off")),
        ("drag, defaults", dict(peer="drag")),
    ]
    if args.smoke:  # the defended staller goes through the same code
        del staller[1]
    drags = [(name, drag_scenario(args, **options)) for name, options in staller]
    honest = drags[0][1]["seconds"]
    print(
        f"\nslow-progress staller: step 1 of H at {args.drag_first:g} s, zeros at "
        f"{args.drag_answer:g} s; --straggler-factor 4, --straggler-min-seconds 60"
    )
    print("| beside the paced worker | run s | vs honest | its results counted | lost |")
    print("| --- | ---: | ---: | ---: | ---: |")
    for name, row in drags:
        print(
            f"| {name} | {row['seconds']:.1f} | {row['seconds'] / honest:.2f} | "
            f"{row['other counted']}/{row['rounds']} | {row['lost']} |"
        )
    print(f"ratio_drag_defended_vs_honest={drags[-1][1]['seconds'] / honest:.2f}")


if __name__ == "__main__":
    main()
