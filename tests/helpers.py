"""Shared test helpers: random prompts for any model config, a synchronous engine driver, the replay
tests' eager-bucket engine, streamed codec decode. A helper two test files need goes here (service
tests: tests/service_helpers.py; the `standin_graphs` fixture: tests/conftest.py)."""

import io
import time

import numpy as np
import soundfile as sf
import torch

from graphs.runner import GraphRunner
from tts.engine import Engine, SamplingParams
from tts.engine.aligner import RETRACT_MAX_FRAMES, Repeat


def tone_wav(rate: int, seconds: float = 2.0) -> bytes:
    """A 220 Hz tone of `seconds` at `rate` Hz as 16-bit WAV bytes (a reference clip the checks take)."""
    t = np.arange(int(seconds * rate)) / rate
    buf = io.BytesIO()
    tone = (0.3 * np.sin(2 * np.pi * 220 * t)).astype(np.float32)
    sf.write(buf, tone, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def random_prompt(
    model, length: int, seed: int, *, text_high: int = 256, semantic_every: int | None = 3
) -> torch.Tensor:
    """A `[length, 1+N]` prompt of text tokens in `[0, text_high)` with a semantic (audio) frame, token
    and codes, every `semantic_every` rows from the first (None: text only). The same arguments give the
    same tensor on every machine: one CPU generator seeded with `seed`, drawn in a fixed order."""
    c = model.config
    g = torch.Generator().manual_seed(seed)
    prompt = torch.zeros(length, 1 + c.num_codebooks, dtype=torch.int64)
    prompt[:, 0] = torch.randint(0, text_high, (length,), generator=g)
    for t in range(0, length, semantic_every) if semantic_every else ():
        codes = torch.randint(0, c.codebook_size, (c.num_codebooks,), generator=g)
        prompt[t, 0] = c.semantic_begin_id + codes[0]
        prompt[t, 1:] = codes
    return prompt


def run_to_completion(engine: Engine, max_iters: int = 10_000):
    """Step until idle; returns ({request_id: codes [T, N]}, {request_id: finish_reason})."""
    codes, reasons = {}, {}
    for _ in range(max_iters):
        if not engine.has_work():
            break
        for out in engine.step():
            codes.setdefault(out.request_id, []).append(out.codes)
            if out.finished:
                reasons[out.request_id] = out.finish_reason
    else:
        raise AssertionError("engine did not finish")
    N = engine.model.config.num_codebooks
    return {k: torch.cat(v) if v else torch.zeros(0, N) for k, v in codes.items()}, reasons


class EagerBucketsGraphRunner(GraphRunner):
    """A graph runner that pads every step to its bucket exactly as a replay would, but always runs it
    eagerly and never captures (at start-up neither): the reference that replays are compared with."""

    def run(self, n: int, variant=None) -> int:
        b = self.bucket_for(n) if self.enabled and n > 0 else None
        if b is None:  # (nothing to run, graphs off, or n above the largest bucket: as any runner does)
            return super().run(n, variant)
        return self._eager(b, variant)

    def capture(self, b: int, variant=None) -> None:
        return None


class EagerBucketsEngine(Engine):
    """An engine whose frame step pads to its bucket as a replay would but runs eagerly
    (`EagerBucketsGraphRunner`); its prefill graphs, if any, are the product's."""

    graph_runner_class = EagerBucketsGraphRunner


def params(**kw) -> SamplingParams:
    base = dict(temperature=0.9, top_p=0.9, top_k=20, max_new_frames=12, seed=7)
    base.update(kw)
    return SamplingParams(**base)


def run_iterations(loop, n: int = 3, timeout: float = 60.0) -> None:
    """Wake an EngineThread `loop` until it has run `n` more iterations (each looks at every job): what a
    test that checks that nothing happens waits for, rather than a sleep (a loaded machine may not run
    the loop at all within a short sleep)."""
    deadline = time.monotonic() + timeout
    for _ in range(n):
        steps = loop.stats.steps
        loop.wake()
        while loop.stats.steps == steps:
            assert time.monotonic() < deadline, "the engine thread ran no iteration"
            time.sleep(0.005)


def decode_in_pushes(codec, codes: torch.Tensor, sizes) -> torch.Tensor:
    """`codes [N, T]` pushed through `codec.stream()` in consecutive pieces of `sizes` frames (the last
    piece may run past the end); the concatenated audio."""
    stream, start, pieces = codec.stream(), 0, []
    for n in sizes:
        pieces.append(stream.push(codes[:, start : start + n]))
        start += n
    return torch.cat(pieces)


def sysfs_mounted() -> bool:
    """Whether /sys is sysfs, which refuses new files even for root: a directory nobody can write to."""
    from pathlib import Path

    mounts = Path("/proc/mounts")
    return mounts.exists() and any(
        line.split()[1:3] == ["/sys", "sysfs"] for line in mounts.read_text().splitlines()
    )


class ScriptedGuard:
    """A stand-in LoopGuard: at the k-th frame it is fed (counting every frame fed, taken back or not),
    `script[k] = (frames, at_end)` reports a repeat of the newest `frames` frames kept; `retractable`
    says `hold`. Records the positions it got and the rewinds."""

    script: dict[int, tuple[int, bool]] = {}
    hold = RETRACT_MAX_FRAMES  # what `retractable` says: by default, as long as any frame could be

    def __init__(self, text_tokens: int, tokens=None):
        self.text_tokens, self.fed, self.kept, self.repeats = text_tokens, 0, 0, 0
        self.positions: list[int] = []
        self.rewinds: list[int] = []

    def push(self, position: int):
        self.positions.append(position)
        self.fed += 1
        self.kept += 1
        entry = self.script.get(self.fed - 1)
        if entry is None:
            return None
        self.repeats += 1
        return Repeat(first=self.kept - entry[0], at_end=entry[1])

    def retractable(self) -> int:
        return self.hold

    def said_all(self) -> bool:  # (the text is said: the end token is never refused for its position)
        return True

    def reached(self) -> int:  # (the position goes on with every frame kept)
        return self.kept - 1

    def rewind(self, first: int) -> None:
        self.rewinds.append(first)
        self.kept = first


def script_loop_guard(
    monkeypatch, script: dict[int, tuple[int, bool]], hold: int = RETRACT_MAX_FRAMES
) -> None:
    """Make the engine's loop guards `ScriptedGuard`s following `script` and saying `hold` frames are
    retractable (for this test)."""
    import tts.engine.engine as engine_module

    monkeypatch.setattr(ScriptedGuard, "script", script)
    monkeypatch.setattr(ScriptedGuard, "hold", hold)
    monkeypatch.setattr(engine_module, "LoopGuard", ScriptedGuard)
