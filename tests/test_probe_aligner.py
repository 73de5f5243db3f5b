"""`tts probe-aligner` (tts/cli/probe_aligner.py): the head table, the choice, and the config it writes,
which the loaders read back (own bundles and Fish checkpoints)."""

import json

from tts.checkpoints.bundle import save_bundle
from tts.checkpoints.load import load_bundle
from tts.cli.main import main
from tts.cli.probe_aligner import HeadScore, choose, record


def test_choose_takes_the_best_layer_and_its_passing_heads():
    table = [
        HeadScore(0, 0, 0.9, 0.0, 0.9),
        HeadScore(1, 0, 0.95, 0.01, 1.0),
        HeadScore(1, 1, 0.2, 0.0, 1.0),  # too little on the text
        HeadScore(1, 2, 0.9, 0.05, 0.85),
        HeadScore(1, 3, 0.9, 0.5, 0.9),  # goes back too often
    ]
    assert choose(table, 0.5, 0.1, 0.8, 4) == (1, [0, 2])
    assert choose(table, 0.5, 0.1, 0.8, 1) == (1, [0])
    assert choose(table, 0.99, 0.1, 0.8, 4) is None


def test_probe_aligner_records_heads_that_the_loader_reads_back(tiny_bundle, tmp_path, capsys):
    directory = save_bundle(tiny_bundle, tmp_path / "b")
    # every head passes these thresholds, so the choice does not depend on what random weights attend to
    argv = ["probe-aligner", "--model", str(directory), "--sentences", "1", "--max-frames", "6"]
    argv += ["--min-mass", "0", "--max-backward", "1", "--min-reach", "0", "--max-heads", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    c = tiny_bundle.model.config
    assert out.count(" head ") == c.n_layer * c.n_head
    line = next(line for line in out.splitlines() if line.startswith("aligner: layer "))
    layer, heads = int(line.split()[2]), tuple(int(h) for h in line.split()[4].split(","))
    spec = load_bundle(directory).aligner
    assert spec is not None and (spec.layer, spec.heads) == (layer, heads) and len(heads) == 2


def test_no_passing_head_writes_nothing_and_bad_input_exits_2(tiny_bundle, tmp_path, capsys):
    directory = save_bundle(tiny_bundle, tmp_path / "b")
    before = (directory / "config.json").read_text()
    argv = ["probe-aligner", "--model", str(directory), "--sentences", "1", "--max-frames", "4"]
    assert main(argv + ["--min-mass", "2"]) == 1
    assert (directory / "config.json").read_text() == before
    assert main(["probe-aligner", "--model", str(tmp_path / "missing")]) == 2
    assert "not a checkpoint directory" in capsys.readouterr().err


def test_a_fish_checkpoints_aligner_goes_under_its_own_key(fish_checkpoints):
    directory = fish_checkpoints["s2"] if "s2" in fish_checkpoints else next(iter(fish_checkpoints.values()))
    raw = json.loads((directory / "config.json").read_text())
    try:
        record(directory, 0, [1])
        written = json.loads((directory / "config.json").read_text())
        assert written["tts_aligner"] == {"layer": 0, "heads": [1]} and "tts_runtime" not in written
        bundle = load_bundle(directory)
        assert (bundle.aligner.layer, bundle.aligner.heads) == (0, (1,))
    finally:
        (directory / "config.json").write_text(json.dumps(raw))
