"""Sampling that runs inside a CUDA graph: per-row parameters, counter-based randomness, no host sync.

Algorithm (docs/fish_dual_ar.md §4.1, `logits_to_probs` of fish-speech main):
1. sort the logits descending; `cum = cumsum(softmax(sorted))` on the *un-tempered* logits;
2. drop a sorted position when `cum > top_p` or its rank >= top_k (the rank-0 token is always kept;
   note the token whose cumulative probability crosses top_p is dropped, unlike Hugging Face);
3. divide by `max(temperature, 1e-5)`, softmax;
4. draw with the exponential race `argmax(p / E)`, `E = -log(U)`: equivalent to a multinomial draw,
   without the host sync of `torch.multinomial`. We evaluate it in log space, `argmax(logit / T -
   log E)` (the softmax normalizer does not change the argmax), as the CUDA kernel does.

Temperature 0 means greedy: the argmax of the logits (and no repetition-aware fallback).

Randomness: U comes from a counter-based hash keyed by (request seed, step, stream, token id), where
*step* is the index of the frame being generated and *stream* identifies the draw within the frame
(0 = main token, k = codebook k, N + 1 = the RAS fallback draw). A row's draws therefore depend only on
its own logits and keys, never on batch neighbours, global RNG state, eager vs replay, or batch size.

Repetition-aware sampling (RAS, docs/fish_dual_ar.md §4.1) for the main token: draw `normal` with the
request's temperature/top-p and `high` with temperature 1.0, top-p 0.9 (same top-k); if `normal` is a semantic
token already present among the row's last `ras_window` main tokens, take `high`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from tts.params import MIN_TEMPERATURE, RAS_HIGH_TEMPERATURE, RAS_HIGH_TOP_P

RAS_WINDOW = 10
# A batch whose rows all have 0 < top_k <= this may sample from the top candidates only (CUDA fast path).
SAMPLER_TOPK_CAP = 64

_MASK32 = 0xFFFFFFFF


def _use_triton(t: Tensor) -> bool:
    from tts.model.kernels import fused_kernels_enabled

    return fused_kernels_enabled(t)


def hash32(x: Tensor) -> Tensor:
    """A 32-bit integer mix (Wellons' low-bias "lowbias32" shape, multipliers below 2**31).

    x: int64 with values in [0, 2**32). Every product stays below 2**63, so int64 arithmetic never
    overflows on any backend; returns int64 in [0, 2**32).
    """
    x = x ^ (x >> 16)
    x = (x * 0x21F0AAAD) & _MASK32
    x = x ^ (x >> 15)
    x = (x * 0x735A2D97) & _MASK32
    return x ^ (x >> 15)


def row_keys(seeds: Tensor, steps: Tensor, stream: int | Tensor) -> Tensor:
    """`[B]` int64 32-bit keys from per-row seeds (any int64), steps (>= 0) and a stream id (broadcast)."""
    k = hash32(seeds & _MASK32)
    k = hash32(k ^ ((seeds >> 32) & _MASK32))
    k = hash32(k ^ (steps & _MASK32))
    return hash32(k ^ stream)


def uniform(keys: Tensor, n: int) -> Tensor:
    """`[B, n]` float32 uniforms in (0, 1), element (b, i) a function of (keys[b], i) only."""
    idx = torch.arange(n, device=keys.device, dtype=torch.int64)
    h = hash32((keys.unsqueeze(1) + idx * 0x61C88647) & _MASK32)
    h = hash32(h ^ 0x5BD1E995)
    return ((h >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


def frame_log_noise(seeds: Tensor, steps: Tensor, streams: int, n: int) -> Tensor:
    """`log(E)`, `E = -log U`, for every stream `0..streams-1` and token id `0..n-1` of a frame at once:
    `[B, streams, n]` float32. Slicing `[:, s, :V]` gives exactly the noise `sample(..., stream=s)` draws
    for a V-way row (U depends only on the keys and the token id), in one batch of ops instead of one
    per draw (the CPU path is launch-bound; the CPU frame step, `CpuFrameStep._frame_noise`, also makes
    the next frames' noise in the same batch, rows `(seed, step + j)`)."""
    stream_ids = torch.arange(streams, device=seeds.device)
    keys = row_keys(seeds.unsqueeze(1), steps.unsqueeze(1), stream_ids)
    u = uniform(keys.reshape(-1), n).view(seeds.shape[0], streams, n)
    return torch.log(-torch.log(u))


class DrawSettings:
    """Per-row sampling parameters prepared for the torch sampler: the work that does not depend on the
    logits, done once and shared by every draw of a step that uses the same parameters.

    temperature, top_p: `[B]` float32; top_k: `[B]` int64 (0 = no limit).
    """

    def __init__(
        self, temperature: Tensor, top_p: Tensor, top_k: Tensor, same_top_k: DrawSettings | None = None
    ):
        self.top_k = top_k
        self.top_p = top_p.unsqueeze(1)
        self.t = torch.clamp(temperature, min=MIN_TEMPERATURE).unsqueeze(1)
        self.sampled = temperature > 0  # else greedy
        # Set by a caller that knows (from host values) that every row is sampled: `draw` then skips
        # its greedy select, which would keep the sampled index everywhere (the CPU frame step does).
        self.all_sampled = False
        # The rank masks depend on top_k only: `same_top_k` (settings with this top_k) shares its own.
        self._rank_masks: dict[tuple[int, torch.device], tuple[Tensor, Tensor]] = (
            same_top_k._rank_masks if same_top_k is not None else {}
        )

    def rank_masks(self, V: int, device: torch.device) -> tuple[Tensor, Tensor]:
        """For V sorted candidates: `(rank > 0 [1, V], rank >= top_k and rank > 0 [B, V])`."""
        masks = self._rank_masks.get((V, device))
        if masks is None:
            ranks = torch.arange(V, device=device).unsqueeze(0)
            k_eff = torch.where(self.top_k > 0, self.top_k, V)
            not_first = ranks > 0
            masks = not_first, (ranks >= k_eff.unsqueeze(1)) & not_first
            self._rank_masks[(V, device)] = masks
        return masks


class SortedLogits:
    """Logits sorted once per step, shared by every draw from them (the RAS pair shares one sort)."""

    def __init__(self, logits: Tensor):
        self.raw = logits if logits.dtype == torch.float32 else logits.float()
        self.values, self.indices = torch.sort(
            self.raw, dim=-1, descending=True, stable=True
        )  # ties: lower id first
        self.cum = torch.cumsum(torch.softmax(self.values, dim=-1), dim=-1)

    def draw(self, settings: DrawSettings, keys: Tensor | None, log_noise: Tensor | None = None) -> Tensor:
        """One draw per row; returns `[B]` int64 indices into the logits' last dimension. The noise
        comes from `keys` or, precomputed, from `log_noise [B, V]` (`frame_log_noise`)."""
        V = self.raw.shape[-1]
        not_first, by_rank = settings.rank_masks(V, self.raw.device)
        # remove = (cum > top_p or rank >= top_k) and rank > 0
        remove = ((self.cum > settings.top_p) & not_first) | by_rank
        if log_noise is None:
            assert keys is not None  # the noise comes from one of them
            log_noise = torch.log(-torch.log(uniform(keys, V)))
        log_e = log_noise.gather(1, self.indices)  # the noise follows the token id, not the rank
        score = (self.values / settings.t - log_e).masked_fill(remove, float("-inf"))
        rank = torch.argmax(score, dim=-1, keepdim=True)
        sampled = self.indices.gather(1, rank).squeeze(1)
        if settings.all_sampled:
            return sampled
        return torch.where(settings.sampled, sampled, self.indices[:, 0])


@dataclass
class RowParams:
    """One step's per-row sampling parameters and randomness keys: temperature, top_p `[B]` float32
    (temperature 0 = greedy, top_p in (0, 1]); top_k `[B]` int64 (0 = no limit); seeds, steps `[B]`
    int64 (the frame being generated)."""

    temperature: Tensor
    top_p: Tensor
    top_k: Tensor
    seeds: Tensor
    steps: Tensor


@dataclass
class FrameDraws:
    """Work the torch sampler shares among every draw of one frame, made once by the caller: the
    frame's noise `log_noise [B, streams, n]` (`frame_log_noise`; a draw of stream s reads `[:, s,
    :V]`), the rows' `settings`, and for the main token's RAS pair the fallback's settings
    (`ras_high_settings`) and the counted window slots (`ras_counted`), made here when None. The
    Triton sampler ignores it (it hashes its own noise)."""

    log_noise: Tensor
    settings: DrawSettings
    high_settings: DrawSettings | None = None
    counted: Tensor | None = None


def sample(
    logits: Tensor,
    rows: RowParams,
    stream: int,
    top_k_cap: int | None = None,
    frame: FrameDraws | None = None,
) -> Tensor:
    """Sample one index per row of `logits [B, V]` (any float dtype; math in fp32) with `rows`'
    parameters, as draw `stream` of the frame. Returns `[B]` int64. On CUDA the Triton kernel of
    tts/kernels/sampling.py does the same in one launch; `top_k_cap` (a promise that every row has 0 <
    top_k <= top_k_cap) lets it sort only that many candidates. `frame`: see `FrameDraws`."""
    if _use_triton(logits):
        from tts.model.kernels.sampling import triton_sample

        r = rows
        return triton_sample(logits, r.temperature, r.top_p, r.top_k, r.seeds, r.steps, stream, top_k_cap)
    if frame is None:
        keys, log_noise = row_keys(rows.seeds, rows.steps, stream), None
        settings = DrawSettings(rows.temperature, rows.top_p, rows.top_k)
    else:
        keys, log_noise, settings = None, frame.log_noise[:, stream, : logits.shape[1]], frame.settings
    return SortedLogits(logits).draw(settings, keys, log_noise)


def ras_high_settings(
    temperature: Tensor, top_p: Tensor, top_k: Tensor, settings: DrawSettings
) -> DrawSettings:
    """The RAS fallback draw's settings (temperature 1.0, top-p 0.9, the rows' top_k), sharing the rank
    masks of `settings` (same top_k); what `sample_main_token` builds when not given them."""
    return DrawSettings(
        torch.full_like(temperature, RAS_HIGH_TEMPERATURE),
        torch.full_like(top_p, RAS_HIGH_TOP_P),
        top_k,
        settings,
    )


def ras_counted(window: Tensor, window_len: Tensor) -> Tensor:
    """`[B, W]` bool: which RAS window slots count (the newest `window_len` of each row); what
    `sample_main_token` builds when not given it."""
    W = window.shape[1]
    return torch.arange(W, device=window.device).unsqueeze(0) >= (W - window_len).unsqueeze(1)


def sample_main_token(
    logits: Tensor,
    rows: RowParams,
    window: Tensor,
    window_len: Tensor,
    n_semantic: int,
    high_stream: int,
    top_k_cap: int | None = None,
    frame: FrameDraws | None = None,
) -> Tensor:
    """Main-token draw with the RAS fallback (docs/fish_dual_ar.md §4.1), draw streams 0 and
    `high_stream` of the frame.

    window: `[B, W]` int64 indices of the row's last W main tokens in the same index space as logits,
    newest last, -1 where empty; window_len: `[B]` how many of the newest entries count (0 disables
    RAS); indices `[0, n_semantic)` are semantic tokens; `top_k_cap`, `frame`: as for `sample`.
    Returns `[B]` int64.
    """
    r = rows
    if _use_triton(logits):
        from tts.model.kernels.sampling import triton_sample_main_token

        return triton_sample_main_token(
            logits,
            r.temperature,
            r.top_p,
            r.top_k,
            r.seeds,
            r.steps,
            window,
            window_len,
            n_semantic,
            high_stream,
            top_k_cap,
        )
    sorted_logits = SortedLogits(logits)
    V = logits.shape[1]
    if frame is None:
        settings = DrawSettings(r.temperature, r.top_p, r.top_k)
        normal = sorted_logits.draw(settings, row_keys(r.seeds, r.steps, 0))
        high_settings = ras_high_settings(r.temperature, r.top_p, r.top_k, settings)
        high = sorted_logits.draw(high_settings, row_keys(r.seeds, r.steps, high_stream))
        counted = ras_counted(window, window_len)
    else:
        normal = sorted_logits.draw(frame.settings, None, frame.log_noise[:, 0, :V])
        fallback = frame.high_settings
        if fallback is None:
            fallback = ras_high_settings(r.temperature, r.top_p, r.top_k, frame.settings)
        high = sorted_logits.draw(fallback, None, frame.log_noise[:, high_stream, :V])
        counted = frame.counted if frame.counted is not None else ras_counted(window, window_len)
    repeated = ((window == normal.unsqueeze(1)) & counted).any(dim=1)
    use_high = repeated & (normal < n_semantic) & (r.temperature > 0)
    return torch.where(use_high, high, normal)
