"""Every environment switch the runtime reads, in one place (docs/operations.md lists them).

TTS_FUSED_KERNELS: the Triton kernels of the CUDA frame step and the DAC decoder. "1" (the default): on;
"0": off, plain torch on CUDA too (A/B measurements, a GPU whose Triton misbehaves); "interpret": run them
on CPU tensors through Triton's interpreter (tests only, with TRITON_INTERPRET=1).

TTS_STEP_STREAM: the CUDA stream of the engine thread's frame steps. "high" (the default): a
high-priority stream, so the codec stage's convolutions do not delay the latency-bound step; "default":
the default stream (A/B measurements).

Read once, at import: set them before the process starts.
"""

from __future__ import annotations

import os

FUSED_KERNELS = os.environ.get("TTS_FUSED_KERNELS", "1")
STEP_STREAM = os.environ.get("TTS_STEP_STREAM", "high")
