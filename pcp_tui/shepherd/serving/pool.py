"""The shepherd's workers: one task per connection, from welcome to goodbye.

`WorkerPool.serve` takes a connection that `Admission` let in, welcomes the worker,
sends it the plan (graphs, data shard), then reads what it sends: progress,
round results (screened and folded into the current `Round`), heartbeats. What
the plan holds, and what it lets the worker send, is `worker_plan.py`'s. The
link's watchdog (`Connection.alive`) drops a worker that falls silent or uploads
too slowly. The shepherd asks the pool who is ready; the round engine opens the
`OpenRounds` each result is folded into. Neither touches a socket.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Callable
from functools import partial

import trio

from pcp_tui import protocol
from pcp_tui.config import RunConfig
from pcp_tui.contract import plan as contract
from pcp_tui.contract.channels import Channel
from pcp_tui.contract.connection import CLOSE_SECONDS, LINK_ERRORS, ConnectionLost, lost, shown
from pcp_tui.shepherd.rounds import sitting_out
from pcp_tui.shepherd.rounds.checks import Verdict
from pcp_tui.shepherd.rounds.pacing import StepPacing
from pcp_tui.shepherd.rounds.results import BadResult, OpenRounds, note_refusal, tell_refused
from pcp_tui.shepherd.run.events import (
    Compiled,
    Internal,
    Joined,
    LateResult,
    Left,
    Lost,
    Rejoined,
    ShardAdopted,
    ShardOrphaned,
    Stragglers,
    WorkerRefused,
)
from pcp_tui.shepherd.run.graphs import GraphLibrary, Unservable
from pcp_tui.shepherd.run.state import RunState, WorkerState, WorkerView
from pcp_tui.shepherd.serving import slots, striping
from pcp_tui.shepherd.serving.admission import Admission, Admitted, held, network_of
from pcp_tui.shepherd.serving.connection import Hello, WorkerLink
from pcp_tui.shepherd.serving.relays import Relays
from pcp_tui.shepherd.serving.uploads import (
    RESULTS_IN_MEMORY,
    ReceiverLoad,
    ResultSlot,
    upload_too_slow,
)
from pcp_tui.shepherd.serving.worker_plan import bind_to_plan, worker_plan
from pcp_tui.training.workload import Workload

log = logging.getLogger(__name__)  # connection-level diagnostics; RunState has the run's events


class WorkerPool:
    """Every connected worker of one run, and the task serving each."""

    def __init__(
        self,
        config: RunConfig,
        workload: Workload,
        state: RunState,
        admission: Admission,
        *,
        graphs: GraphLibrary,
        open_rounds: OpenRounds,
        fragments: tuple[tuple[str, ...], ...],
        pacing: StepPacing | None,
        run_id: str,
        stopping: Callable[[], bool],
    ):
        self.config, self.workload, self.state = config, workload, state
        self.admission = admission
        self.run_id = run_id
        self.graphs = graphs  # each worker's export, made as workers of a new kind join
        self.open_rounds = open_rounds  # the engine's: each result goes to its fragment's
        self.fragments = fragments  # the engine's partition of the parameters, in every plan
        self.pacing = pacing  # --adaptive-steps: late results measure speed too
        self._stopping = stopping
        self._links: dict[str, WorkerLink] = {}
        self._changed = trio.Event()  # set whenever a worker becomes ready or goes away
        self._next_index = 0
        self._known_indices: dict[str, int] = {}  # worker id -> index, from a checkpoint
        self._result_slots = trio.Semaphore(RESULTS_IN_MEMORY)
        self.load = ReceiverLoad()  # the shepherd's own load, which uploads are not blamed for
        self._slot_line = trio.Lock()  # newcomers waiting for a connection slot (`_wait_for_slot`)
        self._slot_waiters = 0
        # --relays: each relay's workers are served here as channels of its link
        self.relays = Relays(config, state, run_id=run_id, serve_channel=self._serve_relayed)

    def remember(self, indices: dict[str, int]) -> None:
        """Give returning workers the index they had before a restart (shards: the ledger)."""
        self._known_indices = dict(indices)
        self._next_index = max(indices.values(), default=-1) + 1

    def ready_links(self) -> list[WorkerLink]:
        """The links a new round goes to: ready, open, and not still owing a result."""
        return [
            link
            for link in self._links.values()
            if link.ready.is_set() and not link.closed and not link.rounds.behind
        ]

    def has_ready(self, count: int) -> bool:
        """Whether `count` links are ready for a round (`ready_links`); while fewer links are
        open than that, without looking at each (a run's first N joins were N² looks)."""
        return len(self._links) >= count and len(self.ready_links()) >= count

    async def compiling_ready(self) -> None:
        """Wait until every connection compiling now is ready or gone, each at most the grace
        (`slots.evictable_after`) from its welcome. The shepherd calls it before it repeats a
        round that got no result: four token holders that said ready at once were that
        repeat's only workers while the two honest newcomers that had just taken their
        slots compiled for 2 s, and held it 45 s more. A compile that takes longer than the
        grace is not waited for (the round goes on without it, as any round does); peers
        that join later are not waited for, so none can stretch the wait."""
        grace = slots.evictable_after(self.config.security.ready_timeout)
        compiling = [link for link in self._links.values() if not link.ready.is_set()]
        while not self._stopping():
            now = trio.current_time()
            deadlines = [
                link.admitted_at + grace
                for link in compiling
                if not link.closed and not link.ready.is_set() and link.admitted_at + grace > now
            ]
            if not deadlines:
                return
            with trio.move_on_at(min(deadlines)):
                await self.changed()

    def settled(self, verdict: Verdict) -> None:
        """A round's results are settled (`RoundEngine.verdicts`): `sitting_out.settled`."""
        sitting_out.settled(self.state, list(self._links.values()), verdict)

    def sitting_out_line(self) -> str:
        """The connected workers that sit rounds out, for a 'waiting' line; "" if none."""
        return sitting_out.waiting_line(list(self._links.values()))

    def wake(self) -> None:
        """Wake whoever waits in `changed` (a worker came or went, or the run is stopping)."""
        self._changed.set()

    async def changed(self) -> None:
        """Wait until the next `wake`."""
        self._changed = trio.Event()
        await self._changed.wait()

    async def goodbye_all(self, reason: str, *, resumable: bool = False) -> None:
        """Tell every worker goodbye; `resumable`: the run can be resumed, so come back."""
        async with trio.open_nursery() as nursery:
            for link in list(self._links.values()):
                link.view.state, link.view.reason = WorkerState.LEFT, reason
                nursery.start_soon(partial(link.close, reason, resumable=resumable))
        await self.relays.goodbye_all(reason, resumable=resumable)

    # -- one connection -------------------------------------------------------

    async def serve(self, raw: trio.abc.Stream, *, via: str = "") -> None:
        """Serve one connection until it ends; never raises for what the peer does.

        `via`: the relay whose channel `raw` is (`relays.py`): its link has TLS already.
        """
        peer = f"{via}/{raw.peer}" if isinstance(raw, Channel) else None
        relay = self.relays.live.get(via) if via else None
        # TLS, token, limits; logs and closes refusals; a relay's worker signs its certificate
        admitted = await self.admission.admit(
            raw, peer=peer, tls=not via, channel=relay.fingerprint if relay else None
        )
        if admitted is None:
            return
        if admitted.hello.relay:
            refused = (
                (
                    protocol.ErrorCode.AUTH_FAILED,
                    "a relay connects to the shepherd itself, not through another relay",
                )
                if via
                else self.relays.refusal(admitted.hello.worker_id)
            )
            if refused is not None:  # shown as any refusal is (a `refused` event)
                await self._refuse(admitted, *refused)
            else:
                await self.relays.serve(admitted)
            return
        if admitted.hello.attach_index:  # an extra connection of a session (--streams)
            await self._attach(admitted)
            return
        refusal = self._refusal(admitted.hello.worker_id)
        if refusal is not None and refusal[0] is protocol.ErrorCode.BUSY:
            refusal = await self._wait_for_slot(admitted.hello.worker_id, refusal)
        if refusal is not None:
            await self._refuse(admitted, *refusal)
            return
        link, joined = self._admit(admitted.stream, admitted.hello, admitted.peer, via)
        ended: ConnectionLost | None = None
        try:
            await self._serve_worker(link, joined)
        except Unservable as exc:  # e.g. its --devices cannot split the batch: told why
            ended = ConnectionLost(str(exc), code=protocol.ErrorCode.UNSUPPORTED_BACKEND.value)
            self._mark_gone(link, "refused", ended.reason)
        except (ConnectionLost, *LINK_ERRORS) as exc:
            ended = link.failure or lost(exc)  # a send past its deadline closed the link
            # a NaN loss (`rounds/divergence.py`): the decoder's error, as `lost` keeps it
            # (a NaN loss; a NaN time or the like is a peer breaking the rules, not divergence)
            cause = ended.__cause__
            diverged = isinstance(cause, protocol.NonFinite) and cause.is_loss
            self._mark_gone(link, "lost", ended.reason, non_finite=diverged)
        except Exception as exc:  # noqa: BLE001 - a bug serving one peer must not end the run
            reason = f"internal error serving this worker ({type(exc).__name__}: {exc})"
            self.state.emit(Internal(f"worker {link.view.index}: {reason}", worker=link.worker_id))
            self._mark_gone(link, "lost", reason)
        else:
            self._mark_gone(link, "left", link.view.reason or "said goodbye")
        finally:
            with trio.CancelScope(shield=True):  # tells the peer what it did wrong, if it did
                # no goodbye: the run goes on (at its end `goodbye_all` said it), and a worker
                # reads a goodbye as "the run is over" and exits instead of reconnecting
                await link.close("connection closed", error=ended, goodbye=False)
            link.ended.set()

    def _refusal(self, worker_id: str) -> tuple[protocol.ErrorCode, str] | None:
        """(code, reason) if an authenticated connection may not join now, else None.

        A worker id belongs to one live connection: a second connection with it is
        refused while the first was heard from within the heartbeat timeout (else it
        would take over the worker's shard and rounds, and the real worker would run
        on unheard). A first connection that has fallen silent is dead: the newcomer
        replaces it, which is a reconnect. Admitted connections are capped, so peers
        holding the token cannot tie up the shepherd with idle or slow connections; one
        that is not ready loses its slot after a while (`slots`).
        """
        previous = self._links.get(worker_id)
        if previous is None or previous.closed:
            return self._busy(previous, self.config.worker_connections)
        return held(
            f"worker id {worker_id!r}",
            "worker",
            previous.view.host,
            previous.silent_for(),
            self.config.network,
            paused=previous.is_paused,
        )

    def _busy(self, previous: WorkerLink | None, cap: int) -> tuple[protocol.ErrorCode, str] | None:
        """(busy, why) when the admitted connections, `previous` (being replaced) aside, are
        at --max-worker-connections; else None."""
        if len(self._links) < cap:  # the count below is of every link (a join's N)
            return None
        live = sum(1 for link in self._links.values() if not link.closed and link is not previous)
        if live >= cap:
            return protocol.ErrorCode.BUSY, (
                f"the shepherd already serves {live} worker connections, its limit; try again "
                f"later, or raise --max-worker-connections on the shepherd (now {cap})"
            )
        return None

    async def _wait_for_slot(
        self, worker_id: str, busy: tuple[protocol.ErrorCode, str]
    ) -> tuple[protocol.ErrorCode, str] | None:
        """Every slot is taken: wait, in order of arrival, for a connection that has not earned
        its slot to pass its bound, and take it (`slots`); None once this worker may join, else
        the refusal (no holder will free: each has earned its slot, or waits for its next
        round while the run has its workers; or as many newcomers as slots wait already).

        Waiting in line, not retrying, is what lets an honest worker in: squatters that
        are put out join again at once, and a retry every few seconds would lose every
        race for a slot to them; in line, they wait behind it.
        """
        if self._slot_waiters >= self.config.worker_connections:
            return busy
        rules = slots.SlotRules.of(self.config)
        self._slot_waiters += 1
        try:
            async with self._slot_line:  # trio's locks are fair: first come, first served
                while (refusal := self._refusal(worker_id)) and refusal[0] is busy[0]:
                    now = trio.current_time()
                    taken = slots.slot_to_take(self._links.values(), now, rules)
                    if taken is not None:
                        await self._move_out(taken)
                        continue
                    free_at = slots.next_to_free(self._links.values(), rules)
                    if free_at is None:  # none will free (`slots`)
                        return refusal
                    await trio.sleep_until(min(free_at, now + 1.0))  # or one leaves sooner
                return refusal
        finally:
            self._slot_waiters -= 1

    async def _move_out(self, link: WorkerLink) -> None:
        """Close a connection that has not earned its slot, for a newcomer to take it (`slots`)."""
        waited = trio.current_time() - link.admitted_at
        if not link.ready.is_set():
            what = "not ready"
        elif link.rounds.shown_work:
            what = "no result taken"
        else:
            what = "no progress and no result"
        reason = (
            f"{what} {waited:.0f} s after its welcome, and every connection slot is taken: "
            "its slot went to a new worker (it may join again)"
        )
        await self._close_link(link, protocol.ErrorCode.BUSY, reason)

    async def drop_revoked(self) -> bool:
        """Close the connections whose key is no longer issued to their worker id (a line
        removed from --worker-keys); True if any was. Called before each round."""
        keys = self.admission.worker_keys
        if keys is None:
            return False
        revoked = [
            (link, why)
            for link in list(self._links.values())
            if not link.closed and (why := self._revoked(link))
        ]
        for link, why in revoked:
            await self._close_link(link, protocol.ErrorCode.AUTH_FAILED, why)
        return bool(revoked)

    def _revoked(self, link: WorkerLink) -> str | None:
        """Why `link` may not train on (its key's line left --worker-keys), or None."""
        keys = self.admission.worker_keys
        why = keys.revoked(link.public_key, link.worker_id) if keys is not None else None
        return f"{why}: the operator revoked it, so this worker may not train on" if why else None

    async def _close_link(self, link: WorkerLink, code: protocol.ErrorCode, reason: str) -> None:
        """Tell `link`'s worker why (`code`, `reason`) and close its connection."""
        # its own task then marks it gone, for this reason (the failure is set first: the
        # task may run as soon as the socket closes)
        link.failure = ConnectionLost(reason, code=code.value)
        link.closed = True
        with trio.move_on_after(CLOSE_SECONDS):  # the link's send refuses once failure is set
            await link.stream.send_error(code, reason)
        with contextlib.suppress(*LINK_ERRORS):
            await trio.aclose_forcefully(link.stream.stream)

    async def _refuse(self, admitted: Admitted, code: protocol.ErrorCode, reason: str) -> None:
        """Tell an authenticated peer why it may not join (one line), log it, and hang up."""
        host = admitted.peer.rpartition(":")[0] or admitted.peer
        self.admission.refusals.refused(host, admitted.peer, reason, code=code.value)
        with trio.move_on_after(1):  # the peer may not read: do not wait on it
            await admitted.stream.send_error(code, reason)
        with contextlib.suppress(*LINK_ERRORS):
            await trio.aclose_forcefully(admitted.stream.stream)

    async def _attach(self, admitted: Admitted) -> None:
        """Hand an extra connection to its worker's session, which then owns it; or refuse it."""
        hello = admitted.hello
        link = self._links.get(hello.worker_id)
        pending = link.attachments if link is not None and not link.closed else None
        problem = (
            f"no session of worker {hello.worker_id!r} is asking for more connections"
            if pending is None
            else pending.offer(hello, admitted.stream)
        )
        if problem is not None or link is None:
            await self._refuse(admitted, protocol.ErrorCode.AUTH_FAILED, problem or "")
            return
        # the session owns the connection now; trio's serve_listeners closes a connection once
        # its handler returns, so this one returns when the session has ended
        await link.ended.wait()

    async def _serve_relayed(self, channel: Channel, relay: str) -> None:
        await self.serve(channel, via=relay)

    def _admit(
        self, stream: protocol.MessageStream, hello: Hello, peer: str, via: str = ""
    ) -> tuple[WorkerLink, Callable[[], None]]:
        """The worker's link and view, and what tells the run it joined: called once the
        shepherd knows it can serve it (`_serve_worker`), so a refused one never joined."""
        old = self.state.workers.get(hello.worker_id)
        if old is not None:
            index = old.index
        elif hello.worker_id in self._known_indices:  # same shard as before the restart
            index = self._known_indices[hello.worker_id]
        else:
            index = self._next_index
            self._next_index += 1
        shard, adopted = self.state.shards.assign(hello.worker_id)
        view = WorkerView(
            worker_id=hello.worker_id,
            index=index,
            host=hello.hostname or peer,
            backend=hello.backend,
            devices=hello.devices,
            processes=hello.processes,
            hosts=hello.hosts,
            shard=shard,
            runtime=hello.runtime.value,
            via=via,
            # a relay's word for its worker's address is any token holder's to forge: its
            # workers weigh by the address its own link comes from, as behind a NAT
            network=network_of(self.relays.live[via].peer if via else peer),
            # its results that counted, before a reconnect too (`slots._earned`, the API)
            rounds_contributed=old.rounds_contributed if old is not None else 0,
        )
        self.state.workers[hello.worker_id] = view
        security = self.config.security
        link = WorkerLink(
            stream,
            view,
            self.state,
            hello.platform,
            hello.runtime,
            min_send_rate=security.min_upload_rate,
            send_grace=security.upload_grace,
            load=self.load,
        )
        link.public_key = hello.public_key  # --worker-keys: checked again before each round
        previous = self._links.get(hello.worker_id)
        if previous is not None:
            previous.closed = True
        self._links[hello.worker_id] = link
        verb = "rejoined" if old is not None else "joined"

        def announce() -> None:
            log.info(
                "worker %d (%s, %s) %s from %s", index, hello.worker_id, hello.backend, verb, peer
            )
            self.state.emit(
                (Rejoined if old is not None else Joined)(
                    f"worker {index} ({hello.worker_id}, {hello.backend}) {verb} from {peer}",
                    worker=hello.worker_id,
                    shard=shard,
                    platform=hello.platform.value,
                    devices=hello.devices,
                    processes=hello.processes,
                )
            )
            if adopted:
                self.state.emit(
                    ShardAdopted(
                        f"worker {index} ({hello.worker_id}) took over untrained shard {shard}",
                        worker=hello.worker_id,
                        shard=shard,
                    )
                )

        return link, announce

    def _mark_gone(
        self, link: WorkerLink, state: str, reason: str, *, non_finite: bool = False
    ) -> None:
        ending = self.state.status.finished or self._stopping()
        if ending:
            state = WorkerState.LEFT  # the run is ending: a closing connection is expected
        if self._links.get(link.worker_id) is link:
            del self._links[link.worker_id]
            link.view.state, link.view.reason = WorkerState(state), reason
            shards = self.state.shards  # a refused worker never trained the shard it was given
            gives_back = shards.withdraw if state == "refused" else shards.release
            orphan = gives_back(link.worker_id)
            log.info("worker %d %s: %s", link.view.index, state, reason)
            if state == "refused":
                self.state.emit(
                    WorkerRefused(
                        f"worker {link.view.index} refused: {reason}", worker=link.worker_id
                    )
                )
            elif state == "lost" and not self._stopping():
                self.state.emit(
                    Lost(
                        f"worker {link.view.index} lost: {reason}",
                        worker=link.worker_id,
                        non_finite=non_finite,
                    )
                )
            elif not ending:  # said goodbye mid-run (stopped by its operator): worth a line too
                self.state.emit(
                    Left(
                        f"worker {link.view.index} left: {reason}",
                        worker=link.worker_id,
                    )
                )
            if orphan is not None and not ending:  # after the line that says why
                self.state.emit(
                    ShardOrphaned(
                        f"shard {orphan} has no worker since worker {link.view.index} {state}; "
                        "the next worker to join trains it",
                        worker=link.worker_id,
                        shard=orphan,
                    )
                )
        link.closed = True
        self.open_rounds.finish(link.worker_id, link)
        self.wake()

    async def _serve_worker(self, link: WorkerLink, joined: Callable[[], None]) -> None:
        """Welcome, plan, then the worker's messages until it leaves; raises ConnectionLost,
        or Unservable before the welcome (and before `joined`, its `joined` event) if no
        graphs fit its platform and devices."""
        cfg = self.config
        slot = link.view.shard  # from the ledger: a lost worker's shard goes to the next joiner
        graphs = await self.graphs.for_worker(link.platform, link.runtime, link.view.devices)
        joined()
        welcome = protocol.Welcome(
            link.view.index,
            self.run_id,
            cfg.network.heartbeat_seconds,
            key_checked=bool(link.public_key),  # admitted under --worker-keys
        )
        wanted = 1 if link.view.via else cfg.network.streams  # a relay's link is one connection
        await striping.welcome(link, welcome, wanted, wait=cfg.security.handshake_timeout)
        log.debug("worker %d: welcomed", link.view.index)
        link.view.state = WorkerState.COMPILING
        assert slot is not None, "the ledger gives every admitted worker a shard"
        plan, tensors = worker_plan(
            cfg, self.workload, graphs, run_id=self.run_id, slot=slot, fragments=self.fragments
        )
        sent = await link.send(plan, tensors)
        log.debug("worker %d: sent plan (%d bytes)", link.view.index, sent)
        bind_to_plan(link, plan, self.workload, self.fragments)
        # a relay vouches for its workers: it heartbeats them and ends a silent one's channel
        # (`pcp_tui/relay.py`), so their beats need not cross to the shepherd either way
        vouched = bool(link.view.via)
        async with link.alive(
            heartbeat_seconds=math.inf if vouched else cfg.network.heartbeat_seconds,
            timeout=math.inf if vouched else cfg.network.heartbeat_timeout,
            too_slow=lambda: (
                upload_too_slow(link, self.config, self.load)
                or sitting_out.hung_reason(link.rounds)
                or sitting_out.unproven_reason(link.rounds)
                or slots.not_ready_reason(link, cfg.security.ready_timeout, trio.current_time())
                or self._holding(link)
            ),
        ):
            await self._receive_loop(link)

    def _holding(self, link: WorkerLink) -> str:
        """`slots.holding_reason` for `link` now, asked by its watchdog: "" always.

        A link that holds a round past its bound is taken out of the fragments' rounds it
        holds and sits new rounds out until that round's result comes (`sitting_out`: its
        last fragment's), at most --ready-timeout without a sign of it; it keeps its
        connection. An honest worker whose first chunk outlasted the grace lost its
        connection here, joined again silent, and a token holder that kept a fresh ready id
        waiting held round 1 so for ever. A streaming worker trains the round on: the
        fragment updates still come to it (`RoundEngine._sync` sends them to every worker
        the round was sent), its late results are dropped, and its last one brings it
        back. A peer that never trains holds no round past the grace either way, and gives
        its slot to a newcomer in line (`slots._free_at`)."""
        reason = slots.holding_reason(
            link,
            lambda: slots.SlotRules.of(self.config).silent_seconds(self._links.values()),
            trio.current_time(),
            holds_a_round=lambda: self._holds_a_round(link),
            ready_timeout=self.config.security.ready_timeout,
        )
        if not reason:
            return ""
        held = [
            current
            for current in self.open_rounds.rounds
            if link.worker_id in current.pending and current.bound_to(link.worker_id, link)
        ]
        for current in held:
            current.finish(link.worker_id)
            sitting_out.sit_out(current, [link.worker_id])
        if held:
            self.state.emit(
                Stragglers(
                    f"round {held[0].number} goes on without {link.worker_id}: {reason}",
                    workers=[link.worker_id],
                )
            )
        link.rounds.behind_grace = self.config.security.ready_timeout
        return ""

    def _holds_a_round(self, link: WorkerLink) -> bool:
        """Whether an open round waits for `link`'s result while another ready connection,
        not sitting out, waits for a round it was not sent (`slots.holding_reason`)."""
        rounds = self.open_rounds.rounds

        def sent(other: WorkerLink) -> bool:
            return any(
                other.worker_id in r.participants and r.bound_to(other.worker_id, other)
                for r in rounds
            )

        if not any(
            link.worker_id in r.pending and r.bound_to(link.worker_id, link) for r in rounds
        ):
            return False
        return any(
            other is not link
            and not other.closed
            and other.ready.is_set()
            and not other.rounds.behind
            and not sent(other)
            for other in self._links.values()
        )

    async def _receive_loop(self, link: WorkerLink) -> None:
        while True:
            slot = ResultSlot(self._result_slots, link, self.load)
            try:
                message = await link.receive(before_payload=slot.admit)
                await self._handle(link, message)
            finally:
                slot.release()
            if message.kind == "goodbye":
                return

    async def _handle(self, link: WorkerLink, message: protocol.Message) -> None:
        view, body = link.view, message.body
        log.debug("worker %d: received %s (%d bytes)", view.index, message.kind, message.wire_bytes)
        if isinstance(body, protocol.Ready):
            view.state = WorkerState.IDLE
            link.stage = contract.Stage.READY
            view.compile_seconds = body.compile_seconds
            link.ready_at = trio.current_time()
            link.ready.set()
            self.state.emit(
                Compiled(
                    f"worker {view.index} compiled in {body.compile_seconds:.1f} s",
                    worker=view.worker_id,
                )
            )
            self.wake()
        elif isinstance(body, protocol.Progress):
            if link.progress.admit():  # beyond a few a second: dropped; a flood ends the link
                self._on_progress(view, body)
                link.rounds.progressed(body)  # a time of its own for the straggler window
                self.open_rounds.reconsider(link.worker_id)  # maybe a shorter one
        elif isinstance(body, protocol.RoundResult):
            await self._on_result(link, message)
        elif isinstance(body, protocol.Goodbye):
            view.reason = shown(body.reason) or "said goodbye"
        elif isinstance(body, protocol.Error):
            # the worker says why it stops (e.g. it refused a round's parameters): it is out
            raise ConnectionLost(f"the worker reported {body.code.value}: {shown(body.message)}")

    def _on_progress(self, view: WorkerView, body: protocol.Progress) -> None:
        view.state = WorkerState(body.phase.value)
        view.record_stats(body.stats)
        if body.phase is not protocol.Phase.TRAINING:
            return  # e.g. the statistics a worker sends once it has compiled: no step, no loss
        view.step = body.step
        view.total_steps = body.total_steps
        view.loss = body.loss
        global_step = (max(body.round, 1) - 1) * self.config.inner.steps + view.step
        self.state.step_losses.append((global_step, body.loss, view.index))
        view.tokens_per_second = body.tokens_per_second

    async def _on_result(self, link: WorkerLink, message: protocol.Message) -> None:
        body = message.body_as(protocol.RoundResult)
        view = link.view
        current = self.open_rounds.of(body.fragment)  # the header check bounds it
        number = body.round
        link.rounds.note_result(body, self.state.round)  # a repeat ends the connection
        if revoked := self._revoked(link):  # revoked mid-round: not its round's result either
            raise ConnectionLost(revoked, code=protocol.ErrorCode.AUTH_FAILED.value)
        link.rounds.claims.check(body)  # more steps, tokens or seconds than asked: ends it too
        if sitting_out.caught_up(link, number, body.fragment):
            self.wake()
        link.rounds.answered(number, body.fragment)
        try:
            added = (
                current is not None
                and current.accepts(link.worker_id, number, link)
                and await current.add(link.worker_id, message)
            )
        except BadResult as exc:
            assert current is not None  # only a round's add refuses a result
            current.finish(link.worker_id)
            note_refusal(self.state, link, number, body.fragment, exc, self.open_rounds)
            await tell_refused(link, exc)
            return
        if not added:
            if self.pacing is not None:
                self.pacing.measure(link.worker_id, body.inner_steps, body.compute_seconds, link)
            self.state.emit(
                LateResult(
                    f"dropped a late result for round {number} from worker {view.index}",
                    worker=link.worker_id,
                    round=number,
                )
            )
            return
        link.rounds.took(body.fragment)
        view.state = WorkerState.IDLE
        view.step = view.total_steps
