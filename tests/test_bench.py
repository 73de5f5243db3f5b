import json

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
    data = json.loads((tmp_path / "bench.json").read_text())
    assert (tmp_path / "bench.png").stat().st_size > 1000
    assert [(r["mode"], r["batch"]) for r in data["results"]] == [("eager", 1), ("eager", 3)]
    for r in data["results"]:
        assert r["frames_per_s_per_stream"] > 0
        assert abs(r["frames_per_s_aggregate"] - r["batch"] * r["frames_per_s_per_stream"]) < 1e-6
        assert r["step_ms_p99"] >= r["step_ms_p50"] > 0
    m = data["method"]
    assert m["prompt_tokens"] == 20 and m["timed_frames"] == 6 and m["torch"]
    assert m["cpu_threads"] == 1  # a small model on a CPU: one intra-op thread, as tts synthesize
    captured = capsys.readouterr()
    assert "fps/stream" in captured.out
    assert "graph mode needs CUDA" not in captured.err  # (the default modes on a CPU: eager only)
    assert m["max_context"] == 1024  # the tiny model's whole context, as tts serve sizes it


def test_bench_rejects_bad_modes(capsys):
    assert main(["bench", "--model", "tiny", "--modes", "fast"]) == 2
    assert "--modes" in capsys.readouterr().err
    assert main(["bench", "--model", "tiny", "--threads", "0"]) == 2
    assert "--threads" in capsys.readouterr().err


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
