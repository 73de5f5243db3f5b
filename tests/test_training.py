"""The default voice's model trainer (training/train.py): loss, gradients, data loading, one real run."""

import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import tts.model.kernels as kernels
from tts.text.tokenizer import build_byte_tokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "training"))

import train  # noqa: E402


def _codes_dir(tmp_path: Path, n: int = 24, heldout: int = 3, frames=lambda i: 10 + i % 7) -> Path:
    """A corpus `codes/` folder as `corpus.py encode` writes it: 2 speakers, random codes of
    `frames(i)` frames; the last `heldout` utterances are in the held-out split."""
    out = tmp_path / "codes"
    out.mkdir()
    tok = build_byte_tokenizer(64)
    tok.save(out / "tokenizer.json")
    g = torch.Generator().manual_seed(0)
    items = []
    for i in range(n):
        T = frames(i)
        items.append(
            {
                "id": f"u{i}",
                "speaker": i % 2,
                "split": "train" if i < n - heldout else "heldout",
                "seconds": T / 21.5,
                "tokens": torch.tensor(tok.encode(f"sentence {i}"), dtype=torch.int16),
                "codes": torch.randint(0, 64, (4, T), generator=g).to(torch.int16),
            }
        )
    torch.save(items, out / "codes-0000.pt")
    (tmp_path / "codec.json").write_text(json.dumps({"num_codebooks": 4, "codebook_size": 64}))
    return out


def test_every_parameter_gets_a_gradient(tmp_path):
    """The training forward must run the autograd path everywhere (a kernel without backward would
    silently stop the gradient at every norm: this happened on CUDA with the fused Triton kernels)."""
    corpus = train.Corpus(_codes_dir(tmp_path), 4)
    args = train.model_config(corpus.tokenizer, 4, 64, "test")
    torch.manual_seed(0)
    model = train.DualARTransformer(args)
    b = corpus.batch(random.Random(0), 2048, "cpu")
    loss, info = train.compute_loss(model, b["frames"], b["mask"])
    loss.backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None or not p.grad.abs().sum() > 0]
    assert missing == []
    assert torch.isfinite(loss) and float(info["slow"]) > 0 and int(info["frames"]) > 0


def test_fused_kernels_are_never_used_under_autograd(monkeypatch):
    pytest.importorskip("triton")
    monkeypatch.setattr(kernels, "_ON_CPU", True)  # what TTS_FUSED_KERNELS=interpret does
    x = torch.ones(4, requires_grad=True)
    assert not kernels.fused_kernels_enabled(x)
    assert kernels.fused_kernels_enabled(x.detach())
    with torch.no_grad():
        assert kernels.fused_kernels_enabled(x)
    weight = torch.ones(4, requires_grad=True)  # a trainable norm weight over a frozen input
    assert not kernels.fused_kernels_enabled(x.detach(), weight)
    with torch.inference_mode():
        assert kernels.fused_kernels_enabled(torch.ones(4), weight)


def test_heldout_utterances_are_scored_and_never_trained_on(tmp_path):
    data = _codes_dir(tmp_path, n=24, heldout=3)
    corpus, heldout = train.Corpus(data, 4), train.Corpus(data, 4, split="heldout")
    assert len(corpus.items) == 21 and len(heldout.items) == 3
    assert {u["id"] for u in corpus.items}.isdisjoint(u["id"] for u in heldout.items)
    torch.manual_seed(0)
    model = train.DualARTransformer(train.model_config(corpus.tokenizer, 4, 64, "test"))
    model.train()
    val = train.heldout_loss(model, heldout, torch.device("cpu"))
    assert model.training  # restored after the eval-mode pass
    assert val["val_slow"] > 0 and val["val_fast"] > 0 and 0 <= val["val_acc0"] <= 1
    # Deterministic (no sampled reference or history), so runs and steps compare.
    assert train.heldout_loss(model, heldout, torch.device("cpu")) == val


def test_history_turns_follow_the_rate_and_the_length_bound(tmp_path, monkeypatch):
    """Examples carry an earlier turn of the same speaker at `history_rate`, of at most
    `history_frames` frames; the defaults draw exactly as the shipped model's training did (15%, turns
    up to MAX_REF_FRAMES, one `random()` then one `choice()` per example)."""
    assert train.MAX_REF_FRAMES == 110
    data = _codes_dir(tmp_path, frames=lambda i: 95 + 5 * (i % 8))  # 95-130 frames
    seen = []
    monkeypatch.setattr(train.Corpus, "columns", lambda self, i, refs, history: seen.append(history))

    def turns(corpus, n=200):
        seen.clear()
        r = random.Random(5)
        for _ in range(n):
            corpus.example(r.randrange(len(corpus.items)), r)
        return [[h.codes.shape[1] for h in history] for history in seen]

    assert all(not t for t in turns(train.Corpus(data, 4, history_rate=0.0)))
    always = turns(train.Corpus(data, 4, history_rate=1.0, history_frames=130))
    assert all(len(t) == 1 for t in always)
    assert {n for (n,) in always} == {95, 100, 105, 110, 115, 120, 125, 130}  # past the reference bound
    shipped = train.Corpus(data, 4)  # the defaults: 15%, turns of at most 110 frames
    got = turns(shipped)
    assert 0 < sum(1 for t in got if t) < 60 and all(t[0] <= 110 for t in got if t)
    # The same draws as the shipped training's code: a reference, then `random() < 0.15` and a choice
    # among the speaker's utterances of at most MAX_REF_FRAMES frames.
    r, want = random.Random(5), []
    for _ in range(200):
        i = r.randrange(len(shipped.items))
        spk = shipped.items[i]["speaker"]
        if not (spk == 0 and r.random() < 0.5):
            if r.choice(shipped.short[spk]) == i:
                r.choice(shipped.short[spk])
        want.append(
            [shipped.items[r.choice(shipped.short[spk])]["codes"].shape[1]] if r.random() < 0.15 else []
        )
    assert got == want
    with pytest.raises(ValueError, match="history_rate"):
        train.Corpus(data, 4, history_rate=1.5)


def test_batches_from_worker_processes_differ_and_are_well_formed(tmp_path):
    corpus = train.Corpus(_codes_dir(tmp_path), 4)
    batches = train.batch_loader(corpus, seed=1, batch_tokens=512, workers=2)
    seen = [next(batches) for _ in range(4)]
    for b in seen:
        assert b["frames"].dtype == torch.int64 and b["frames"].shape[:2] == b["mask"].shape
        assert b["frames"].shape[0] * b["frames"].shape[1] <= 512 and b["mask"].any()
    assert len({b["frames"].numpy().tobytes() for b in seen}) == 4


def test_train_script_writes_a_loadable_model(tmp_path):
    data = _codes_dir(tmp_path)
    out = tmp_path / "out"
    cmd = [
        sys.executable,
        str(ROOT / "training" / "train.py"),
        "--data",
        str(data),
        "--codec",
        str(tmp_path),
        "--out",
        str(out),
        "--size",
        "test",
        "--steps",
        "3",
        "--batch-tokens",
        "1024",
        "--workers",
        "0",
        "--log-every",
        "1",
        "--val-every",
        "2",
        "--max-seconds",
        "120",
        "--no-compile",
    ]
    subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=180)
    state = json.loads((out / "train_state.json").read_text())
    assert state["step"] == 3 and len(state["history"]) == 3
    assert [("val_slow" in rec) for rec in state["history"]] == [True, True, False]  # steps 1 and 2
    assert "val_fast" in (out / "loss.csv").read_text().splitlines()[0]
    from tts.checkpoints.bundle import weight_files
    from tts.model.config import ModelArgs

    args = ModelArgs.from_dict(json.loads((out / "config.json").read_text()))
    assert args.num_codebooks == 4 and args.codebook_size == 64 and weight_files(out)
    # Resumed from those weights (as the next GPU call does): the step count and the training seconds
    # carry on, so that a shared --schedule-seconds makes one schedule of both runs.
    out2 = tmp_path / "out2"
    resume = cmd[:]
    resume[resume.index("--out") + 1] = str(out2)
    resume[resume.index("--steps") + 1] = "5"
    subprocess.run(
        [
            *resume,
            "--resume",
            str(out),
            "--schedule-seconds",
            "1000",
            "--end-weight",
            "4",
            "--tail-frames",
            "3",
        ],
        check=True,
        capture_output=True,
        text=True,
        timeout=180,
    )
    state2 = json.loads((out2 / "train_state.json").read_text())
    assert state2["step"] == 5 and [rec["step"] for rec in state2["history"]] == [1, 2, 3, 4, 5]
    assert state2["train_seconds"] > state["train_seconds"] and state2["schedule_seconds"] == 1000
    assert (state2["end_weight"], state2["tail_frames"], state2["tail_weight"]) == (4.0, 3, 1.0)
    bad = subprocess.run([*cmd, "--end-weight", "0"], capture_output=True, text=True, timeout=180)
    assert bad.returncode == 2 and "--end-weight and --tail-weight must be finite and above 0" in bad.stderr


def test_one_schedule_spans_resumed_runs_given_schedule_seconds():
    # 300 s trained before, 100 s now, of a 1,000 s schedule: 40% along, whatever this run's budget.
    assert train.schedule_progress(10, 10**9, 100.0, 250.0, 300.0, 1000.0) == pytest.approx(0.4)
    # Without it, each run decays over its own budget (the shipped model's single run).
    assert train.schedule_progress(10, 10**9, 100.0, 500.0, 300.0) == pytest.approx(0.2)
    # A step limit that is further along wins.
    assert train.schedule_progress(30, 40, 50.0, 250.0, 0.0, 1000.0) == pytest.approx(0.75)


def test_init_from_a_deeper_model_keeps_its_first_layers_and_drops_the_rest(tmp_path):
    """`--init-from`: a 1-layer model started from a 2-layer one gets every tensor whose name and
    shape match (layer 0, embeddings, fast AR, norms) and none of layer 1."""
    tok = build_byte_tokenizer(64)
    deep_args = train.model_config(tok, 4, 64, "test")  # 2 slow layers
    torch.manual_seed(1)
    deep = train.DualARTransformer(deep_args)
    train.save_weights(deep.state_dict(), tmp_path)
    shallow_args = train.ModelArgs.from_dict({**deep_args.to_dict(), "n_layer": 1})
    torch.manual_seed(2)
    shallow = train.DualARTransformer(shallow_args)
    train.init_from(shallow, tmp_path)
    got, src = shallow.state_dict(), deep.state_dict()
    assert all(torch.equal(got[k], src[k]) for k in got)
    assert not any(k.startswith("layers.1.") for k in got)


def test_paragraphs_join_two_to_four_training_sentences_within_the_chunk_length():
    """`corpus.py text --paragraphs N`: multi-sentence utterances like the chunks long text is spoken
    in: 2-4 of the given rows each, in order of drawing, joined by spaces (raw and normalized alike),
    at most max_bytes of normalized text, distinct, the same for the same seed."""
    import corpus

    rows = [
        {"source": "wordnet", "raw": f"Raw {i}.", "text": f"sentence number {i} is here."} for i in range(30)
    ]
    out = corpus.paragraphs(rows, 40, 90, seed=5)
    assert len(out) == 40 and out == corpus.paragraphs(rows, 40, 90, seed=5)
    assert len({p["text"] for p in out}) == 40
    by_text = {r["text"]: r for r in rows}
    for p in out:
        assert p["source"] == "paragraph" and len(p["text"].encode()) <= 90
        parts = [t + "." for t in p["text"].removesuffix(".").split(". ")]
        assert 2 <= len(parts) <= 4 and all(t in by_text for t in parts), p["text"]
        assert p["raw"] == " ".join(by_text[t]["raw"] for t in parts)
    assert corpus.paragraphs(rows, 0, 90, seed=5) == []


def test_both_teachers_give_the_same_texts_and_speakers():
    """`corpus.py text --teacher flite` must speak the corpus the espeak-ng teacher speaks: every
    utterance draws the same two jitter numbers, so the speaker draws after it stay the same."""
    import corpus

    row = {"source": "wordnet", "raw": "A cat.", "text": "A cat.", "phonemes": "ɐ kˈæt."}
    r_es, r_fl = random.Random(3), random.Random(3)
    for speaker in range(len(corpus.SPEAKERS)):
        es = corpus._utterance(row, speaker, r_es, "espeak")
        fl = corpus._utterance(row, speaker, r_fl, "flite")
        assert es["speaker"] == fl["speaker"] == speaker and fl["teacher"] == "flite" and "teacher" not in es
        spk_es, spk_fl = corpus.SPEAKERS[speaker], corpus.FLITE_SPEAKERS[speaker]
        assert spk_es["name"] == spk_fl["name"] and fl["voice"] == spk_fl["voice"]
        # The rate's jitter d (words/min of 165) becomes the stretch 1 - d / 165: slower speech, longer.
        d_rate, d_pitch = es["rate"] - spk_es["rate"], es["pitch"] - spk_es["pitch"]
        assert fl["stretch"] == round(spk_fl["stretch"] * (1 - d_rate / 165), 3)
        assert fl["f0"] == (spk_fl["f0"] + 3 * d_pitch if spk_fl["f0"] else 0)
    assert r_es.random() == r_fl.random()
    held = corpus._utterance(row, 0, random.Random(0), "flite", jitter=False)
    assert (held["voice"], held["stretch"], held["f0"]) == ("slt", 1.0, 0)


@pytest.mark.skipif(
    __import__("shutil").which("flite") is None, reason="needs the flite binary (apt-get install flite)"
)
def test_flite_speaks_at_the_codec_rate_and_its_stretch_slows_it():
    import corpus

    row = {"teacher": "flite", "text": "Please call Stella.", "voice": "slt", "stretch": 1.0, "f0": 0}
    audio = corpus.speak(row)
    slow = corpus.speak({**row, "stretch": 1.3})
    assert audio.dtype.name == "float32" and audio.ndim == 1
    assert 0.5 < len(audio) / 22050 < 3.0 and 0.05 < float(abs(audio).max()) <= 1.0
    # Durations scale by the stretch; the silences at both ends do not, hence the loose bounds.
    assert 1.15 < len(slow) / len(audio) < 1.35


def test_export_refuses_to_average_models_trained_apart(tmp_path):
    """Two models of one shape trained from different starts average to noise: their weight matrices
    point apart (cosine near 0), where a fine-tune stays near its start (above 0.99 for the shipped
    voice's). The export refuses them, naming the matrix; a fine-tune of the first is averaged."""
    import export
    from safetensors.torch import save_file

    g = torch.Generator().manual_seed(0)
    start = {"w": torch.randn(64, 64, generator=g), "norm": torch.ones(64)}
    tuned = {"w": start["w"] + 0.05 * torch.randn(64, 64, generator=g), "norm": torch.ones(64) * 1.01}
    apart = {"w": torch.randn(64, 64, generator=g), "norm": torch.ones(64)}
    for name, state in (("start", start), ("tuned", tuned), ("apart", apart)):
        (tmp_path / name).mkdir()
        save_file(
            {k: v.to(torch.bfloat16) for k, v in state.items()}, str(tmp_path / name / "model.safetensors")
        )
    export.average_weights([tmp_path / "start", tmp_path / "tuned"], tmp_path)
    with pytest.raises(SystemExit, match=r"apart .*not a checkpoint or fine-tune of .*start.*'w'"):
        export.average_weights([tmp_path / "start", tmp_path / "apart"], tmp_path)


def test_export_averages_several_runs_weights_and_names_the_teacher(tmp_path):
    import export
    from safetensors.torch import load_file, save_file

    a = {
        "w": torch.tensor([1.0, 2.0, -3.0], dtype=torch.bfloat16),
        "b": torch.tensor([0.5], dtype=torch.bfloat16),
    }
    b = {
        "w": torch.tensor([3.0, 2.0, 1.0], dtype=torch.bfloat16),
        "b": torch.tensor([1.5], dtype=torch.bfloat16),
    }
    for name, state in (("a", a), ("b", b)):
        (tmp_path / name).mkdir()
        save_file(state, str(tmp_path / name / "model.safetensors"))
    mean = load_file(str(export.average_weights([tmp_path / "a", tmp_path / "b"], tmp_path)))
    assert (
        mean["w"].dtype == torch.bfloat16
        and mean["w"].tolist() == [2.0, 2.0, -1.0]
        and mean["b"].tolist() == [1.0]
    )
    (tmp_path / "c").mkdir()
    save_file({"w": a["w"]}, str(tmp_path / "c" / "model.safetensors"))
    with pytest.raises(SystemExit, match="other weights"):
        export.average_weights([tmp_path / "a", tmp_path / "c"], tmp_path)

    # A fine-tune may be averaged with the exported bundle it started from: the same model fields, the
    # bundle's runtime settings aside; another model is refused.
    fields = {"dim": 64, "n_layer": 2}
    (tmp_path / "a" / "config.json").write_text(json.dumps(fields | {"tts_runtime": {"name": "default"}}))
    (tmp_path / "b" / "config.json").write_text(json.dumps(fields))
    assert export.model_fields(tmp_path / "a") == export.model_fields(tmp_path / "b") == fields
    (tmp_path / "c" / "config.json").write_text(json.dumps(fields | {"n_layer": 3}))
    assert export.model_fields(tmp_path / "c") != fields

    for teacher, key, name in ((None, "espeak", "espeak-ng"), ("flite", "flite", "flite")):
        row = {"id": 0, "text": "Hi."} | ({"teacher": teacher} if teacher else {})
        (tmp_path / "sentences.jsonl").write_text(json.dumps(row) + "\n")
        assert export.corpus_teacher(tmp_path) == key
        assert export.VOICE_TEACHERS[key][0] == name  # (the family string's name)


def test_export_writes_a_trial_models_samples_beside_it_not_over_the_shipped_ones(tmp_path):
    import export

    assert export.samples_dir(tmp_path / "trial", None) == tmp_path / "trial" / "samples"
    shipped = ROOT / "tts" / "assets" / "default"
    assert export.samples_dir(shipped, None) == ROOT / "samples" / "voices"
    assert export.samples_dir(tmp_path / "trial", tmp_path / "s") == tmp_path / "s"


def test_export_parses_the_aligner_heads_of_the_model():
    import export

    from tts.checkpoints.load import load_bundle
    from tts.model.config import AlignerSpec

    args = load_bundle("default").model.config  # 4 layers, 6 heads
    assert export.parse_aligner("3:0,2", args) == AlignerSpec(3, (0, 2))
    for bad in ("3", "3:", "x:0", "4:0", "3:6"):
        with pytest.raises(ValueError):
            export.parse_aligner(bad, args)


def test_residual_dropout_acts_only_in_training_mode(tmp_path):
    corpus = train.Corpus(_codes_dir(tmp_path), 4)
    args = train.model_config(corpus.tokenizer, 4, 64, "test")
    torch.manual_seed(0)
    plain = train.DualARTransformer(args)
    dropped = train.DualARTransformer(args)
    dropped.load_state_dict(plain.state_dict())
    train.add_residual_dropout(dropped, 0.5)
    b = corpus.batch(random.Random(0), 2048, "cpu")

    def loss(model):
        return float(train.compute_loss(model, b["frames"], b["mask"])[0])

    plain.eval(), dropped.eval()
    assert loss(dropped) == loss(plain)  # eval mode (held-out loss, inference): no dropout
    plain.train(), dropped.train()
    torch.manual_seed(1)
    first = loss(dropped)
    torch.manual_seed(2)
    assert first != loss(dropped) and first != loss(plain)  # training: random masks on every branch
    assert sorted(dropped.state_dict()) == sorted(plain.state_dict())  # the saved weights are the same
    with pytest.raises(ValueError, match="dropout"):
        train.add_residual_dropout(plain, 1.0)


def test_reference_clips_have_a_floor(tmp_path, monkeypatch):
    """`--ref-min-frames`: a corpus of one-word utterances gives references like the preset voices, never
    its shortest clips; earlier turns (history) may still be short."""
    data = _codes_dir(tmp_path, frames=lambda i: 5 + 10 * (i % 8))  # 5-75 frames
    seen = []
    monkeypatch.setattr(train.Corpus, "columns", lambda self, i, refs, history: seen.append((refs, history)))
    r = random.Random(0)
    floor = train.Corpus(data, 4, history_rate=1.0, ref_min_frames=40)
    for _ in range(300):
        floor.example(r.randrange(len(floor.items)), r)
    refs = [ref.codes.shape[1] for refs, _ in seen for ref in refs]
    history = [h.codes.shape[1] for _, hs in seen for h in hs]
    assert refs and min(refs) == 45 and min(history) == 5
    seen.clear()
    shipped = train.Corpus(data, 4)
    for _ in range(300):
        shipped.example(r.randrange(len(shipped.items)), r)
    assert min(ref.codes.shape[1] for refs, _ in seen for ref in refs) == 5  # (the default: no floor)
    with pytest.raises(ValueError, match=r"speakers \[0, 1\] have no reference clip of 80-110 frames"):
        train.Corpus(data, 4, ref_min_frames=80)


def test_end_weights_fall_on_each_rows_end_token_and_its_last_frames():
    """Two rows of different lengths: the end token (each row's last target) gets the end weight, the
    tail_frames targets before it the tail weight, everything else 1; the order is that of m's targets."""
    m = torch.tensor([[0, 1, 1, 1, 1, 1, 0], [0, 0, 0, 1, 1, 0, 0]], dtype=torch.bool)
    is_end = torch.tensor([False, False, False, False, True, False, True])
    w = train.target_weights(m, is_end, train.EndWeights(end=5.0, tail=2.0, tail_frames=2))
    assert w.tolist() == [1.0, 1.0, 2.0, 2.0, 5.0, 2.0, 5.0]
    assert train.target_weights(m, is_end, train.EndWeights()).tolist() == [1.0] * 7
    assert not train.EndWeights().active() and not train.EndWeights(tail=3.0).active()


def test_end_weights_change_the_objective_but_not_the_reported_slow_loss(tmp_path):
    corpus = train.Corpus(_codes_dir(tmp_path), 4)
    args = train.model_config(corpus.tokenizer, 4, 64, "test")
    torch.manual_seed(0)
    model = train.DualARTransformer(args).eval()
    b = corpus.batch(random.Random(0), 2048, "cpu")
    with torch.no_grad():
        plain, info = train.compute_loss(model, b["frames"], b["mask"])
        weighted, winfo = train.compute_loss(
            model, b["frames"], b["mask"], train.EndWeights(end=10.0, tail=3.0, tail_frames=4)
        )
        same, _ = train.compute_loss(model, b["frames"], b["mask"], train.EndWeights())
    assert float(winfo["slow"]) == float(info["slow"])
    assert float(same) == float(plain)
    assert abs(float(weighted) - float(plain)) > 1e-4


def test_aligner_probe_ends_asks_what_the_runtimes_end_rule_asks():
    """`ends`: the loop guard, fed a reading's positions, trusts one of the text's last END_TOKENS
    tokens. A steady climb to the end does; one that rests three tokens short does not, however close its
    reach; nor does a one-frame glance at the end (a glance is never trusted)."""
    import aligner_probe

    from tts.engine.aligner import END_TOKENS

    n = 20
    climb = torch.tensor([0, 0, 1, 2, 4, 6, 8, 10, 12, 14, 16, 18, 19, 19, 19])
    assert aligner_probe.ends_at_text_end(climb, n)
    short = torch.tensor([0, 0, 1, 2, 4, 6, 8, 10, 12, 14, 16, 16, 16, 16])
    assert 19 - 16 > END_TOKENS - 1 and not aligner_probe.ends_at_text_end(short, n)
    glance = torch.tensor([0, 0, 1, 2, 4, 6, 8, 10, 12, 14, 19, 14, 14, 14])
    assert not aligner_probe.ends_at_text_end(glance, n)
    mass, backward, reach, ends = aligner_probe.reading_statistics(0.9, climb, n)
    assert (mass, reach, ends) == (0.9, 1.0, 1.0) and backward == 0.0
