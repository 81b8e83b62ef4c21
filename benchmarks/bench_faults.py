"""What each fault costs a run: time to notice it, rounds lost, loss against no fault.

Real `pcp-tui worker` processes on 127.0.0.1, the tiny model, the same seed and
the same three data shards in every scenario:

- ``uninterrupted``: three workers, no fault; the reference for the loss. It
  runs twice: the second run shows the noise floor (results are averaged in
  arrival order, so float sums differ in the last bits).
- ``kill -9 worker``: one of three workers is SIGKILLed mid-round 2.
- ``worker silenced``: one of three is SIGSTOPped mid-round 2; only the
  heartbeat watchdog (--heartbeat-timeout) can find it. SIGCONT once it is
  marked lost: it reconnects by itself and trains again from a later round.
- ``late join``: two workers start; the run is held at the round-2 boundary
  while a third starts, joins and compiles, so it trains from round 3.
- ``straggler``: one of three stalls round 2 (`pcp_tui.testing.faulty_worker`) past
  --round-timeout; the round closes without it and its late result is dropped.
- ``hung``: one of three stalls round 2 for an hour, heartbeats going, and no
  --round-timeout: the straggler window (on by default; --straggler-min-seconds
  set low here) closes round 2 without it, and it sits out every later round.
- ``shepherd kill -9``: the shepherd process (checkpoint every 2 rounds) is
  SIGKILLed mid-round 4 and started again with --resume; the workers find it by
  themselves.

Workers start one after another, so w0, w1, w2 always get indices (data shards
and sample streams) 0, 1, 2 and every fault hits the same shard. Every time
comes from the shepherd's own events (`RunState.events` when it runs in this
process, its --metrics JSON Lines for the restart scenario), against
time.time() taken right after the signal was sent. docs/faults.md has a run.

    python benchmarks/bench_faults.py [--rounds 8] [--only kill silenced] [--json out.json] [--smoke]

Ends with `ratio_eval_last_vs_uninterrupted=<x>`: the last scenario's final eval
loss over the uninterrupted run's.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path

import trio

from pcp_tui.config import RunConfig
from pcp_tui.shepherd.coordinator import Shepherd
from pcp_tui.testing import faulty_worker_command, free_port, parse_with_smoke, worker_command
from pcp_tui.training.build import build_workload

REPO = Path(__file__).resolve().parents[1]
SHARDS = 3  # every scenario cuts the corpus the same way, whatever its worker count
TOKEN = "bench-faults"
ENV = dict(
    os.environ,
    PYTHONUNBUFFERED="1",
    XLA_FLAGS="--xla_cpu_multi_thread_eigen=false intra_op_parallelism_threads=1",
)


@dataclass
class Outcome:
    fault: str
    notice: str  # the table's "seconds to notice" cell
    rounds: str  # the table's "rounds lost / repeated" cell
    final_eval_loss: float
    round_numbers: list[int]
    workers_per_round: list[int]
    eval_losses: list[float | None]
    round_seconds: list[float]
    notes: list[str] = field(default_factory=list)
    measured: dict[str, float | None] = field(default_factory=dict)


class Processes:
    """The processes one scenario starts; whatever is still running at the end is killed."""

    def __init__(self, logs: Path):
        self.logs = logs
        self.started: list[subprocess.Popen] = []
        self.killed: set[int] = set()  # pids this benchmark SIGKILLed on purpose
        self._files: list = []

    def start(self, name: str, command: list[str]) -> subprocess.Popen:
        log = open(self.logs / f"{name}.log", "a")  # noqa: SIM115 - closed in finish()
        process = subprocess.Popen(command, cwd=REPO, env=ENV, stdout=log, stderr=log)
        self.started.append(process)
        self._files.append(log)
        return process

    def worker(self, port: int, worker_id: str, stall: tuple[int, float] | None = None):
        """Start `worker_id`; with `stall` (round, seconds), one that stalls that round."""
        if stall is None:
            command = worker_command(port, "--id", worker_id, "--quiet", token=TOKEN)
        else:
            round_number, seconds = stall
            command = faulty_worker_command(
                port,
                "stall",
                "--id",
                worker_id,
                "--quiet",
                token=TOKEN,
                round=round_number,
                seconds=seconds,
            )
        return self.start(worker_id, command)

    def kill(self, process: subprocess.Popen) -> float:
        """SIGKILL on purpose; returns the wall-clock time right after the signal."""
        self.killed.add(process.pid)
        process.kill()
        return time.time()

    def finish(self, timeout: float = 20) -> list[str]:
        """After the run: wait for every process, kill what is left; say which ended badly."""
        problems = []
        for process, log in zip(self.started, self._files, strict=True):
            if process.poll() is None:
                process.send_signal(signal.SIGCONT)  # a stopped worker cannot even die of SIGTERM
            try:
                process.wait(timeout=timeout)
            except subprocess.TimeoutExpired:  # a worker that missed the goodbye retries forever
                problems.append(f"{Path(log.name).stem} still retrying {timeout:g} s after the end")
                self.kill(process)
                process.wait()
            log.close()
            if process.returncode != 0 and process.pid not in self.killed:
                problems.append(
                    f"{Path(log.name).stem} exited with {process.returncode}: {_why(log.name)}"
                )
        return problems


def _why(log: str) -> str:
    """The last error line of a process log."""
    lines = [line.strip(" |+") for line in Path(log).read_text().splitlines()]
    errors = [line for line in lines if "Error" in line or "error" in line]
    return (errors or lines or ["(empty log)"])[-1][:200]


def base_config(args: argparse.Namespace) -> RunConfig:
    return RunConfig(
        model="tiny",
        seq_len=32,
        batch_size=4,
        data_max_bytes=256 * 1024,
        eval_batches=4,
        rounds=args.rounds,
        inner_steps=args.inner_steps,
        chunk_steps=5,
        warmup_steps=10,
        inner_lr=2e-3,
        workers=3,
        host="127.0.0.1",
        port=0,
        token=TOKEN,
        heartbeat_seconds=0.5,
        heartbeat_timeout=30.0,
        seed=0,
        # platforms: the default, as `pcp-tui shepherd` (restart scenario) has no flag for it
    )


# -- helpers over the shepherd's record -------------------------------------------


async def _until(predicate: Callable[[], object], what: str, timeout: float = 300) -> None:
    with trio.move_on_after(timeout):
        while not predicate():
            await trio.sleep(0.02)
        return
    raise RuntimeError(f"gave up after {timeout:.0f} s waiting for {what}")


def _events(shepherd: Shepherd, kind: str, worker: str | None = None) -> list:
    return [
        e
        for e in shepherd.state.events
        if e.kind == kind and (worker is None or e.fields().get("worker") == worker)
    ]


async def _mid_round(shepherd: Shepherd, worker_id: str, number: int) -> None:
    """Until `worker_id` reported progress inside round `number` (at least one chunk done)."""
    views = shepherd.state.workers
    await _until(
        lambda: (
            worker_id in views
            and views[worker_id].round == number
            and views[worker_id].state == "training"
            and views[worker_id].step > 0
        ),
        f"{worker_id} to be in round {number}",
    )


async def _start_in_order(shepherd, processes, port, ids, stall=None) -> list:
    """Start workers one by one, each once the last has joined (so `ids[i]` gets index i);
    `stall` (round, seconds) makes the last one a straggler."""
    started = []
    for worker_id in ids:
        last = worker_id == ids[-1]
        started.append(processes.worker(port, worker_id, stall if last else None))
        joined = lambda w=worker_id: _events(shepherd, "joined", w)  # noqa: E731
        await _until(joined, f"{worker_id} to join")
    return started


def _round_starts(shepherd: Shepherd) -> dict[int, float]:
    """Wall-clock start of every recorded round (record time minus its duration)."""
    return {e.record.round: e.at - e.record.round_seconds for e in _events(shepherd, "round")}


def _rounds_cell(numbers: list[int], total: int, repeated: int, redone: int = 0) -> str:
    lost = len(set(range(1, total + 1)) - set(numbers))
    twice = len(numbers) - len(set(numbers))
    cell = f"{lost} lost / {repeated} repeated"
    if redone:
        cell += f" / {redone} redone"
    return cell + (f" / {twice} recorded twice" if twice else "")


def _outcome(fault: str, shepherd: Shepherd, notice: str, measured: dict) -> Outcome:
    history = shepherd.state.history
    problems = measured.pop("problems", [])
    return Outcome(
        fault=fault,
        notice=notice,
        rounds=_rounds_cell(
            [r.round for r in history],
            shepherd.config.outer.rounds,
            len(_events(shepherd, "round_repeated")),
        ),
        final_eval_loss=history[-1].eval_loss,
        round_numbers=[r.round for r in history],
        workers_per_round=[r.workers for r in history],
        eval_losses=[r.eval_loss for r in history],
        round_seconds=[r.round_seconds for r in history],
        notes=list(problems),
        measured=measured,
    )


def run_in_process(
    config: RunConfig,
    processes: Processes,
    scenario: Callable[[Shepherd, int], Awaitable[dict]],
    timeout: float,
) -> tuple[Shepherd, dict]:
    """A shepherd in this process; `scenario(shepherd, port)` starts workers and faults."""
    shepherd = Shepherd(config, build_workload(config, shards=SHARDS))
    found: dict = {}

    async def main() -> None:
        with trio.fail_after(timeout):
            async with trio.open_nursery() as nursery:
                port = await nursery.start(shepherd.run)
                found.update(await scenario(shepherd, port))
                await _until(lambda: shepherd.state.status in ("done", "stopped"), "the run to end")

    try:
        trio.run(main)
    finally:
        found["problems"] = processes.finish()
    return shepherd, found


# -- the scenarios -----------------------------------------------------------------


def uninterrupted(config, processes, timeout, label="uninterrupted, 3 workers") -> Outcome:
    async def scenario(shepherd, port):
        await _start_in_order(shepherd, processes, port, ["w0", "w1", "w2"])
        return {}

    shepherd, _ = run_in_process(config, processes, scenario, timeout)
    return _outcome(label, shepherd, "—", {})


def kill_worker(config, processes, timeout) -> Outcome:
    async def scenario(shepherd, port):
        victim = (await _start_in_order(shepherd, processes, port, ["w0", "w1", "w2"]))[2]
        await _mid_round(shepherd, "w2", 2)
        killed = processes.kill(victim)
        await _until(lambda: _events(shepherd, "lost", "w2"), "the shepherd to see the loss")
        return {"notice": _events(shepherd, "lost", "w2")[0].at - killed}

    shepherd, found = run_in_process(config, processes, scenario, timeout)
    notice = f"{found['notice']:.2f} (kill → lost)"
    return _outcome("kill -9 of 1 of 3 workers, mid-round 2", shepherd, notice, found)


def silenced_worker(config, processes, timeout) -> Outcome:
    async def scenario(shepherd, port):
        victim = (await _start_in_order(shepherd, processes, port, ["w0", "w1", "w2"]))[2]
        await _mid_round(shepherd, "w2", 2)
        victim.send_signal(signal.SIGSTOP)
        stopped, quiet = time.time(), time.monotonic() - shepherd.state.workers["w2"].last_heard
        await _until(lambda: _events(shepherd, "lost", "w2"), "the watchdog", timeout=120)
        lost = _events(shepherd, "lost", "w2")[0]
        victim.send_signal(signal.SIGCONT)
        resumed = time.time()
        back = lambda: _events(shepherd, "rejoined", "w2")  # noqa: E731
        await _until(lambda: back() or shepherd.state.status == "done", "w2 to rejoin")
        return {
            "notice": lost.at - stopped,
            "silent_before_stop": quiet,
            "rejoin_after_sigcont": back()[0].at - resumed if back() else None,
        }

    shepherd, found = run_in_process(config, processes, scenario, timeout)
    limit = config.network.heartbeat_timeout
    outcome = _outcome(
        "worker SIGSTOPped mid-round 2, SIGCONT after it is lost",
        shepherd,
        f"{found['notice']:.2f} (--heartbeat-timeout {limit:g})",
        found,
    )
    rejoin = found["rejoin_after_sigcont"]
    outcome.notes.append(
        f"last message from it {found['silent_before_stop']:.2f} s before the stop; SIGCONT → "
        + (f"rejoined in {rejoin:.2f} s" if rejoin is not None else "not back before the run ended")
    )
    return outcome


def late_join(config, processes, timeout) -> Outcome:
    async def scenario(shepherd, port):
        def hold_after_round_2(event) -> None:  # called inside the round's record, before round 3
            if event.kind == "round" and event.record.round == 2:
                shepherd.pause()

        shepherd.state.subscribe(hold_after_round_2)
        await _start_in_order(shepherd, processes, port, ["w0", "w1"])
        await _until(lambda: _events(shepherd, "paused"), "round 2")
        processes.worker(port, "w2")
        started = time.time()
        await _until(lambda: _events(shepherd, "compiled", "w2"), "w2 to compile")
        shepherd.resume()
        return {
            "join": _events(shepherd, "joined", "w2")[0].at - started,
            "ready": _events(shepherd, "compiled", "w2")[0].at - started,
        }

    shepherd, found = run_in_process(config.replace(workers=2), processes, scenario, timeout)
    first = next((r.round for r in shepherd.state.history if "w2" in r.worker_ids), None)
    notice = f"{found['join']:.2f} to join, {found['ready']:.2f} to compile (start → event)"
    outcome = _outcome("late join of a 3rd worker after round 2", shepherd, notice, found)
    outcome.notes.append(
        f"the run was held (pause) at the round-2 boundary until it had compiled; "
        f"it trained from round {first}"
    )
    return outcome


def straggler(config, processes, timeout, stall: float) -> Outcome:
    async def scenario(shepherd, port):
        await _start_in_order(shepherd, processes, port, ["w0", "w1", "w2"], stall=(2, stall))
        # w2 sits the rounds after out until its late result comes: a short run may end first
        done = lambda: shepherd.state.status in ("done", "stopped")  # noqa: E731
        await _until(lambda: _events(shepherd, "late_result", "w2") or done(), "the late result")
        closed = _events(shepherd, "stragglers")[0]
        return {"notice": closed.at - _round_starts(shepherd)[2]}

    shepherd, found = run_in_process(config, processes, scenario, timeout)
    late = [e.round for e in _events(shepherd, "late_result")]
    notice = f"{found['notice']:.2f} (round start → closed; --round-timeout {config.network.round_timeout:g})"
    outcome = _outcome(f"straggler: round 2 stalled {stall:g} s", shepherd, notice, found)
    outcome.rounds += (
        f"; late result of round {', '.join(map(str, late))} dropped"
        if late
        else "; the run ended before the late result"
    )
    return outcome


def hung(config, processes, timeout) -> Outcome:
    async def scenario(shepherd, port):
        await _start_in_order(shepherd, processes, port, ["w0", "w1", "w2"], stall=(2, 3600))
        await _until(lambda: len(shepherd.state.history) >= 2, "round 2's close")
        closed = _events(shepherd, "stragglers")[0]
        return {"notice": closed.at - _round_starts(shepherd)[2]}

    shepherd, found = run_in_process(config, processes, scenario, timeout)
    network = config.network
    notice = (
        f"{found['notice']:.2f} (round start → closed; --straggler-factor "
        f"{network.straggler_factor:g}, --straggler-min-seconds {network.straggler_min_seconds:g})"
    )
    return _outcome("hung: round 2 stalled for ever, heartbeats on", shepherd, notice, found)


# -- the shepherd restart: a shepherd process, read through its metrics file -------


def shepherd_command(config: RunConfig) -> list[str]:
    """`pcp-tui shepherd --headless` with every option that differs from the defaults."""
    default, flags = RunConfig().flat(), []
    for name, value in config.flat().items():
        if name != "platforms" and value is not None and value != default[name]:
            flags += [f"--{name.replace('_', '-')}", str(value)]
    return [sys.executable, "-m", "pcp_tui", "shepherd", "--headless", *flags]


def _rows(path: Path) -> list[dict]:
    if not path.exists():
        return []
    rows = []
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:  # a line being written
            break
    return rows


def _wait_for_row(path: Path, predicate: Callable[[dict], bool], timeout: float = 300) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        row = next((r for r in _rows(path) if predicate(r)), None)
        if row is not None:
            return row
        time.sleep(0.02)
    raise RuntimeError(f"gave up after {timeout:.0f} s reading {path}")


def shepherd_restart(config, processes, timeout, workdir: Path) -> Outcome:
    metrics, checkpoints = workdir / "restart.jsonl", workdir / "checkpoints"
    config = config.replace(
        port=free_port(), metrics=str(metrics), checkpoint_dir=str(checkpoints), checkpoint_every=2
    )
    first = processes.start("shepherd-1", shepherd_command(config))
    _wait_for_row(metrics, lambda r: r["event"] == "listening")
    workers = []
    for worker_id in ("w0", "w1", "w2"):  # one by one: w0, w1, w2 get indices 0, 1, 2
        workers.append(processes.worker(config.network.port, worker_id))
        _wait_for_row(metrics, lambda r, w=worker_id: r["event"] == "joined" and r["worker"] == w)
    three = _wait_for_row(metrics, lambda r: r["event"] == "round" and r["round"] == 3)
    time.sleep(max(0.0, three["time"] + 0.5 * three["round_seconds"] - time.time()))  # mid-round 4
    processes.kill(first)
    first.wait()
    restarted = time.time()
    second = processes.start(
        "shepherd-2", shepherd_command(config.replace(resume=str(checkpoints)))
    )
    _wait_unless_orphaned(second, workers, processes, timeout)
    problems = processes.finish()
    if second.returncode != 0 and not problems:
        raise RuntimeError(f"the resumed shepherd exited with {second.returncode}; see {workdir}")
    outcome = _restart_outcome(config, _rows(metrics), restarted)
    if second.returncode != 0:
        outcome.rounds = "run did not finish: every worker died after the restart"
    outcome.notes += problems
    return outcome


def _wait_unless_orphaned(shepherd, workers, processes: Processes, timeout: float) -> None:
    """Wait for the shepherd; kill it once every worker is gone (it would wait forever)."""
    deadline = time.time() + timeout
    while shepherd.poll() is None and time.time() < deadline:
        if all(worker.poll() is not None for worker in workers):
            time.sleep(5)  # time to finish on its own, if the workers ended normally
            if shepherd.poll() is None:
                processes.kill(shepherd)
        time.sleep(0.1)


def _restart_outcome(config: RunConfig, rows: list[dict], restarted: float) -> Outcome:
    cut = next(i for i, r in enumerate(rows) if r["event"] == "resumed_from")
    before, after = rows[:cut], rows[cut:]
    saved = rows[cut]["round"]
    done_before = [r for r in before if r["event"] == "round"]
    redone = [r["round"] for r in done_before if r["round"] > saved]
    resumed = [r for r in after if r["event"] == "round"]
    rounds = [r for r in done_before if r["round"] <= saved] + resumed
    listening = next(r for r in after if r["event"] == "listening")["time"] - restarted
    joined = [r["time"] - restarted for r in after if r["event"] in ("joined", "rejoined")]
    training = resumed[0]["time"] - resumed[0]["round_seconds"] - restarted if resumed else None
    numbers = [r["round"] for r in rounds]
    outcome = Outcome(
        fault=f"shepherd kill -9 mid-round {saved + len(redone) + 1}, restart with --resume",
        notice="—" if training is None else f"{training:.2f} (restart → next round starts)",
        rounds=_rounds_cell(
            numbers,
            config.outer.rounds,
            sum(r["event"] == "round_repeated" for r in rows),
            redone=len(redone),
        ),
        final_eval_loss=rounds[-1]["eval_loss"] if resumed else float("nan"),
        round_numbers=numbers,
        workers_per_round=[r["workers"] for r in rounds],
        eval_losses=[r["eval_loss"] for r in rounds],
        round_seconds=[r["round_seconds"] for r in rounds],
        measured={"restart_to_training": training, "restart_to_listening": listening},
    )
    outcome.notes.append(
        f"checkpoint of round {saved}; rounds {redone} redone; restart → listening "
        f"{listening:.2f} s, → workers back {', '.join(f'{t:.2f}' for t in sorted(joined))} s"
    )
    evals = {r["round"]: r["eval_loss"] for r in done_before}
    for number in redone:
        again = next((f"{r['eval_loss']:.4f}" for r in resumed if r["round"] == number), "-")
        outcome.notes.append(
            f"round {number} eval loss: {evals[number]:.4f} before the kill, {again} when redone"
        )
    return outcome


# -- the report ----------------------------------------------------------------------


def _failed(name: str, exc: BaseException) -> Outcome:
    while isinstance(exc, ExceptionGroup):
        exc = exc.exceptions[0]
    reason = f"failed: {exc}"
    return Outcome(name, "—", reason, float("nan"), [], [], [], [])


def table(outcomes: list[Outcome]) -> str:
    reference = outcomes[0].final_eval_loss
    lines = [
        "| fault | seconds to notice | rounds lost / repeated | final eval loss | vs uninterrupted |",
        "| --- | --- | --- | ---: | ---: |",
    ]
    for o in outcomes:
        delta = o.final_eval_loss - reference
        versus = "—" if o is outcomes[0] else f"{delta:+.4f} ({100 * delta / reference:+.2f}%)"
        lines.append(
            f"| {o.fault} | {o.notice} | {o.rounds} | {o.final_eval_loss:.4f} | {versus} |"
        )
    return "\n".join(lines)


def details(outcomes: list[Outcome]) -> str:
    lines = []
    for o in outcomes:
        workers = ",".join(map(str, o.workers_per_round))
        evals = ", ".join("-" if e is None else f"{e:.4f}" for e in o.eval_losses)
        seconds = ", ".join(f"{t:.1f}" for t in o.round_seconds)
        lines.append(
            f"- {o.fault}: rounds {o.round_numbers}; workers per round {workers}; "
            f"round seconds {seconds}; eval loss per round {evals}"
        )
        lines += [f"  - {note}" for note in o.notes]
    return "\n".join(lines)


SCENARIOS = ("again", "kill", "silenced", "late", "straggler", "hung", "restart")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--inner-steps", type=int, default=30)
    parser.add_argument("--heartbeat-timeout", type=float, default=5.0, help="for 'silenced'")
    parser.add_argument("--round-timeout", type=float, default=8.0, help="for 'straggler'")
    parser.add_argument("--stall", type=float, default=12.0, help="seconds the straggler stalls")
    parser.add_argument(
        "--straggler-min-seconds", type=float, default=5.0, help="for 'hung' (the default is 60)"
    )
    parser.add_argument("--only", nargs="*", choices=SCENARIOS, default=list(SCENARIOS))
    parser.add_argument("--timeout", type=float, default=600, help="seconds per scenario")
    parser.add_argument("--json", type=Path, help="also write the outcomes here")
    args = parse_with_smoke(parser, rounds=3, inner_steps=10, only=["kill"])
    config = base_config(args)
    workdir = Path(tempfile.mkdtemp(prefix="bench-faults-"))
    print(f"logs and metrics in {workdir}", flush=True)
    runs: list[tuple[str, Callable[[Processes], Outcome]]] = [
        ("uninterrupted", lambda p: uninterrupted(config, p, args.timeout)),
        ("again", lambda p: uninterrupted(config, p, args.timeout, "uninterrupted again")),
        ("kill", lambda p: kill_worker(config, p, args.timeout)),
        (
            "silenced",
            lambda p: silenced_worker(
                config.replace(heartbeat_timeout=args.heartbeat_timeout), p, args.timeout
            ),
        ),
        ("late", lambda p: late_join(config, p, args.timeout)),
        (
            "straggler",
            lambda p: straggler(
                config.replace(round_timeout=args.round_timeout, min_workers=1),
                p,
                args.timeout,
                args.stall,
            ),
        ),
        (
            "hung",
            lambda p: hung(
                config.replace(straggler_min_seconds=args.straggler_min_seconds), p, args.timeout
            ),
        ),
        ("restart", lambda p: shepherd_restart(config, p, args.timeout, workdir)),
    ]
    outcomes, started = [], time.perf_counter()
    for name, run in runs:
        if name != "uninterrupted" and name not in args.only:
            continue
        logs = workdir / name
        logs.mkdir()
        began = time.perf_counter()
        try:
            outcomes.append(run(Processes(logs)))
        except (RuntimeError, trio.TooSlowError, subprocess.SubprocessError, ExceptionGroup) as exc:
            print(f"{name}: failed ({exc!r}); logs in {logs}", flush=True)
            outcomes.append(_failed(name, exc))
        print(f"{name}: {time.perf_counter() - began:.0f} s", flush=True)
    print(f"all scenarios: {time.perf_counter() - started:.0f} s\n")
    print(table(outcomes) + "\n\n" + details(outcomes))
    ratio = outcomes[-1].final_eval_loss / outcomes[0].final_eval_loss
    print(f"ratio_eval_last_vs_uninterrupted={ratio:.4f}")
    if args.json:
        args.json.write_text(json.dumps([dataclasses.asdict(o) for o in outcomes], indent=1))


if __name__ == "__main__":
    main()
