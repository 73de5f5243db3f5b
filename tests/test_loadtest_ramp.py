"""`tts bench-server --ramp`: the ramp's search and verdicts with a fake level runner (a pass/fail rule per
concurrency -> the exact levels run and the number reported), its options, and one run end to end against
a tiny-model server (the report's shape only: whether a level is real time on this machine is timing)."""

from __future__ import annotations

import asyncio
import json

import pytest
from tts_tools.loadtest import LevelResult
from tts_tools.ramp import (
    LIMITS,
    SERVER_LIMITS,
    RampSettings,
    format_ramp,
    judge_level,
    ramp_report,
    ramp_search,
)

pytest.importorskip("grpc_health")


def level(c: int, *, p95: float | None = 100.0, underruns: int = 0, errors=None, server=None) -> LevelResult:
    """A level's result as `_run_level` would report it (4 requests per stream)."""
    errors = dict(errors or {})
    lv = LevelResult(concurrency=c, requests=4 * c, ok=4 * c - sum(errors.values()), errors=errors)
    lv.ttfa_ms = {"p50": None if p95 is None else p95 / 2, "p95": p95, "p99": p95}
    lv.underruns = underruns
    lv.server = dict(server or {})
    return lv


def fake_runner(rule):
    """A level runner whose level c is real time iff rule(c) (else one underrun), recording the levels."""
    calls: list[int] = []

    async def run(c: int) -> LevelResult:
        calls.append(c)
        result = rule(c)
        return result if isinstance(result, LevelResult) else level(c, underruns=0 if result else 1)

    return run, calls


def search(rule, rows=None, **settings):
    run, calls = fake_runner(rule)
    seen: list[int] = []
    outcome = asyncio.run(
        ramp_search(
            run,
            RampSettings(**{"paced": False, **settings}),  # (the rows' rules of the closed loop unless asked)
            rows,
            progress=lambda lv: seen.append(lv.concurrency),
        )
    )
    assert [lv.concurrency for lv in outcome.levels] == calls == seen  # each level run once, reported
    return outcome, calls


# ---- the search ---------------------------------------------------------------------------------------


def test_doubles_until_a_level_fails_then_bisects_to_the_step():
    outcome, calls = search(lambda c: c <= 200, start=16, stop=512, step=16)
    assert calls == [16, 32, 64, 128, 256, 192, 224, 208]
    assert (outcome.real_time_streams, outcome.first_failing, outcome.stopped_by) == (192, 208, "real_time")
    assert [lv.verdict.passed for lv in outcome.levels] == [True] * 4 + [False, True, False, False]


def test_every_level_real_time_stops_at_the_maximum_which_is_run_itself():
    outcome, calls = search(lambda c: True, start=16, stop=100, step=16)
    assert calls == [16, 32, 64, 100]
    assert (outcome.real_time_streams, outcome.first_failing, outcome.stopped_by) == (100, None, "ramp_max")


def test_a_failing_first_level_is_bisected_down_from_zero():
    outcome, calls = search(lambda c: c <= 20, start=64, stop=512, step=16)
    assert calls == [64, 32, 16]
    assert (outcome.real_time_streams, outcome.first_failing) == (16, 32)
    outcome, calls = search(lambda c: False, start=64, stop=512, step=16)
    assert calls == [64, 32, 16]
    assert (outcome.real_time_streams, outcome.first_failing, outcome.stopped_by) == (0, 16, "real_time")


def test_step_one_finds_the_exact_boundary():
    outcome, calls = search(lambda c: c <= 5, start=1, stop=8, step=1)
    assert calls == [1, 2, 4, 8, 6, 5]
    assert (outcome.real_time_streams, outcome.first_failing) == (5, 6)


def server_rule(rows: int, real_time_up_to: int):
    """A server decoding `rows` streams at once: above them streams wait for a row (TTFA p95 far over);
    up to them, real time up to `real_time_up_to` streams (then underruns)."""

    def rule(c: int) -> LevelResult:
        if c > rows:
            return level(c, p95=5000.0)
        return level(c, underruns=0 if c <= real_time_up_to else 3)

    return rule


@pytest.mark.parametrize("mean_batch, limited_by", [(200.0, "real_time"), (240.0, "max_batch")])
def test_paced_levels_above_the_rows_are_searched_and_judged_by_the_mean_batch(mean_batch, limited_by):
    """Paced, a stream holds no row while its audio plays: 256 rows may carry more than 256 streams.
    Levels above the rows are bisected like any other, and a failed one is the server's max batch
    only when its steps averaged 90% of the rows or more (240 of 256 here), else real time."""

    def rule(c: int) -> LevelResult:
        return level(c, underruns=0 if c <= 320 else 3, server={"mean_batch": mean_batch})

    outcome, calls = search(rule, rows=256, start=64, stop=512, step=32, paced=True)
    assert calls == [64, 128, 256, 512, 384, 320, 352]
    assert (outcome.real_time_streams, outcome.first_failing) == (320, 352)
    assert outcome.stopped_by == limited_by
    assert (
        judge_level(level(512, underruns=1), 300.0, 256, paced=True).limited_by == "real_time"
    )  # (no counters)


def test_a_level_above_the_max_batch_is_the_server_limit_and_not_bisected():
    """Real time at every level up to the server's rows, the next level above them: the ramp stops at the
    rows and says the server's max batch stopped it (no level between the rows and that one is run)."""
    outcome, calls = search(server_rule(256, 10_000), rows=256, start=64, stop=512, step=16)
    assert calls == [64, 128, 256, 512]
    assert (outcome.real_time_streams, outcome.first_failing, outcome.stopped_by) == (256, 512, "max_batch")
    assert outcome.levels[-1].verdict.limited_by == "max_batch"


def test_the_rows_are_probed_before_bisecting_below_them():
    outcome, calls = search(server_rule(200, 10_000), rows=200, start=64, stop=512, step=16)
    assert calls == [64, 128, 256, 200]
    assert (outcome.real_time_streams, outcome.first_failing, outcome.stopped_by) == (200, 256, "max_batch")
    # the rows themselves below real time: bisection below them, and real time is the finding
    outcome, calls = search(server_rule(200, 150), rows=200, start=64, stop=512, step=16)
    assert calls == [64, 128, 256, 200, 164, 146, 155]
    assert (outcome.real_time_streams, outcome.first_failing, outcome.stopped_by) == (146, 155, "real_time")


def test_real_time_above_the_rows_is_kept_and_said():
    """Streams that take turns for a row can still be real time for their clients (a server far faster
    than real time): such a level passes, and the conclusion says the answer is above the rows."""
    settings = RampSettings(start=64, stop=512, step=16, paced=False)
    run, calls = fake_runner(lambda c: c <= 300)
    outcome = asyncio.run(ramp_search(run, settings, 200))
    assert calls == [64, 128, 256, 512]  # 512 fails above the rows, with 256 above them passed: no bisection
    assert (outcome.real_time_streams, outcome.stopped_by) == (256, "max_batch")
    conclusion = ramp_report(settings, outcome, 200, 16)["conclusion"]
    assert "256 is above the server's 200 rows" in conclusion and "--max-batch" in conclusion


def test_without_known_rows_levels_above_them_are_bisected_like_any():
    outcome, calls = search(server_rule(200, 10_000), rows=None, start=64, stop=512, step=16)
    assert calls == [64, 128, 256, 192, 224, 208]
    assert outcome.stopped_by == "real_time"  # (nothing says the server's rows were the limit)


def test_a_queue_refusal_is_the_server_limit():
    def rule(c: int) -> LevelResult:
        return level(c) if c <= 128 else level(c, p95=900.0, errors={"RESOURCE_EXHAUSTED": 7})

    outcome, calls = search(rule, rows=512, start=64, stop=512, step=64)
    assert calls == [64, 128, 256, 192]
    assert (outcome.real_time_streams, outcome.first_failing, outcome.stopped_by) == (128, 192, "queue")


def test_a_level_runner_error_aborts_the_ramp():
    async def run(c: int) -> LevelResult:
        if c > 16:
            raise RuntimeError("the server went away")
        return level(c)

    with pytest.raises(RuntimeError, match="went away"):
        asyncio.run(ramp_search(run, RampSettings(start=16, stop=64), None))


@pytest.mark.parametrize(
    "settings, message",
    [
        (dict(start=0), "--ramp-start must be >= 1"),
        (dict(start=64, stop=32), "--ramp-max must be >= --ramp-start (64)"),
        (dict(step=0), "--ramp-step must be >= 1"),
        (dict(rounds=0), "--ramp-rounds must be >= 1"),
        (dict(ttfa_p95_ms=0.0), "--ramp-ttfa-p95 must be milliseconds > 0"),
        (dict(ttfa_p95_ms=float("nan")), "--ramp-ttfa-p95 must be milliseconds > 0"),
    ],
)
def test_bad_settings_name_the_option(settings, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        asyncio.run(ramp_search(fake_runner(lambda c: True)[0], RampSettings(**settings), None))


# ---- the verdict of one level -------------------------------------------------------------------------


@pytest.mark.parametrize(
    "result, rows, passed, limited_by, failures",
    [
        (level(8, p95=300.0), 16, True, None, []),  # the bound itself is real time
        (level(8, p95=300.5), 16, False, "real_time", ["TTFA p95 300.5 ms > 300 ms"]),
        (level(8, underruns=1), 16, False, "real_time", ["1 underruns"]),
        (level(32, underruns=2), 16, False, "max_batch", ["2 underruns"]),
        (level(8, p95=None), 16, False, "real_time", ["no audio"]),
        (level(8, errors={"DEADLINE_EXCEEDED": 1}), 16, False, "errors", ["errors DEADLINE_EXCEEDED 1"]),
        (
            level(32, errors={"RESOURCE_EXHAUSTED": 3, "INTERNAL": 1}),
            16,
            False,
            "queue",
            ["errors INTERNAL 1, RESOURCE_EXHAUSTED 3"],
        ),
        (
            level(8, errors={"RESOURCE_EXHAUSTED": 3}, server={"kv_preemptions": 3.0, "kv_stalls": 0.0}),
            16,
            False,
            "kv_cache",
            ["errors RESOURCE_EXHAUSTED 3"],
        ),
        (
            level(8, underruns=4, server={"kv_stalls": 12.0, "kv_preemptions": 0.0}),
            16,
            False,
            "kv_cache",
            None,
        ),
        (level(8, underruns=4, server={"kv_stalls": None}), 16, False, "real_time", None),  # not exported
        # The server held newcomers because its step was too slow for one more stream (real-time
        # admission's speed rule), and the queue overflowed behind them: real time, not the queue bound.
        (
            level(16, errors={"RESOURCE_EXHAUSTED": 5}, server={"realtime_deferred_speed": 7.0}),
            32,
            False,
            "real_time",
            ["errors RESOURCE_EXHAUSTED 5"],
        ),
        (
            level(16, errors={"RESOURCE_EXHAUSTED": 5}, server={"realtime_deferred_speed": 0.0}),
            32,
            False,
            "queue",
            None,
        ),
        (level(32, underruns=1), None, False, "real_time", None),  # rows unknown
    ],
)
def test_a_level_is_real_time_without_underruns_errors_or_a_late_first_audio(
    result, rows, passed, limited_by, failures
):
    verdict = judge_level(result, 300.0, rows)
    assert (verdict.passed, verdict.limited_by) == (passed, limited_by)
    assert limited_by is None or limited_by in LIMITS
    if failures is not None:
        assert verdict.failures == failures


# ---- the report ---------------------------------------------------------------------------------------


def test_report_section_and_table_say_the_server_stopped_the_ramp():
    from dataclasses import asdict

    settings = RampSettings(start=64, stop=512, step=16, paced=False)
    run, _ = fake_runner(server_rule(256, 10_000))
    outcome = asyncio.run(ramp_search(run, settings, 256))
    ramp = ramp_report(settings, outcome, 256, 512)
    assert ramp["visited"] == [64, 128, 256, 512]
    assert (ramp["real_time_streams"], ramp["first_failing"], ramp["stopped_by"]) == (256, 512, "max_batch")
    assert ramp["limited_by_server"] is True
    assert ramp["first_failing_failures"] == ["TTFA p95 5000.0 ms > 300 ms"]
    assert ramp["conclusion"].startswith("real-time streams: 256, limited by the server's settings")
    assert "--max-batch" in ramp["conclusion"]
    report = json.loads(json.dumps({"ramp": ramp, "levels": [asdict(lv) for lv in outcome.levels]}))
    lines = format_ramp(report).splitlines()
    assert len(lines) == 2 + 4 + 2  # head, rule, one line per level, criteria, conclusion
    assert lines[2].split()[:2] == ["64", "256"] and lines[2].endswith("real time")
    assert lines[5].split()[:2] == ["512", "2048"] and "max_batch: TTFA p95 5000.0 ms > 300 ms" in lines[5]
    assert lines[-1] == ramp["conclusion"]


@pytest.mark.parametrize(
    "stopped_by, words",
    [
        ("ramp_max", "128 or more"),
        ("real_time", "limited by real time"),
        ("errors", "limited by errors"),
        ("queue", "max batch + max waiting = 768"),
        ("kv_cache", "KV pool ran out"),
    ],
)
def test_the_conclusion_names_what_stopped_the_ramp(stopped_by, words):
    from tts_tools.ramp import ramp_conclusion

    ramp = {"real_time_streams": 128, "first_failing": 192, "stopped_by": stopped_by, "max": 512}
    ramp |= {"server_rows": 256, "max_waiting": 512, "first_failing_failures": ["3 underruns"]}
    text = ramp_conclusion(ramp)
    assert text.startswith("real-time streams: 128") and words in text
    assert ("not by real time" in text) == (stopped_by in SERVER_LIMITS or stopped_by == "errors")


# ---- the command line ---------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--ramp-max", "64"], "--ramp-max needs --ramp"),
        (["--ramp-step", "4", "--ramp-rounds", "1"], "--ramp-step, --ramp-rounds need --ramp"),
        (["--ramp", "--ramp-start", "0"], "--ramp-start must be >= 1"),
        (["--ramp", "--ramp-start", "64", "--ramp-max", "32"], "--ramp-max must be >= --ramp-start (64)"),
        (["--ramp", "--ramp-ttfa-p95", "-1"], "--ramp-ttfa-p95 must be milliseconds > 0"),
        (["--ramp", "--concurrency", "4"], "--ramp takes no --concurrency"),
        (["--ramp", "--requests", "4"], "--ramp takes no --requests"),
        (["--ramp", "--sessions", "4"], "--ramp takes no --sessions"),
        (["--ramp", "--soak"], "--ramp takes no --soak"),
        (["--ramp-pacing", "none"], "--ramp-pacing needs --ramp"),
    ],
)
def test_bad_ramp_options_exit_2_with_one_line(extra, message, tmp_path, capsys):
    from tts.cli.main import main

    # (refused before any connection: nothing listens on port 9)
    rc = main(["bench-server", "--server", "127.0.0.1:9", "--json", str(tmp_path / "r.json"), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith("tts: error: ") and message in err[0]
    assert not (tmp_path / "r.json").exists()


def test_a_start_above_the_default_maximum_raises_the_maximum():
    import argparse

    from tts_tools.loadtest import add_arguments, ramp_settings

    p = argparse.ArgumentParser()
    add_arguments(p)
    args = p.parse_args(["--server", "h:1", "--ramp", "--ramp-start", "1024"])
    settings = ramp_settings(args)
    assert settings is not None and (settings.start, settings.stop) == (1024, 1024)
    assert settings.paced  # streams paced by their playback unless asked otherwise
    assert ramp_settings(p.parse_args(["--server", "h:1"])) is None
    closed = ramp_settings(p.parse_args(["--server", "h:1", "--ramp", "--ramp-pacing", "none"]))
    assert closed is not None and not closed.paced


# ---- end to end ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    from service_helpers import ServerThread

    from tts.checkpoints.load import load_bundle
    from tts.engine import EngineConfig

    srv = ServerThread(load_bundle("tiny"), EngineConfig(max_batch=2), metrics_port=0)
    yield srv
    srv.stop()


def test_bench_server_ramp_end_to_end_report_shape(server, tmp_path, capsys):
    """--ramp from 1 to 4 streams on a server of 2 rows: whichever levels are real time on this machine,
    the levels run follow the search's rule, each has its numbers and verdict, and the answer and what
    stopped the ramp agree with them."""
    from service_helpers import wait_idle

    from tts.cli.main import main

    out = tmp_path / "ramp.json"
    metrics = f"http://127.0.0.1:{server.server.metrics_port}/metrics"
    rc = main(
        ["bench-server", "--server", server.address, "--ramp", "--ramp-start", "1", "--ramp-max", "4"]
        + ["--ramp-step", "1", "--ramp-rounds", "2", "--max-new-frames", "4", "--min-new-frames", "4"]
        + ["--metrics-url", metrics, "--json", str(out)]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    ramp, levels = report["ramp"], report["levels"]
    assert report["mode"] == "ramp"
    assert (ramp["start"], ramp["max"], ramp["step"], ramp["rounds"], ramp["ttfa_p95_ms"]) == (
        1,
        4,
        1,
        2,
        300.0,
    )
    assert (ramp["server_rows"], ramp["max_waiting"]) == (2, report["info"]["max_waiting"])
    assert (ramp["arrivals"], ramp["pacing"]) == ("spread", "playback")
    visited = [lv["concurrency"] for lv in levels]
    assert ramp["visited"] == visited and visited in ([1], [1, 2], [1, 2, 4])
    for lv in levels:
        assert (
            lv["requests"] == 2 * lv["concurrency"]
            and lv["ok"] + sum(lv["errors"].values()) == lv["requests"]
        )
        assert {"p50", "p95"} <= set(lv["ttfa_ms"]) and lv["audio_s_per_s"] >= 0 and lv["frames_per_s"] >= 0
        assert isinstance(lv["underruns"], int) and "kv_stalls" in lv["server"]
        v = lv["verdict"]
        assert v["passed"] == (not v["failures"]) and (v["limited_by"] is None) == v["passed"]
        if not v["passed"] and lv["concurrency"] > 2:
            assert v["limited_by"] in SERVER_LIMITS  # above the server's rows: its limit, not real time
    passed = [lv["concurrency"] for lv in levels if lv["verdict"]["passed"]]
    failed = [lv for lv in levels if not lv["verdict"]["passed"]]
    # doubling stops at the first failure, and no bisection fits between levels 1 apart or above the rows
    assert len(failed) <= 1 and (not failed or failed[0] is levels[-1])
    assert ramp["real_time_streams"] == max(passed, default=0)
    if failed:
        assert ramp["first_failing"] == failed[0]["concurrency"]
        assert ramp["stopped_by"] == failed[0]["verdict"]["limited_by"]
    else:
        assert (ramp["first_failing"], ramp["stopped_by"], visited) == (None, "ramp_max", [1, 2, 4])
    assert ramp["limited_by_server"] == (ramp["stopped_by"] in SERVER_LIMITS)
    printed = capsys.readouterr().out
    assert ramp["conclusion"] in printed
    assert ramp["conclusion"].startswith(f"real-time streams: {ramp['real_time_streams']}")
    wait_idle(server.loop)


class Reply:
    """What `_run_level` reads of a `service.client.StreamResult`: 4 frames; chunks' arrivals (seconds
    from the send) and samples at `sample_rate`."""

    def __init__(self, arrivals=(), chunk_samples=(), sample_rate=1):
        self.header = type("H", (), {"replica": ""})()
        self.end = type("E", (), {"frames": 4})()
        self.audio_seconds, self.ttfa, self.rtf, self.max_gap = 0.2, 0.01, 0.1, 0.0
        self.stream_frames_per_s = None
        self.arrivals, self.chunk_samples, self.sample_rate = list(arrivals), list(chunk_samples), sample_rate


def test_spread_arrivals_delay_worker_k_by_k_over_c_of_the_spread(monkeypatch):
    """--ramp-arrivals spread: worker k's first request waits k x spread / C (counted through the sleeps
    asked for, not timed); burst (spread 0) asks for none."""
    import tts_tools.loadtest as lt

    import service.client

    async def fake_stream(stub, request, timeout=None):
        return Reply()

    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def recording_sleep(delay, *args):
        slept.append(delay)
        await real_sleep(0)

    monkeypatch.setattr(service.client, "synthesize_stream", fake_stream)
    monkeypatch.setattr(lt, "playback_underruns", lambda *a: (0, 0.0))
    monkeypatch.setattr(lt.asyncio, "sleep", recording_sleep)
    for spread, expected in ((2.0, [0.5, 1.0, 1.5]), (0.0, [])):
        slept.clear()
        counter = iter(range(100))
        level = asyncio.run(lt._run_level([None], 4, 8, counter, lambda i: i, None, spread))
        assert sorted(slept) == expected
        assert level.ok == 8


def test_spread_arrivals_need_a_known_request_length():
    """Spread arrivals span one request's playback time; without --max-new-frames the length is unknown,
    so the streams arrive at once and the settings (hence the report) say burst."""
    from tts_tools.loadtest import ramp_arrivals
    from tts_tools.ramp import RampSettings

    assert ramp_arrivals(RampSettings(), 128, 21.5) == (RampSettings(), 128 / 21.5)
    assert ramp_arrivals(RampSettings(), None, 21.5) == (RampSettings(spread=False), 0.0)
    assert ramp_arrivals(RampSettings(spread=False), 128, 21.5) == (RampSettings(spread=False), 0.0)
    assert ramp_arrivals(None, 128, 21.5) == (None, 0.0)


def test_playback_end_counts_a_late_chunk_from_its_arrival():
    """A player started by the first chunk with audio: on time, it ends at that arrival plus all the audio;
    a chunk that arrives after the player ran dry plays from its arrival; chunks without audio do not
    start it."""
    from tts_tools.loadtest import playback_end

    rate = 100
    # audio-less header chunk at 0.1, then 0.5 s at 0.2, 0.5 s at 0.3: 0.2 + 1.0
    assert playback_end([0.1, 0.2, 0.3], [0, 50, 50], rate) == pytest.approx(1.2)
    # the second chunk comes at 0.9, 0.2 s after the first's 0.5 s ran out at 0.7: 0.9 + 0.5
    assert playback_end([0.2, 0.9], [50, 50], rate) == pytest.approx(1.4)
    assert playback_end([0.1], [0], rate) == 0.0
    with pytest.raises(ValueError):
        playback_end([0.1], [1, 2], rate)


def test_paced_streams_send_the_next_request_when_the_last_ones_audio_has_played(monkeypatch):
    """--ramp-pacing playback: a worker's next request waits until its last one's audio has played
    (send time + playback_end), counted on an injected clock through the sleeps asked for; unpaced, it
    asks for none."""
    import tts_tools.loadtest as lt

    import service.client

    now = [10.0]

    async def fake_stream(stub, request, timeout=None):
        now[0] += 0.5  # the stream takes 0.5 s
        # two chunks of 1 s each, arriving 0.25 s and 0.5 s after the send: played 2.25 s after it
        return Reply(arrivals=[0.25, 0.5], chunk_samples=[8, 8], sample_rate=8)

    slept: list[float] = []
    real_sleep = asyncio.sleep

    async def recording_sleep(delay, *args):
        slept.append(delay)
        now[0] += delay
        await real_sleep(0)

    monkeypatch.setattr(service.client, "synthesize_stream", fake_stream)
    monkeypatch.setattr(lt.time, "perf_counter", lambda: now[0])
    monkeypatch.setattr(lt.asyncio, "sleep", recording_sleep)
    for paced, expected in ((True, [1.75, 1.75]), (False, [])):
        slept.clear()
        level = asyncio.run(lt._run_level([None], 1, 3, iter(range(100)), lambda i: i, None, 0.0, paced))
        # (2.25 s of playback less the 0.5 s stream, before requests 2 and 3)
        assert slept == pytest.approx(expected)
        assert level.ok == 3


def test_a_stream_that_breaks_the_protocol_is_a_level_error_not_a_crash(monkeypatch):
    """A server whose stream breaks the protocol (`StreamError`: a chunk out of order, no end) fails that
    request as an error of the level (`PROTOCOL`), and the level goes on to its other requests."""
    import tts_tools.loadtest as lt

    import service.client
    from service.client import StreamError

    async def fake_stream(stub, request, timeout=None):
        if request == 1:
            raise StreamError("sequence gap: expected 1, got 2")
        return Reply(arrivals=[0.1], chunk_samples=[8], sample_rate=8)

    monkeypatch.setattr(service.client, "synthesize_stream", fake_stream)
    level = asyncio.run(lt._run_level([None], 2, 4, iter(range(100)), lambda i: i, None))
    assert (level.ok, level.errors) == (3, {"PROTOCOL": 1})


@pytest.mark.parametrize("paced", [False, True])
def test_every_stream_of_a_level_sends_its_share_of_the_requests(monkeypatch, paced):
    """C streams, spread arrivals, C x rounds requests: each stream sends `rounds` of them, also where
    the first streams finish before the last ones start (one round: each stream exactly one request)."""
    import tts_tools.loadtest as lt

    import service.client

    senders: list[int] = []

    async def fake_stream(stub, request, timeout=None):
        senders.append(id(asyncio.current_task()))
        return Reply(arrivals=[0.0], chunk_samples=[1], sample_rate=1000)

    real_sleep = asyncio.sleep

    async def no_sleep(delay, *args):
        await real_sleep(0)

    monkeypatch.setattr(service.client, "synthesize_stream", fake_stream)
    monkeypatch.setattr(lt.asyncio, "sleep", no_sleep)
    for total, shares in ((4, [1, 1, 1, 1]), (8, [2, 2, 2, 2]), (6, [2, 2, 1, 1])):
        senders.clear()
        level = asyncio.run(lt._run_level([None], 4, total, iter(range(100)), lambda i: i, None, 2.0, paced))
        assert level.ok == total
        assert sorted((senders.count(t) for t in set(senders)), reverse=True) == shares
