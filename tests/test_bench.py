import importlib.util
import json

import pytest
from tts_tools.bench import floor_line, gpu_bandwidth, profile_line

from tts.cli.main import main


def test_bench_runs_the_real_engine_and_writes_json_and_plot(tmp_path, capsys):
    rc = main(
        [
            "bench",
            "--model",
            "tiny",
            "--batch-sizes",
            "1,3",
            "--frames",
            "6",
            "--warmup-frames",
            "2",
            "--prompt-tokens",
            "20",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    captured = capsys.readouterr()
    data = json.loads((tmp_path / "bench.json").read_text())
    if importlib.util.find_spec("matplotlib") is not None:  # the plot comes with the tools extra
        assert (tmp_path / "bench.png").stat().st_size > 1000
    else:
        assert not (tmp_path / "bench.png").exists()
        assert "pip install -e '.[tools]'" in captured.out
    assert [(r["mode"], r["batch"]) for r in data["results"]] == [("eager", 1), ("eager", 3)]
    for r in data["results"]:
        assert r["frames_per_s_per_stream"] > 0
        assert abs(r["frames_per_s_aggregate"] - r["batch"] * r["frames_per_s_per_stream"]) < 1e-6
        assert r["step_ms_p99"] >= r["step_ms_p50"] > 0
    m = data["method"]
    assert m["prompt_tokens"] == 20 and m["timed_frames"] == 6 and m["torch"]
    assert m["cpu_threads"] == 1  # a small model on a CPU: one intra-op thread, as tts synthesize
    assert "fps/stream" in captured.out
    assert "graph mode needs CUDA" not in captured.err  # (the default modes on a CPU: eager only)
    assert m["max_context"] == 1024  # the tiny model's whole context, as tts serve sizes it
    # a CPU has no weight-bandwidth floor; the KV the requests held: 20 prompt + 8 frames, 16-token blocks
    assert m["floor_ms_per_frame_batch1"] is None and "no weight floor (a CPU" in captured.out
    # (27 positions written: 2 blocks a request; the pool: batch x 1024 / 16 blocks + the scratch block)
    for r in data["results"]:
        assert r["kv_used_bytes"] == r["batch"] * 2 * r["kv_bytes"] // (r["batch"] * 1024 // 16 + 1)


@pytest.mark.parametrize(
    "name, bandwidth, label",
    [
        ("NVIDIA H100 80GB HBM3", 3.35e12, "H100 SXM"),
        ("NVIDIA H100 PCIe", 2.0e12, "H100 PCIe"),
        ("NVIDIA H200", 4.8e12, "H200"),
        ("NVIDIA A100-SXM4-80GB", 2.039e12, "A100 80GB SXM"),
        ("NVIDIA A100-SXM4-40GB", 1.555e12, "A100 40GB"),
        ("NVIDIA A10", 0.6e12, "A10"),
    ],
)
def test_the_floor_uses_the_gpu_it_ran_on(name, bandwidth, label):
    assert gpu_bandwidth(name) == (bandwidth, label)


def test_an_unknown_gpu_has_no_floor():
    assert gpu_bandwidth("Some Future Accelerator 9000") is None
    env = {"floor_ms_per_frame_batch1": None, "on_gpu": True}
    assert floor_line(env).startswith("no weight floor (unknown GPU")
    env = {
        "floor_ms_per_frame_batch1": 15.55e9 / 3.35e12 * 1e3,
        "weight_bytes_per_frame": 15.55e9,
        "bandwidth_bytes_per_s": 3.35e12,
        "bandwidth_source": "datasheet HBM bandwidth of the H100 SXM",
    }
    assert floor_line(env) == (
        "weight floor 4.64 ms/frame at batch 1 (15.55 GB at 3.35 TB/s, datasheet HBM bandwidth of the H100 "
        "SXM)"
    )


def test_a_step_profile_reports_ops_and_time_beside_the_floor_of_its_gpu():
    line = profile_line("graph batch 1", 985.2, 7.77, 15_550_000_000, "NVIDIA H100 80GB HBM3")
    assert line == (
        "== graph batch 1: 985 device ops per frame, 7.770 ms device time per frame; weight floor 4.64 "
        "ms/frame at batch 1 (15.55 GB at 3.35 TB/s, datasheet HBM bandwidth of the H100 SXM): 1.67x the "
        "floor"
    )
    h200 = profile_line("graph batch 1", 985, 6.2, 15_550_000_000, "NVIDIA H200")
    assert "(15.55 GB at 4.80 TB/s, datasheet HBM bandwidth of the H200): 1.91x the floor" in h200
    assert profile_line("g", 1, 1.0, 1, "Future GPU").endswith("; no weight floor for Future GPU")


def test_bench_rejects_bad_modes(capsys):
    assert main(["bench", "--model", "tiny", "--modes", "fast"]) == 2
    assert "--modes" in capsys.readouterr().err
    assert main(["bench", "--model", "tiny", "--threads", "0"]) == 2
    assert "--threads" in capsys.readouterr().err


def test_service_benchmark_options_need_a_server(tmp_path, capsys, monkeypatch):
    """`tts bench` without --server is the engine benchmark: the service benchmark's modes (--ramp and its
    options, --soak, --sessions) are refused in one line rather than ignored."""
    import tts_tools.bench

    def never(*args, **kwargs):
        raise AssertionError("the engine benchmark ran")

    monkeypatch.setattr(tts_tools.bench, "load_bench_model", never)
    monkeypatch.chdir(tmp_path)
    for extra, named in (
        (["--ramp"], "--ramp needs"),
        (["--ramp-pacing", "none", "--ramp-max", "64"], "--ramp-max, --ramp-pacing need"),
        (["--soak"], "--soak needs"),
        (["--sessions", "4"], "--sessions needs"),
    ):
        assert main(["bench", "--model", "tiny", *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"tts: error: {named} --server"), err


def test_bench_checks_its_options_before_loading_a_model(tmp_path, capsys, monkeypatch):
    """Bad options are one line before any model loads, and leave no results folder behind."""

    def never(*args, **kwargs):
        raise AssertionError("the model was loaded before the options were checked")

    import tts_tools.bench

    monkeypatch.setattr(tts_tools.bench, "load_bench_model", never)
    monkeypatch.chdir(tmp_path)
    assert main(["bench", "--model", "tiny", "--frames", "1"]) == 2
    assert capsys.readouterr().err.strip() == "tts: error: --frames must be >= 2, got 1"
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["bench", "--model", "tiny", "--out", str(blocker)]) == 2
    assert capsys.readouterr().err.startswith(f"tts: error: cannot write results to --out {blocker}")
    assert main(["bench", "--model", "tiny", "--out", str(blocker / "sub")]) == 2
    assert capsys.readouterr().err.strip() == (
        f"tts: error: cannot write results to --out {blocker / 'sub'}: {blocker} is not a directory"
    )
    assert main(["bench", "--model", "s2-pro-shape"]) == 2  # (a CPU by default)
    assert capsys.readouterr().err.strip() == (
        "tts: error: --model s2-pro-shape has 4.56 B parameters of random weights, for GPU benchmarks: give "
        "--device cuda, or on a CPU bench fish-1.5-shape, small-s2-shape or the default voice"
    )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]  # (no bench-out/)


def test_bench_refuses_a_context_too_small_for_the_run(capsys):
    assert main(["bench", "--model", "tiny", "--max-context", "5", "--modes", "eager"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("tts: error: the context (--max-context") and err.endswith("got 5")


def test_bench_runs_batches_larger_than_the_engines_default_queue(tmp_path):
    # Every request of a batch is submitted before the first step, so the queue must hold them all
    # (the engine's default bound is 16 waiting requests).
    rc = main(
        [
            "bench",
            "--model",
            "tiny",
            "--modes",
            "eager",
            "--batch-sizes",
            "17",
            "--frames",
            "2",
            "--warmup-frames",
            "1",
            "--prompt-tokens",
            "8",
            "--out",
            str(tmp_path),
        ]
    )
    assert rc == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    assert [r["batch"] for r in data["results"]] == [17]
