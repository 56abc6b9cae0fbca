"""Why GPU tasks wait unplaced, and when to say so: decisions only, no distributed.

Plain distributed leaves a task no worker can take in ``no-worker`` without a word ("it
will hang indefinitely"). accelsched says it: a GPU task unplaced for
:data:`NOTICE_AFTER` seconds is counted under the reason no worker takes it, the count is
in ``accelsched status`` and on the dashboard, and a ``gpu-waiting`` event is written
once per reason: again only after that reason had no task waiting.
"""

from __future__ import annotations

from collections.abc import Iterable

__all__ = [
    "NOTICE_AFTER",
    "NO_GPU",
    "TOO_FEW_GPUS",
    "UNMET_REQUIREMENT",
    "NO_ELIGIBLE_WORKER",
    "REASONS",
    "reason_for",
    "Notices",
]

#: Seconds a GPU task waits unplaced before it is counted and said: a task submitted
#: while its worker is still being verified is placed well within this.
NOTICE_AFTER = 2.0

NO_GPU = "no-verified-gpu"  # no worker in the cluster offers a verified GPU
TOO_FEW_GPUS = "too-few-gpus"  # it needs more GPUs than any one worker offers
UNMET_REQUIREMENT = "unmet-requirement"  # no verified device meets what it asks of one
NO_ELIGIBLE_WORKER = "no-eligible-worker"  # GPUs enough, not on a worker it may run on

#: What each reason means, for people (``accelsched status``, the event's text).
REASONS = {
    NO_GPU: "no worker has a verified GPU",
    TOO_FEW_GPUS: "no worker has as many verified GPUs as they need",
    UNMET_REQUIREMENT: "no verified device meets their requirement",
    NO_ELIGIBLE_WORKER: "the workers they may run on offer them no verified GPU",
}


def reason_for(amount: float, largest: float, requirement: bool) -> str:
    """Why a GPU task needing ``amount`` GPUs is unplaced, ``largest`` being the most any
    one worker offers now; ``requirement``: it asks something of its device."""
    if largest <= 0:
        return NO_GPU
    if requirement:
        return UNMET_REQUIREMENT
    if amount > largest:
        return TOO_FEW_GPUS
    return NO_ELIGIBLE_WORKER


class Notices:
    """Which reasons to say now: each once, again only after it had no task waiting."""

    def __init__(self) -> None:
        self.said: set[str] = set()

    def update(self, waiting: Iterable[str]) -> list[str]:
        """``waiting``: the reasons with tasks waiting now; returns those to say."""
        now = set(waiting)
        new = sorted(now - self.said)
        self.said = now
        return new
