"""Shared test helpers: random prompts for any model config, a synchronous engine driver, streamed codec
decode. A helper two test files need goes here (service tests: tests/service_helpers.py)."""

import torch

from tts.engine import Engine, SamplingParams


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


def params(**kw) -> SamplingParams:
    base = dict(temperature=0.9, top_p=0.9, top_k=20, max_new_frames=12, seed=7)
    base.update(kw)
    return SamplingParams(**base)


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
