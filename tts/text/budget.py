"""The budget of one text preparation: a deadline and a count of the work done, checked between steps.

Text preparation (markup, the text policy's normalization, splitting into chunks, prompt building) is
host work that a server runs on a worker thread, where nothing from outside can stop it. Every step of
it is linear in the text's length, and every step reports the characters it scans to `charge`, which:

* adds them to the current budget's `work` (what tests bound: a multiple of the input's length), and
* raises `PreparationTimeout` once the budget's deadline has passed or its request was cancelled, so a
  preparation whose client gave up stops at its next step instead of running to the end.

`text_budget(deadline)` opens a budget for the code it wraps (a context variable: each thread and each
asyncio task has its own; no budget open means no deadline and nothing counted).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from dataclasses import dataclass


class PreparationTimeout(TimeoutError):
    """Text preparation ran past its request's deadline (or its request was cancelled meanwhile)."""


def _now() -> float:
    return time.monotonic()


@dataclass
class TextBudget:
    """deadline: a `time.monotonic()` time (None: none). work: characters scanned so far (every step's
    `charge`). cancelled: set by `cancel()` (from any thread); the next step stops."""

    deadline: float | None = None
    work: int = 0
    cancelled: bool = False

    def cancel(self) -> None:
        """Stop the preparation at its next step (its request was cancelled or timed out)."""
        self.cancelled = True

    def check(self) -> None:
        """Raise PreparationTimeout if the deadline has passed or the budget was cancelled."""
        if self.cancelled or (self.deadline is not None and _now() > self.deadline):
            raise PreparationTimeout("text preparation ran past the request's deadline")


_BUDGET: ContextVar[TextBudget | None] = ContextVar("tts_text_budget", default=None)


@contextmanager
def text_budget(deadline: float | None = None, budget: TextBudget | None = None) -> Iterator[TextBudget]:
    """Open a budget (`budget`, or a new one with `deadline`, a `time.monotonic()` time) for the
    preparation inside the block; yields it."""
    budget = budget if budget is not None else TextBudget(deadline)
    token = _BUDGET.set(budget)
    try:
        yield budget
    finally:
        _BUDGET.reset(token)


def charge(chars: int) -> None:
    """Count `chars` characters of work against the open budget (if any) and check its deadline; raises
    PreparationTimeout."""
    budget = _BUDGET.get()
    if budget is not None:
        budget.work += chars
        budget.check()
