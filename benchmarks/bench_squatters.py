"""How long squatters keep honest workers out: a `--workers 2` run with and without them.

A real `pcp-tui shepherd` process (the tiny model, one round of 2 inner steps) and two
real `pcp-tui worker` processes on 127.0.0.1. In the squatted run, SQUATTERS token
holders join first, read the plan, heartbeat and never say ready, and join again at
once whenever they are put out or refused (the worst for the honest workers: they
hold every connection slot, and race for every one that frees). Measured from
starting the honest workers: until both are admitted (the delay squatting causes:
without squatters, the workers' start-up alone), and until the run's end (their
compile and the round too, which vary with the machine's load). docs/security.md
has a run.

With --ready the squatters say ready at once (nothing compiled), read every roundStart
and never answer one (`shepherd/serving/slots.py`: a ready connection sent a round that
shows nothing gives its slot up after the grace); --rounds and --ready-timeout are the
shepherd's (default: 1 round, the CLI's --ready-timeout). With --fresh-ids a squatter
that is put out joins again under a new worker id, so nothing kept by id can tell it.

    python benchmarks/bench_squatters.py [--squatters 4] [--limit 300] [--ready]
        [--fresh-ids] [--rounds 1] [--ready-timeout S]
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import subprocess
import sys
import threading
import time

import trio

from pcp_tui import protocol
from pcp_tui.contract import auth
from pcp_tui.testing import parse_with_smoke

TOKEN = "bench-token"
SHEPHERD = [
    *("--workers", "2", "--inner-steps", "2", "--chunk-steps", "2"),
    *("--seq-len", "32", "--batch-size", "4", "--data-max-bytes", "262144"),
    *("--eval-batches", "2", "--heartbeat-seconds", "0.5", "--host", "127.0.0.1"),
    *("--port", "0", "--headless", "--token", TOKEN),
]
PEER_ERRORS = (trio.BrokenResourceError, trio.ClosedResourceError, protocol.ProtocolError, OSError)


async def squat(
    port: int, name: str, counts: dict, ready: bool = False, fresh: bool = False
) -> None:
    """Join, take the plan, heartbeat, never say ready (`ready`: say it at once, and never
    answer a round); join again whenever put out (`fresh`: under a new worker id each time)."""
    for attempt in itertools.count():
        worker_id = f"{name}-{attempt}" if fresh else name
        try:
            stream = protocol.MessageStream(await trio.open_tcp_stream("127.0.0.1", port))
            async with stream.stream:
                nonce = (await stream.receive()).body.nonce
                proof = auth.proof(TOKEN, nonce, worker_id)
                await stream.send(
                    protocol.WorkerHello(
                        supported_versions=(2, 3), worker_id=worker_id, proof=proof
                    )
                )
                if (await stream.receive()).kind == "welcome":
                    await stream.receive()  # the plan
                    if ready:
                        await stream.send(protocol.Ready(compile_seconds=0.0))
                    counts["welcomed"] = counts.get("welcomed", 0) + 1
                    while True:
                        await stream.send(protocol.Heartbeat(time.time()))
                        with trio.move_on_after(0.2):
                            await stream.receive()
        except PEER_ERRORS:
            pass
        await trio.sleep(0.05)


def run(squatters: int, args: argparse.Namespace) -> tuple[float | None, float | None]:
    """Seconds from starting the honest workers to both being admitted, and to the run's end;
    None past `args.limit`."""
    limit = args.limit
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    flags = [*SHEPHERD, "--rounds", str(args.rounds)]
    if args.ready_timeout is not None:
        flags += ["--ready-timeout", str(args.ready_timeout)]
    shepherd = subprocess.Popen(
        [sys.executable, "-m", "pcp_tui", "shepherd", *flags],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env=env,
    )
    workers: list[subprocess.Popen] = []
    try:
        for line in shepherd.stdout:
            if found := re.search(r"listening on 127\.0\.0\.1:(\d+)", line):
                port = int(found.group(1))
                break

        joined: dict[str, float] = {}

        def read_joins() -> None:
            for line in shepherd.stdout:
                if found := re.search(r"\((honest-\d),[^)]*\) (re)?joined", line):
                    joined.setdefault(found.group(1), time.monotonic())

        async def main() -> tuple[float | None, float | None]:
            counts: dict = {}
            async with trio.open_nursery() as nursery:
                for index in range(squatters):
                    nursery.start_soon(
                        squat, port, f"squatter-{index}", counts, args.ready, args.fresh_ids
                    )
                while counts.get("welcomed", 0) < squatters:
                    await trio.sleep(0.1)
                started = time.monotonic()
                for index in range(2):
                    command = [sys.executable, "-m", "pcp_tui", "worker"]
                    command += ["--connect", f"127.0.0.1:{port}", "--token", TOKEN]
                    command += ["--backend", "cpu", "--id", f"honest-{index}"]
                    workers.append(
                        subprocess.Popen(
                            command, stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT, env=env
                        )
                    )
                ended = None
                with trio.move_on_after(limit):
                    while shepherd.poll() is None:
                        await trio.sleep(0.2)
                    ended = time.monotonic() - started
                nursery.cancel_scope.cancel()
            admitted = max(joined.values()) - started if len(joined) == 2 else None
            return admitted, ended

        reader = threading.Thread(target=read_joins, daemon=True)
        reader.start()
        return trio.run(main)
    finally:
        for process in [shepherd, *workers]:
            if process.poll() is None:
                process.kill()
            process.wait()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--squatters", type=int, default=4)
    parser.add_argument("--limit", type=float, default=300.0, help="seconds to give up after")
    parser.add_argument("--ready", action="store_true", help="squatters say ready at once")
    parser.add_argument(
        "--fresh-ids", action="store_true", help="squatters join again under a new id each time"
    )
    parser.add_argument("--rounds", type=int, default=1, help="the shepherd's --rounds")
    parser.add_argument("--ready-timeout", type=float, default=None, help="the shepherd's")
    args = parse_with_smoke(parser, squatters=1, limit=120.0)
    show = lambda t: f"{t:.1f} s" if t is not None else f"> {args.limit:g} s"  # noqa: E731
    print("squatters  both honest workers admitted  run ended")
    admitted_after = {}
    for squatters in (0, args.squatters):
        admitted, ended = run(squatters, args)
        admitted_after[squatters] = admitted if admitted is not None else args.limit
        print(f"{squatters:>9}  {show(admitted):>28}  {show(ended):>9}", flush=True)
    ratio = admitted_after[args.squatters] / max(admitted_after[0], 1e-9)
    print(f"ratio_admitted_squatted_vs_clean={ratio:.3g}")


if __name__ == "__main__":
    main()
