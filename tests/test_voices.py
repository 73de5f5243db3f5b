"""Registered voices and the reference cache (tts/voices.py), and the planner's runaway guard."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future

import numpy as np
import pytest
import soundfile as sf
import torch

from tts.api import TTS
from tts.checkpoints.load import load_bundle
from tts.params import InvalidRequest
from tts.runtime.voices import (
    ReferenceCache,
    VoiceExists,
    VoiceNotFound,
    VoiceRegistry,
    codec_fingerprint,
    reference_key,
)
from tts.text.prompt import VoiceReference


def voice(n: int, text: str = "words") -> VoiceReference:
    return VoiceReference(codes=torch.arange(4 * n).view(4, n), text=text)


def test_registry_persists_registered_voices_and_guards_presets(tmp_path):
    presets = {"alpha": voice(3)}
    reg = VoiceRegistry(presets, tmp_path / "voices", "fp1")
    reg.add("mine", voice(5, "my words"))
    with pytest.raises(VoiceExists):
        reg.add("mine", voice(6))
    reg.add("mine", voice(6, "new words"), replace=True)
    with pytest.raises(InvalidRequest, match="preset"):
        reg.add("alpha", voice(2))
    with pytest.raises(InvalidRequest, match="not valid"):
        reg.check_new("../escape")
    with pytest.raises(InvalidRequest, match="cannot be deleted"):
        reg.delete("alpha")
    # A new registry on the same directory (a restart) sees the voice, codes and transcript intact.
    again = VoiceRegistry(presets, tmp_path / "voices", "fp1")
    assert [(e.name, e.kind) for e in again.list()] == [("alpha", "preset"), ("mine", "registered")]
    assert torch.equal(again.get("mine").codes, voice(6).codes) and again.get("mine").text == "new words"
    # Files made with another codec are skipped.
    assert [e.name for e in VoiceRegistry(presets, tmp_path / "voices", "fp2").list()] == ["alpha"]
    again.delete("mine")
    with pytest.raises(VoiceNotFound):
        again.delete("mine")
    assert list((tmp_path / "voices").iterdir()) == []


def test_a_running_registry_sees_voices_another_process_adds_replaces_or_deletes(tmp_path):
    """The folder is the truth: `tts voices add` / `delete` (another process, another registry) while
    `tts serve` runs are seen by the server's registry at its next lookup or listing."""
    presets = {"alpha": voice(3)}
    server = VoiceRegistry(presets, tmp_path / "voices", "fp1")  # started before the folder exists
    cli = VoiceRegistry(presets, tmp_path / "voices", "fp1")
    cli.add("late", voice(5, "late words"))
    assert server.get("late").text == "late words"
    assert [e.name for e in server.list()] == ["alpha", "late"]
    cli.add("late", voice(7, "newer words"), replace=True)
    assert server.get("late").text == "newer words" and server.get("late").codes.shape == (4, 7)
    VoiceRegistry(presets, tmp_path / "voices", "fp2").add("other", voice(2))  # another codec's file
    with pytest.raises(VoiceNotFound):
        server.get("other")
    cli.delete("late")
    with pytest.raises(VoiceNotFound):
        server.get("late")
    assert [e.name for e in server.list()] == ["alpha"]
    with pytest.raises(VoiceNotFound):
        server.get("../voices/late")  # never a path


def test_unknown_voice_message_is_bounded():
    reg = VoiceRegistry({"alpha": voice(3)}, None, "fp")
    with pytest.raises(VoiceNotFound) as info:
        reg.get("x" * 20_000)
    assert len(str(info.value)) < 200 and "available: alpha" in str(info.value)


def test_cache_hits_misses_single_flight_and_eviction():
    cache = ReferenceCache(capacity_bytes=2 * (4 * 10 * 8 + 64 + 5))
    started = []

    def encoder(n):
        def encode():
            future: Future = Future()
            started.append((n, future))
            return future

        return encode

    a1 = cache.get_or_encode("a", encoder(10))
    a2 = cache.get_or_encode("a", encoder(10))  # in flight: the same future, no second encode
    assert a1 is a2 and len(started) == 1 and (cache.hits, cache.misses) == (1, 1)
    started[0][1].set_result(voice(10))
    assert cache.get_or_encode("a", encoder(10)).result().codes.shape == (4, 10) and cache.hits == 2
    cache.get_or_encode("b", encoder(10))
    started[1][1].set_result(voice(10))
    cache.get_or_encode("c", encoder(10))
    started[2][1].set_result(voice(10))  # over capacity: the least recently used ("a") goes
    assert len(cache) == 2
    cache.get_or_encode("a", encoder(10))
    assert len(started) == 4 and cache.misses == 4
    # A failed encode is not cached: the next request encodes again.
    started[3][1].set_exception(RuntimeError("boom"))
    cache.get_or_encode("a", encoder(10))
    assert len(started) == 5


def test_reference_key_depends_on_audio_text_and_codec():
    k = reference_key(b"abc", "hello", "fp")
    assert k == reference_key(b"abc", "hello", "fp")
    assert (
        len(
            {
                k,
                reference_key(b"abd", "hello", "fp"),
                reference_key(b"abc", "hallo", "fp"),
                reference_key(b"abc", "hello", "fq"),
                reference_key(b"ab", "chello", "fp"),
            }
        )
        == 5
    )


@pytest.fixture(scope="module")
def tiny_tts():
    tts = TTS(load_bundle("tiny"))
    yield tts
    tts.close()


def test_api_registered_voice_equals_the_same_clip_inline(tiny_tts, tmp_path):
    tone = 0.3 * np.sin(2 * np.pi * 220 * np.arange(16000) / 16000).astype(np.float32)
    tts = TTS(tiny_tts.bundle, voices_dir=tmp_path)
    try:
        entry = tts.add_voice("tone", tone, 16000, "A tone.")
        assert entry.kind == "registered" and [e.name for e in tts.voices()][-1] == "tone"
        inline = tts.reference_from_audio(tone, 16000, "A tone.")
        a = tts.synthesize("Hello.", voice="tone", seed=3, max_new_frames=8, min_new_frames=8)
        b = tts.synthesize("Hello.", voice=inline, seed=3, max_new_frames=8, min_new_frames=8)
        assert torch.equal(a.codes, b.codes) and np.array_equal(a.audio, b.audio)
    finally:
        tts.close()
    again = TTS(tiny_tts.bundle, voices_dir=tmp_path)  # a new process on the same directory
    try:
        c = again.synthesize("Hello.", voice="tone", seed=3, max_new_frames=8, min_new_frames=8)
        assert torch.equal(a.codes, c.codes)
    finally:
        again.close()


def test_runaway_guard_caps_each_chunks_budget(tiny_tts):
    planner = tiny_tts.planner
    job = planner.job("Hi.", max_new_frames=500, min_new_frames=500, seed=1)
    guard = planner.guard_frames("Hi.")
    assert job.budgets == [guard] and guard == int(np.ceil(25 * (3.0 + 0.25 * 3)))
    result = tiny_tts.synthesize(job)
    assert result.frames == guard and [r.value for r in result.finish_reasons] == ["length"]
    assert result.warnings == [
        f"the text reached the runaway guard of {guard} frames (3.8 s) for 3 bytes of text"
    ]


def test_fingerprint_differs_between_codecs():
    assert codec_fingerprint(load_bundle("tiny").codec) != codec_fingerprint(load_bundle("default").codec)


def test_registry_is_safe_to_read_while_adding(tmp_path):
    reg = VoiceRegistry({}, tmp_path, "fp")
    errors = []

    def reader():
        for _ in range(200):
            try:
                reg.list()
            except Exception as exc:  # noqa: BLE001
                errors.append(exc)

    t = threading.Thread(target=reader)
    t.start()
    for i in range(20):
        reg.add(f"v{i}", voice(3))
    t.join()
    assert not errors and len(reg.list()) == 20


def test_voices_add_names_a_missing_or_bad_clip_in_one_line_before_loading(tmp_path, capsys, monkeypatch):
    """`tts voices add` reads its clip as `--reference-audio` is read: one `tts: error:` line naming the
    file and the reason (not soundfile's own wording), exit 2, before the model loads, nothing written."""
    import tts.checkpoints.load
    from tts.cli.main import main

    monkeypatch.setattr(
        tts.checkpoints.load, "load_bundle", lambda *a, **k: pytest.fail("the model was loaded")
    )
    bad = tmp_path / "notes.txt"
    bad.write_text("not audio")
    voices = tmp_path / "voices"
    for clip, reason in ((tmp_path / "missing.wav", "not found"), (bad, "expected WAV, FLAC, MP3 or Ogg")):
        argv = [
            "voices",
            "--model",
            "tiny",
            "--voices-dir",
            str(voices),
            "add",
            "me",
            str(clip),
            "--text",
            "Hi.",
        ]
        assert main(argv) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("tts: error: ") and len(err.splitlines()) == 1, err
        assert str(clip) in err and reason in err and "System error" not in err
    assert not voices.exists()


def test_a_listing_between_the_file_write_and_the_registration_is_no_conflict(tmp_path, monkeypatch):
    """A reader that lists (and so reads the directory) right after `add` wrote the voice's file must not
    make `add` see its own file as another's voice (this failed as VoiceExists under load)."""
    import tts.runtime.voices

    reg = VoiceRegistry({}, tmp_path, "fp")
    real_replace = os.replace

    def replace_then_list(src, dst):
        real_replace(src, dst)
        assert [e.name for e in reg.list()] == ["mine"]  # what a concurrent ListVoices sees now

    monkeypatch.setattr(tts.runtime.voices.os, "replace", replace_then_list)
    assert reg.add("mine", voice(4)).name == "mine"
    with pytest.raises(VoiceExists):  # a second add of the name still conflicts
        reg.add("mine", voice(5))


def test_voices_options_go_before_or_after_the_action(tmp_path, capsys):
    """--model, --voices-dir and -q are the same options before and after the action word; one given
    before the action keeps its value (the action's copy of the option has no default to put over it)."""
    from tts.cli.main import main

    voices, clip = tmp_path / "voices", tmp_path / "clip.wav"
    sf.write(str(clip), 0.3 * np.sin(2 * np.pi * 220 * np.arange(16000) / 16000), 16000)
    model, where = ["--model", "tiny"], ["--voices-dir", str(voices)]
    assert main(["voices", "add", "me", str(clip), "--text", "A tone.", *model, *where]) == 0
    assert capsys.readouterr().out == f"added voice me: 1.00 s, kept in {voices}\n"
    assert [p.name for p in voices.iterdir()] == ["me.safetensors"]

    def listing(*argv: str) -> str:
        assert main(["voices", *argv]) == 0
        out, err = capsys.readouterr()
        assert err == ""  # -q held wherever it was given
        return out

    presets = "alpha\tpreset\t25 frames\tThis is voice alpha.\nbeta\tpreset\t25 frames\tThis is voice beta.\n"
    after = listing("list", *model, *where, "-q")
    assert after.startswith(presets + "me\tregistered\t") and after.count("\n") == 3, after
    # a taken name: one line in the CLI's words (the service's name the request field instead)
    assert main(["voices", "add", "me", str(clip), "--text", "A tone.", *model, *where]) == 2
    assert capsys.readouterr().err == "tts: error: a voice named 'me' exists (replace it: --replace)\n"
    assert listing(*model, *where, "-q", "list") == after
    assert listing(*model, *where, "-q") == after  # no action lists
    assert listing(*model, "list", *where, "-q") == after
    assert listing("-q", *where, "list", *model) == after

    assert main(["voices", *model, "list", *where]) == 0  # without -q: the directory on stderr
    assert capsys.readouterr().err == f"(registered voices are kept in {voices})\n"

    assert main(["voices", "delete", "me", *model, *where]) == 0
    assert capsys.readouterr().out == f"deleted voice me from {voices}\n"
    assert listing("list", *model, *where, "-q") == presets
    # a preset is named as one, as the service answers (not "no registered voice")
    assert main(["voices", "delete", "alpha", *model, *where]) == 2
    assert (
        capsys.readouterr().err
        == "tts: error: 'alpha' is a preset voice of the model and cannot be deleted\n"
    )


@pytest.mark.parametrize("action", ["list", "add", "delete"])
def test_each_voices_action_shows_the_shared_options_in_its_help(action, capsys):
    from tts.cli.main import main

    with pytest.raises(SystemExit) as exc:
        main(["voices", action, "--help"])
    out = capsys.readouterr().out
    assert exc.value.code == 0 and all(o in out for o in ("--model", "--voices-dir", "-q, --quiet")), out


def test_bad_voices_options_after_the_action_are_one_line_errors(capsys):
    from tts.cli.main import main

    for argv, start, message in (
        (
            ["voices", "list", "--model"],
            "tts voices list: error: ",
            "argument --model: expected one argument",
        ),
        (
            ["voices", "delete", "me", "--bogus"],
            "tts voices delete: error: ",
            "unrecognized arguments: --bogus",
        ),
    ):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        err = capsys.readouterr().err
        assert exc.value.code == 2 and err.startswith(start) and message in err and err.count("\n") == 1, err


def _add_after_barrier(directory: str, name: str, text: str, barrier, results) -> None:
    """(In a child process.) Add voice `name` to a registry on `directory`, every process's writer waiting
    at `barrier` once it has passed the name check: all of them find the name free before any writes."""
    import tts.runtime.voices as voices

    save = voices.save_file

    def save_after_barrier(*args, **kwargs):
        barrier.wait(60)
        return save(*args, **kwargs)

    voices.save_file = save_after_barrier
    try:
        VoiceRegistry({}, directory, "fp1").add(name, voice(5, text))
        results.put((text, "ok"))
    except VoiceExists:
        results.put((text, "exists"))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        results.put((text, f"error: {exc!r}"))


def test_two_processes_adding_one_name_one_wins_and_no_voice_is_lost(tmp_path):
    """Two servers sharing a voices folder, both adding a new name at once (both past the name check
    before either writes): exactly one gets OK, the other VoiceExists, and the file is the winner's."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    barrier, results = ctx.Barrier(2), ctx.Queue()
    directory = str(tmp_path / "voices")
    procs = [
        ctx.Process(target=_add_after_barrier, args=(directory, "shared", text, barrier, results))
        for text in ("first", "second")
    ]
    for p in procs:
        p.start()
    outcomes = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(60)
    assert sorted(outcomes.values()) == ["exists", "ok"], outcomes
    winner = next(text for text, outcome in outcomes.items() if outcome == "ok")
    assert VoiceRegistry({}, directory, "fp1").get("shared").text == winner
    assert sorted(f.name for f in (tmp_path / "voices").iterdir()) == ["shared.safetensors"]  # no temp files


def test_a_voice_file_with_wrong_shaped_codes_is_refused_at_load(tmp_path, caplog):
    """A file whose codes this codec cannot decode (wrong rows, not 2-D, empty, out of the codebook, not
    integers) is refused when the registry reads it: one warning naming the file and why, a count for the
    metric, and a lookup of it says why; the other voices serve."""
    from safetensors.torch import save_file

    directory = tmp_path / "voices"
    VoiceRegistry({}, directory, "fp1").add("good", voice(5))
    bad = {
        "rows": torch.zeros(3, 5, dtype=torch.int64),
        "flat": torch.zeros(20, dtype=torch.int64),
        "empty": torch.zeros(4, 0, dtype=torch.int64),
        "range": torch.full((4, 5), 1000, dtype=torch.int64),
        "floats": torch.zeros(4, 5),
    }
    for name, codes in bad.items():
        save_file(
            {"codes": codes}, str(directory / f"{name}.safetensors"), metadata={"text": "x", "codec": "fp1"}
        )
    with caplog.at_level("WARNING", logger="tts.runtime.voices"):
        reg = VoiceRegistry({}, directory, "fp1", codebooks=(4, 100))
        assert [e.name for e in reg.list()] == ["good"]
    assert reg.refused == len(bad)
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == len(bad)
    for name in bad:
        assert any(str(directory / f"{name}.safetensors") in line for line in lines), (name, lines)
    assert any("codes are [3, 5]; this codec's are [4, T]" in line for line in lines), lines
    assert any("codes outside 0..99" in line for line in lines), lines
    with pytest.raises(VoiceNotFound, match="refused: its codes are \\[3, 5\\]"):
        reg.get("rows")
    assert torch.equal(reg.get("good").codes, voice(5).codes)
    reg.list()
    assert reg.refused == len(bad)  # counted once per file, however often it is read
