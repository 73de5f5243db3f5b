"""The real-time ramp of the load benchmark: `tts bench-server --ramp`.

How many concurrent streams can a server keep in real time? The ramp runs levels of the load benchmark
(`loadtest._run_level`: C streams, each sending `--ramp-rounds` requests one after another, so a level is
rounds x C requests) at growing concurrency C, and judges each level. By default (`--ramp-pacing
playback`) a stream sends its next request when its last one's audio has played, so a level is C
real-time audio streams; `--ramp-pacing none` sends it as soon as the audio arrived (a closed loop, which
asks for audio faster than real time whenever the server is faster). A level is

* real time: no playback underrun (`loadtest.playback_underruns`, all OK requests together), TTFA p95
  at most `--ramp-ttfa-p95` ms (default 300), and no error of any kind;
* otherwise the level failed, and the report says what limited it (`limited_by`, first match):
  `queue`: requests refused with RESOURCE_EXHAUSTED (the server's admission bound, max batch + max
  waiting), unless the server's real-time admission held requests back because its frame step was too
  slow for one more stream (`tts_realtime_deferred_total{reason="speed"}`): that is `real_time`;
  `kv_cache`: the same, or waits for KV blocks, with the server's counters showing the paged KV pool ran
  out (needs `--metrics-url`); `max_batch`: C above the rows the server decodes at once (the
  sum of GetInfo.max_batch over the listed servers), so streams waited in its queue (paced, a stream
  holds no row while its audio plays, so C may pass the rows: there a failed level is `max_batch`
  when the server's mean batch over the level reached FULL_ROWS of its rows, and levels above the
  rows are searched like any other); `errors`: any
  other error; `real_time`: none of those, the streams fell below real time.
  The first three are limits of the server's settings, a different finding than "fell below real time".

The search: levels `--ramp-start`, doubling, up to `--ramp-max` (the last level is `--ramp-max` itself),
until one fails; then bisection between the last passing level (0 if none passed) and the first failing
one until they are at most `--ramp-step` apart. Levels above the server's rows are not bisected: when the
failing level is above them, the next probe is the rows themselves (or, if those already passed, the
search ends there). The answer, `real_time_streams`, is the largest passing level; `stopped_by` is the
first failing level's `limited_by`, or `ramp_max` when every level passed (the answer is then a lower
bound).

Behind a load balancer GetInfo describes one replica: list the replicas' addresses (comma-separated
`--server`) so the rows are the sum of theirs.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tts_tools.loadtest import LevelResult

# `limited_by` values that name a limit of the server's settings rather than real time.
SERVER_LIMITS = ("queue", "kv_cache", "max_batch")
LIMITS = (*SERVER_LIMITS, "errors", "real_time")

# How the report's criteria line names a ramp's pacing.
PACING_WORDS = {
    "playback": "a stream's next request when its last one's audio has played",
    "none": "a stream's next request as soon as its last one's audio arrived",
}

# Paced, a failed level whose frame steps averaged this share of the server's rows or more was held
# back by them (the streams waited for a row), not by the GPU's speed.
FULL_ROWS = 0.9

DEFAULT_START = 16
DEFAULT_MAX = 512
DEFAULT_STEP = 16
DEFAULT_ROUNDS = 4
DEFAULT_TTFA_P95_MS = 300.0


@dataclass
class RampSettings:
    """The ramp's options: levels from `start` doubling up to `stop`, bisected to `step`; each level
    `rounds` x C requests; a level is real time with no underrun, no error and TTFA p95 <= `ttfa_p95_ms`."""

    start: int = DEFAULT_START
    stop: int = DEFAULT_MAX
    step: int = DEFAULT_STEP
    rounds: int = DEFAULT_ROUNDS
    ttfa_p95_ms: float = DEFAULT_TTFA_P95_MS
    # Streams' first requests spread over one request's playback time (independent callers) rather than
    # all sent at once (a burst of C prefills, the worst case).
    spread: bool = True
    # Each stream sends its next request when the last one's audio has played (C real-time audio
    # streams) rather than as soon as it arrived (a closed loop asking for audio faster than real time).
    paced: bool = True

    def check(self) -> None:
        """Raise ValueError (naming the option) unless 1 <= start <= stop, step >= 1, rounds >= 1 and
        0 < ttfa_p95_ms < inf."""
        if self.start < 1:
            raise ValueError(f"--ramp-start must be >= 1, got {self.start}")
        if self.stop < self.start:
            raise ValueError(f"--ramp-max must be >= --ramp-start ({self.start}), got {self.stop}")
        if self.step < 1:
            raise ValueError(f"--ramp-step must be >= 1, got {self.step}")
        if self.rounds < 1:
            raise ValueError(f"--ramp-rounds must be >= 1, got {self.rounds}")
        if not 0 < self.ttfa_p95_ms < float("inf"):
            raise ValueError(f"--ramp-ttfa-p95 must be milliseconds > 0, got {self.ttfa_p95_ms:g}")


@dataclass
class Verdict:
    """A ramp level's judgement: `passed` (real time), the `failures` in words, and what limited a failed
    level (`limited_by`: one of LIMITS; None when it passed)."""

    passed: bool
    failures: list[str] = field(default_factory=list)
    limited_by: str | None = None


def judge_level(level: LevelResult, ttfa_p95_ms: float, rows: int | None, paced: bool = False) -> Verdict:
    """Judge one level (see the module docstring for the criteria and the order of `limited_by`).
    `rows`: the batch rows of the server(s) (the sum of GetInfo.max_batch; None or 0: unknown); paced:
    the level's streams were paced by their playback (`max_batch` then reads the server's mean batch).
    The KV-pool and real-time labels read the level's server counters (`level.server["kv_stalls"]`,
    `["kv_preemptions"]`, `["realtime_deferred_speed"]`), absent without --metrics-url."""
    failures = []
    if level.underruns:
        failures.append(f"{level.underruns} underruns")
    p95 = level.ttfa_ms.get("p95")
    if p95 is not None and p95 > ttfa_p95_ms:
        failures.append(f"TTFA p95 {p95:.1f} ms > {ttfa_p95_ms:g} ms")
    if level.errors:
        failures.append("errors " + ", ".join(f"{name} {n}" for name, n in sorted(level.errors.items())))
    elif p95 is None:
        failures.append("no audio")  # OK requests without any audio: nothing played in real time
    if not failures:
        return Verdict(True)
    server = level.server or {}
    kv = (server.get("kv_stalls") or 0) + (server.get("kv_preemptions") or 0) > 0
    if level.errors.get("RESOURCE_EXHAUSTED"):
        if (server.get("kv_preemptions") or 0) > 0:
            limited = "kv_cache"
        elif (server.get("realtime_deferred_speed") or 0) > 0:
            limited = "real_time"  # (admission held newcomers: the step was too slow for one more stream)
        else:
            limited = "queue"
    elif (
        rows
        and level.concurrency > rows
        and (not paced or (server.get("mean_batch") or 0) >= FULL_ROWS * rows)
    ):
        limited = "max_batch"
    elif kv:
        limited = "kv_cache"
    elif level.errors:
        limited = "errors"
    else:
        limited = "real_time"
    return Verdict(False, failures, limited)


@dataclass
class RampOutcome:
    """The ramp's answer: the largest real-time level (0: none), the smallest failing one (None: none
    failed up to the maximum), what limited it (`stopped_by`: a LIMITS value or `ramp_max`) and the
    levels in the order they ran, each with its `verdict` set."""

    real_time_streams: int
    first_failing: int | None
    stopped_by: str
    levels: list[LevelResult]


async def ramp_search(
    run_level: Callable[[int], Awaitable[LevelResult]],
    settings: RampSettings,
    rows: int | None,
    progress: Callable[[LevelResult], None] | None = None,
) -> RampOutcome:
    """Run the ramp: `run_level(c)` runs one level at concurrency c (and raises to abort the ramp);
    each result gets its `verdict` (`judge_level`) and goes to `progress`. `rows` as in `judge_level`.
    The order of levels is a function of the verdicts alone (see the module docstring)."""
    settings.check()
    levels: list[LevelResult] = []

    async def probe(c: int) -> Verdict:
        level = await run_level(c)
        level.verdict = verdict = judge_level(level, settings.ttfa_p95_ms, rows, settings.paced)
        levels.append(level)
        if progress is not None:
            progress(level)
        return verdict

    lo, hi, hi_verdict = 0, None, None
    c = settings.start
    while True:  # doubling up to the maximum, the maximum included
        verdict = await probe(c)
        if not verdict.passed:
            hi, hi_verdict = c, verdict
            break
        lo = c
        if c >= settings.stop:
            break
        c = min(2 * c, settings.stop)
    while hi is not None and hi - lo > settings.step:
        if rows and hi > rows and not settings.paced:  # only the server's limit can be learned above them
            if lo >= rows:
                break
            mid = rows
        else:
            mid = (lo + hi) // 2
        verdict = await probe(mid)
        if verdict.passed:
            lo = mid
        else:
            hi, hi_verdict = mid, verdict
    stopped_by = hi_verdict.limited_by if hi_verdict is not None and hi_verdict.limited_by else "ramp_max"
    return RampOutcome(lo, hi, stopped_by, levels)


def ramp_report(settings: RampSettings, outcome: RampOutcome, rows: int | None, max_waiting: int) -> dict:
    """The report's `ramp` section: the settings (start, max, step, rounds, ttfa_p95_ms), the server's
    rows and queue (server_rows, max_waiting: summed over the listed servers), the levels in the order
    they ran (`visited`), the answer (`real_time_streams`), the first failing level and its failures,
    `stopped_by`, and `conclusion` (`ramp_conclusion`)."""
    first = next((lv for lv in outcome.levels if lv.concurrency == outcome.first_failing), None)
    ramp = {
        "start": settings.start,
        "max": settings.stop,
        "step": settings.step,
        "rounds": settings.rounds,
        "ttfa_p95_ms": settings.ttfa_p95_ms,
        "arrivals": "spread" if settings.spread else "burst",
        "pacing": "playback" if settings.paced else "none",
        "server_rows": rows,
        "max_waiting": max_waiting,
        "visited": [lv.concurrency for lv in outcome.levels],
        "real_time_streams": outcome.real_time_streams,
        "first_failing": outcome.first_failing,
        "first_failing_failures": first.verdict.failures if first is not None and first.verdict else [],
        "stopped_by": outcome.stopped_by,
        "limited_by_server": outcome.stopped_by in SERVER_LIMITS,
    }
    ramp["conclusion"] = ramp_conclusion(ramp)
    return ramp


def ramp_conclusion(ramp: dict) -> str:
    """The report's `ramp` section in a sentence: the answer and what stopped the ramp."""
    n, first, stopped = ramp["real_time_streams"], ramp["first_failing"], ramp["stopped_by"]
    rows, waiting = ramp.get("server_rows"), ramp.get("max_waiting")
    why = f" ({'; '.join(ramp.get('first_failing_failures') or [])})"
    server = "limited by the server's settings, not by real time"
    if stopped == "ramp_max":
        text = f"real-time streams: {n} or more: every level up to --ramp-max {ramp['max']} was real time"
    elif stopped == "real_time":
        text = f"real-time streams: {n}, limited by real time: concurrency {first} was not{why}"
    elif stopped == "errors":
        text = f"real-time streams: {n}, limited by errors, not by real time: concurrency {first} had{why}"
    elif stopped == "max_batch":
        text = (
            f"real-time streams: {n}, {server}: concurrency {first} is above the {rows} rows it decodes at "
            f"once (max batch), so streams waited for a row{why}; serve with a larger --max-batch"
        )
    elif stopped == "queue":
        bound = f" (max batch + max waiting = {rows + waiting})" if rows and waiting is not None else ""
        text = (
            f"real-time streams: {n}, {server}: at concurrency {first} its admission bound{bound} refused "
            f"requests{why}; serve with a larger --max-waiting"
        )
    else:
        text = (
            f"real-time streams: {n}, {server}: at concurrency {first} the paged KV pool ran out, requests "
            f"waited for KV blocks or were preempted{why}; serve with a larger --kv-memory-fraction"
        )
    if rows and n > rows:  # real time from the client's side, though not all decoded at once
        text += f"; {n} is above the server's {rows} rows: streams took turns for a row, each fast enough"
    return text


def format_ramp(report: dict) -> str:
    """The ramp's table (one line per level in the order they ran: TTFA p50/p95, underruns, audio s/s,
    frames/s, errors, the verdict and what limited a failed level) and its conclusion."""
    ramp = report["ramp"]
    head = (
        f"{'conc':>5} {'reqs':>5} {'TTFA p50':>9} {'p95':>8} {'underruns':>9} {'audio s/s':>9} "
        f"{'frames/s':>8} {'err':>4}  verdict"
    )
    lines = [head, "-" * len(head)]
    for lv in report["levels"]:
        t, v = lv["ttfa_ms"], lv["verdict"]
        p50 = "-" if t["p50"] is None else f"{t['p50']:.0f}ms"
        p95 = "-" if t["p95"] is None else f"{t['p95']:.0f}ms"
        verdict = (
            "real time" if v["passed"] else f"not real time ({v['limited_by']}: {'; '.join(v['failures'])})"
        )
        errors = sum(lv["errors"].values())
        lines.append(
            f"{lv['concurrency']:>5} {lv['requests']:>5} {p50:>9} {p95:>8} {lv['underruns']:>9} "
            f"{lv['audio_s_per_s']:>9.2f} {lv['frames_per_s']:>8.1f} {errors:>4}  {verdict}"
        )
    lines.append(
        f"criteria: 0 underruns, TTFA p95 <= {ramp['ttfa_p95_ms']:g} ms, no errors; levels of "
        f"{ramp['rounds']} x C requests, {PACING_WORDS[ramp.get('pacing', 'none')]}; "
        f"resolution {ramp['step']}; "
        f"server rows {ramp.get('server_rows') or '?'}"
    )
    lines.append(ramp_conclusion(ramp))
    return "\n".join(lines)
