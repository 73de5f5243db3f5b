"""Soak test of a running synthesis server: `tts bench-server --soak --server HOST:PORT`.

`--requests` streams (default 1000) from `--concurrency` concurrent clients (default 8; each client has
its own channel and sends one request at a time). Every request is drawn, reproducibly for `--seed`,
from a mix of client kinds (`--mix`; normal readers take the share the others leave):

| kind | what the client does | statuses it may end with |
|---|---|---|
| normal | reads the stream to its end | OK |
| cancel | cancels before the header, right after it, or after 1-3 chunks | CANCELLED, OK (ended first) |
| slow | sleeps `--slow-delay` between chunks | OK |
| stall | reads the header, stops reading for `--stall` seconds, then cancels or reads on | CANCELLED, RESOURCE_EXHAUSTED (the server's pause timeout), OK |
| deadline | sets a `--deadline` second deadline | DEADLINE_EXCEEDED, OK |
| unary | SynthesizeUnary | OK |
| invalid | an invalid request (empty text, top_p 1.5, ...) | INVALID_ARGUMENT |

RESOURCE_EXHAUSTED (the server's admission bound) and FAILED_PRECONDITION (the job ended without any
audio: a random-weight model may stop at once) are allowed for every valid kind. Stalled clients are
capped at `--max-stalled` at a time (default: the server's max batch - 1) so they cannot hold every row.

Checked on every stream, whatever its status: sequence numbers 0, 1, 2, ... and contiguous frame ranges
from frame 0 (the end's frame count included), the protocol (header first, end last), and for OK
replies that the audio holds exactly frames x samples-per-frame samples. Requests that ended with no
audio (FAILED_PRECONDITION: the server never ends one OK) and OK replies with a single frame are counted
and reported (not a failure: a random-weight model may stop at once).

With the server's Prometheus endpoint (`--metrics-url`, default http://<server host>:9464/metrics,
`off` to skip), the process's RSS (`process_resident_memory_bytes`) is sampled every second, and after
the last request the gauges tts_requests_running/_waiting/_in_flight/_paused and tts_kv_blocks_used are
polled until all are 0 or `--settle-timeout` passes.

The soak FAILS (exit 1, one line on stderr) on: a leak (gauges not back to 0 in time), any sequence or
frame-range gap, a protocol or audio-length error, a status outside its kind's list above (INTERNAL and
UNKNOWN always are; DEADLINE_EXCEEDED outside the deadline kind means a request outlived `--timeout`,
default 120 s plus the longest stall: a hang), or RSS growth beyond the bound: the RSS after the last
request and the settle must stay within `--rss-growth-pct` (20) percent plus `--rss-growth-mb` (50) MiB of
the RSS after warm-up. The warm-up (max(--warmup, 2 x concurrency) normal requests at full concurrency)
fills the allocator's pools and the server's caches first, so what remains is growth that scales with
the number of requests; the percentage absorbs allocator fragmentation that scales with the process
(glibc arenas, torch's CPU caches), the 50 MiB the fixed overheads of a small process. A leak of L bytes
per request shows once N x L passes that; `rss.growth_per_1000_requests` reports the trend below it.
"""  # noqa: E501 (a Markdown table; its rows cannot wrap)

from __future__ import annotations

import argparse
import asyncio
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

KINDS = ("normal", "cancel", "slow", "stall", "deadline", "unary", "invalid")
DEFAULT_MIX = {"cancel": 0.15, "slow": 0.10, "stall": 0.05, "deadline": 0.10, "unary": 0.10, "invalid": 0.05}
NO_AUDIO = "FAILED_PRECONDITION"  # a job that ended without any audio (never an OK with none)
ALLOWED = {
    "normal": {"OK", "RESOURCE_EXHAUSTED", NO_AUDIO},
    "cancel": {"OK", "CANCELLED", "RESOURCE_EXHAUSTED", NO_AUDIO},
    "slow": {"OK", "RESOURCE_EXHAUSTED", NO_AUDIO},
    "stall": {"OK", "CANCELLED", "RESOURCE_EXHAUSTED", NO_AUDIO},
    "deadline": {"OK", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", NO_AUDIO},
    "unary": {"OK", "RESOURCE_EXHAUSTED", NO_AUDIO},
    "invalid": {"INVALID_ARGUMENT"},
}
CANCEL_PHASES = ("before_header", "after_header", "after_chunks")
# (name, build_request keywords): every one is INVALID_ARGUMENT before any generation work.
# (name, the build_request keywords it replaces: values of several types)
INVALID_VARIANTS: tuple[tuple[str, dict[str, Any]], ...] = (
    ("empty text", {"text": ""}),
    ("top_p 1.5", {"top_p": 1.5}),
    ("temperature -1", {"temperature": -1.0}),
    ("max_new_frames 0", {"max_new_frames": 0}),
    ("first_chunk_frames 1000000", {"first_chunk_frames": 1_000_000}),
    ("unreadable reference clip", {"reference_audio": b"RIFF\x00\x01garbage" * 16, "reference_text": "x"}),
)
GAUGES = (
    "tts_requests_running", "tts_requests_waiting", "tts_requests_in_flight", "tts_requests_paused",
    "tts_kv_blocks_used",
)  # fmt: skip
RSS = "process_resident_memory_bytes"
# The clients' channels: no BDP probing and 8 KiB stream windows, so a client that stops reading backs
# up into the server within a few chunks (as a phone on a bad network does) and exercises the
# server's back-pressure pause and pause timeout.
SOAK_CHANNEL_OPTIONS = [("grpc.http2.bdp_probe", 0), ("grpc.http2.lookahead_bytes", 8192)]
DEFAULT_METRICS_PORT = 9464
DEFAULT_SAFETY_TIMEOUT = 120.0
MiB = 1024 * 1024


# ---- the plan ----------------------------------------------------------------------------------------


def mix_counts(requests: int, mix: dict[str, float]) -> dict[str, int]:
    """How many of `requests` each kind gets: shares of `mix` (kinds other than normal; normal takes the
    rest), apportioned by largest remainder (ties in KINDS order), so the counts add up exactly."""
    shares = {k: mix.get(k, 0.0) for k in KINDS if k != "normal"}
    if any(v < 0 for v in shares.values()) or sum(shares.values()) > 1 + 1e-9:
        raise ValueError(f"mix shares must be >= 0 and sum to at most 1: {shares}")
    shares["normal"] = max(0.0, 1.0 - sum(shares.values()))
    exact = {k: shares[k] * requests for k in KINDS}
    counts = {k: int(exact[k]) for k in KINDS}
    rest = requests - sum(counts.values())
    for k in sorted(KINDS, key=lambda k: (-(exact[k] - counts[k]), KINDS.index(k)))[:rest]:
        counts[k] += 1
    return counts


@dataclass(frozen=True)
class Spec:
    """One planned request. delay_s: cancel before the header: the wait before cancelling; slow: the
    sleep after each chunk; stall: how long it stops reading; deadline: its deadline."""

    index: int
    kind: str
    delay_s: float = 0.0
    cancel_phase: str | None = None
    cancel_chunks: int = 0
    then: str | None = None  # stall: "cancel" or "resume"
    invalid: int | None = None  # index into INVALID_VARIANTS

    @property
    def detail(self) -> str:
        """A short description for the report."""
        if self.kind == "cancel":
            assert self.cancel_phase is not None  # make_plan sets it on every cancel request
            return self.cancel_phase + (
                f" {self.cancel_chunks}" if self.cancel_phase == "after_chunks" else ""
            )
        if self.kind == "stall":
            return f"{self.delay_s:.2f} s then {self.then}"
        if self.kind in ("slow", "deadline"):
            return f"{self.delay_s:.3f} s"
        if self.kind == "invalid":
            assert self.invalid is not None  # make_plan sets it on every invalid request
            return INVALID_VARIANTS[self.invalid][0]
        return ""


def make_plan(
    requests: int,
    mix: dict[str, float],
    seed: int,
    *,
    slow_delay=(0.05, 0.5),
    stall=(1.0, 5.0),
    deadline=(0.05, 2.0),
) -> list[Spec]:
    """The soak's requests in order: `mix_counts` kinds shuffled with `random.Random(seed)`. The k-th
    request of a kind takes the k-th variant in turn (cancel: before the header, after it, after 1, 2 or
    3 chunks; stall: then cancel, then resume; invalid: INVALID_VARIANTS), so even a short soak covers
    them all; its duration (cancel delay, slow delay, stall, deadline) is drawn uniformly from its range
    by the same generator (one draw per request whatever its kind). The plan depends only on the
    arguments."""
    rng = random.Random(seed)
    kinds = [k for k, n in mix_counts(requests, mix).items() for _ in range(n)]
    rng.shuffle(kinds)
    seen = dict.fromkeys(KINDS, 0)
    plan = []
    for i, kind in enumerate(kinds):
        u, k = rng.random(), seen[kind]
        seen[kind] += 1
        if kind == "cancel":
            phase = CANCEL_PHASES[k % 3]
            chunks = 1 + (k // 3) % 3 if phase == "after_chunks" else 0
            plan.append(Spec(i, kind, delay_s=0.05 * u, cancel_phase=phase, cancel_chunks=chunks))
        elif kind == "slow":
            plan.append(Spec(i, kind, delay_s=slow_delay[0] + u * (slow_delay[1] - slow_delay[0])))
        elif kind == "stall":
            then = ("cancel", "resume")[k % 2]
            plan.append(Spec(i, kind, delay_s=stall[0] + u * (stall[1] - stall[0]), then=then))
        elif kind == "deadline":
            plan.append(Spec(i, kind, delay_s=deadline[0] + u * (deadline[1] - deadline[0])))
        elif kind == "invalid":
            plan.append(Spec(i, kind, invalid=k % len(INVALID_VARIANTS)))
        else:
            plan.append(Spec(i, kind))
    return plan


# ---- checking a stream ----------------------------------------------------------------------------------


class StreamCheck:
    """Checks the messages of one Synthesize stream as they arrive (never raises): sequence numbers
    0, 1, 2, ..., frame ranges contiguous from 0, header first and end last; `finish(ok)` adds the end's
    frame count and chunk count, and for an OK stream the audio length (frames x samples per frame)."""

    def __init__(self):
        self.header = None
        self.end = None
        self.chunks = 0
        self.next_frame = 0
        self.samples = 0
        self.sequence_gaps = 0
        self.frame_gaps = 0
        self.length_mismatch = False
        self.problems: list[str] = []

    @property
    def width(self) -> int:
        from service.grpc_gen.v1 import tts_pb2 as pb

        return 4 if self.header is not None and self.header.encoding == pb.AUDIO_ENCODING_FLOAT32 else 2

    def add(self, response) -> str | None:
        """Check one SynthesizeResponse; returns its kind ("header", "chunk", "end")."""
        kind = response.WhichOneof("message")
        if kind == "header":
            if self.header is not None or self.chunks or self.end is not None:
                self.problems.append("a second or late header")
            self.header = response.header
        elif kind == "chunk":
            c = response.chunk
            if self.header is None or self.end is not None:
                self.problems.append(f"chunk {c.sequence} outside header .. end")
            if c.sequence != self.chunks:
                self.sequence_gaps += 1
            if c.frame_start != self.next_frame:
                self.frame_gaps += 1
            self.next_frame = c.frame_end
            self.chunks += 1
            self.samples += len(c.audio) // self.width
        elif kind == "end":
            if self.header is None or self.end is not None:
                self.problems.append("end without header, or a second end")
            self.end = response.end
        else:
            self.problems.append("an empty response")
        return kind

    def finish(self, ok: bool) -> None:
        """The stream is over (`ok`: with status OK)."""
        if self.end is not None:
            if self.end.frames != self.next_frame:
                self.frame_gaps += 1
            if self.end.chunks != self.chunks:
                self.problems.append(f"end says {self.end.chunks} chunks, {self.chunks} arrived")
        if not ok:
            return
        if self.header is None or self.end is None:
            self.problems.append("OK without a header and an end")
            return
        self.length_mismatch = not audio_length_ok(self.header, self.end.frames, self.samples)


def audio_length_ok(header, frames: int, samples: int) -> bool:
    """samples == frames x samples per frame (True where samples per frame is not a whole number)."""
    if not header.frame_rate:
        return True
    per_frame = header.sample_rate / header.frame_rate
    if abs(per_frame - round(per_frame)) > 1e-6:
        return True
    return samples == frames * round(per_frame)


# ---- one request ------------------------------------------------------------------------------------


@dataclass
class Outcome:
    """How one request ended."""

    index: int
    kind: str
    status: str  # "OK" or the gRPC status name
    detail: str = ""
    client_cancelled: bool = False
    frames: int = 0
    chunks: int = 0
    sequence_gaps: int = 0
    frame_gaps: int = 0
    length_mismatch: bool = False
    problems: list[str] = field(default_factory=list)
    seconds: float = 0.0


async def run_request(stub, spec: Spec, request, timeout: float, stalled: asyncio.Semaphore) -> Outcome:
    """Run one planned request as its kind of client would; never raises for a gRPC status."""
    import grpc

    out = Outcome(spec.index, spec.kind, "OK", spec.detail)
    t0 = time.perf_counter()
    try:
        if spec.kind == "unary":
            await _unary(stub, request, timeout, out)
        elif spec.kind == "stall":
            async with stalled:
                await _stream(stub, spec, request, timeout, out)
        else:
            await _stream(stub, spec, request, spec.delay_s if spec.kind == "deadline" else timeout, out)
    except grpc.aio.AioRpcError as exc:
        out.status = exc.code().name
    except Exception as exc:  # noqa: BLE001 - a client-side surprise is a finding, not a crash of the soak
        out.status = "CLIENT_ERROR"
        out.problems.append(f"{type(exc).__name__}: {exc}")
    out.seconds = time.perf_counter() - t0
    return out


async def _unary(stub, request, timeout: float, out: Outcome) -> None:
    from service.grpc_gen.v1 import tts_pb2 as pb

    reply = await stub.SynthesizeUnary(request, timeout=timeout)
    width = 4 if reply.header.encoding == pb.AUDIO_ENCODING_FLOAT32 else 2
    out.frames, out.chunks = reply.end.frames, reply.end.chunks
    out.length_mismatch = not audio_length_ok(reply.header, reply.end.frames, len(reply.audio) // width)


async def _stream(stub, spec: Spec, request, timeout: float, out: Outcome) -> None:
    import grpc

    call = stub.Synthesize(request, timeout=timeout)
    check = StreamCheck()
    try:
        if spec.cancel_phase == "before_header":
            await asyncio.sleep(spec.delay_s)
            out.client_cancelled = call.cancel()
        else:
            while True:
                response = await call.read()
                if response is grpc.aio.EOF:
                    break
                kind = check.add(response)
                if spec.kind == "stall" and kind == "header":
                    await asyncio.sleep(spec.delay_s)
                    if spec.then == "cancel":
                        out.client_cancelled = call.cancel()
                        break
                elif spec.kind == "slow" and kind == "chunk":
                    await asyncio.sleep(spec.delay_s)
                elif spec.kind == "cancel" and (
                    (spec.cancel_phase == "after_header" and kind == "header")
                    or (
                        spec.cancel_phase == "after_chunks"
                        and kind == "chunk"
                        and check.chunks >= spec.cancel_chunks
                    )
                ):
                    out.client_cancelled = call.cancel()
                    break
        out.status = (await call.code()).name
    except grpc.aio.AioRpcError as exc:
        out.status = exc.code().name
    finally:
        check.finish(out.status == "OK")
        out.frames = check.end.frames if check.end is not None else check.next_frame
        out.chunks = check.chunks
        out.sequence_gaps, out.frame_gaps = check.sequence_gaps, check.frame_gaps
        out.length_mismatch, out.problems = check.length_mismatch, check.problems


def build_soak_request(spec: Spec, seed: int, request_options: dict, voice: dict):
    """The SynthesizeRequest of a planned request: request_text(i), seed + i, the shared options and the
    reference mode's voice; an invalid request replaces one of them with a bad value."""
    from service.client import build_request
    from tts_tools.loadtest import request_text

    options = {**request_options, **voice}
    text = request_text(spec.index)
    if spec.kind == "invalid":
        assert spec.invalid is not None  # make_plan sets it on every invalid request
        _, bad = INVALID_VARIANTS[spec.invalid]
        bad = dict(bad)
        text = bad.pop("text", text)
        if "reference_audio" in bad:
            options = {
                k: v for k, v in options.items() if k not in ("voice", "reference_audio", "reference_text")
            }
        options.update(bad)
    return build_request(text, seed=seed + spec.index, **options)


# ---- server metrics ---------------------------------------------------------------------------------------


@dataclass
class Sampler:
    """Scrapes the server's metrics every `interval` seconds while the soak runs: RSS samples and the
    largest value each gauge reached."""

    url: str
    interval: float = 1.0
    t0: float = field(default_factory=time.monotonic)
    rss: list[tuple[float, float]] = field(default_factory=list)
    gauge_max: dict[str, float] = field(default_factory=dict)
    failed_scrapes: int = 0

    async def sample(self) -> dict[str, float] | None:
        """One scrape (recorded); None if it failed."""
        from tts_tools.loadtest import read_metrics

        try:
            values = await asyncio.to_thread(read_metrics, self.url)
        except (OSError, ValueError):
            self.failed_scrapes += 1
            return None
        if RSS in values:
            self.rss.append((round(time.monotonic() - self.t0, 3), values[RSS]))
        for g in GAUGES:
            if g in values:
                self.gauge_max[g] = max(self.gauge_max.get(g, 0.0), values[g])
        return values

    async def run(self, stop: asyncio.Event) -> None:
        """Sample until `stop` is set."""
        while not stop.is_set():
            await self.sample()
            try:
                await asyncio.wait_for(stop.wait(), self.interval)
            except asyncio.TimeoutError:
                pass


async def settle(sampler: Sampler, timeout: float) -> tuple[bool, dict[str, float], float]:
    """Poll the gauges until every one the server exports is 0, or `timeout` seconds pass. Returns
    (idle, the last gauge values, seconds waited)."""
    t0 = time.monotonic()
    last: dict[str, float] = {}
    while True:
        values = await sampler.sample()
        if values is not None:
            last = {g: values[g] for g in GAUGES if g in values}
            if last and all(v == 0 for v in last.values()):
                return True, last, time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            return False, last, time.monotonic() - t0
        await asyncio.sleep(0.1)


# ---- the soak ----------------------------------------------------------------------------------------------


@dataclass
class SoakConfig:
    """The soak's settings (see the module docstring and `add_soak_arguments`)."""

    requests: int = 1000
    concurrency: int = 8
    seed: int = 1000
    mix: dict[str, float] = field(default_factory=lambda: dict(DEFAULT_MIX))
    slow_delay: tuple[float, float] = (0.05, 0.5)
    stall: tuple[float, float] | None = None  # None: around the server's pause timeout, else (1, 5)
    deadline: tuple[float, float] = (0.05, 2.0)
    max_stalled: int | None = None  # None: the server's max batch - 1
    timeout: float | None = None  # None: DEFAULT_SAFETY_TIMEOUT + the longest stall
    warmup: int = 1
    metrics_url: str | None = None  # None: no leak or RSS check
    settle_timeout: float = 30.0
    rss_growth_pct: float = 20.0
    rss_growth_mb: float = 50.0


async def run_soak(
    server: str,
    config: SoakConfig,
    *,
    reference: str = "none",
    reference_audio: bytes | None = None,
    reference_text: str | None = None,
    progress=None,
    **request_options,
) -> dict:
    """Run the soak; returns the report (with "verdict" "pass" or "fail" and the one-line "failures").
    Raises BenchError if it cannot run (metrics unreachable, a reference mode the server lacks) and
    grpc.aio.AioRpcError if GetInfo fails."""
    import grpc
    from google.protobuf.json_format import MessageToDict

    from service.client import aio_channel, build_request, channel_options
    from service.grpc_gen.v1 import tts_pb2 as pb
    from service.grpc_gen.v1 import tts_pb2_grpc as pb_grpc
    from tts_tools.loadtest import (
        BenchError,
        delete_voice,
        reference_clip,
        register_voice,
        request_text,
        voice_source,
    )

    cfg = config
    async with aio_channel(server) as control:
        stub = pb_grpc.TextToSpeechStub(control)
        info = await stub.GetInfo(pb.GetInfoRequest(), timeout=30)
        sampler = Sampler(cfg.metrics_url) if cfg.metrics_url else None
        if sampler is not None and await sampler.sample() is None:
            raise BenchError(
                f"cannot read the server's metrics at {cfg.metrics_url}; give --metrics-url of this server, "
                "or --metrics-url off to skip the leak and RSS checks"
            )
        stall = cfg.stall
        if stall is None:
            t = info.pause_timeout_seconds
            stall = (0.5 * t, 1.5 * t) if t > 0 else (1.0, 5.0)
        max_stalled = cfg.max_stalled or max(1, info.max_batch - 1)
        timeout = cfg.timeout if cfg.timeout is not None else DEFAULT_SAFETY_TIMEOUT + stall[1]
        plan = make_plan(
            cfg.requests, cfg.mix, cfg.seed, slow_delay=cfg.slow_delay, stall=stall, deadline=cfg.deadline
        )
        clip = reference_clip(reference, reference_audio, reference_text, info)
        voice = voice_source(reference, clip)
        options = [*channel_options(), *SOAK_CHANNEL_OPTIONS]
        channels = [grpc.aio.insecure_channel(server, options=options) for _ in range(cfg.concurrency)]
        stubs = [pb_grpc.TextToSpeechStub(c) for c in channels]
        registered = False
        try:
            if reference == "registered":
                assert clip is not None  # reference_clip returns None only for mode "none"
                await register_voice(stub, clip)
                registered = True
            # Warm-up: normal requests at full concurrency (numbered after the plan's, never repeated).
            n_warm = max(cfg.warmup, 2 * cfg.concurrency)
            warm_queue = iter(range(cfg.requests, cfg.requests + n_warm))
            warm_statuses: dict[str, int] = {}

            async def warm_worker(s):
                for i in warm_queue:
                    request = build_request(request_text(i), seed=cfg.seed + i, **voice(i), **request_options)
                    o = await run_request(s, Spec(i, "normal"), request, timeout, asyncio.Semaphore(1))
                    warm_statuses[o.status] = warm_statuses.get(o.status, 0) + 1

            await asyncio.gather(*(warm_worker(s) for s in stubs))
            baseline = None
            if sampler is not None:
                await settle(sampler, cfg.settle_timeout)
                baseline = sampler.rss[-1][1] if sampler.rss else None
                sampler.rss, sampler.gauge_max = sampler.rss[-1:], {}

            # The soak.
            stalled = asyncio.Semaphore(max_stalled)
            queue = iter(plan)
            outcomes: list[Outcome] = []
            step = max(1, cfg.requests // 10)

            async def worker(s):
                for spec in queue:
                    request = build_soak_request(spec, cfg.seed, request_options, voice(spec.index))
                    outcomes.append(await run_request(s, spec, request, timeout, stalled))
                    if progress is not None and len(outcomes) % step == 0:
                        progress(len(outcomes), cfg.requests)

            stop = asyncio.Event()
            sampling = asyncio.ensure_future(sampler.run(stop)) if sampler is not None else None
            t0 = time.perf_counter()
            await asyncio.gather(*(worker(s) for s in stubs))
            wall = time.perf_counter() - t0
            if sampling is not None:
                stop.set()
                await sampling
            gauges_after: dict[str, float] = {}
            idle, settle_s = False, 0.0
            final = None
            if sampler is not None:
                idle, gauges_after, settle_s = await settle(sampler, cfg.settle_timeout)
                final = sampler.rss[-1][1] if sampler.rss else None
        finally:
            if registered:
                await delete_voice(stub)
            for c in channels:
                await c.close()

    report = {
        "mode": "soak",
        "server": server,
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "info": MessageToDict(info, preserving_proto_field_name=True),
        "settings": {
            **asdict(cfg),
            "stall": list(stall),
            "max_stalled": max_stalled,
            "timeout": timeout,
            "reference": reference,
            **request_options,
        },
        "warmup": {"requests": n_warm, "statuses": warm_statuses},
        "wall_s": wall,
    }
    report.update(summarize(plan, outcomes))
    report["rss"] = rss_report(sampler, baseline, final, cfg)
    report["gauges"] = {
        "skipped": sampler is None,
        "checked": sampler is not None and bool(gauges_after),
        "idle": idle,
        "after": gauges_after,
        "settle_s": settle_s,
        "max_during": dict(sampler.gauge_max) if sampler is not None else {},
    }
    report["failures"] = failures(report)
    report["verdict"] = "fail" if report["failures"] else "pass"
    return report


def summarize(plan: list[Spec], outcomes: list[Outcome]) -> dict:
    """Counts of a soak's outcomes: statuses by kind, unexpected statuses, gaps, problems, short OKs."""
    planned = {k: 0 for k in KINDS}
    for spec in plan:
        planned[spec.kind] += 1
    statuses: dict[str, dict[str, int]] = {k: {} for k in KINDS}
    cancelled = dict.fromkeys(KINDS, 0)  # requests the client cancelled (the call was still open)
    unexpected: dict[str, dict[str, int]] = {}
    cancel: dict[str, dict[str, int]] = {p: {} for p in CANCEL_PHASES}
    stall: dict[str, dict[str, int]] = {"then_cancel": {}, "then_resume": {}}
    gaps = {"sequence": 0, "frame_range": 0, "streams": 0}
    problems: list[str] = []
    short = {"no_audio": 0, "one_frame": 0}
    by_index = {s.index: s for s in plan}
    for o in sorted(outcomes, key=lambda o: o.index):
        statuses[o.kind][o.status] = statuses[o.kind].get(o.status, 0) + 1
        cancelled[o.kind] += o.client_cancelled
        if o.status not in ALLOWED[o.kind]:
            unexpected.setdefault(o.kind, {})
            unexpected[o.kind][o.status] = unexpected[o.kind].get(o.status, 0) + 1
        if o.kind == "cancel":
            phase = by_index[o.index].cancel_phase
            assert phase is not None  # make_plan sets it on every cancel request
            cancel[phase][o.status] = cancel[phase].get(o.status, 0) + 1
        if o.kind == "stall":
            then = stall[f"then_{by_index[o.index].then}"]
            then[o.status] = then.get(o.status, 0) + 1
        gaps["sequence"] += o.sequence_gaps
        gaps["frame_range"] += o.frame_gaps
        gaps["streams"] += bool(o.sequence_gaps or o.frame_gaps)
        problems += [f"request {o.index} ({o.kind}): {p}" for p in o.problems]
        if o.status == NO_AUDIO or (o.status == "OK" and o.frames == 0):
            short["no_audio"] += 1
        elif o.status == "OK" and o.frames == 1:
            short["one_frame"] += 1
    return {
        "requests": len(plan),
        "completed": sum(sum(s.values()) for s in statuses.values()),
        "planned": planned,
        "statuses": statuses,
        "unexpected": unexpected,
        "client_cancelled": {k: n for k, n in cancelled.items() if n},
        "cancel_phases": cancel,
        "stall": stall,
        "gaps": gaps,
        "protocol_errors": len(problems),
        "protocol_examples": problems[:10],
        "length_mismatches": sum(o.length_mismatch for o in outcomes),
        "short_ok": short,
        "outcomes": [
            [o.index, o.kind, o.status, o.frames, o.detail] for o in sorted(outcomes, key=lambda o: o.index)
        ],
    }


def rss_report(sampler: Sampler | None, baseline: float | None, final: float | None, cfg: SoakConfig) -> dict:
    """RSS after warm-up (baseline), after the settle (final), the peak, the bound and the samples."""
    if sampler is None or baseline is None or final is None:
        reason = "no metrics (--metrics-url off)" if sampler is None else f"the server does not export {RSS}"
        return {"checked": False, "reason": reason}
    bound = baseline * (1 + cfg.rss_growth_pct / 100) + cfg.rss_growth_mb * MiB
    return {
        "checked": True,
        "baseline_bytes": baseline,
        "final_bytes": final,
        "peak_bytes": max(v for _, v in sampler.rss),
        "bound_bytes": bound,
        "growth_bytes": final - baseline,
        "growth_per_1000_requests": (final - baseline) * 1000 / max(1, cfg.requests),
        "samples": sampler.rss,
    }


def failures(report: dict) -> list[str]:
    """The soak's failed checks, one line each (empty: pass)."""
    out = []
    if report["completed"] != report["requests"]:
        out.append(f"{report['requests'] - report['completed']} requests did not complete")
    g = report["gauges"]
    if g["checked"] and not g["idle"]:
        busy = ", ".join(f"{k}={v:g}" for k, v in g["after"].items() if v)
        out.append(f"leak: {g['settle_s']:.0f} s after the last request the server still reports {busy}")
    elif not g["checked"] and not g["skipped"]:
        out.append("leak check impossible: the server's metrics have none of " + ", ".join(GAUGES))
    gaps = report["gaps"]
    if gaps["sequence"] or gaps["frame_range"]:
        out.append(
            f"gaps: {gaps['sequence']} sequence-number and {gaps['frame_range']} frame-range gaps "
            f"in {gaps['streams']} streams"
        )
    if report["unexpected"]:
        parts = [
            f"{k}: " + ", ".join(f"{s} x{n}" for s, n in v.items()) for k, v in report["unexpected"].items()
        ]
        out.append("unexpected statuses: " + "; ".join(parts))
    if report["protocol_errors"]:
        out.append(f"protocol: {report['protocol_errors']} errors (first: {report['protocol_examples'][0]})")
    if report["length_mismatches"]:
        out.append(
            f"audio length: {report['length_mismatches']} OK replies whose audio is not frames x samples "
            "per frame"
        )
    rss = report["rss"]
    if rss["checked"] and rss["final_bytes"] > rss["bound_bytes"]:
        out.append(
            f"rss: {rss['baseline_bytes'] / MiB:.0f} MiB after warm-up -> {rss['final_bytes'] / MiB:.0f} MiB "
            f"after the soak (bound {rss['bound_bytes'] / MiB:.0f} MiB)"
        )
    return out


def format_report(report: dict) -> str:
    """Statuses by kind as a table, then the checks, then the verdict line."""
    cols = ["OK", "CANCELLED", "DEADLINE_EXCEEDED", "RESOURCE_EXHAUSTED", "INVALID_ARGUMENT"]
    short = {
        "CANCELLED": "CANCEL",
        "DEADLINE_EXCEEDED": "DEADLINE",
        "RESOURCE_EXHAUSTED": "EXHAUST",
        "INVALID_ARGUMENT": "INVALID",
    }
    head = f"{'kind':<9} {'sent':>6} " + " ".join(f"{short.get(c, c):>8}" for c in cols) + "  other"
    lines = [head, "-" * len(head)]
    for k in KINDS:
        s = report["statuses"][k]
        other = ", ".join(f"{n} x{v}" for n, v in s.items() if n not in cols)
        lines.append(
            f"{k:<9} {report['planned'][k]:>6} " + " ".join(f"{s.get(c, 0):>8}" for c in cols) + f"  {other}"
        )
    lines.append(
        "stalled clients: "
        + ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in report["stall"].items())
        + "; cancels: "
        + ", ".join(f"{p.replace('_', ' ')} {v}" for p, v in report["cancel_phases"].items())
    )
    gaps, so = report["gaps"], report["short_ok"]
    lines.append(
        f"gaps: {gaps['sequence']} sequence, {gaps['frame_range']} frame-range; protocol errors "
        f"{report['protocol_errors']}; audio-length mismatches {report['length_mismatches']}; no audio "
        f"{so['no_audio']}, OK with one frame {so['one_frame']}"
    )
    g = report["gauges"]
    if g["checked"]:
        after = ", ".join(f"{k.removeprefix('tts_')}={v:g}" for k, v in g["after"].items())
        peak = ", ".join(f"{k.removeprefix('tts_')}={v:g}" for k, v in g["max_during"].items())
        lines.append(f"gauges after {g['settle_s']:.1f} s: {after} (peak during the soak: {peak})")
    rss = report["rss"]
    if rss["checked"]:
        lines.append(
            f"RSS: {rss['baseline_bytes'] / MiB:.0f} MiB after warm-up, peak {rss['peak_bytes'] / MiB:.0f}, "
            f"{rss['final_bytes'] / MiB:.0f} after the soak (bound {rss['bound_bytes'] / MiB:.0f}; "
            f"{rss['growth_per_1000_requests'] / MiB:+.1f} MiB per 1000 requests)"
        )
    else:
        lines.append(f"leak and RSS checks skipped: {rss['reason']}")
    return "\n".join(lines)


# ---- command line --------------------------------------------------------------------------------------


def parse_mix(text: str) -> dict[str, float]:
    """`cancel=0.2,stall=0` -> DEFAULT_MIX with those shares replaced (argparse type)."""
    mix = dict(DEFAULT_MIX)
    for part in filter(None, (p.strip() for p in text.split(","))):
        name, _, value = part.partition("=")
        name = name.strip()
        if name not in KINDS or name == "normal":
            raise argparse.ArgumentTypeError(
                f"--mix takes KIND=SHARE with KIND one of {', '.join(KINDS[1:])} (normal readers take the "
                "rest); "
                f"got {part!r}"
            )
        try:
            mix[name] = float(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--mix: {part!r} is not KIND=SHARE") from None
    try:
        mix_counts(100, mix)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"--mix: {exc}") from None
    return mix


def parse_range(text: str) -> tuple[float, float]:
    """`0.05,0.5` -> (0.05, 0.5): seconds, 0 <= MIN <= MAX (argparse type)."""
    try:
        lo, hi = (float(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX seconds like 0.05,0.5; got {text!r}") from None
    if not 0 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"expected 0 <= MIN <= MAX; got {text!r}")
    return lo, hi


def add_soak_arguments(p) -> None:
    """The options of `--soak` (added to the load benchmark's parser by loadtest.add_arguments; in a
    group of their own unless `p` already is a group)."""
    if isinstance(p, argparse.ArgumentParser):
        p = p.add_argument_group("soak test (with --soak)")
    p.add_argument(
        "--soak",
        action="store_true",
        help="run the soak test instead: --requests (default 1000) streams of mixed client kinds from "
        "--concurrency clients (default 8); fails on leaks, gaps, unexpected statuses or RSS growth",
    )
    mix = ",".join(f"{k}={v:g}" for k, v in DEFAULT_MIX.items())
    p.add_argument(
        "--mix",
        type=parse_mix,
        default=dict(DEFAULT_MIX),
        help=f"--soak: shares of the client kinds, normal readers take the rest (default {mix})",
    )
    p.add_argument(
        "--slow-delay",
        type=parse_range,
        default=(0.05, 0.5),
        help="--soak: slow readers' sleep between chunks, MIN,MAX seconds (default 0.05,0.5)",
    )
    p.add_argument(
        "--stall",
        type=parse_range,
        default=None,
        help="--soak: how long stalled clients stop reading, MIN,MAX seconds (default: 0.5x-1.5x the "
        "server's pause timeout, or 1,5 if it has none)",
    )
    p.add_argument(
        "--deadline",
        type=parse_range,
        default=(0.05, 2.0),
        help="--soak: short deadlines, MIN,MAX seconds (default 0.05,2)",
    )
    p.add_argument(
        "--max-stalled",
        type=int,
        default=None,
        help="--soak: stalled clients at a time (default: max batch - 1)",
    )
    p.add_argument(
        "--settle-timeout",
        type=float,
        default=30.0,
        help="--soak: seconds for the server's gauges to return to idle after the last request (default 30)",
    )
    p.add_argument(
        "--rss-growth-pct", type=float, default=20.0, help="--soak: allowed RSS growth, percent (default 20)"
    )
    p.add_argument(
        "--rss-growth-mb",
        type=float,
        default=50.0,
        help="--soak: allowed RSS growth on top, MiB (default 50)",
    )


def default_metrics_url(server: str) -> str:
    """http://<the --server host>:9464/metrics (the `tts serve` default metrics port)."""
    host = server.rpartition(":")[0] or "127.0.0.1"
    return f"http://{host}:{DEFAULT_METRICS_PORT}/metrics"


def run_soak_from_args(args: argparse.Namespace) -> int:
    """`tts bench-server --soak`: run, print the table and the verdict, write the JSON. Exit codes: 0 pass,
    1 fail (one line on stderr says why), 2 bad options or the soak could not run."""
    import grpc

    from tts_tools.loadtest import BenchError, check_common_args, request_options, write_json

    args.json = args.json or "soak.json"
    args.requests = args.requests or 1000
    levels = args.concurrency or [8]
    try:
        if len(levels) != 1:
            raise BenchError("--soak takes one --concurrency value (the number of concurrent clients)")
        if args.settle_timeout <= 0 or args.rss_growth_pct < 0 or args.rss_growth_mb < 0:
            raise BenchError("--settle-timeout must be > 0, --rss-growth-pct and --rss-growth-mb >= 0")
        if args.max_stalled is not None and args.max_stalled < 1:
            raise BenchError("--max-stalled must be >= 1")
        out, data = check_common_args(args)
    except BenchError as exc:
        print(f"tts: error: {exc}", file=sys.stderr)
        return 2
    url = args.metrics_url or default_metrics_url(args.server)
    config = SoakConfig(
        requests=args.requests,
        concurrency=levels[0],
        seed=args.seed,
        mix=args.mix,
        slow_delay=args.slow_delay,
        stall=args.stall,
        deadline=args.deadline,
        max_stalled=args.max_stalled,
        timeout=args.timeout,
        warmup=args.warmup,
        metrics_url=None if url == "off" else url,
        settle_timeout=args.settle_timeout,
        rss_growth_pct=args.rss_growth_pct,
        rss_growth_mb=args.rss_growth_mb,
    )

    def progress(done: int, total: int) -> None:
        print(f"soak: {done}/{total} requests done", file=sys.stderr, flush=True)

    try:
        report = asyncio.run(
            run_soak(
                args.server,
                config,
                reference=args.reference,
                reference_audio=data,
                reference_text=args.reference_text,
                progress=progress,
                **request_options(args),
            )
        )
    except BenchError as exc:
        print(f"tts: error: {args.server}: {exc}", file=sys.stderr)
        return 2
    except grpc.aio.AioRpcError as exc:
        print(f"tts: error: {args.server}: {exc.code().name}: {exc.details()}", file=sys.stderr)
        return 2
    info = report["info"]
    print(
        f"soak of {args.server} (model {info.get('model')}, max batch {info.get('max_batch')}): "
        f"{report['requests']} requests from {config.concurrency} clients in {report['wall_s']:.1f} s, seed "
        f"{config.seed}"
    )
    print(format_report(report))
    write_json(report, Path(out))
    print(f"wrote {out}")
    if report["failures"]:
        print(f"soak FAILED: {'; '.join(report['failures'])}", file=sys.stderr)
        return 1
    print(
        "soak passed: no leak, no gap, no unexpected status, RSS within bound"
        if report["rss"]["checked"]
        else "soak passed (leak and RSS not checked)"
    )
    return 0
