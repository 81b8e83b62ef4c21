"""Whether a round that got no result (or a NaN eval) means the run diverged, and what to say.

A round whose every result is refused as non-finite (a loss of NaN or inf, a
pseudo-gradient that overflows) would otherwise repeat for ever: the workers
rejoin, train the same round from the same parameters, and diverge again. One
worker's NaN among healthy results is that worker's problem (its result is
refused, the round goes on with the others); only a round in which every
failure was non-finite, and nothing else went wrong, is divergence.
"""

from __future__ import annotations

import math
import re
from collections.abc import Iterable

from pcp_tui.diloco.screening import Refusal
from pcp_tui.diloco.validation import BLOW_UP
from pcp_tui.shepherd.run.events import Event, Internal, Lost, ResultRefused
from pcp_tui.shepherd.run.history import RoundRecord

# Where the decoder's refusal of a non-finite loss (`Lost.non_finite`) names it ("worker 0
# lost: roundResult.losses[3] is nan; ..."): read only from such an event, whose text is the
# decoder's, not the peer's
_STEP = re.compile(r"losses\[(\d+)\] is -?(nan|inf)", re.I)
_FAILURES = ("lost", "bad_result")


def events_since(events: Iterable[Event], mark: Event | None) -> list[Event]:
    """The events after `mark` (None: all), oldest first."""
    found: list[Event] = []
    for event in reversed(list(events)):
        if event is mark:
            break
        found.append(event)
    return found[::-1]


def diverged(
    round_events: list[Event], number: int, inner_steps: int, record: RoundRecord | None
) -> str | None:
    """Why round `number` shows the run diverged (a phrase), or None.

    `round_events` are the events the round emitted; `record` is None when the
    round got no result. A round that got results diverged only if its outer step
    made the eval loss non-finite (its refused results were their senders' problem).
    """
    if record is not None:
        loss = record.eval_loss
        if loss is not None and not math.isfinite(loss):
            return f"round {number}'s outer step made the eval loss {loss}"
        return None
    failures = [e for e in round_events if e.kind in _FAILURES]
    if not failures or not all(_diverging(e) for e in failures):
        return None
    steps = [
        int(m.group(1)) + 1
        for e in failures
        if isinstance(e, Lost) and e.non_finite and (m := _STEP.search(e.message))
    ]
    where = f" (first at inner step {min(steps)} of {inner_steps})" if steps else ""
    what = (
        "was non-finite"
        if all(_non_finite(e) for e in failures)
        else f"diverged: non-finite, or raising its own batches' loss over {BLOW_UP:g} times"
    )
    return f"every result of round {number} {what}{where} ({failures[0].message})"


# tries of a round in a row whose every result was non-finite before the run stops as
# diverged: one try could be a lone peer's lie (any token holder's), and a model that
# diverged does so again from the same parameters
NAN_TRIES = 2

# rounds in a row that got no result while the shepherd failed internally serving workers:
# a bug the workers meet again each time they rejoin; then the run stops instead
INTERNAL_ROUNDS = 3


def internal_failure(round_events: list[Event], record: RoundRecord | None) -> str | None:
    """The first internal error of a round that got no result (a shepherd bug its workers
    hit: each rejoins and meets it again), as its event said it; None otherwise."""
    if record is not None:
        return None
    return next((e.message for e in round_events if isinstance(e, Internal)), None)


def internal_advice(
    rounds: int, number: int, error: str, checkpoint: int | None, checkpoint_dir: str | None
) -> str:
    """The line a run stopped by `INTERNAL_ROUNDS` repeats of an internal error ends with."""
    if not checkpoint_dir:
        kept = "no --checkpoint-dir: nothing is saved"
    elif checkpoint is None:
        kept = f"no checkpoint was written to {checkpoint_dir} yet"
    else:
        kept = f"round {checkpoint}'s checkpoint in {checkpoint_dir} is kept"
    return (
        f"the shepherd failed internally in {rounds} tries of round {number} in a row, none "
        f"with a result ({error}): a bug in pcp-tui, not in the workers; {kept}. Report it "
        "with this log; --resume goes on from the checkpoint once it is fixed"
    )


def _non_finite(event: Event) -> bool:
    """A result refused as non-finite, or a connection ended for a NaN in its message: by
    the event's kind, never its text (a peer's own error message may say "is nan")."""
    if isinstance(event, ResultRefused):
        return event.refusal is Refusal.NON_FINITE
    return isinstance(event, Lost) and event.non_finite


def _diverging(event: Event) -> bool:
    """Whether a failure says the result itself diverged: non-finite, or a loss blown up
    (validation's `Refusal.BLOWN_UP`: its own batches' loss over `BLOW_UP` times higher)."""
    blown_up = isinstance(event, ResultRefused) and event.refusal is Refusal.BLOWN_UP
    return _non_finite(event) or blown_up


def advice(why: str, last_good: int | None, inner_lr: float, checkpoint_dir: str | None) -> str:
    """The one line a diverged run ends with: what happened, what is kept, what to try.

    `last_good` is the round whose parameters are kept (checkpointed, with a
    `checkpoint_dir`): the one before the divergence, or None if none finished.
    """
    if last_good is None:
        kept = "no round had finished, nothing is saved"
    elif checkpoint_dir:
        kept = f"the checkpoint of round {last_good} in {checkpoint_dir} is kept"
    else:
        kept = f"round {last_good} was the last good one (no --checkpoint-dir: not saved)"
    return (
        f"the run diverged: {why}; {kept}; try a lower --inner-lr (now {inner_lr:g}) or "
        "--grad-clip 1, and check that the model's loss is finite"
    )
