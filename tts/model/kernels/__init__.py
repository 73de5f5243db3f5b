"""Triton kernels for the CUDA decode step and the DAC decoder. Each has a torch counterpart that is the
CPU path and its test reference. `TTS_FUSED_KERNELS=0` turns them off (plain torch on CUDA too)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable

import torch

from tts.environment import FUSED_KERNELS

log = logging.getLogger(__name__)

_ENABLED = FUSED_KERNELS != "0"
# Tests only: run the kernels on CPU tensors through Triton's interpreter (TRITON_INTERPRET=1).
_ON_CPU = FUSED_KERNELS == "interpret"


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def fused_kernels_enabled(t: torch.Tensor, *weights: torch.Tensor) -> bool:
    """True when `t` lives on CUDA, Triton is importable, the kernels are not switched off, and autograd
    is not recording: neither `t` nor any of the op's `weights` requires grad while grad mode is on.
    The kernels are inference-only (no backward), so a training forward must take the torch path or
    its gradients would silently stop at every norm. Under `torch.inference_mode()` / `no_grad()`
    (every engine path) grad mode is off and the kernels run."""
    if torch.is_grad_enabled() and (t.requires_grad or any(w.requires_grad for w in weights)):
        return False
    return _ENABLED and (t.is_cuda or _ON_CPU) and triton_available()


def kernel_head_dim_ok(head_dim: int) -> bool:
    """The Triton kernels tile a head as one power-of-two block of at least 16 (tl.arange, tl.dot)."""
    return head_dim >= 16 and head_dim & (head_dim - 1) == 0


def set_fused_kernels(enabled: bool) -> None:
    """Switch the fused kernels on or off for this process (benchmarks compare both)."""
    global _ENABLED
    _ENABLED = enabled


def fused_ops():
    """The Triton fused-op module (imported on first use, so CPU-only installs never need Triton)."""
    from tts.model.kernels import fused

    return fused


def snake_ops():
    """The Triton Snake kernels of the DAC decoder (imported on first use, like `fused_ops`)."""
    from tts.model.kernels import snake

    return snake


def prepare_triton_in_background() -> Callable[[], None]:
    """Start, in a daemon thread, what the first Triton launch of a process does before anything else:
    compute Triton's cache key (a hash of Triton's own sources and library, ~0.35 s on a Hopper host),
    so that a one-shot command does it while its model loads. Returns the function that
    waits for it: call it before the first launch (a launch that comes first computes the key again
    itself: correct, only slower). Where Triton is absent or the kernels are off, nothing starts and the
    function returns at once."""
    if not (_ENABLED and triton_available()):  # (Triton is imported here, as measured, not in the thread)
        return lambda: None

    def prepare() -> None:
        try:
            from triton.runtime.cache import triton_key  # (Triton's own memoized key of itself)

            triton_key()
        except Exception:  # noqa: BLE001 - another Triton: its first launch does what it does
            log.debug("Triton's cache key was not prepared", exc_info=True)

    thread = threading.Thread(target=prepare, name="triton-key", daemon=True)
    thread.start()
    return thread.join
