"""Device turns: the engine thread's frame steps and the codec stage's calls take turns on one GPU.

Both threads issue work on their own CUDA streams. Left alone, the GPU runs the two streams at the same
time, and that is slow for the frame step: it is a chain of hundreds of small, latency-bound kernels,
and while a codec call's convolutions hold every SM each of those kernels waits for SM slots and memory
bandwidth (stream priorities only order blocks that have not started; nothing is preempted). Measured
on an H200 at 64 streams: 46 ms per batch-64 frame step beside the codec, 8.3 ms alone.

`DeviceTurns.turn()` orders the device work issued inside it after all work issued inside earlier
turns, whichever thread issued it: under a host lock held only while launching, the current stream
waits on the event recorded at the end of the previous turn (`cudaStreamWaitEvent`: a device-side
wait), and the turn records its own event when it ends. Neither thread ever waits on the host for the
other; the GPU simply runs a frame step, then the codec call queued meanwhile, then the next frame step.
With `enabled=False` (a CPU, or `TTS_CODEC_SCHEDULE=overlap` for A/B measurements) a turn does nothing.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from contextlib import contextmanager

import torch

# "serial": frame steps and codec calls take turns on the GPU (the default); "overlap": they share it.
SCHEDULES = ("serial", "overlap")


def default_schedule() -> str:
    """The schedule `TTS_CODEC_SCHEDULE` names (a diagnostic for A/B runs), "serial" by default.
    Raises ValueError for any other value."""
    schedule = os.environ.get("TTS_CODEC_SCHEDULE", "serial")
    if schedule not in SCHEDULES:
        raise ValueError(f"TTS_CODEC_SCHEDULE must be one of {', '.join(SCHEDULES)}, got {schedule!r}")
    return schedule


class DeviceTurns:
    """See the module docstring. device: the GPU both threads use; enabled: False makes every turn a
    no-op (it is always False off CUDA)."""

    def __init__(self, device: torch.device | str, enabled: bool = True):
        self.device = torch.device(device)
        self.enabled = enabled and self.device.type == "cuda"
        self._lock = threading.Lock()
        self._last: torch.cuda.Event | None = None  # recorded at the end of the latest turn
        self._events: dict[int, torch.cuda.Event] = {}  # one reusable event per stream
        self.turns = 0

    @contextmanager
    def turn(self) -> Iterator[None]:
        """Issue device work on the current stream after every earlier turn's work (on the device)."""
        if not self.enabled:
            yield
            return
        stream = torch.cuda.current_stream(self.device)
        with self._lock:
            if self._last is not None:
                stream.wait_event(self._last)
            try:
                yield
            finally:
                # An event's wait applies to its latest record at the time of the wait: reusing one
                # event per stream is safe, a later record does not change an earlier wait.
                event = self._events.get(stream.cuda_stream)
                if event is None:
                    event = self._events[stream.cuda_stream] = torch.cuda.Event()
                event.record(stream)
                self._last = event
                self.turns += 1
