"""The load benchmark's computations (underruns, the server-side time split, reference clips) on
hand-made inputs, and `tts bench-server` end to end against a tiny-model server on 127.0.0.1."""

from __future__ import annotations

import json

import grpc
import numpy as np
import pytest
from tts_tools.loadtest import (
    BENCH_VOICE,
    FIRST_AUDIO_PHASES,
    SERVER_COUNTERS,
    SYNTHETIC_TEXT,
    ReferenceClip,
    format_first_audio,
    parse_metrics,
    playback_underruns,
    server_time_split,
    synthetic_speech,
    voice_source,
)

from service.client import StreamResult, build_request
from service.grpc_gen.v1 import tts_pb2 as pb
from service.grpc_gen.v1 import tts_pb2_grpc as pb_grpc
from tts.audio.files import read_audio

pytest.importorskip("grpc_health")

# ---- underruns -----------------------------------------------------------------------------------------


def test_no_underrun_when_chunks_arrive_in_time():
    # Three chunks of 0.1 s (1600 samples at 16 kHz); each arrives exactly when the previous ones end.
    assert playback_underruns([0.0, 0.1, 0.2], [1600, 1600, 1600], 16000) == (0, 0.0)
    # Arriving early is fine too (a big first chunk buys time).
    assert playback_underruns([5.0, 5.01, 5.02, 5.9], [16000, 800, 800, 800], 16000) == (0, 0.0)


def test_underruns_are_counted_from_the_first_chunk_without_rebuffering():
    # Playback starts at 1.0; chunk 1 is due at 1.1 (on time), chunk 2 at 1.2 (arrives 1.35: 0.15 s
    # late), chunk 3 at 1.3 (arrives 1.36: late again, 0.06 s, because the schedule never moves).
    count, worst = playback_underruns([1.0, 1.1, 1.35, 1.36], [1600, 1600, 1600, 1600], 16000)
    assert count == 2 and worst == pytest.approx(0.15)
    # A single chunk cannot underrun; the worst lateness is the largest, not the last.
    assert playback_underruns([0.0], [640], 16000) == (0, 0.0)
    count, worst = playback_underruns([0.0, 0.5, 0.6], [1600, 1600, 16000], 16000)
    assert count == 2 and worst == pytest.approx(0.4)


def test_underruns_start_at_the_first_chunk_with_audio():
    # An empty leading chunk (codes only) does not start playback.
    assert playback_underruns([0.0, 0.5, 0.6], [0, 1600, 1600], 16000) == (0, 0.0)
    assert playback_underruns([0.0, 0.1], [0, 0], 16000) == (0, 0.0)
    assert playback_underruns([], [], 16000) == (0, 0.0)
    with pytest.raises(ValueError):
        playback_underruns([0.0, 0.1], [1600], 16000)


def test_stream_frames_per_s_leaves_out_the_time_to_first_audio():
    def result(chunks, arrivals):
        return StreamResult(
            pb.StreamHeader(), pb.StreamEnd(), np.zeros(0, np.float32), b"", chunks, arrivals=arrivals
        )

    # Chunk 0 (frames 0-4) after 0.5 s of queueing and prefill; frames 4..36 then take 0.25 s: 128 frames/s.
    r = result([(0, 0, 4), (1, 4, 12), (2, 12, 28), (3, 28, 36)], [0.5, 0.55, 0.7, 0.75])
    assert r.stream_frames_per_s == pytest.approx(32 / 0.25)
    assert result([(0, 0, 4)], [0.5]).stream_frames_per_s is None  # one chunk: no rate
    assert result([], []).stream_frames_per_s is None


# ---- server-side time split -----------------------------------------------------------------------------

METRICS_TEXT = """# TYPE tts_frame_step_seconds counter
tts_frame_step_seconds_total 12.5
tts_frame_step_seconds_created 1.7e9
# TYPE tts_requests counter
tts_requests_total{outcome="ok"} 3.0
tts_requests_total{outcome="cancelled"} 2.0
process_resident_memory_bytes 1.5e8
"""


def test_parse_metrics_sums_label_sets_and_drops_created():
    values = parse_metrics(METRICS_TEXT)
    assert values == {
        "tts_frame_step_seconds_total": 12.5,
        "tts_requests_total": 5.0,
        'tts_requests_total{outcome="ok"}': 3.0,
        'tts_requests_total{outcome="cancelled"}': 2.0,
        "process_resident_memory_bytes": 1.5e8,
    }


def test_engine_phases_per_level_from_the_labelled_counter():
    before = parse_metrics(
        'tts_engine_seconds_total{phase="prefill"} 1.0\ntts_engine_seconds_total{phase="idle"} 2\n'
    )
    after = parse_metrics(
        'tts_engine_seconds_total{phase="prefill"} 4.5\ntts_engine_seconds_total{phase="idle"} 2\n'
    )
    split = server_time_split(before, after)
    assert split["engine_prefill_s"] == 3.5 and split["engine_idle_s"] == 0.0
    assert split["engine_replay_s"] is None  # a server without the phase
    assert split["engine_device_replay_s"] is None  # (a CPU server: no device time)


def test_engine_device_time_per_level():
    before = parse_metrics('tts_engine_device_seconds_total{phase="replay"} 1.25\n')
    after = parse_metrics('tts_engine_device_seconds_total{phase="replay"} 4.0\n')
    assert server_time_split(before, after)["engine_device_replay_s"] == 2.75


def test_codec_share_and_cache_counts_per_level():
    before = {
        "tts_frame_step_seconds_total": 10.0,
        "tts_codec_decode_seconds_total": 4.0,
        "tts_codec_encode_seconds_total": 1.0,
        "tts_reference_cache_hits_total": 5.0,
        "tts_reference_cache_misses_total": 2.0,
    }
    after = {
        "tts_frame_step_seconds_total": 16.0,
        "tts_codec_decode_seconds_total": 7.0,
        "tts_codec_encode_seconds_total": 2.0,
        "tts_reference_cache_hits_total": 12.0,
        "tts_reference_cache_misses_total": 3.0,
    }
    split = server_time_split(before, after)
    assert split["frame_step_s"] == 6.0 and split["codec_decode_s"] == 3.0 and split["codec_encode_s"] == 1.0
    assert split["codec_share"] == pytest.approx(4.0 / 10.0)
    assert (split["reference_cache_hits"], split["reference_cache_misses"]) == (7.0, 1.0)
    # Without an encode counter the share is decode / (steps + decode); without the step counter none.
    no_encode = {k: v for k, v in after.items() if "encode" not in k}
    split = server_time_split({k: v for k, v in before.items() if "encode" not in k}, no_encode)
    assert split["codec_encode_s"] is None and split["codec_share"] == pytest.approx(3.0 / 9.0)
    split = server_time_split({}, {"tts_codec_decode_seconds_total": 1.0})
    derived = {
        "codec_share": None,
        "mean_batch": None,
        "requests_per_prefill": None,
        "codec_frames_per_call": None,
        "codec_fill": None,
        **{f"first_audio_{p}_ms": None for p in FIRST_AUDIO_PHASES},
    }
    assert split == {**dict.fromkeys(SERVER_COUNTERS), **derived}
    assert server_time_split(None, after) == {**dict.fromkeys(SERVER_COUNTERS), **derived}
    # No time spent at all: no share rather than a division by zero.
    assert server_time_split(before, before)["codec_share"] is None


# ---- reference clips ------------------------------------------------------------------------------------


def test_synthetic_clip_is_deterministic_speech_like_audio():
    a = synthetic_speech()
    assert a.dtype == np.float32 and a.shape == (160_000,)
    assert np.array_equal(a, synthetic_speech())
    assert np.abs(a).max() == pytest.approx(0.5)
    frames = a[: len(a) // 1600 * 1600].reshape(-1, 1600)  # 0.1 s frames
    rms = np.sqrt((frames**2).mean(axis=1))
    assert (rms > 0.02).mean() > 0.5 and (rms < 0.01).any()  # mostly voiced, with pauses
    clip = ReferenceClip.synthetic()
    samples, rate = read_audio(clip.raw)
    assert rate == 16000 and samples.shape == (1, 160_000) and clip.text == SYNTHETIC_TEXT


def test_distinct_clips_differ_repeated_and_registered_do_not():
    clip = ReferenceClip.synthetic(2.0)
    distinct = voice_source("distinct", clip)
    sent = [distinct(i)["reference_audio"] for i in range(40)]
    assert len(set(sent)) == 40
    assert all(len(b) == len(clip.raw) for b in sent)  # same length and format, other content
    assert distinct(3) == distinct(3)  # reproducible
    samples, rate = read_audio(sent[5])
    assert rate == clip.rate and samples.shape == clip.samples.shape
    repeated = voice_source("repeated", clip)
    assert repeated(0) == repeated(7) == {"reference_audio": clip.raw, "reference_text": clip.text}
    assert voice_source("registered", clip)(9) == {"voice": BENCH_VOICE}
    assert voice_source("none", None)(1) == {}


def test_a_given_clip_keeps_its_rate_and_channels_when_made_distinct():
    from tts_tools.loadtest import wav_bytes

    stereo = np.stack([synthetic_speech(1.0), 0.5 * synthetic_speech(1.0)])
    clip = ReferenceClip.from_bytes(wav_bytes(stereo, 16000), "its transcript")
    assert clip.samples.shape == (2, 16000) and clip.text == "its transcript"
    samples, rate = read_audio(clip.distinct(1))
    assert rate == 16000 and samples.shape == (2, 16000)
    assert clip.distinct(1) != clip.distinct(2) != clip.raw


def test_min_new_frames_goes_on_the_wire():
    request = build_request("Hi.", min_new_frames=12, max_new_frames=40)
    assert request.sampling.HasField("min_new_frames") and request.sampling.min_new_frames == 12
    assert not build_request("Hi.").sampling.HasField("min_new_frames")


# ---- end to end ---------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server():
    from service_helpers import ServerThread

    from tts.checkpoints.load import load_bundle
    from tts.engine import EngineConfig

    srv = ServerThread(load_bundle("tiny"), EngineConfig(max_batch=4), metrics_port=0)
    yield srv
    srv.stop()


def bench(server, tmp_path, *extra: str) -> tuple[int, dict | None]:
    from tts.cli.main import main

    out = tmp_path / "bench.json"
    metrics = f"http://127.0.0.1:{server.server.metrics_port}/metrics"
    args = ["bench-server", "--server", server.address, "--concurrency", "1,2", "--requests", "3"]
    args += ["--max-new-frames", "8", "--metrics-url", metrics, "--json", str(out), *extra]
    rc = main(args)
    return rc, json.loads(out.read_text()) if out.exists() else None


def test_bench_server_repeated_reference_reports_the_new_fields(server, tmp_path):
    rc, report = bench(server, tmp_path, "--reference", "repeated", "--min-new-frames", "2")
    assert rc == 0
    settings = report["settings"]
    assert settings["reference"] == "repeated" and settings["min_new_frames"] == 2
    # 10 s, or 90% of the server's longest reference (the tiny model takes 10.24 s: 9.216 s).
    seconds = min(10.0, 0.9 * server.loop.planner.max_reference_seconds)
    assert settings["reference_bytes"] == len(ReferenceClip.synthetic(seconds).raw)
    assert settings["reference_seconds"] == pytest.approx(seconds)
    levels = report["levels"]
    assert [(lv["concurrency"], lv["requests"], lv["ok"], lv["errors"]) for lv in levels] == [
        (1, 3, 3, {}),
        (2, 3, 3, {}),
    ]
    for lv in levels:
        assert isinstance(lv["underruns"], int) and lv["underruns"] >= 0
        assert 0.0 <= lv["underrun_share"] <= 1.0
        assert (lv["underrun_worst_ms"] is None) == (lv["underruns"] == 0)
        assert lv["stream_fps_p50"] is None or lv["stream_fps_p50"] > 0
        assert set(lv["server"]) == {
            *SERVER_COUNTERS,
            "codec_share",
            "mean_batch",
            "requests_per_prefill",
            "codec_frames_per_call",
            "codec_fill",
            *(f"first_audio_{p}_ms" for p in FIRST_AUDIO_PHASES),
        }
        # Counters the server does not export stay None; those it does are non-negative.
        assert all(v is None or v >= 0 for v in lv["server"].values())
        share = lv["server"]["codec_share"]
        assert share is None or 0.0 <= share <= 1.0
        assert lv["register_s"] is None


def test_bench_server_registered_reference_needs_add_voice(server, tmp_path, capsys):
    """`--reference registered` registers the clip (and deletes it at the end), or, on a server without
    AddVoice, stops with a one-line error naming the missing RPC."""
    with server.channel() as channel:
        stub = pb_grpc.TextToSpeechStub(channel)
        try:
            stub.DeleteVoice(pb.DeleteVoiceRequest(name="no-such-voice"))
            implemented = True
        except grpc.RpcError as exc:
            implemented = exc.code() != grpc.StatusCode.UNIMPLEMENTED
        rc, report = bench(server, tmp_path, "--reference", "registered")
        if not implemented:
            assert rc == 1 and report is None
            err = capsys.readouterr().err.strip().splitlines()
            assert len(err) == 1 and "AddVoice" in err[0] and "UNIMPLEMENTED" in err[0]
            return
        assert rc == 0
        assert [lv["ok"] for lv in report["levels"]] == [3, 3]
        assert all(lv["register_s"] > 0 for lv in report["levels"])
        names = [v.name for v in stub.ListVoices(pb.ListVoicesRequest()).voices]
        assert BENCH_VOICE not in names


def test_bench_server_refuses_conflicting_reference_options(server, tmp_path, capsys):
    assert bench(server, tmp_path, "--reference", "repeated", "--voice", "alpha")[0] == 2
    assert "--voice or --reference" in capsys.readouterr().err
    assert bench(server, tmp_path, "--reference-text", "x")[0] == 2
    assert "need --reference" in capsys.readouterr().err
    garbage = tmp_path / "garbage.wav"
    garbage.write_bytes(b"RIFF\x00\x01garbage" * 10)
    args = ("--reference", "distinct", "--reference-audio", str(garbage), "--reference-text", "x")
    assert bench(server, tmp_path, *args)[0] == 2
    assert f"cannot read --reference-audio {garbage}" in capsys.readouterr().err


def test_mean_batch_is_rows_over_steps_per_level():
    before = {"tts_frame_steps_total": 10.0, "tts_frame_step_rows_total": 30.0}
    after = {"tts_frame_steps_total": 14.0, "tts_frame_step_rows_total": 50.0}
    split = server_time_split(before, after)
    assert (split["frame_steps"], split["frame_step_rows"], split["mean_batch"]) == (4.0, 20.0, 5.0)
    assert server_time_split(after, after)["mean_batch"] is None  # no step in the level


@pytest.mark.parametrize(
    "key, numerator, denominator, before, after, want",
    [
        (
            "requests_per_prefill",
            "tts_prefill_requests_total",
            "tts_prefill_passes_total",
            (2, 2),
            (14, 5),
            4.0,
        ),
        (
            "codec_frames_per_call",
            "tts_codec_decode_frames_total",
            "tts_codec_decode_calls_total",
            (40, 3),
            (200, 7),
            40.0,
        ),
        (
            "codec_fill",
            "tts_codec_decode_frames_total",
            "tts_codec_decode_padded_frames_total",
            (40, 64),
            (100, 144),
            0.75,
        ),
    ],
)
def test_per_level_ratios_are_counter_increments_divided(key, numerator, denominator, before, after, want):
    """requests per prefill pass, codec frames per call, codec fill: the level's increment of one counter
    over another's; None when the level has none of the denominator."""
    b = {numerator: float(before[0]), denominator: float(before[1])}
    a = {numerator: float(after[0]), denominator: float(after[1])}
    assert server_time_split(b, a)[key] == want
    assert server_time_split(a, a)[key] is None


def test_first_audio_phases_are_mean_milliseconds_per_request_of_the_level():
    def counters(jobs, **seconds):
        return {"tts_first_audio_jobs_total": jobs} | {
            f'tts_first_audio_seconds_total{{phase="{p}"}}': seconds.get(p, 0.0) for p in FIRST_AUDIO_PHASES
        }

    before = counters(2.0, first_frame=0.1, frames=0.2, codec=0.05)
    after = counters(6.0, first_frame=0.5, frames=0.6, codec=0.25)
    split = server_time_split(before, after)
    got = {p: split[f"first_audio_{p}_ms"] for p in FIRST_AUDIO_PHASES}
    assert got == pytest.approx({"encode": 0.0, "first_frame": 100.0, "frames": 100.0, "codec": 50.0})
    report = {"levels": [{"concurrency": 4, "server": split}, {"concurrency": 8, "server": {}}]}
    assert format_first_audio(report) == (
        "first audio at concurrency 4 (server, mean): encode 0 ms, first_frame 100 ms, frames 100 ms, "
        "codec 50 ms; codec fill -"
    )
    from tts.runtime.jobs import FIRST_AUDIO_PHASES as runner_phases

    assert FIRST_AUDIO_PHASES == runner_phases  # the names the server exports


def test_bench_server_sessions_reports_exact_counts(server, tmp_path, capsys):
    """`--sessions 2`: two concurrent SynthesizeSession calls fed word by word, one of which barges in;
    the report's structure and its exact counts (sessions, chunks, frames), not its timings."""
    from service_helpers import wait_idle

    from tts.cli.main import main

    out = tmp_path / "sessions.json"
    rc = main(
        ["bench-server", "--server", server.address, "--sessions", "2", "--words-per-second", "1000"]
        + ["--cancel-share", "0.5", "--max-new-frames", "30", "--min-new-frames", "30", "--seed", "7"]
        + ["--session-spread", "0.05", "--json", str(out)]
    )
    assert rc == 0
    report = json.loads(out.read_text())
    assert (report["mode"], report["sessions"], report["ok"], report["errors"]) == ("sessions", 2, 2, {})
    assert report["spread_seconds"] == 0.05
    assert report["barge_in_sessions"] == 1
    # every session speaks two sentences of the pool, one chunk each (the barge-in's second one after its
    # cancel), whether or not the cancel caught its first chunk still speaking
    assert report["chunks"] == 4
    plain, barged = report["per_session"]
    assert (plain["barge_in"], barged["barge_in"]) == (False, True)
    for s in (plain, barged):
        assert s["ok"] and s["end_reason"] == "closed" and s["chunks"] == s["chunk_starts"] == 2
        assert len(s["prefill_tokens"]) == len(s["cached_tokens"]) == 2
    assert plain["audio_samples"] == 2 * 30 * 640  # 30 frames per chunk, exactly
    assert plain["cached_tokens"][0] == 0 and plain["cached_tokens"][1] > 0  # the second reuses the KV
    assert barged["cancelled_chunks"] == report["cancelled_chunks"] <= 1
    for key in ("clause_to_first_audio_ms", "close_to_last_audio_ms", "cancel_to_silence_ms"):
        assert set(report[key]) == {"p50", "p95", "n"}
    assert report["clause_to_first_audio_ms"]["n"] == 2 and report["cancel_to_silence_ms"]["n"] == 1
    assert report["close_to_last_audio_ms"]["n"] == 1
    assert report["prefill_tokens_first_chunk"] > 0 and report["prefill_tokens_later_chunks"] > 0
    assert "clause -> first audio" in capsys.readouterr().out
    wait_idle(server.loop)
    assert server.loop.sessions_open == 0


def test_a_session_start_carries_every_request_option():
    """`--sessions` starts its sessions with the options a one-shot request would carry (top-p and top-k
    were dropped before)."""
    from tts_tools.session_bench import _session_start

    from service.grpc_gen.v1 import tts_pb2 as pb

    options = {"seed": 3, "top_p": 0.8, "top_k": 5, "temperature": 0.7, "max_new_frames": 64}
    options |= {"min_new_frames": None, "voice": "ava", "encoding": "float32"}
    start = _session_start(pb, options | {"first_chunk_frames": None, "chunk_frames": 8})
    s = start.sampling
    assert (s.seed, round(s.top_p, 6), s.top_k, round(s.temperature, 6)) == (3, 0.8, 5, 0.7)
    assert s.max_new_frames == 64 and not s.HasField("min_new_frames")
    assert start.voice.name == "ava"
    output = start.output
    assert (output.encoding, output.first_chunk_frames, output.chunk_frames) == (
        pb.AUDIO_ENCODING_FLOAT32,
        0,
        8,
    )
