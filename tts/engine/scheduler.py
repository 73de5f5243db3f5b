"""Continuous-batching scheduler: waiting -> running -> finished, admission by free KV blocks.

The scheduler owns the block allocator and the batch rows. A running request occupies one row
`0 .. num_running - 1` of the step buffers; rows above are pad rows. When a request leaves, the last
running request moves into its row so the running rows stay contiguous (the bucket then only has to
cover `num_running`).

KV blocks are taken as a request grows, not for its whole budget up front: at admission the blocks of
its prompt (and its first frame's position), then one more each time its next position crosses into a
new block (`grow`, before every frame step). Admission is first come, first served: the head of the
queue waits until a row is free and the free blocks cover its prompt plus a reserve of one block per
running request (each may cross into a new block in the coming frames), and while no running request
is stalled. When the pool runs out mid-stream, a request that needs a block waits, its row inactive,
while the others decode and free blocks as they finish (`Engine` makes the policy: if no running
request can decode, the most recently admitted stalled one is ended, finish reason PREEMPTED, to free
its blocks). A request whose whole budget (prompt + max_new_frames) is larger than the pool is refused
at submission. Each admitted request is prefilled before the next frame step, so one iteration admits
prompts of at most `max_prefill_tokens` tokens in all (at least one request): a burst of new requests
then delays the running streams' next frame by a bounded amount instead of by every queued prefill at
once. The engine may also pass a gate that the head must pass (`admit(gate)`): its real-time admission
(tts.engine.realtime) keeps the head waiting while a playing stream would fall behind its player for
the prefill and the slower step, and while the step is too slow for a new stream; the frame steps go on
meanwhile, and the streams get ahead.
"""

from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from tts.engine.request import FinishReason, InvalidRequest, Request, RequestState
from tts.model.kv_cache import BlockAllocator, blocks_needed

# An admission gate: whether the head of the queue may join now, given those admitted before it in
# this iteration.
Gate = Callable[[Request, list[Request]], bool]


class QueueFull(RuntimeError):
    """The waiting queue is at its bound. Maps to RESOURCE_EXHAUSTED."""


@dataclass
class RowMove:
    """The request in row `src` moved to row `dst` (row `src` became a pad row)."""

    src: int
    dst: int


class Scheduler:
    def __init__(
        self,
        allocator: BlockAllocator,
        block_size: int,
        max_batch: int,
        max_context: int,
        max_waiting: int,
        max_prefill_tokens: int | None,
    ):
        self.allocator = allocator
        self.block_size = block_size
        self.max_batch = max_batch
        self.max_context = max_context
        self.max_waiting = max_waiting
        self.max_prefill_tokens = max_prefill_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # index = batch row
        self._admissions = itertools.count(1)  # admission order (Request.admission)

    # ---- submission ---------------------------------------------------------------------------------

    def check(self, request: Request) -> None:
        """Raise InvalidRequest if the request can never run here (before any work is queued)."""
        request.params.validate()
        if request.prompt.dim() != 2 or request.prompt_len < 1:
            raise InvalidRequest("prompt must be a non-empty [T, 1 + N] frame matrix")
        if request.max_tokens > self.max_context:
            raise InvalidRequest(
                f"prompt ({request.prompt_len} tokens) + max_new_frames ({request.params.max_new_frames}) "
                f"= {request.max_tokens} exceeds the context size {self.max_context}"
            )
        if self.blocks_for_budget(request) > self.allocator.num_usable:
            raise InvalidRequest(
                f"request needs up to {self.blocks_for_budget(request)} KV blocks; "
                f"the pool has {self.allocator.num_usable}"
            )

    def add(self, request: Request) -> None:
        self.check(request)
        if len(self.waiting) >= self.max_waiting:
            raise QueueFull(f"waiting queue is full ({self.max_waiting} requests)")
        request.state = RequestState.WAITING
        self.waiting.append(request)

    def blocks_for_budget(self, request: Request) -> int:
        """Blocks a request holds at most: every prompt column and every generated frame except the last
        (never fed back)."""
        return blocks_needed(request.max_tokens - 1, self.block_size)

    def blocks_for_next_step(self, request: Request) -> int:
        """Blocks a request must hold before its next frame step, which writes the K/V of position
        `prompt_len - 1 + num_generated`: those covering positions 0 .. that one."""
        return blocks_needed(request.prompt_len + request.num_generated, self.block_size)

    def blocks_missing(self, request: Request) -> int:
        """Blocks a running request lacks for its next frame step (0: it has them)."""
        return max(0, self.blocks_for_next_step(request) - len(request.blocks))

    def admission_blocks(self, request: Request) -> int:
        """Free blocks that admitting a waiting request needs (`admit`): the first blocks it lacks (a
        session's request already holds its kept prefix's) plus one per running request."""
        return self.blocks_missing(request) + len(self.running)

    def grow(self, request: Request) -> list[int] | None:
        """Give a running request the blocks its next frame step needs (`blocks_for_next_step`; usually
        none, one when its position enters a new block). Returns the new blocks, appended to
        `request.blocks` (empty: it had them), or None when the pool has too few free (it takes none)."""
        missing = self.blocks_missing(request)
        if missing == 0:
            return []
        if missing > self.allocator.num_free:
            return None
        new = self.allocator.allocate(missing)
        request.blocks.extend(new)
        return new

    # ---- admission and removal ----------------------------------------------------------------------

    def admit(self, gate: Gate | None = None) -> list[tuple[int, Request]]:
        """Move waiting requests to running while a row is free and the free blocks cover the head's
        first blocks (`blocks_for_next_step`: its prompt and first frame) plus one block per request
        already running (FCFS), up to `max_prefill_tokens` prompt tokens in all (the first request is
        admitted whatever its length), and while `gate(head, admitted so far)` allows it (the engine's
        real-time admission, tts.engine.realtime). Nothing is admitted while a running request is
        stalled (waits for a block): those come first.

        Returns `(row, request)` for each admitted request, its first blocks allocated.
        """
        admitted: list[tuple[int, Request]] = []
        tokens = 0
        if any(r.stalled for r in self.running):
            return admitted
        while self.waiting and len(self.running) < self.max_batch:
            request = self.waiting[0]
            # (a session's request already holds its kept prefix's blocks: tts.engine.sequences)
            need = self.blocks_missing(request)
            if self.admission_blocks(request) > self.allocator.num_free:
                break
            tokens += request.prompt_len
            if admitted and self.max_prefill_tokens is not None and tokens > self.max_prefill_tokens:
                break
            if gate is not None and not gate(request, [r for _, r in admitted]):
                break
            self.waiting.popleft()
            request.blocks = request.blocks + self.allocator.allocate(max(need, 0))
            request.state = RequestState.RUNNING
            request.admission = next(self._admissions)
            self.running.append(request)
            admitted.append((len(self.running) - 1, request))
        return admitted

    def finish(self, request: Request, reason: FinishReason, error: str | None = None) -> RowMove | None:
        """End a waiting or running request and free its blocks.

        Returns the row move that keeps running rows contiguous, if one is needed; the caller applies
        it to the step buffers and clears the vacated row.
        """
        move = None
        if request.state == RequestState.WAITING:
            self.waiting.remove(request)
        elif request.state == RequestState.RUNNING:
            row = self.running.index(request)
            last = len(self.running) - 1
            if row != last:
                self.running[row] = self.running[last]
                move = RowMove(src=last, dst=row)
            self.running.pop()
            move = move or RowMove(src=last, dst=last)
        if request.blocks:
            self.allocator.free(request.blocks)
            request.blocks = []
        request.state = RequestState.FINISHED
        request.stalled = False
        request.finish_reason = reason
        request.error = error
        return move

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)
