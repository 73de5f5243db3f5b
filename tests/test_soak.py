"""The soak test (`tts bench-server --soak`): its plan, stream checks and verdict rules on hand-made
inputs, and a short soak of a real tiny-model server on 127.0.0.1 whose verdict must be pass."""

from __future__ import annotations

import argparse
import json
import math

import pytest
from tts_tools.soak import (
    ALLOWED,
    CANCEL_PHASES,
    DEFAULT_MIX,
    GAUGES,
    INVALID_VARIANTS,
    KINDS,
    MiB,
    Outcome,
    SoakConfig,
    StreamCheck,
    build_soak_request,
    failures,
    make_plan,
    mix_counts,
    parse_mix,
    parse_range,
    summarize,
)

from service.grpc_gen.v1 import tts_pb2 as pb

pytest.importorskip("grpc_health")

# ---- the plan ------------------------------------------------------------------------------------------


def test_mix_counts_add_up_exactly():
    assert mix_counts(100, DEFAULT_MIX) == {
        "normal": 45,
        "cancel": 15,
        "slow": 10,
        "stall": 5,
        "deadline": 10,
        "unary": 10,
        "invalid": 5,
    }
    for n in (1, 7, 33, 999):
        counts = mix_counts(n, DEFAULT_MIX)
        assert sum(counts.values()) == n
        assert all(abs(counts[k] - n * DEFAULT_MIX.get(k, 0.45)) < 1 for k in KINDS)
    assert mix_counts(10, {"stall": 1.0}) == {**dict.fromkeys(KINDS, 0), "stall": 10}
    with pytest.raises(ValueError):
        mix_counts(10, {"cancel": 0.7, "slow": 0.5})


def test_plan_is_reproducible_and_covers_every_variant():
    plan = make_plan(200, DEFAULT_MIX, seed=5, stall=(2.0, 4.0), deadline=(0.1, 0.3))
    assert plan == make_plan(200, DEFAULT_MIX, seed=5, stall=(2.0, 4.0), deadline=(0.1, 0.3))
    assert [s.kind for s in plan] != [s.kind for s in make_plan(200, DEFAULT_MIX, seed=6)]
    assert [s.index for s in plan] == list(range(200))
    by_kind = {k: [s for s in plan if s.kind == k] for k in KINDS}
    assert {k: len(v) for k, v in by_kind.items()} == mix_counts(200, DEFAULT_MIX)
    cancels = by_kind["cancel"]
    assert [s.cancel_phase for s in cancels[:6]] == [*CANCEL_PHASES, *CANCEL_PHASES]
    assert {s.cancel_chunks for s in cancels if s.cancel_phase == "after_chunks"} == {1, 2, 3}
    assert [s.then for s in by_kind["stall"][:4]] == ["cancel", "resume", "cancel", "resume"]
    assert all(2.0 <= s.delay_s <= 4.0 for s in by_kind["stall"])
    assert all(0.1 <= s.delay_s <= 0.3 for s in by_kind["deadline"])
    assert sorted({s.invalid for s in by_kind["invalid"]}) == list(range(len(INVALID_VARIANTS)))


def test_invalid_requests_carry_one_bad_value():
    plan = [s for s in make_plan(400, {"invalid": 1.0}, seed=1)][: len(INVALID_VARIANTS)]
    requests = [build_soak_request(s, 1000, {"voice": "alpha", "max_new_frames": 20}, {}) for s in plan]
    by_variant = {INVALID_VARIANTS[s.invalid][0]: r for s, r in zip(plan, requests, strict=True)}
    assert by_variant["empty text"].text == ""
    assert by_variant["top_p 1.5"].sampling.top_p == pytest.approx(1.5)
    assert by_variant["max_new_frames 0"].sampling.max_new_frames == 0
    clip = by_variant["unreadable reference clip"]
    assert clip.voice.WhichOneof("source") == "reference" and clip.voice.reference.audio.startswith(b"RIFF")


def test_option_parsers():
    assert parse_mix("cancel=0.3,stall=0")["cancel"] == 0.3
    assert parse_mix("stall=0")["stall"] == 0.0 and parse_mix("")["slow"] == DEFAULT_MIX["slow"]
    for bad in ("normal=0.5", "bogus=0.1", "cancel=x", "cancel=0.9"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_mix(bad)
    assert parse_range("0.05,0.5") == (0.05, 0.5)
    for bad in ("1", "2,1", "-1,1", "a,b"):
        with pytest.raises(argparse.ArgumentTypeError):
            parse_range(bad)


# ---- stream checks -------------------------------------------------------------------------------------


def header(encoding=pb.AUDIO_ENCODING_PCM16):
    return pb.SynthesizeResponse(
        header=pb.StreamHeader(sample_rate=16000, frame_rate=25.0, encoding=encoding)
    )


def chunk(seq, start, end, width=2):
    audio = b"\x00" * ((end - start) * 640 * width)
    return pb.SynthesizeResponse(
        chunk=pb.AudioChunk(sequence=seq, frame_start=start, frame_end=end, audio=audio)
    )


def end(frames, chunks):
    return pb.SynthesizeResponse(end=pb.StreamEnd(frames=frames, chunks=chunks))


def check(messages, ok=True) -> StreamCheck:
    c = StreamCheck()
    for m in messages:
        c.add(m)
    c.finish(ok)
    return c


def test_stream_check_accepts_a_good_stream():
    c = check([header(), chunk(0, 0, 4), chunk(1, 4, 20), chunk(2, 20, 23), end(23, 3)])
    assert (c.sequence_gaps, c.frame_gaps, c.length_mismatch, c.problems) == (0, 0, False, [])
    c = check([header(pb.AUDIO_ENCODING_FLOAT32), chunk(0, 0, 4, width=4), end(4, 1)])
    assert (c.sequence_gaps, c.frame_gaps, c.length_mismatch, c.problems) == (0, 0, False, [])
    # A cancelled stream: what arrived must still be gap-free; no end is expected.
    c = check([header(), chunk(0, 0, 4)], ok=False)
    assert (c.sequence_gaps, c.frame_gaps, c.problems) == (0, 0, [])


def test_stream_check_finds_gaps_and_protocol_errors():
    c = check([header(), chunk(0, 0, 4), chunk(2, 4, 20), end(20, 2)])
    assert c.sequence_gaps == 1 and c.frame_gaps == 0
    c = check([header(), chunk(0, 0, 4), chunk(1, 5, 20), end(20, 2)])
    assert c.sequence_gaps == 0 and c.frame_gaps == 1
    c = check([header(), chunk(0, 1, 4), end(4, 1)])  # does not start at frame 0
    assert c.frame_gaps == 1
    c = check([header(), chunk(0, 0, 4), end(8, 1)])  # the end claims frames that never came
    assert c.frame_gaps == 1
    c = check([header(), chunk(0, 0, 4)], ok=True)
    assert c.problems == ["OK without a header and an end"]
    c = check([chunk(0, 0, 4), header(), end(4, 2)])
    assert len(c.problems) == 3  # chunk before the header, late header, chunk count
    bad = chunk(0, 0, 4)
    bad.chunk.audio = b"\x00" * 100
    assert check([header(), bad, end(4, 1)]).length_mismatch


# ---- verdict -------------------------------------------------------------------------------------------


def report_of(outcomes, plan, **extra) -> dict:
    report = summarize(plan, outcomes)
    report["gauges"] = {
        "skipped": False,
        "checked": True,
        "idle": True,
        "after": dict.fromkeys(GAUGES, 0.0),
        "settle_s": 0.1,
        "max_during": {},
    }
    report["rss"] = {
        "checked": True,
        "baseline_bytes": 500 * MiB,
        "final_bytes": 510 * MiB,
        "bound_bytes": 650 * MiB,
    }
    report.update(extra)
    return report


def test_verdict_rules():
    plan = make_plan(20, DEFAULT_MIX, seed=3)
    good = {k: sorted(ALLOWED[k])[0] for k in KINDS}
    outcomes = [Outcome(s.index, s.kind, good[s.kind]) for s in plan]
    report = report_of(outcomes, plan)
    assert failures(report) == []
    assert report["completed"] == 20 and sum(report["planned"].values()) == 20
    # A server error, a status outside the kind's list, a gap, a leak, RSS growth: each one line.
    normal = next(o for o in outcomes if o.kind == "normal")
    normal.status = "INTERNAL"
    invalid = next(o for o in outcomes if o.kind == "invalid")
    invalid.status = "OK"
    outcomes[0].sequence_gaps = 1
    report = report_of(outcomes, plan)
    report["gauges"].update(idle=False, after={**dict.fromkeys(GAUGES, 0.0), "tts_requests_in_flight": 1.0})
    report["rss"]["final_bytes"] = 700 * MiB
    reasons = failures(report)
    assert len(reasons) == 4, reasons
    assert reasons[0].startswith("leak:") and "tts_requests_in_flight=1" in reasons[0]
    assert reasons[1].startswith("gaps: 1 sequence-number")
    assert reasons[2] == "unexpected statuses: normal: INTERNAL x1; invalid: OK x1"
    assert reasons[3].startswith("rss: 500 MiB after warm-up -> 700 MiB")
    # Without metrics (--metrics-url off) the leak and RSS checks are skipped, not failed.
    report = report_of([Outcome(s.index, s.kind, good[s.kind]) for s in plan], plan)
    report["gauges"] = {"skipped": True, "checked": False, "idle": False, "after": {}}
    report["rss"] = {"checked": False, "reason": "no metrics (--metrics-url off)"}
    assert failures(report) == []


# ---- a real soak ----------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def bundle():
    from tts.checkpoints.load import load_bundle

    return load_bundle("tiny")


@pytest.fixture(scope="module")
def server(bundle):
    from service_helpers import ServerThread

    from service.server import ServiceLimits
    from tts.engine import EngineConfig

    # max_queued_chunks 2: a stalled client (8 KiB windows) pauses its request after a few chunks.
    limits = ServiceLimits(max_waiting=8, max_queued_chunks=2)
    srv = ServerThread(bundle, EngineConfig(max_batch=8), limits, metrics_port=0)
    yield srv
    srv.stop()


def test_soak_of_a_tiny_server_passes_and_counts_add_up(server, tmp_path):
    """200 mixed requests from 6 clients (fewer than the max batch of 8, so stalled clients never
    hold every row). Exact: the plan's counts per kind, every request accounted for, no gap, no leak;
    timing decides e.g. whether a cancel beat the end, so those statuses are only checked to be allowed."""
    from tts.cli.main import main

    out = tmp_path / "soak.json"
    requests, seed = 200, 7
    args = [
        "bench-server",
        "--soak",
        "--server",
        server.address,
        "--concurrency",
        "6",
        "--requests",
        str(requests),
        "--seed",
        str(seed),
        "--json",
        str(out),
        "--metrics-url",
        f"http://127.0.0.1:{server.server.metrics_port}/metrics",
        "--max-new-frames",
        "48",
        "--encoding",
        "float32",
        "--slow-delay",
        "0.01,0.05",
        "--stall",
        "0.3,0.8",
        "--deadline",
        "0.05,0.5",
        "--settle-timeout",
        "60",
    ]
    assert main(args) == 0
    report = json.loads(out.read_text())
    assert report["verdict"] == "pass" and report["failures"] == []
    planned = mix_counts(requests, DEFAULT_MIX)
    assert report["planned"] == planned
    assert report["requests"] == report["completed"] == requests
    assert sum(sum(s.values()) for s in report["statuses"].values()) == requests
    for kind in KINDS:
        assert sum(report["statuses"][kind].values()) == planned[kind], kind
        assert set(report["statuses"][kind]) <= ALLOWED[kind], kind
    assert report["statuses"]["invalid"] == {"INVALID_ARGUMENT": planned["invalid"]}
    assert report["unexpected"] == {}
    stall = report["stall"]
    assert sum(stall["then_cancel"].values()) == math.ceil(planned["stall"] / 2)
    assert sum(stall["then_resume"].values()) == planned["stall"] // 2
    plan = make_plan(requests, DEFAULT_MIX, seed)
    for phase in CANCEL_PHASES:
        expected = sum(1 for s in plan if s.kind == "cancel" and s.cancel_phase == phase)
        assert sum(report["cancel_phases"][phase].values()) == expected
    assert [o[1] for o in report["outcomes"]] == [s.kind for s in plan]
    assert report["gaps"] == {"sequence": 0, "frame_range": 0, "streams": 0}
    assert report["protocol_errors"] == 0 and report["length_mismatches"] == 0
    gauges = report["gauges"]
    assert gauges["checked"] and gauges["idle"] and gauges["after"] == dict.fromkeys(GAUGES, 0.0)
    assert report["rss"]["checked"] and report["rss"]["baseline_bytes"] > 0
    assert report["rss"]["final_bytes"] <= report["rss"]["bound_bytes"]
    assert report["warmup"]["requests"] == 12
    assert report["settings"]["max_stalled"] == 7  # the server's max batch - 1


def test_soak_fails_with_one_line_when_a_request_stays_in_flight(bundle, tmp_path, capsys, monkeypatch):
    """A server whose in-flight gauge never returns to 0 (here: made to report one job too many) fails
    the soak: exit 1, one line naming the gauge."""
    from service_helpers import ServerThread

    from tts.cli.main import main
    from tts.engine import EngineConfig
    from tts.runtime.engine_thread import EngineThread

    refresh = EngineThread._refresh_stats

    def one_too_many(self):
        refresh(self)
        self.stats.jobs += 1

    monkeypatch.setattr(EngineThread, "_refresh_stats", one_too_many)
    srv = ServerThread(bundle, EngineConfig(max_batch=2), metrics_port=0)
    try:
        args = [
            "bench-server",
            "--soak",
            "--server",
            srv.address,
            "--concurrency",
            "1",
            "--requests",
            "4",
            "--mix",
            "cancel=0,slow=0,stall=0,deadline=0,unary=0,invalid=0",
            "--max-new-frames",
            "4",
            "--settle-timeout",
            "0.5",
            "--json",
            str(tmp_path / "leak.json"),
            "--metrics-url",
            f"http://127.0.0.1:{srv.server.metrics_port}/metrics",
        ]
        assert main(args) == 1
    finally:
        srv.stop()
    err = capsys.readouterr().err.strip().splitlines()[-1]
    assert err.startswith("soak FAILED: leak: ") and err.endswith("tts_requests_in_flight=1")
    report = json.loads((tmp_path / "leak.json").read_text())
    assert report["verdict"] == "fail" and report["statuses"]["normal"] == {"OK": 4}


def test_soak_stops_when_the_metrics_cannot_be_read(server, tmp_path, capsys):
    from tts.cli.main import main

    args = [
        "bench-server",
        "--soak",
        "--server",
        server.address,
        "--requests",
        "5",
        "--json",
        str(tmp_path / "s.json"),
        "--metrics-url",
        "http://127.0.0.1:9/metrics",
    ]
    assert main(args) == 2
    err = capsys.readouterr().err.strip()
    assert "cannot read the server's metrics at http://127.0.0.1:9/metrics" in err and "\n" not in err
    assert not (tmp_path / "s.json").exists()


def test_soak_config_defaults_match_the_documentation():
    cfg = SoakConfig()
    assert (cfg.requests, cfg.concurrency, cfg.settle_timeout) == (1000, 8, 30.0)
    assert (cfg.rss_growth_pct, cfg.rss_growth_mb) == (20.0, 50.0)
