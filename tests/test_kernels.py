import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("triton")


def test_triton_kernels_match_torch_references_in_the_interpreter():
    """Every Triton kernel (paged attention with and without splits, norms, qk-norm + RoPE, SwiGLU,
    the sampler with RAS) and the whole fused frame step equal their torch references on CPU."""
    env = dict(os.environ, TRITON_INTERPRET="1", TTS_FUSED_KERNELS="interpret")
    script = Path(__file__).with_name("kernel_checks.py")
    r = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "kernel checks passed" in r.stdout


def test_preparing_triton_computes_its_cache_key_once_in_a_background_thread(monkeypatch):
    """What a one-shot command overlaps with its model's load: Triton's own cache key, computed once in
    the background, then a hit for the first launch."""
    from triton.runtime.cache import triton_key

    from tts.model import kernels

    monkeypatch.setattr(kernels, "_ENABLED", True)
    triton_key.cache_clear()
    wait = kernels.prepare_triton_in_background()
    wait()
    assert triton_key.cache_info().misses == 1 and triton_key.cache_info().currsize == 1
    triton_key()
    assert triton_key.cache_info().hits == 1
