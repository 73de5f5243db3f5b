"""The voice-agent benchmark of a running server: `tts bench-server --sessions N`.

N concurrent gRPC `SynthesizeSession` calls, each fed by a synthetic LLM that writes a reply word by word
at `--words-per-second` (default 15) from a fixed pool of sentences (two sentences per session, each one
text chunk: the pool's sentences have no clause break, so the counts are exact), then closes. A share of
the sessions (`--cancel-share`, default 0.25: the last round(N x share)) barge in: once the first audio
of their first sentence arrives they send `cancel` mid-sentence, then one more sentence, then close.

Reported (the table to stdout, everything to the JSON file):

* clause to first audio p50/p95: from sending the word that completes the first chunk of text (here the
  first sentence's last word) to the first audio message;
* close to last audio p50/p95: from sending `close` to the last audio message (the tail of the reply);
* underruns: per session, audio messages that arrived after the audio before them would have finished
  playing, had playback started with the first (`loadtest.playback_underruns`); the total, the sessions
  with any and the worst lateness (sessions that barged in are left out: their audio stops on purpose);
* cancel to silence p50/p95: from sending `cancel` to the last audio message of the chunks that started
  before it (0 when none came after the cancel), and the audio messages that came after the cancel;
* prefill tokens per chunk, first chunk vs later chunks, and the later chunks' tokens reused from the
  session's kept KV (`cached_tokens`): prefix reuse keeps a later chunk's prefill small;
* counts: sessions ok, chunks (chunk ends) in all, chunks cut by a barge-in, errors by gRPC status.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import asdict, dataclass, field

from tts_tools.loadtest import SENTENCES, percentile, playback_underruns

# Sentences without a clause break: each is exactly one chunk of a session's text.
SESSION_SENTENCES = [s for s in SENTENCES if not any(mark in s for mark in ",;:")]
SENTENCES_PER_SESSION = 2


@dataclass
class SessionResult:
    """One session as its client saw it. Times are seconds on the client's monotonic clock."""

    index: int
    barge_in: bool
    ok: bool = False
    error: str | None = None  # the gRPC status name when the call failed
    chunks: int = 0  # chunk ends received
    chunk_starts: int = 0
    cancelled_chunks: int = 0  # chunk ends with FINISH_REASON_CANCELLED
    audio_messages: int = 0
    audio_samples: int = 0
    clause_to_first_audio: float | None = None
    close_to_last_audio: float | None = None
    underruns: int = 0
    worst_lateness: float = 0.0
    cancel_to_silence: float | None = None
    audio_after_cancel: int = 0
    prefill_tokens: list[int] = field(default_factory=list)  # per chunk, in order
    cached_tokens: list[int] = field(default_factory=list)
    end_reason: str = ""


def session_text(i: int, n: int = SENTENCES_PER_SESSION) -> list[str]:
    """Session i's sentences from the pool (each one chunk)."""
    return [SESSION_SENTENCES[(i * n + k) % len(SESSION_SENTENCES)] for k in range(n)]


def barge_in_sessions(n: int, share: float) -> set[int]:
    """The indices of the sessions that barge in: the last round(n * share)."""
    k = min(n, round(n * share))
    return set(range(n - k, n))


async def _one_session(stub, pb, i: int, barge_in: bool, options: dict, wps: float, timeout: float | None):
    """Run session i; returns its SessionResult."""
    return await _SessionScript(stub, pb, i, barge_in, options, wps, timeout).run()


def _session_start(pb, options: dict):
    """The `SessionStart` message of a session run with `options` (see `run_sessions`): voice, sampling
    and output as `service.client.build_request` sets them for a one-shot request."""
    from service.client import build_request

    request = build_request("", **{k: v for k, v in options.items() if v is not None})
    return pb.SessionStart(voice=request.voice, sampling=request.sampling, output=request.output)


class _SessionScript:
    """Session i as its client plays it (see the module docstring): start, the sentences word by word at
    `wps` words per second (with a barge-in: the first sentence, a cancel once its first audio came, the
    second), close; meanwhile every server message is read and timed. `run` returns its SessionResult."""

    def __init__(self, stub, pb, i: int, barge_in: bool, options: dict, wps: float, timeout: float | None):
        self.pb, self.wps = pb, wps
        self.result = SessionResult(i, barge_in)
        self.call = stub.SynthesizeSession(timeout=timeout)
        self.start = _session_start(pb, options)
        self.width = 2 if options.get("encoding", "pcm16") == "pcm16" else 4  # bytes per sample
        self.rate = 0  # the header's sample rate
        self.arrivals: list[float] = []  # per audio message: when it came, its samples, its chunk
        self.samples: list[int] = []
        self.chunks_of: list[int] = []
        self.first_audio = asyncio.Event()
        self.marks: dict[str, float] = {}  # clause (the first chunk's text complete), cancel, close
        self.before_cancel = 0  # audio messages before the cancel
        self.started_before = 0  # chunks started before the cancel

    async def run(self) -> SessionResult:
        import grpc

        pb, call, result = self.pb, self.call, self.result
        reader = asyncio.ensure_future(self._read())
        try:
            await call.write(pb.SessionRequest(start=self.start))
            await self._write_text(reader)
            self.marks["close"] = time.monotonic()
            await call.write(pb.SessionRequest(close=pb.SessionClose()))
            await call.done_writing()
            await reader
            result.ok = await call.code() == grpc.StatusCode.OK
        except grpc.aio.AioRpcError as exc:
            result.error = exc.code().name
            reader.cancel()
            return result
        self._measure()
        return result

    async def _write_text(self, reader: asyncio.Future) -> None:
        """The session's sentences; with a barge-in, `cancel` between them once the first audio came (or
        the call ended)."""
        sentences = session_text(self.result.index)
        if not self.result.barge_in:
            for sentence in sentences:
                await self._write_words(sentence)
            return
        await self._write_words(sentences[0])
        await asyncio.wait(
            {reader, asyncio.ensure_future(self.first_audio.wait())}, return_when="FIRST_COMPLETED"
        )
        self.marks["cancel"] = time.monotonic()
        self.before_cancel = len(self.arrivals)
        await self.call.write(self.pb.SessionRequest(cancel=self.pb.SessionCancel()))
        self.started_before = self.result.chunk_starts
        await self._write_words(sentences[1])

    async def _write_words(self, sentence: str) -> None:
        words = sentence.split()
        for k, word in enumerate(words):
            await self.call.write(self.pb.SessionRequest(text=word + " "))
            if k == len(words) - 1 and "clause" not in self.marks:
                self.marks["clause"] = time.monotonic()  # this word completes the first chunk
            await asyncio.sleep(1.0 / self.wps)

    async def _read(self) -> None:
        import grpc

        while (m := await self.call.read()) is not grpc.aio.EOF:
            self._receive(m, time.monotonic())

    def _receive(self, m, now: float) -> None:
        """Count server message `m`, which came at `now`."""
        result = self.result
        kind = m.WhichOneof("message")
        if kind == "header":
            self.rate = m.header.sample_rate
        elif kind == "audio":
            n = len(m.audio.audio) // self.width
            self.arrivals.append(now)
            self.samples.append(n)
            self.chunks_of.append(m.audio.chunk)
            result.audio_messages += 1
            result.audio_samples += n
            self.first_audio.set()
        elif kind == "chunk_start":
            result.chunk_starts += 1
        elif kind == "chunk_end":
            e = m.chunk_end
            result.chunks += 1
            result.cancelled_chunks += e.finish_reason == self.pb.FINISH_REASON_CANCELLED
            result.prefill_tokens.append(e.prefill_tokens)
            result.cached_tokens.append(e.cached_tokens)
        elif kind == "end":
            result.end_reason = m.end.reason

    def _measure(self) -> None:
        """The session's latencies, and its underruns (or, with a barge-in, what came after the cancel)."""
        result, arrivals, marks = self.result, self.arrivals, self.marks
        if arrivals and "clause" in marks:
            result.clause_to_first_audio = max(0.0, arrivals[0] - marks["clause"])
        if arrivals:
            result.close_to_last_audio = max(0.0, arrivals[-1] - marks["close"])
        if result.barge_in:
            # audio of the chunks that started before the cancel, arriving after it
            late = [
                t
                for t, c in zip(
                    arrivals[self.before_cancel :], self.chunks_of[self.before_cancel :], strict=True
                )
                if c < self.started_before
            ]
            result.audio_after_cancel = len(late)
            result.cancel_to_silence = max(late) - marks["cancel"] if late else 0.0
        elif self.rate:
            result.underruns, result.worst_lateness = playback_underruns(arrivals, self.samples, self.rate)


def _stats(values: list[float], scale: float = 1000.0) -> dict:
    return {
        "p50": None if not values else percentile(values, 50) * scale,  # type: ignore[operator]
        "p95": None if not values else percentile(values, 95) * scale,  # type: ignore[operator]
        "n": len(values),
    }


def _mean(values: list[int]) -> float | None:
    return sum(values) / len(values) if values else None


async def run_sessions(
    server: str,
    sessions: int,
    *,
    words_per_second: float = 15.0,
    cancel_share: float = 0.25,
    spread_seconds: float = 0.0,
    timeout: float | None = None,
    **options,
) -> dict:
    """Run `sessions` concurrent sessions against `server` (HOST:PORT); returns the report (see the
    module docstring). spread_seconds: session i starts i x spread_seconds / sessions after the first
    (0: all at once). options: seed (session i uses seed + i), max_new_frames, min_new_frames,
    temperature, top_p, top_k, voice, encoding ("pcm16" / "float32"), first_chunk_frames, chunk_frames."""
    import grpc

    from service.client import channel_options
    from service.grpc_gen.v1 import tts_pb2 as pb
    from service.grpc_gen.v1 import tts_pb2_grpc as pb_grpc

    cancelling = barge_in_sessions(sessions, cancel_share)
    seed = options.pop("seed", None)
    async with grpc.aio.insecure_channel(server, options=channel_options()) as channel:
        stub = pb_grpc.TextToSpeechStub(channel)
        info = await stub.GetInfo(pb.GetInfoRequest(), timeout=30)

        async def session(i: int) -> SessionResult:
            if spread_seconds > 0 and i:
                await asyncio.sleep(i * spread_seconds / sessions)
            options_i = {**options, "seed": None if seed is None else seed + i}
            return await _one_session(stub, pb, i, i in cancelling, options_i, words_per_second, timeout)

        t0 = time.monotonic()
        results = await asyncio.gather(*(session(i) for i in range(sessions)))
        wall = time.monotonic() - t0
    ok = [r for r in results if r.ok]
    errors: dict[str, int] = {}
    for r in results:
        if r.error:
            errors[r.error] = errors.get(r.error, 0) + 1
    played = [r for r in ok if not r.barge_in]
    barged = [r for r in ok if r.barge_in]
    return {
        "mode": "sessions",
        "server": server,
        "info": {"model": info.model, "device": info.device, "max_batch": info.max_batch},
        "sessions": sessions,
        "ok": len(ok),
        "errors": errors,
        "wall_s": wall,
        "words_per_second": words_per_second,
        "cancel_share": cancel_share,
        "spread_seconds": spread_seconds,
        "barge_in_sessions": len(barged),
        "chunks": sum(r.chunks for r in ok),
        "cancelled_chunks": sum(r.cancelled_chunks for r in ok),
        "audio_seconds": sum(r.audio_samples for r in ok) / info.sample_rate if info.sample_rate else 0.0,
        "clause_to_first_audio_ms": _stats(
            [r.clause_to_first_audio for r in ok if r.clause_to_first_audio is not None]
        ),
        "close_to_last_audio_ms": _stats(
            [r.close_to_last_audio for r in played if r.close_to_last_audio is not None]
        ),
        "underruns": sum(r.underruns for r in played),
        "sessions_with_underruns": sum(1 for r in played if r.underruns),
        "worst_lateness_ms": max((r.worst_lateness for r in played), default=0.0) * 1000,
        "cancel_to_silence_ms": _stats(
            [r.cancel_to_silence for r in barged if r.cancel_to_silence is not None]
        ),
        "audio_after_cancel": sum(r.audio_after_cancel for r in barged),
        "prefill_tokens_first_chunk": _mean([r.prefill_tokens[0] for r in ok if r.prefill_tokens]),
        "prefill_tokens_later_chunks": _mean([t for r in ok for t in r.prefill_tokens[1:]]),
        "cached_tokens_later_chunks": _mean([t for r in ok for t in r.cached_tokens[1:]]),
        "per_session": [asdict(r) for r in results],
    }


def format_report(report: dict) -> str:
    """The report as a few lines for the terminal."""

    def ms(stats: dict) -> str:
        if stats["p50"] is None:
            return "-"
        return f"p50 {stats['p50']:.0f} ms, p95 {stats['p95']:.0f} ms"

    def num(value) -> str:
        return "-" if value is None else f"{value:.1f}"

    errors = ", ".join(f"{k} {v}" for k, v in report["errors"].items()) or "none"
    return "\n".join(
        [
            f"sessions {report['ok']}/{report['sessions']} ok ({report['barge_in_sessions']} barged in), "
            f"{report['chunks']} chunks ({report['cancelled_chunks']} cut), "
            f"{report['audio_seconds']:.1f} s audio in {report['wall_s']:.1f} s at "
            f"{report['words_per_second']:g} words/s; errors: {errors}",
            f"clause -> first audio: {ms(report['clause_to_first_audio_ms'])}",
            f"close -> last audio:   {ms(report['close_to_last_audio_ms'])}",
            f"underruns: {report['underruns']} in {report['sessions_with_underruns']} sessions, "
            f"worst {report['worst_lateness_ms']:.0f} ms late",
            f"cancel -> silence:     {ms(report['cancel_to_silence_ms'])}; "
            f"{report['audio_after_cancel']} audio messages after the cancel",
            f"prefill tokens per chunk: first {num(report['prefill_tokens_first_chunk'])}, later "
            f"{num(report['prefill_tokens_later_chunks'])} (reused from the kept KV: "
            f"{num(report['cached_tokens_later_chunks'])})",
        ]
    )


def run_sessions_from_args(args) -> int:
    """`tts bench-server --sessions N`: run, print, write the JSON. Exit 0 when every session ended OK,
    1 otherwise (the report says which statuses)."""
    from pathlib import Path

    import grpc

    from tts_tools.loadtest import write_json

    out = Path(args.json or "bench_sessions.json")
    if not (out.parent if str(out.parent) else Path(".")).is_dir():
        print(f"tts: error: directory of --json {out} does not exist", file=sys.stderr)
        return 2
    try:
        report = asyncio.run(
            run_sessions(
                args.server,
                args.sessions,
                words_per_second=args.words_per_second,
                cancel_share=args.cancel_share,
                spread_seconds=args.session_spread,
                timeout=args.timeout,
                seed=args.seed,
                max_new_frames=args.max_new_frames,
                min_new_frames=args.min_new_frames,
                temperature=args.temperature,
                top_p=args.top_p,
                top_k=args.top_k,
                voice=args.voice,
                encoding=args.encoding,
                first_chunk_frames=args.first_chunk_frames,
                chunk_frames=args.chunk_frames,
            )
        )
    except grpc.aio.AioRpcError as exc:
        from service.client import rpc_error_line

        print(f"tts: error: {rpc_error_line(args.server, exc, args.timeout)}", file=sys.stderr)
        return 1
    print(format_report(report))
    write_json(report, out)
    print(f"wrote {out}")
    return 0 if report["ok"] == report["sessions"] else 1
