"""A site's messages: process 0 to a follower, over the site's connection vs JAX's store.

A site of several processes (`pcp_tui/worker/site.py`) hands every message of
process 0's session (the plan, round starts with the parameters, fragment
updates) to the other processes. Two real processes on this host join a site
(multi-controller JAX on CPU), then process 0 sends `--messages` random
messages of `--mib` MiB each, timed from the first send until the follower
holds the last:

- `connection`: `Site.send` / `Site.receive`, what a site uses: one TCP
  connection from each follower to process 0;
- `store`: the same bytes through JAX's coordination-service key-value store
  (`key_value_set_bytes` / `blocking_key_value_get_bytes`), the other way JAX
  offers, whose gRPC compresses every value (the baseline).

    python benchmarks/bench_site_messages.py [--mib 256] [--messages 2] [--smoke]

Prints a table (MB/s each way) and `ratio_connection_vs_store=<x>`.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

from pcp_tui.testing import free_port, parse_with_smoke


def process(port: int, process_id: int, mib: int, messages: int) -> None:
    """One process of the site: process 0 sends, process 1 receives and prints the rates."""
    import numpy as np

    from pcp_tui.worker.site import join_site

    site = join_site(f"127.0.0.1:{port}", 2, process_id, heartbeat_seconds=60)
    client = site._client  # the coordination service's client, as join_site got it
    data = np.random.default_rng(0).bytes(mib << 20)
    rates = {}
    for method in ("connection", "store"):
        client.wait_at_barrier(f"bench/{method}", 120_000)
        started = time.perf_counter()
        for index in range(messages):
            if method == "connection" and site.leads:
                site.send(data)
            elif method == "connection":
                assert site.receive() == data, "the follower got other bytes"
            elif site.leads:
                client.key_value_set_bytes(f"bench/{index}", data)
            else:
                assert client.blocking_key_value_get_bytes(f"bench/{index}", 600_000) == data
        client.wait_at_barrier(f"bench/{method}/done", 600_000)
        rates[method] = messages * len(data) / (time.perf_counter() - started) / 1e6
    if site.leads:
        site.end(0, "the benchmark is over")
    else:
        site.receive()  # the end
        site.leave()
        print(f"{'method':<12}{'MB/s':>10}")
        for method, rate in rates.items():
            print(f"{method:<12}{rate:>10.1f}")
        print(f"ratio_connection_vs_store={rates['connection'] / rates['store']:.1f}", flush=True)
    sys.stdout.flush()
    os._exit(0)  # as a site's process does (`launch._run_site_process`)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mib", type=int, default=256, help="MiB a message")
    parser.add_argument("--messages", type=int, default=2)
    parser.add_argument("--process", type=int, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = parse_with_smoke(parser, mib=4, messages=2)
    if args.process is not None:
        process(args.port, args.process, args.mib, args.messages)
        return
    port = free_port()
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1")
    print(f"a site of 2 processes on this host; {args.messages} x {args.mib} MiB", flush=True)
    command = [sys.executable, __file__, "--mib", str(args.mib), "--messages", str(args.messages)]
    command += ["--port", str(port), "--process"]
    leader = subprocess.Popen([*command, "0"], env=env, stderr=subprocess.DEVNULL)
    follower = subprocess.run([*command, "1"], env=env, stderr=subprocess.PIPE, text=True)
    leader.wait(timeout=120)  # a hang guard: the follower has all it sent
    if follower.returncode or leader.returncode:
        raise SystemExit(f"a process of the site failed:\n{follower.stderr[-3000:]}")


if __name__ == "__main__":
    main()
