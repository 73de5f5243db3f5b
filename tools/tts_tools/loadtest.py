"""Closed-loop load benchmark of a running synthesis server (`tts bench-server --server HOST:PORT`).

At each concurrency level c (default 1, 4, 16, 64), c workers each send one streaming request at a time,
back to back, until the level's request count is reached; every request has its own text (a sentence
from a fixed pool with the request number spoken in it) and its own seed. Reported per level:

* req/s (completed requests / level wall time) and audio seconds per second (the throughput);
* TTFA p50/p95/p99: from just before the call is sent to the first response holding PCM (client side);
* RTF p50/p95: per request, (end message time - send time) / audio seconds (client side);
* per-stream frames/s p50 (`StreamResult.stream_frames_per_s`: a request's frames after its first
  chunk over the time from its first chunk to its last; the decode rate one client sees, to compare
  with `tts bench` frames/s per stream);
* the longest gap between consecutive audio chunks of any request, and the p95 of per-request longest
  gaps (how smooth streaming is under load);
* playback underruns (`playback_underruns`): chunks that arrived after the audio before them would have
  finished playing, had playback started when the first chunk arrived; the total, the share of
  requests with any, and the worst lateness;
* with `--metrics-url`, the server's own time split from its Prometheus counters read before and after
  the level: the codec's share of device time (`codec_share`), reference-cache hits and misses, and
  (printed under the table) where the time to first audio went on the server and how full the codec's
  padded decode calls were;
* errors by gRPC status (RESOURCE_EXHAUSTED counts: the server's admission bound was hit);
* the replicas' shares: OK requests per replica, as each stream's header names it (`StreamHeader.replica`),
  so the shares are right through a load balancer too.

`--server` takes one address (a server, or a load balancer in front of replicas) or several,
comma-separated: then the requests go to them in turn (request i to server i mod n), as a client-side
balancer would spread them.

`--reference` sends a voice clip with the requests (`distinct`: every request its own clip, so a
server-side cache cannot hit; `repeated`: the same clip every time; `registered`: the clip registered
once per level with AddVoice and named in every request), to measure what cloning costs.

The table goes to stdout and everything (with the server's GetInfo) to a JSON file. `--soak` runs the
soak test of `service/soak.py` instead; `--ramp` the real-time ramp of `tts_tools.ramp` (levels of growing
concurrency until streams fall below real time: the most concurrent real-time streams, or the server
setting that stopped the ramp first).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import dataclasses
import io
import itertools
import json
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # (imported where used: `tts --help` loads this module)
    import numpy as np

    from tts_tools.ramp import RampSettings, Verdict


SENTENCES = [
    "The quick brown fox jumps over the lazy dog near the river bank.",
    "Please remember to bring your umbrella, it may rain this afternoon.",
    "Our train leaves the station at a quarter past seven every morning.",
    "She opened the old wooden box and found a stack of yellowed letters.",
    "A gentle breeze carried the smell of fresh bread down the narrow street.",
    "The committee will announce the results of the competition next week.",
    "He tuned the guitar carefully before the concert started in the hall.",
    "Bright stars filled the sky above the quiet mountain village tonight.",
    "Could you tell me the way to the nearest library, please?",
    "The children laughed as the puppy chased its tail around the garden.",
    "Fresh vegetables from the market make the best soup in winter.",
    "Scientists observed a rare bird nesting on the northern cliffs.",
]


class BenchError(RuntimeError):
    """The benchmark cannot run as asked (e.g. the server lacks an RPC a mode needs); one-line reason."""


def request_text(i: int) -> str:
    """A distinct text for request i (the number is spoken, so every prompt differs)."""
    return f"Request {i}. {SENTENCES[i % len(SENTENCES)]}"


def percentile(values: list[float], q: float) -> float | None:
    """The q-th percentile of `values` (None if empty)."""
    import numpy as np

    if not values:
        return None
    return float(np.percentile(np.asarray(values, dtype=np.float64), q))


# ---- playback underruns ---------------------------------------------------------------------------------


def playback_underruns(arrivals: list[float], samples: list[int], sample_rate: int) -> tuple[int, float]:
    """Underruns of a player that starts when the first chunk holding audio arrives and never re-buffers.

    arrivals: per chunk, its arrival time (seconds, any origin); samples: per chunk, the samples it holds.
    Chunk k (after the first with audio) underruns if it arrives later than the first one's arrival plus
    the duration of the audio of the chunks before it. Returns (underruns, worst lateness in seconds;
    0.0 without underruns). Chunks before the first with audio are ignored.
    """
    if len(arrivals) != len(samples):
        raise ValueError("arrivals and samples must have one entry per chunk")
    start = next((k for k, n in enumerate(samples) if n > 0), None)
    if start is None:
        return 0, 0.0
    count, worst = 0, 0.0
    played = 0  # samples delivered before chunk k
    for k in range(start, len(arrivals)):
        due = arrivals[start] + played / sample_rate
        if k > start and arrivals[k] > due:
            count += 1
            worst = max(worst, arrivals[k] - due)
        played += samples[k]
    return count, worst


def playback_end(arrivals: list[float], samples: list[int], sample_rate: int) -> float:
    """When a player that starts with the first chunk holding audio has played all of it (seconds, the
    origin of `arrivals`): each chunk plays from its arrival or the end of the one before, whichever is
    later (a late chunk re-starts the player). 0.0 when no chunk holds audio. Same arguments as
    `playback_underruns`."""
    if len(arrivals) != len(samples):
        raise ValueError("arrivals and samples must have one entry per chunk")
    end = 0.0
    for arrival, n in zip(arrivals, samples, strict=True):
        if n > 0:
            end = max(end, arrival) + n / sample_rate
    return end


# ---- the server's Prometheus metrics --------------------------------------------------------------------

# Counters the benchmark reads before and after each level (key in the report: metric sample name).
# The server's split of the time to first audio (tts.runtime.jobs.FIRST_AUDIO_PHASES; this module does not
# import the engine, which needs torch).
FIRST_AUDIO_PHASES = ("encode", "first_frame", "frames", "codec")
SERVER_COUNTERS = (
    {
        "frame_step_s": "tts_frame_step_seconds_total",
        "codec_decode_s": "tts_codec_decode_seconds_total",
        "codec_encode_s": "tts_codec_encode_seconds_total",
        "reference_cache_hits": "tts_reference_cache_hits_total",
        "reference_cache_misses": "tts_reference_cache_misses_total",
        "frame_steps": "tts_frame_steps_total",
        "frame_step_rows": "tts_frame_step_rows_total",
        "prefill_passes": "tts_prefill_passes_total",
        "prefill_requests": "tts_prefill_requests_total",
        "codec_calls": "tts_codec_decode_calls_total",
        "codec_frames": "tts_codec_decode_frames_total",
        "codec_padded_frames": "tts_codec_decode_padded_frames_total",
        "first_audio_jobs": "tts_first_audio_jobs_total",
        "loop_repeats": "tts_loop_repeats_total",
        "kv_stalls": "tts_kv_stalls_total",
        "kv_preemptions": "tts_kv_preemptions_total",
        "realtime_deferred_speed": 'tts_realtime_deferred_total{reason="speed"}',
        "realtime_deferred_slack": 'tts_realtime_deferred_total{reason="slack"}',
        "realtime_deferred_gather": 'tts_realtime_deferred_total{reason="gather"}',
        "realtime_forced": "tts_realtime_forced_total",
        "realtime_rode_along": "tts_realtime_rode_along_total",
    }
    | {
        f"engine_{phase}_s": f'tts_engine_seconds_total{{phase="{phase}"}}'
        for phase in ("prefill", "replay", "rows", "audio", "route", "commands", "idle", "handover")
    }
    | {
        f"engine_device_{phase}_s": f'tts_engine_device_seconds_total{{phase="{phase}"}}'
        for phase in ("prefill", "replay")
    }
    | {
        f"first_audio_{phase}_s": f'tts_first_audio_seconds_total{{phase="{phase}"}}'
        for phase in FIRST_AUDIO_PHASES
    }
)


def parse_metrics(text: str) -> dict[str, float]:
    """Prometheus text exposition -> {sample name: value summed over its label sets}, plus each labelled
    sample as `name{label="value",...}` (`_created` timestamps dropped)."""
    from prometheus_client.parser import text_string_to_metric_families

    values: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name.endswith("_created"):
                continue
            values[sample.name] = values.get(sample.name, 0.0) + float(sample.value)
            if sample.labels:
                labels = ",".join(f'{k}="{v}"' for k, v in sorted(sample.labels.items()))
                values[f"{sample.name}{{{labels}}}"] = float(sample.value)
    return values


def read_metrics(url: str, timeout: float = 5.0) -> dict[str, float]:
    """Scrape a Prometheus endpoint (blocking); see `parse_metrics`. Raises OSError if unreachable."""
    with urllib.request.urlopen(url, timeout=timeout) as response:
        return parse_metrics(response.read().decode("utf-8", "replace"))


def server_time_split(before: dict[str, float] | None, after: dict[str, float] | None) -> dict:
    """The server-side counters' change over a level: frame-step, codec decode and encode seconds,
    reference-cache hits and misses, the loop guard's repeats, waits for KV blocks and streams preempted
    to free them (kv_stalls, kv_preemptions), frame steps and their rows (mean_batch =
    rows / steps), prefill passes and the requests they took (requests_per_prefill), codec decode calls
    and their frames (codec_frames_per_call; codec_fill = frames / padded frames computed), codec_share =
    codec / (frame
    steps + codec), and the mean server-side time to first audio by phase
    (first_audio_{encode,first_frame,frames,codec}_ms; see `tts_first_audio_seconds_total`).

    A counter the server does not export is None (codec encode counts as 0 for the share if only it is
    missing); a derived value is None without its counters or when its denominator is 0 (e.g.
    codec_share without any time spent)."""
    out: dict[str, float | None] = {}
    for key, name in SERVER_COUNTERS.items():
        if before is None or after is None or name not in before or name not in after:
            out[key] = None
        else:
            out[key] = after[name] - before[name]
    step, decode, encode = out["frame_step_s"], out["codec_decode_s"], out["codec_encode_s"]
    share = None
    if step is not None and decode is not None:
        codec = decode + (encode or 0.0)
        share = codec / (step + codec) if step + codec > 0 else None
    out["codec_share"] = share
    steps, rows = out["frame_steps"], out["frame_step_rows"]
    out["mean_batch"] = rows / steps if steps and rows is not None else None
    passes, prefilled = out["prefill_passes"], out["prefill_requests"]
    out["requests_per_prefill"] = prefilled / passes if passes and prefilled is not None else None
    calls, frames = out["codec_calls"], out["codec_frames"]
    out["codec_frames_per_call"] = frames / calls if calls and frames is not None else None
    padded = out["codec_padded_frames"]
    out["codec_fill"] = frames / padded if padded and frames is not None else None
    jobs = out["first_audio_jobs"]
    for phase in FIRST_AUDIO_PHASES:
        seconds = out[f"first_audio_{phase}_s"]
        out[f"first_audio_{phase}_ms"] = 1000.0 * seconds / jobs if jobs and seconds is not None else None
    return out


# ---- reference clips ------------------------------------------------------------------------------------

REFERENCE_MODES = ("none", "distinct", "repeated", "registered")
BENCH_VOICE = "bench-voice"  # the name `--reference registered` registers (replacing) and deletes
SYNTHETIC_TEXT = "This is a synthetic reference clip that the load benchmark sends to the server."
SYNTHETIC_SECONDS = 10.0
SYNTHETIC_RATE = 16000


def synthetic_speech(seconds: float = SYNTHETIC_SECONDS, rate: int = SYNTHETIC_RATE) -> np.ndarray:
    """A deterministic speech-like float32 signal (peak 0.5): syllables of 0.12-0.3 s with pauses,
    each a voiced source (harmonics of a gliding pitch around 120 Hz) shaped by two formants that move
    from syllable to syllable, and noise bursts (fricatives) in some pauses. Not speech, but it has
    speech's pitch, spectral envelope and rhythm, so codecs and silence checks treat it like a voice."""
    import numpy as np

    n = int(round(seconds * rate))
    rng = np.random.default_rng(20261201)
    env = np.zeros(n)
    hiss = np.zeros(n)
    f1 = np.full(n, 500.0)
    f2 = np.full(n, 1500.0)
    pos = 0
    while pos < n:
        dur = int(rate * rng.uniform(0.12, 0.3))
        gap = int(rate * rng.uniform(0.03, 0.12))
        end = min(n, pos + dur)
        env[pos:end] = np.sin(np.pi * (np.arange(end - pos) + 0.5) / dur) ** 0.7
        f1[pos:end], f2[pos:end] = rng.uniform(300, 800), rng.uniform(900, 2300)
        stop = min(n, end + gap)
        if stop > end and rng.random() < 0.4:
            hiss[end:stop] = np.hanning(stop - end)
        f1[end:stop], f2[end:stop] = f1[end - 1], f2[end - 1]
        pos = stop
    smooth = np.ones(int(0.02 * rate)) / int(0.02 * rate)  # 20 ms glides between vowels
    f1, f2 = np.convolve(f1, smooth, "same"), np.convolve(f2, smooth, "same")
    t = np.arange(n) / rate
    f0 = 120 + 20 * np.sin(2 * np.pi * 0.5 * t) + 8 * np.sin(2 * np.pi * 2.3 * t)
    phase = 2 * np.pi * np.cumsum(f0) / rate
    voiced = np.zeros(n)
    for h in range(1, int((rate / 2 - 300) / f0.max()) + 1):
        fh = h * f0
        amp = np.exp(-(((fh - f1) / 120) ** 2)) + 0.6 * np.exp(-(((fh - f2) / 200) ** 2)) + 0.03
        voiced += amp / np.sqrt(h) * np.sin(h * phase)
    noise = np.diff(rng.standard_normal(n + 1))  # a rough high-pass: fricative-like
    x = voiced * env + 0.15 * noise * hiss
    return (0.5 * x / np.abs(x).max()).astype(np.float32)


def wav_bytes(samples: np.ndarray, rate: int) -> bytes:
    """`[channels, n]` or `[n]` float samples -> 16-bit PCM WAV bytes."""
    import numpy as np
    import soundfile as sf

    data = np.asarray(samples, dtype=np.float32)
    data = data.T if data.ndim == 2 else data
    buf = io.BytesIO()
    sf.write(buf, np.clip(data, -1.0, 1.0), rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


@dataclass
class ReferenceClip:
    """The clip `--reference` sends: `raw` as given (repeated, registered) or changed per request
    (`distinct`: a different circular offset and gain of the same samples for every request index, so
    no two requests send the same bytes)."""

    samples: np.ndarray  # [channels, n] float32
    rate: int
    text: str
    raw: bytes

    @classmethod
    def from_bytes(cls, data: bytes, text: str) -> ReferenceClip:
        """A clip from audio file bytes (raises tts.codec.base.AudioError if unreadable)."""
        from tts.audio.files import read_audio

        samples, rate = read_audio(data)
        return cls(samples, rate, text, data)

    @classmethod
    def synthetic(cls, seconds: float = SYNTHETIC_SECONDS) -> ReferenceClip:
        """The generated speech-like clip (`synthetic_speech`) with `SYNTHETIC_TEXT` as its transcript."""
        samples = synthetic_speech(seconds)[None]
        return cls(samples, SYNTHETIC_RATE, SYNTHETIC_TEXT, wav_bytes(samples, SYNTHETIC_RATE))

    def distinct(self, i: int) -> bytes:
        """Request i's own clip: the samples rotated by i * 7919 samples (7919 is prime, so the offsets of
        different i differ as long as i stays below the clip's sample count) and scaled by a gain in
        [0.55, 0.95) that also varies with i."""
        import numpy as np

        n = self.samples.shape[-1]
        gain = 0.55 + 0.4 * ((i * 0.6180339887498949) % 1.0)
        return wav_bytes(np.roll(self.samples, (i * 7919) % n, axis=-1) * gain, self.rate)


async def register_voice(stub, clip: ReferenceClip, name: str = BENCH_VOICE) -> float:
    """Register `clip` as voice `name` with AddVoice (replace=true); returns the call's seconds.
    Raises BenchError if the server lacks AddVoice (UNIMPLEMENTED) or refuses the clip."""
    import grpc

    from service.grpc_gen.v1 import tts_pb2 as pb

    request = pb.AddVoiceRequest(
        name=name, reference=pb.ReferenceAudio(audio=clip.raw, text=clip.text), replace=True
    )
    t0 = time.perf_counter()
    try:
        await stub.AddVoice(request, timeout=120)
    except grpc.aio.AioRpcError as exc:
        if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
            raise BenchError(
                "--reference registered needs the AddVoice RPC, which this server does not implement "
                "(UNIMPLEMENTED); use --reference repeated or distinct"
            ) from exc
        raise BenchError(f"AddVoice {name!r} failed: {exc.code().name}: {exc.details()}") from exc
    return time.perf_counter() - t0


async def delete_voice(stub, name: str = BENCH_VOICE) -> None:
    """Delete a voice registered by `register_voice` (best effort: errors are ignored)."""
    import grpc

    from service.grpc_gen.v1 import tts_pb2 as pb

    try:
        await stub.DeleteVoice(pb.DeleteVoiceRequest(name=name), timeout=30)
    except grpc.aio.AioRpcError:
        pass


def voice_source(mode: str, clip: ReferenceClip | None) -> Callable[[int], dict]:
    """request index -> the `build_request` voice keywords of reference mode `mode`."""
    if mode == "none":
        return lambda i: {}
    if clip is None:
        raise ValueError(f"reference mode {mode} needs a clip")
    if mode == "distinct":
        return lambda i: {"reference_audio": clip.distinct(i), "reference_text": clip.text}
    if mode == "repeated":
        return lambda i: {"reference_audio": clip.raw, "reference_text": clip.text}
    if mode == "registered":
        return lambda i: {"voice": BENCH_VOICE}
    raise ValueError(f"unknown reference mode {mode!r}")


def reference_clip(mode: str, data: bytes | None, text: str | None, info) -> ReferenceClip | None:
    """The clip of `--reference MODE` (None for `none`): the given file's bytes, or the synthetic clip
    (10 s, shorter if the server's GetInfo.max_reference_seconds is smaller). Raises BenchError if the
    file is unreadable or larger than the server accepts."""
    from tts.codec.base import AudioError

    if mode == "none":
        return None
    if data is None:
        seconds = SYNTHETIC_SECONDS
        if info.max_reference_seconds > 0:
            seconds = min(seconds, 0.9 * info.max_reference_seconds)
        clip = ReferenceClip.synthetic(seconds)
    else:
        try:
            clip = ReferenceClip.from_bytes(data, text or "")
        except AudioError as exc:
            raise BenchError(f"--reference-audio: {exc}") from exc
    if info.max_reference_bytes and len(clip.raw) > info.max_reference_bytes:
        raise BenchError(
            f"the reference clip is {len(clip.raw)} bytes; the server accepts at most "
            f"{info.max_reference_bytes}"
        )
    return clip


# ---- one level ------------------------------------------------------------------------------------------


@dataclass
class LevelResult:
    """One concurrency level's figures (times in ms where the name says so)."""

    concurrency: int
    requests: int
    ok: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    wall_s: float = 0.0
    req_per_s: float = 0.0
    audio_s_per_s: float = 0.0
    frames_per_s: float = 0.0
    audio_s_mean: float = 0.0
    ttfa_ms: dict[str, float | None] = field(default_factory=dict)
    rtf: dict[str, float | None] = field(default_factory=dict)
    stream_fps_p50: float | None = None  # per-stream frames/s once audio flows, median over requests
    max_gap_ms: float | None = None
    gap_p95_ms: float | None = None
    underruns: int = 0  # chunks late for playback, all OK requests together
    underrun_share: float | None = None  # share of OK requests with at least one underrun
    underrun_worst_ms: float | None = None  # the latest any chunk was (None: no underrun)
    server: dict = field(default_factory=dict)  # server_time_split of the level (None values: not exported)
    register_s: float | None = None  # --reference registered: the AddVoice call before the level
    replicas: dict[str, int] = field(default_factory=dict)  # OK requests per replica (StreamHeader.replica)
    verdict: Verdict | None = None  # --ramp: real time or not, and what limited it (tts_tools.ramp)


async def _run_level(
    stubs,
    concurrency: int,
    total: int,
    counter,
    make_request,
    timeout: float | None,
    spread_s: float = 0.0,
    paced: bool = False,
):
    """One level: `concurrency` workers (streams) issue `total` requests in all, each its share
    (total // concurrency, one more for the first total % concurrency): every stream runs for the whole
    level, the first ones do not take the requests of those that start later. spread_s > 0: worker k
    sends its first request k x spread_s / concurrency seconds after the start, so the streams arrive
    spread over that time (as independent callers do) instead of all at once. paced: a worker sends its
    next request when the audio of its last one has played (`playback_end`), so each worker is one
    real-time audio stream; unpaced, it sends it as soon as the last one's stream ended, asking for
    audio faster than real time whenever the server is faster."""
    import grpc

    from service.client import StreamError, synthesize_stream

    result = LevelResult(concurrency=concurrency, requests=total)
    ttfa: list[float] = []
    rtf: list[float] = []
    max_gaps: list[float] = []
    stream_fps: list[float] = []
    audio_s: list[float] = []
    late: list[tuple[int, float]] = []
    frames = 0

    async def worker(k: int):
        nonlocal frames
        if spread_s > 0 and k:
            await asyncio.sleep(k * spread_s / concurrency)
        played_at = None  # paced: when the last request's audio will have played (perf_counter)
        for _ in range(total // concurrency + (k < total % concurrency)):
            if played_at is not None:
                await asyncio.sleep(max(0.0, played_at - time.perf_counter()))
                played_at = None
            i = next(counter)
            request = make_request(i)
            sent = time.perf_counter()
            try:
                r = await synthesize_stream(stubs[i % len(stubs)], request, timeout=timeout)
            except (grpc.aio.AioRpcError, StreamError) as exc:
                # (StreamError: the server broke the stream's protocol, an error of the level's like a status)
                name = exc.code().name if isinstance(exc, grpc.aio.AioRpcError) else "PROTOCOL"
                result.errors[name] = result.errors.get(name, 0) + 1
                continue
            if paced:
                played_at = sent + playback_end(r.arrivals, r.chunk_samples, r.sample_rate)
            result.ok += 1
            replica = r.header.replica or "-"
            result.replicas[replica] = result.replicas.get(replica, 0) + 1
            frames += r.end.frames
            audio_s.append(r.audio_seconds)
            if r.ttfa is not None:
                ttfa.append(r.ttfa)
            if r.audio_seconds > 0:
                rtf.append(r.rtf)
            max_gaps.append(r.max_gap)
            if r.stream_frames_per_s is not None:
                stream_fps.append(r.stream_frames_per_s)
            late.append(playback_underruns(r.arrivals, r.chunk_samples, r.sample_rate))

    t0 = time.perf_counter()
    await asyncio.gather(*(worker(k) for k in range(concurrency)))
    result.wall_s = time.perf_counter() - t0
    result.req_per_s = result.ok / result.wall_s
    result.audio_s_per_s = sum(audio_s) / result.wall_s
    result.frames_per_s = frames / result.wall_s
    result.audio_s_mean = sum(audio_s) / len(audio_s) if audio_s else 0.0
    result.ttfa_ms = {f"p{q}": _ms(percentile(ttfa, q)) for q in (50, 95, 99)}
    result.rtf = {f"p{q}": percentile(rtf, q) for q in (50, 95)}
    result.stream_fps_p50 = percentile(stream_fps, 50)
    result.max_gap_ms = _ms(max(max_gaps, default=None))
    result.gap_p95_ms = _ms(percentile(max_gaps, 95))
    result.underruns = sum(n for n, _ in late)
    result.underrun_share = sum(1 for n, _ in late if n) / len(late) if late else None
    result.underrun_worst_ms = _ms(max((w for n, w in late if n), default=None))
    return result


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


async def _scrape(url: str | None) -> dict[str, float] | None:
    if url is None:
        return None
    try:
        return await asyncio.to_thread(read_metrics, url)
    except (OSError, ValueError):
        return None


def ramp_arrivals(
    ramp: RampSettings | None, max_new_frames: int | None, frame_rate: float
) -> tuple[RampSettings | None, float]:
    """The ramp's settings as they will run and the spread of a level's first requests, seconds: one
    request's playback time (`max_new_frames` / `frame_rate`) with spread arrivals; without a known
    request length (no `max_new_frames`) the streams arrive at once, and the settings say so."""
    if ramp is None or not ramp.spread:
        return ramp, 0.0
    if not max_new_frames or not frame_rate:
        return dataclasses.replace(ramp, spread=False), 0.0
    return ramp, max_new_frames / frame_rate


async def run_loadtest(
    server: str,
    concurrency: list[int],
    *,
    requests: int | None = None,
    seed: int = 1000,
    warmup: int = 1,
    timeout: float | None = None,
    progress=None,
    reference: str = "none",
    reference_audio: bytes | None = None,
    reference_text: str | None = None,
    metrics_url: str | None = None,
    ramp: RampSettings | None = None,
    **request_options,
) -> dict:
    """Run the benchmark; returns the report dict (see `format_table`). `server`: HOST:PORT, or several
    comma-separated (request i goes to server i mod n). `requests`: per level (default
    max(8, 4 * concurrency)); `reference`: one of REFERENCE_MODES, with the clip's bytes and transcript
    (None: the synthetic clip); `metrics_url`: the server's Prometheus endpoint for the server-side time
    split (None: those fields stay None); `request_options`: build_request keywords (voice, temperature,
    top_p, top_k, max_new_frames, min_new_frames, encoding, first_chunk_frames, chunk_frames).
    `ramp`: instead of the levels of `concurrency` (ignored, as is `requests`), the real-time ramp of
    `tts_tools.ramp` (levels of ramp.rounds x C requests); the report then has `mode` "ramp", a `ramp`
    section (`ramp_report`) and a `verdict` per level.
    Raises BenchError (e.g. `registered` on a server without AddVoice), ValueError (bad ramp settings)
    and grpc.aio.AioRpcError."""
    from google.protobuf.json_format import MessageToDict

    from service.client import aio_channel, build_request, synthesize_stream
    from service.grpc_gen.v1 import tts_pb2 as pb
    from service.grpc_gen.v1 import tts_pb2_grpc as pb_grpc

    if reference not in REFERENCE_MODES:
        raise ValueError(f"reference must be one of {REFERENCE_MODES}, got {reference!r}")
    if reference != "none" and request_options.get("voice") is not None:
        raise ValueError("give a voice or a reference mode, not both")
    servers = [s.strip() for s in server.split(",")]
    async with contextlib.AsyncExitStack() as channels:
        stubs = [
            pb_grpc.TextToSpeechStub(await channels.enter_async_context(aio_channel(s))) for s in servers
        ]
        infos = [await stub.GetInfo(pb.GetInfoRequest(), timeout=30) for stub in stubs]
        info = infos[0]
        clip = reference_clip(reference, reference_audio, reference_text, info)
        voice = voice_source(reference, clip)

        def make_request(i: int):
            return build_request(request_text(i), seed=seed + i, **{**request_options, **voice(i)})

        async def register() -> float:  # on every listed server (through a balancer: on one replica only)
            assert clip is not None  # called only for reference mode "registered", which has a clip
            return sum([await register_voice(stub, clip) for stub in stubs])

        registered = False
        try:
            if reference == "registered":
                await register()
                registered = True
            counter = itertools.count()
            for _ in range(warmup):
                i = next(counter)
                await synthesize_stream(stubs[i % len(stubs)], make_request(i), timeout)

            # --ramp with spread arrivals: first requests spread over one request's playback time.
            ramp, spread_s = ramp_arrivals(ramp, request_options.get("max_new_frames"), info.frame_rate)

            async def run_level(c: int, n: int) -> LevelResult:
                register_s = await register() if reference == "registered" else None
                before = await _scrape(metrics_url)
                paced = ramp is not None and ramp.paced
                level = await _run_level(stubs, c, n, counter, make_request, timeout, spread_s, paced)
                level.server = server_time_split(before, await _scrape(metrics_url))
                level.register_s = register_s
                return level

            outcome = None
            if ramp is None:
                levels = []
                for c in concurrency:
                    levels.append(await run_level(c, requests if requests is not None else max(8, 4 * c)))
                    if progress is not None:
                        progress(levels[-1])
            else:
                from tts_tools.ramp import ramp_search

                rounds = ramp.rounds
                outcome = await ramp_search(
                    lambda c: run_level(c, rounds * c), ramp, server_rows(infos), progress
                )
                levels = outcome.levels
            info_after = await stubs[0].GetInfo(pb.GetInfoRequest(), timeout=30)
        finally:
            if registered:
                for stub in stubs:
                    await delete_voice(stub)
    settings = {
        "requests_per_level": requests,
        "seed": seed,
        "warmup": warmup,
        "reference": reference,
        "reference_bytes": len(clip.raw) if clip else None,
        "reference_seconds": clip.samples.shape[-1] / clip.rate if clip else None,
        "metrics_url": metrics_url,
        **request_options,
    }
    report = {
        "mode": "levels" if ramp is None else "ramp",
        "server": server,
        "servers": servers,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "info": MessageToDict(info, preserving_proto_field_name=True),
        "infos": [MessageToDict(i, preserving_proto_field_name=True) for i in infos],
        "replay_share_after": info_after.replay_share,
        "settings": settings,
        "levels": [asdict(level) for level in levels],
    }
    if ramp is not None and outcome is not None:
        from tts_tools.ramp import ramp_report

        report["ramp"] = ramp_report(ramp, outcome, server_rows(infos), sum(i.max_waiting for i in infos))
    return report


def server_rows(infos) -> int | None:
    """The batch rows of the listed servers: the sum of their GetInfo.max_batch (None if one lacks it)."""
    return sum(i.max_batch for i in infos) if all(i.max_batch for i in infos) else None


def format_table(report: dict) -> str:
    """A fixed-width table of the report's levels ("-": no value, e.g. a counter the server lacks)."""
    head = (
        f"{'conc':>5} {'reqs':>5} {'ok':>5} {'err':>4} {'req/s':>7} {'audio s/s':>9} {'frames/s':>8} "
        f"{'TTFA p50':>9} {'p95':>8} {'p99':>8} {'RTF p50':>8} {'p95':>7} {'fps/stream':>10} {'max gap':>8} "
        f"{'underruns':>9} {'%req':>5} {'worst':>8} {'codec':>6} {'cache hit/miss':>14}"
    )
    lines = [head, "-" * len(head)]

    def f(v, width: int, spec: str, unit: str = "", scale: float = 1.0) -> str:
        return format("-" if v is None else format(v * scale, spec) + unit, f">{width}")

    for lv in report["levels"]:
        t, r = lv["ttfa_ms"], lv["rtf"]
        s = lv.get("server") or {}
        hits, misses = s.get("reference_cache_hits"), s.get("reference_cache_misses")
        cache = "-" if hits is None and misses is None else f"{f(hits, 0, '.0f')}/{f(misses, 0, '.0f')}"
        lines.append(
            f"{lv['concurrency']:>5} {lv['requests']:>5} {lv['ok']:>5} {sum(lv['errors'].values()):>4} "
            f"{lv['req_per_s']:>7.2f} {lv['audio_s_per_s']:>9.2f} {lv['frames_per_s']:>8.1f} "
            f"{f(t['p50'], 9, '.0f', 'ms')} {f(t['p95'], 8, '.0f', 'ms')} {f(t['p99'], 8, '.0f', 'ms')} "
            f"{f(r['p50'], 8, '.3f')} {f(r['p95'], 7, '.3f')} {f(lv.get('stream_fps_p50'), 10, '.1f')} "
            f"{f(lv['max_gap_ms'], 8, '.0f', 'ms')} "
            f"{lv.get('underruns', 0):>9} {f(lv.get('underrun_share'), 5, '.0f', '%', 100)} "
            f"{f(lv.get('underrun_worst_ms'), 8, '.0f', 'ms')} {f(s.get('codec_share'), 6, '.1f', '%', 100)} "
            f"{cache:>14}"
        )
    return "\n".join(lines)


def format_first_audio(report: dict) -> str:
    """One line per level that has the server's counters: the mean server-side time to first audio by
    phase, and the codec calls' fill (real frames / frames computed with padding)."""
    lines = []
    for lv in report["levels"]:
        s = lv.get("server") or {}
        ms = [s.get(f"first_audio_{phase}_ms") for phase in FIRST_AUDIO_PHASES]
        if all(v is None for v in ms):
            continue
        parts = ", ".join(
            f"{phase} {'-' if v is None else f'{v:.0f} ms'}"
            for phase, v in zip(FIRST_AUDIO_PHASES, ms, strict=True)
        )
        fill = s.get("codec_fill")
        lines.append(
            f"first audio at concurrency {lv['concurrency']} (server, mean): {parts}; "
            f"codec fill {'-' if fill is None else f'{fill:.0%}'}"
        )
    return "\n".join(lines)


def replica_shares(level: dict) -> dict[str, float]:
    """A level's share of OK requests per replica (name -> fraction; {} without OK requests)."""
    counts = level.get("replicas") or {}
    total = sum(counts.values())
    return {name: n / total for name, n in sorted(counts.items())} if total else {}


def format_shares(report: dict) -> str:
    """One line per level: how many OK requests each replica served, and its share."""
    lines = []
    for lv in report["levels"]:
        counts, shares = lv.get("replicas") or {}, replica_shares(lv)
        parts = ", ".join(f"{name} {counts[name]} ({share:.0%})" for name, share in shares.items())
        lines.append(f"replicas at concurrency {lv['concurrency']}: {parts or '-'}")
    return "\n".join(lines)


# ---- command line -------------------------------------------------------------------------------------


def parse_levels(text: str) -> list[int]:
    """`1,4,16` -> [1, 4, 16] (argparse type: positive integers)."""
    try:
        levels = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        levels = []
    if not levels or min(levels) < 1:
        raise argparse.ArgumentTypeError(
            f"concurrency levels must be positive integers like 1,4,16; got {text!r}"
        )
    return levels


def add_arguments(p: argparse.ArgumentParser, server_required: bool = True) -> None:
    """The load benchmark's options (shared by `tts bench-server` and `tts bench --server`, which passes
    server_required=False and calls `run_from_args` when --server is given), the soak's included."""
    from tts_tools.soak import add_soak_arguments

    p.add_argument(
        "--server",
        required=server_required,
        help="HOST:PORT of a running `tts serve` (or of a load balancer in front of replicas); several, "
        "comma-separated, get the requests in turn",
    )
    p.add_argument(
        "--concurrency",
        type=parse_levels,
        default=None,
        help="levels (default 1,4,16,64); with --soak one value, the concurrent clients (default 8)",
    )
    p.add_argument(
        "--requests",
        type=int,
        default=None,
        help="requests per level (default max(8, 4 x level)); with --soak in all (default 1000)",
    )
    p.add_argument(
        "--json",
        default=None,
        help="write the report here (default bench_server.json; soak.json with --soak)",
    )
    p.add_argument("--warmup", type=int, default=1, help="requests before the first level (default 1)")
    p.add_argument("--timeout", type=float, default=None, help="deadline per request in seconds")
    p.add_argument("--seed", type=int, default=1000, help="request i uses seed + i (default 1000)")
    p.add_argument("--voice", default=None, help="preset or registered voice for every request")
    p.add_argument("--max-new-frames", type=int, default=None, help="frame budget per request")
    p.add_argument(
        "--min-new-frames",
        type=int,
        default=None,
        help="frames per text chunk before the end token may be sampled (fixes the length on real models)",
    )
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--first-chunk-frames", type=int, default=0, help="0 = server default")
    p.add_argument("--chunk-frames", type=int, default=0, help="0 = server default")
    p.add_argument("--encoding", choices=["pcm16", "float32"], default="pcm16")
    p.add_argument(
        "--reference",
        choices=REFERENCE_MODES,
        default="none",
        help="send a voice clip: distinct (a different clip per request), repeated (the same clip), "
        f"registered (AddVoice once per level as {BENCH_VOICE!r}, named in every request); default none",
    )
    p.add_argument(
        "--reference-audio",
        help="WAV, FLAC, MP3 or Ogg clip for --reference (default: a generated 10 s clip)",
    )
    p.add_argument("--reference-text", help="transcript of --reference-audio")
    p.add_argument(
        "--metrics-url",
        default=None,
        help="the server's Prometheus endpoint (http://HOST:PORT/metrics): the server-side time split per "
        "level (default: none); with --soak default http://<--server host>:9464/metrics, 'off' = none",
    )
    p.add_argument(
        "--sessions",
        type=int,
        default=None,
        help="instead of the levels: N concurrent SynthesizeSession calls fed word by word by a synthetic "
        "LLM (tts_tools.session_bench): clause -> first audio, close -> last audio, underruns, "
        "cancel -> silence, prefill tokens per chunk",
    )
    p.add_argument(
        "--words-per-second",
        type=float,
        default=15.0,
        help="with --sessions: the synthetic LLM's writing rate (default 15)",
    )
    p.add_argument(
        "--cancel-share",
        type=float,
        default=0.25,
        help="with --sessions: the share of sessions that barge in mid-sentence (default 0.25)",
    )
    p.add_argument(
        "--session-spread",
        type=float,
        default=0.0,
        help="with --sessions: session i starts i x SPREAD / N seconds after the first, as independent "
        "callers arrive (default 0: all at once, so their first clauses complete together: the worst case)",
    )
    add_ramp_arguments(p)
    add_soak_arguments(p)


def add_ramp_arguments(p) -> None:
    """The options of `--ramp` (in a group of their own unless `p` already is a group)."""
    from tts_tools import ramp

    if isinstance(p, argparse.ArgumentParser):
        p = p.add_argument_group("real-time ramp (with --ramp)")
    p.add_argument(
        "--ramp",
        action="store_true",
        help="instead of --concurrency levels: ramp the concurrency (from --ramp-start, doubling, then "
        "bisecting between the last real-time level and the first that is not, to --ramp-step) and report "
        "the most concurrent streams that stay real time (no playback underrun, TTFA p95 <= --ramp-ttfa-p95, "
        "no error), or, when the server's max batch, queue bound or KV pool stopped the ramp, say so; fix "
        "the request length with --max-new-frames and --min-new-frames",
    )
    p.add_argument(
        "--ramp-start",
        type=int,
        default=None,
        help=f"--ramp: the first level's concurrency (default {ramp.DEFAULT_START})",
    )
    p.add_argument(
        "--ramp-max",
        type=int,
        default=None,
        help=f"--ramp: the highest concurrency tried; the ramp stops there (default {ramp.DEFAULT_MAX})",
    )
    p.add_argument(
        "--ramp-step",
        type=int,
        default=None,
        help=f"--ramp: the bisection's resolution in streams (default {ramp.DEFAULT_STEP})",
    )
    p.add_argument(
        "--ramp-rounds",
        type=int,
        default=None,
        help=f"--ramp: requests per stream per level: a level is ROUNDS x C requests (default "
        f"{ramp.DEFAULT_ROUNDS})",
    )
    p.add_argument(
        "--ramp-ttfa-p95",
        type=float,
        default=None,
        help=f"--ramp: the highest TTFA p95 of a real-time level, ms (default {ramp.DEFAULT_TTFA_P95_MS:g})",
    )
    p.add_argument(
        "--ramp-arrivals",
        choices=("spread", "burst"),
        default=None,
        help="--ramp: spread (default): a level's streams start spread over one request's playback time "
        "(--max-new-frames / the frame rate), as independent callers arrive; burst: all at once (TTFA then "
        "measures C simultaneous prefills, the worst case)",
    )
    p.add_argument(
        "--ramp-pacing",
        choices=("playback", "none"),
        default=None,
        help="--ramp: playback (default): a stream sends its next request when the audio of its last one "
        "has played, so C streams are C real-time audio streams; none: as soon as the last one's audio "
        "arrived (closed loop: each stream asks for audio as fast as the server makes it, a heavier load "
        "than C real-time streams)",
    )


RAMP_OPTIONS = (
    "ramp_start",
    "ramp_max",
    "ramp_step",
    "ramp_rounds",
    "ramp_ttfa_p95",
    "ramp_arrivals",
    "ramp_pacing",
)


def options_need(names: list[str], what: str) -> str:
    """The one-line error for options (argparse dest names) given without `what`: "--a, --b need X"."""
    given = ", ".join(f"--{name.replace('_', '-')}" for name in names)
    return f"{given} {'needs' if len(names) == 1 else 'need'} {what}"


def ramp_settings(args: argparse.Namespace) -> RampSettings | None:
    """The RampSettings of parsed `add_arguments` options (None without --ramp). Raises BenchError with a
    one-line reason for ramp options without --ramp, options the ramp replaces (--concurrency,
    --requests, --soak, --sessions) and values out of range."""
    from tts_tools.ramp import RampSettings

    given = [name for name in RAMP_OPTIONS if getattr(args, name, None) is not None]
    if not getattr(args, "ramp", False):
        if given:
            raise BenchError(options_need(given, "--ramp"))
        return None
    for option, replaced in (
        ("concurrency", "the ramp chooses the levels"),
        ("requests", "a level is --ramp-rounds x C requests"),
        ("soak", "a different mode"),
        ("sessions", "a different mode"),
    ):
        if getattr(args, option, None) not in (None, False):
            raise BenchError(f"--ramp takes no --{option} ({replaced})")
    defaults = RampSettings()
    settings = RampSettings(
        start=args.ramp_start if args.ramp_start is not None else defaults.start,
        stop=args.ramp_max if args.ramp_max is not None else defaults.stop,
        step=args.ramp_step if args.ramp_step is not None else defaults.step,
        rounds=args.ramp_rounds if args.ramp_rounds is not None else defaults.rounds,
        ttfa_p95_ms=args.ramp_ttfa_p95 if args.ramp_ttfa_p95 is not None else defaults.ttfa_p95_ms,
        spread=args.ramp_arrivals != "burst",
        paced=args.ramp_pacing != "none",
    )
    if args.ramp_start is not None and args.ramp_max is None:
        settings.stop = max(settings.stop, settings.start)
    try:
        settings.check()
    except ValueError as exc:
        raise BenchError(str(exc)) from exc
    return settings


def request_options(args: argparse.Namespace) -> dict:
    """The build_request keywords of parsed `add_arguments` options."""
    return {
        "voice": args.voice,
        "max_new_frames": args.max_new_frames,
        "min_new_frames": args.min_new_frames,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "first_chunk_frames": args.first_chunk_frames,
        "chunk_frames": args.chunk_frames,
        "encoding": args.encoding,
    }


def check_common_args(args: argparse.Namespace) -> tuple[Path, bytes | None]:
    """Validate the options the benchmark and the soak share; returns (--json path, reference bytes).
    Raises BenchError with a one-line reason."""
    out = Path(args.json)
    if not (out.parent if str(out.parent) else Path(".")).is_dir():
        raise BenchError(f"directory of --json {out} does not exist")
    if args.requests is not None and args.requests < 1:
        raise BenchError("--requests must be >= 1")
    if args.min_new_frames is not None and args.min_new_frames < 0:
        raise BenchError("--min-new-frames must be >= 0")
    if args.reference == "none" and (args.reference_audio or args.reference_text):
        raise BenchError("--reference-audio/--reference-text need --reference distinct|repeated|registered")
    if args.reference != "none" and args.voice is not None:
        raise BenchError("give --voice or --reference, not both")
    if args.reference_audio is not None and not args.reference_text:
        raise BenchError("--reference-audio needs --reference-text (its transcript)")
    data = None
    if args.reference_audio is not None:
        from tts.audio.files import read_audio
        from tts.codec.base import AudioError

        try:
            data = Path(args.reference_audio).read_bytes()
            read_audio(data)
        except (OSError, AudioError) as exc:
            raise BenchError(f"cannot read --reference-audio {args.reference_audio}: {exc}") from exc
    return out, data


def write_json(report: dict, out: Path) -> None:
    """Write the report atomically (a temporary file renamed)."""
    tmp = out.with_name(f".{out.name}.tmp")
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    tmp.replace(out)


def run_from_args(args: argparse.Namespace) -> int:
    """Run the benchmark (or, with --soak, the soak test) from parsed `add_arguments` options; prints the
    table, writes the JSON. Exit codes: 0 done, 1 server-side failure, 2 bad options or input."""
    import grpc

    try:
        ramp = ramp_settings(args)
    except BenchError as exc:
        print(f"tts: error: {exc}", file=sys.stderr)
        return 2
    if getattr(args, "soak", False):
        from tts_tools.soak import run_soak_from_args

        return run_soak_from_args(args)
    args.json = args.json or "bench_server.json"
    args.concurrency = args.concurrency or [1, 4, 16, 64]
    try:
        out, data = check_common_args(args)
    except BenchError as exc:
        print(f"tts: error: {exc}", file=sys.stderr)
        return 2

    def progress(level: LevelResult) -> None:
        errors = f", errors {level.errors}" if level.errors else ""
        verdict = ""
        if level.verdict is not None:
            v = level.verdict
            why = "; ".join(v.failures)
            verdict = ": real time" if v.passed else f": not real time ({v.limited_by}: {why})"
        print(
            f"concurrency {level.concurrency}: {level.ok}/{level.requests} ok in {level.wall_s:.1f} "
            f"s{errors}{verdict}",
            file=sys.stderr,
        )

    try:
        report = asyncio.run(
            run_loadtest(
                args.server,
                args.concurrency,
                requests=args.requests,
                seed=args.seed,
                warmup=args.warmup,
                timeout=args.timeout,
                progress=progress,
                reference=args.reference,
                reference_audio=data,
                reference_text=args.reference_text,
                metrics_url=args.metrics_url,
                ramp=ramp,
                **request_options(args),
            )
        )
    except BenchError as exc:
        print(f"tts: error: {args.server}: {exc}", file=sys.stderr)
        return 1
    except grpc.aio.AioRpcError as exc:
        from service.client import rpc_error_line

        print(f"tts: error: {rpc_error_line(args.server, exc, args.timeout)}", file=sys.stderr)
        return 2 if exc.code() in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND) else 1
    info = report["info"]
    print(
        f"server {args.server}: model {info.get('model')} on {info.get('device')}, max batch "
        f"{info.get('max_batch')}, "
        f"graphs {'on' if info.get('graphs') else 'off'}, replay share {report['replay_share_after']:.3f}"
    )
    print(format_table(report))
    if first_audio := format_first_audio(report):
        print(first_audio)
    print(format_shares(report))
    if "ramp" in report:
        from tts_tools.ramp import format_ramp

        print(format_ramp(report))
    write_json(report, out)
    print(f"wrote {out}")
    return 0


# ---- the `tts bench-server` command --------------------------------------------------------------------


def add_parser(subparsers) -> None:
    """Register `tts bench-server` (the `tts.commands` entry point of the tools)."""
    p = subparsers.add_parser(
        "bench-server",
        help="closed-loop load benchmark (or, with --soak, soak test) of a running server",
        description="Closed-loop load benchmark: req/s, audio s/s, frames/s, TTFA p50/p95/p99, RTF p50/p95, "
        "frames/s per stream once audio flows, the longest gap between chunks and playback underruns at "
        "each concurrency level (optionally with "
        "reference clips and the server's codec time share); prints a table and writes JSON. With --soak, "
        "a soak test instead: many requests of mixed client kinds (cancels, slow and stalled readers, "
        "deadlines, unary, invalid), failing on leaks, gaps, unexpected statuses or RSS growth. With --ramp, "
        "the real-time ramp: levels of growing concurrency until streams fall below real time (an underrun, "
        "TTFA p95 over --ramp-ttfa-p95, an error), reporting the most real-time streams and whether the "
        "server's max batch, queue or KV pool stopped it instead.",
    )
    add_arguments(p)
    p.set_defaults(func=cmd_bench_server)


def cmd_bench_server(args: argparse.Namespace) -> int:
    import math

    from tts.cli.main import require
    from tts.cli.serve import check_chunk_options, check_sampling_options, check_seconds, check_server_address
    from tts.runtime.errors import UserError

    servers = [s.strip() for s in args.server.split(",")]
    if not all(servers):
        raise UserError(f"--server must be HOST:PORT or a comma-separated list of them, got {args.server!r}")
    if len(servers) > 1 and args.soak:
        raise UserError("--soak takes one --server (a server, or a load balancer in front of replicas)")
    for server in servers:
        check_server_address(server)
    check_seconds("--timeout", args.timeout, zero_ok=False)
    require(args.requests is None or args.requests >= 1, f"--requests must be >= 1, got {args.requests}")
    require(args.warmup >= 0, f"--warmup must be >= 0, got {args.warmup}")
    check_chunk_options(args)
    check_sampling_options(args)
    try:
        ramp_settings(args)  # (before the modes part ways: --ramp with --sessions is refused, not ignored)
    except BenchError as exc:
        raise UserError(str(exc)) from exc
    if args.sessions is not None:
        require(args.sessions >= 1, f"--sessions must be >= 1, got {args.sessions}")
        require(
            math.isfinite(args.words_per_second) and args.words_per_second > 0,
            f"--words-per-second must be > 0, got {args.words_per_second:g}",
        )
        require(0 <= args.cancel_share <= 1, f"--cancel-share must be in [0, 1], got {args.cancel_share:g}")
        require(
            0 <= args.session_spread < float("inf"),
            f"--session-spread must be >= 0 seconds, got {args.session_spread:g}",
        )
        require(len(servers) == 1 and not args.soak, "--sessions takes one --server and no --soak")
        from tts_tools.session_bench import run_sessions_from_args

        return run_sessions_from_args(args)
    return run_from_args(args)
