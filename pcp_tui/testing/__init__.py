"""Harness for tests and benchmarks that run the real thing: free ports, worker processes, small runs.

What the test suite, the benchmarks and a user's own integration tests would
otherwise each write again (as trio ships `trio.testing`). Everything here
starts real processes and real sockets on 127.0.0.1, or (`SimulatedNetwork`) runs the real
shepherd against protocol-level fake workers over in-memory links on trio's clock; nothing
of the shepherd is mocked.

    with WorkerProcesses() as workers:
        workers.spawn(port, "--id", "w0")
        workers.start(faulty_worker_command(port, "stall", "--id", "w1", round=2, seconds=5))
        ...                              # leftovers are killed on exit

Workers that misbehave on purpose (stall a round, send NaN or a scaled
pseudo-gradient) are `pcp_tui.testing.faulty_worker`; its docstring lists the
faults and their parameters.
"""

from pcp_tui.testing._benchmarks import (
    gpt2_like_shapes,
    link_emulator_command,
    parse_with_smoke,
    run_over_link,
)
from pcp_tui.testing._inprocess import (
    heartbeat_until_hung_up,
    local_worker,
    local_workers,
    memory_link,
    pause_after_round,
    run_shepherd,
    until,
    worker_batches,
)
from pcp_tui.testing._peers import (
    PEER_ERRORS,
    connect_peer,
    join_as,
    peer_hello,
    planned,
    ready_peer,
    round_start,
)
from pcp_tui.testing._processes import (
    ONE_XLA_THREAD,
    QUICK_FLAGS,
    SMALL_RUN,
    OutputProcess,
    ShepherdProcess,
    WorkerProcesses,
    child_pids,
    faulty_worker_command,
    free_port,
    read_metrics,
    round_workers,
    self_signed_certificate,
    shepherd_command,
    small_config,
    worker_command,
    worker_env,
)
from pcp_tui.testing._simulation import (
    CpuByPart,
    SimulatedNetwork,
    fake_worker,
    pseudo_gradient,
    simulate,
    stand_in,
    stand_in_shepherd,
)

__all__ = [
    "PEER_ERRORS",
    "planned",
    "connect_peer",
    "join_as",
    "peer_hello",
    "ready_peer",
    "round_start",
    "heartbeat_until_hung_up",
    "local_worker",
    "local_workers",
    "memory_link",
    "ONE_XLA_THREAD",
    "QUICK_FLAGS",
    "read_metrics",
    "round_workers",
    "self_signed_certificate",
    "SMALL_RUN",
    "OutputProcess",
    "parse_with_smoke",
    "pause_after_round",
    "WorkerProcesses",
    "child_pids",
    "faulty_worker_command",
    "free_port",
    "gpt2_like_shapes",
    "link_emulator_command",
    "run_over_link",
    "run_shepherd",
    "ShepherdProcess",
    "shepherd_command",
    "small_config",
    "until",
    "worker_batches",
    "worker_command",
    "worker_env",
    "SimulatedNetwork",
    "fake_worker",
    "pseudo_gradient",
    "simulate",
    "CpuByPart",
    "stand_in",
    "stand_in_shepherd",
]
