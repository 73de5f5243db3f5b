"""The text aligner and the loop guard (tts/engine/aligner.py): the step's text position, the guard's
verdicts on position sequences, and the engine's rewind and the job pipeline's take-back around them."""

import dataclasses

import pytest
import torch
from helpers import params, random_prompt, script_loop_guard

from tts.api import TTS
from tts.checkpoints.bundle import save_bundle
from tts.checkpoints.load import load_bundle
from tts.engine import Engine, EngineConfig, FinishReason
from tts.engine.aligner import (
    FALL_TOKENS,
    MAX_REWINDS,
    RETRACT_MAX_FRAMES,
    RETRY_FRAMES,
    RETRY_TEMPERATURE,
    REWIND_EXTRA_FRAMES,
    LoopGuard,
    Repeat,
    text_alignment,
)
from tts.model.config import AlignerSpec

# ---- the position in the text -------------------------------------------------------------------------


def paged_keys(seed: int):
    """A paged key cache `[6 blocks, 4, 2 KV heads, 8]` and three rows' block tables (blocks out of order)."""
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(6, 4, 2, 8, generator=g)
    tables = torch.tensor([[3, 1, 5, 0], [2, 4, 0, 1], [5, 5, 5, 5]], dtype=torch.int32)
    return k_cache, tables


def reference_position(q, k_cache, table, start, end, heads, kv_heads, scale) -> int:
    """The median token of the heads' mean attention over positions [start, end), computed plainly."""
    keys = torch.stack([k_cache[int(table[p // 4]), p % 4] for p in range(start, end)])  # [n, Hkv, D]
    probs = torch.stack(
        [torch.softmax(keys[:, kv] @ q[h] * scale, dim=0) for h, kv in zip(heads, kv_heads, strict=True)]
    ).mean(0)
    return int((probs.cumsum(0) < 0.5).sum())


def test_text_alignment_is_the_median_of_the_heads_attention_over_each_rows_span():
    k_cache, tables = paged_keys(0)
    q = torch.randn(3, 4, 8, generator=torch.Generator().manual_seed(1))
    start, length = torch.tensor([2, 0, 0]), torch.tensor([7, 16, 0])  # row 2: no span
    heads, kv_heads = torch.tensor([0, 3]), torch.tensor([0, 1])  # 4 query heads over 2 KV heads
    for tokens in (16, 512):  # read as much as the longest span, or the step's fixed width
        got = text_alignment(q * 3, k_cache, tables, start, length, heads, kv_heads, 0.35, tokens)
        want = [
            reference_position(
                q[r] * 3, k_cache, tables[r], 2 if r == 0 else 0, [9, 16][r], [0, 3], [0, 1], 0.35
            )
            for r in (0, 1)
        ]
        assert got.tolist() == [*want, -1]


def test_text_alignment_finds_the_token_the_heads_look_at():
    """Queries pointing hard at the key of one span position: that position (counted from the span's
    start), whatever the block layout."""
    k_cache, tables = paged_keys(2)
    start, length = torch.tensor([3, 5]), torch.tensor([10, 9])
    targets = [6, 2]  # positions 9 and 7 of the rows' contexts
    q = torch.zeros(2, 4, 8)
    for r, (s, t) in enumerate(zip(start.tolist(), targets, strict=True)):
        p = s + t
        key = k_cache[int(tables[r, p // 4]), p % 4]  # [Hkv, D]
        q[r, 0], q[r, 3] = 50 * key[0], 50 * key[1]
    got = text_alignment(
        q, k_cache, tables[:2], start, length, torch.tensor([0, 3]), torch.tensor([0, 1]), 1.0
    )
    assert got.tolist() == targets


def test_the_text_span_is_the_chunks_text_tokens_in_its_prompt():
    """What the guard follows: the positions of the chunk's own text, after the voice reference and the
    previous chunk, as the default model reads it (phonemes)."""
    from tts.params import SamplingParams
    from tts.text.prompt import Turn

    tts = TTS.load("default")
    fmt = tts.bundle.prompt_format
    voice = tts.voice("ben")
    history = [Turn("An earlier sentence.", torch.zeros(4, 9, dtype=torch.int64))]
    for hist in ([], history):
        prompt, (start, end) = tts.planner.prompt_with_span("Then this one.", voice, hist, SamplingParams())
        assert prompt[start:end, 0].tolist() == fmt.tokenizer.encode(fmt.model_text("Then this one."))
        assert torch.equal(prompt, tts.planner.prompt("Then this one.", voice, hist, SamplingParams()))


# ---- the guard's verdicts ---------------------------------------------------------------------------------


def feed(guard: LoopGuard, positions: list[int]) -> list[tuple[int, Repeat]]:
    return [(i, r) for i, p in enumerate(positions) if (r := guard.push(p)) is not None]


def reading(start: int, end: int) -> list[int]:
    """A steady reading: one token every other frame, then one more."""
    out, p = [], start
    while p < end:
        out += [p, p + 1]
        p += 2
    return out


def test_a_steady_reading_its_glances_and_its_end_are_no_repeat():
    text = reading(0, 200)
    glance = text[:100] + [text[100] + 20, text[100] + 21] + text[100:]  # two frames far ahead, then back
    end_drift = text + [199, 199, 196, 179, 179, 158, 199]  # after the last token: drift, then a jump back
    for positions in (text, glance, end_drift):
        assert feed(LoopGuard(200), positions) == []


def test_a_repeat_mid_text_is_found_where_it_began():
    """ "...where he where he was": the position falls back to "where" and reads it again."""
    before = reading(150, 212) + [212, 212]
    again = [204, 205, 207, 209, 211, 212, 213]
    found = feed(LoopGuard(216), before + again)
    # reported once the climb is sure: three small steps forward, three tokens above the fall
    assert found == [(len(before) + 3, Repeat(first=len(before), at_end=False))]


def test_a_repeat_that_the_text_itself_has_is_no_loop():
    """The same fall and climb over tokens 204..207 as above, where the text repeats them just past the
    trusted position (212..215 are the same tokens: "three, five, three"): the heads looked at the
    first copy while the second was said. With other tokens there, it is a repeat."""
    before = reading(150, 212) + [212, 212]
    again = [204, 205, 207, 209, 211, 212, 213]
    tokens = list(range(220))
    repeated = tokens[:212] + tokens[204:212]  # tokens 212.. are tokens 204.. again
    assert feed(LoopGuard(220, repeated), before + again) == []
    assert feed(LoopGuard(220, tokens), before + again) == [(len(before) + 3, Repeat(len(before), False))]


def test_a_glance_ahead_does_not_hide_a_repeat():
    """Positions read on the default model as it said "with a basket with a basket" (chunk positions
    83-85, "with a basket", then a fall to 73 broken by a three-frame glance to 94-96): still a repeat,
    found from the fall."""
    before = reading(40, 82) + [83, 85, 85]
    again = [92, 87, 79, 83, 73, 77, 77, 94, 95, 96, 81, 81, 81, 83]
    found = feed(LoopGuard(174), before + again)
    assert found == [(len(before) + 10, Repeat(first=len(before) + 2, at_end=False))]  # at the first 81


def test_a_repeat_after_the_last_token_is_at_the_end():
    """The model reached the text's last token and read its last sentence again."""
    before = reading(200, 260) + [259, 260]
    found = feed(LoopGuard(261), before + [240, 200, 201, 201, 202, 205, 206])
    assert found == [(len(before) + 5, Repeat(first=len(before), at_end=True))]


def test_a_glance_at_the_last_token_does_not_make_a_repeat_mid_text_one_at_the_end():
    """Only trusted positions count for `at_end`: a two-frame glance at the last token, then a repeat
    halfway through, is rewound (at_end False), not taken as the end of the text (which would end the
    request with its second half unsaid)."""
    before = reading(0, 100)
    before = before[:60] + [199, 199] + before[60:] + [100, 100]
    found = feed(LoopGuard(200), before + [92, 93, 95, 97, 99])
    assert found == [(len(before) + 3, Repeat(first=len(before), at_end=False))]


def test_a_small_dip_or_a_fall_without_a_climb_is_no_repeat():
    base = reading(0, 100)
    dip = base + [100 - FALL_TOKENS + 1, 99, 100, 101]  # less than FALL_TOKENS down
    stuck = base + [80] * (RETRACT_MAX_FRAMES + 5) + [81, 82, 83, 84, 85]  # the climb comes too late
    for positions in (dip, stuck):
        assert feed(LoopGuard(300), positions) == []


def test_after_a_rewind_the_guard_forgets_the_repeat():
    guard = LoopGuard(214)
    before = reading(150, 212) + [212, 212]
    [(_, repeat)] = feed(guard, before + [204, 205, 207, 209])
    guard.rewind(repeat.first)
    assert len(guard.positions) == len(guard.trusted) == repeat.first and guard.repeats == 1
    assert feed(guard, [213, 213, 213]) == []  # (feed counts from 0 again: only the verdicts matter)


def test_aligner_spec_from_config():
    assert AlignerSpec.from_config({"layer": 3, "heads": [0, 2]}, 4, 6) == AlignerSpec(3, (0, 2))
    assert AlignerSpec.from_config(None, 4, 6) is None
    for bad in (
        {"layer": 4, "heads": [0]},
        {"layer": 0, "heads": [6]},
        {"layer": 0, "heads": []},
        {"heads": [0]},
    ):
        with pytest.raises(ValueError, match="aligner"):
            AlignerSpec.from_config(bad, 4, 6)


def test_the_default_model_names_its_aligner_and_a_saved_bundle_keeps_it(tiny_bundle, tmp_path):
    assert load_bundle("default").aligner == AlignerSpec(3, (0, 2))
    bundle = dataclasses.replace(tiny_bundle, aligner=AlignerSpec(1, (0, 3)))
    assert load_bundle(save_bundle(bundle, tmp_path / "b")).aligner == AlignerSpec(1, (0, 3))


# ---- the engine's rewind ---------------------------------------------------------------------------------


@pytest.fixture
def scripted(monkeypatch):
    return lambda script, **hold: script_loop_guard(monkeypatch, script, **hold)


def guarded_engine(model, **kw):
    """A CPU engine whose aligner is the tiny model's layer 1, heads 0 and 3; the end token never drawn,
    so that every request runs to its budget."""
    cfg = dict(max_batch=2, graphs="off", block_size=8, aligner=AlignerSpec(1, (0, 3)), ignore_eos=True)
    cfg.update(kw)
    return Engine(model, EngineConfig(**cfg))


def drive(engine: Engine, rid: str, check=None):
    """Step until idle: (the frames a consumer keeps after every take-back, the finish output, the
    frames taken back); `check(step number, outputs)` after each step."""
    kept, taken, end, n = [], 0, None, 0
    while engine.has_work():
        outs = engine.step()
        n += 1
        for out in outs:
            if out.retract:
                del kept[-out.retract :]
                taken += out.retract
            kept += list(out.codes)
            end = out if out.finished else end
        if check is not None:
            check(n, outs)
    return kept, end, taken


def test_a_rewind_takes_back_the_repeat_and_restores_the_row(tiny_model, scripted):
    """A repeat of frames 6..9 reported at frame 9: the request goes back REWIND_EXTRA_FRAMES (3) more,
    so frames 3..8 are taken back, frame 9 never comes out, and the row is as it was after 3 frames
    (position, next input, RAS window), sampling hotter for RETRY_FRAMES frames; the budget counts
    the frames kept."""
    prompt = random_prompt(tiny_model, 20, 0)
    p = params(max_new_frames=30, min_new_frames=20, temperature=0.1, top_p=0.5)
    bufs = None
    states = {}

    def snapshot(n, outs):
        states[n] = (int(bufs.positions[0]), bufs.input_columns[0].clone(), bufs.ras_history[0].clone())

    engine = guarded_engine(tiny_model)
    bufs = engine.runner.buffers
    engine.submit(prompt, p, "r")  # no span: unguarded, the reference
    drive(engine, "r", snapshot)

    scripted({9: (4, False)})
    engine = guarded_engine(tiny_model)
    bufs = engine.runner.buffers
    request = engine.submit(prompt, p, "r", text_span=(3, 12))
    assert request.text_span == (3, 12) and request.guard.text_tokens == 9
    temperatures = {}

    def check(n, outs):
        temperatures[n] = float(bufs.temperature[0])
        if n == 10:
            [out] = outs
            assert (out.retract, out.codes.shape[0]) == (6, 0)  # frames 3..8 back; frame 9 dropped
            position, column, ras = states[3]
            assert int(bufs.positions[0]) == position
            # the budget and min_new_frames count kept frames: 7 more sampled (6 taken back, 1 dropped)
            assert (int(bufs.budgets[0]), int(bufs.min_frames[0])) == (30 + 7, 20 + 7)
            assert torch.equal(bufs.input_columns[0], column) and torch.equal(bufs.ras_history[0], ras)

    kept, end, taken = drive(engine, "r", check)
    assert REWIND_EXTRA_FRAMES == 3
    assert request.guard.rewinds == [3] and taken == 6 and engine.loop_repeats == 1
    assert len(kept) == 30 and end.finish_reason == FinishReason.LENGTH
    hot = [n for n, t in temperatures.items() if t == pytest.approx(RETRY_TEMPERATURE)]
    assert hot == list(range(10, 10 + RETRY_FRAMES))  # set after step 10, back after RETRY_FRAMES frames
    fed = request.guard.positions  # every frame fed: the 30 kept, the 6 taken back and the one dropped
    assert len(fed) == 30 + 7 and all(0 <= x < 9 for x in fed)


def test_a_repeat_after_the_text_ends_the_request_there(tiny_model, scripted):
    scripted({7: (3, True)})
    engine = guarded_engine(tiny_model)
    engine.submit(random_prompt(tiny_model, 20, 1), params(max_new_frames=30), "r", text_span=(0, 10))
    kept, end, taken = drive(engine, "r")
    assert (len(kept), taken, end.finish_reason, end.retract) == (5, 2, FinishReason.STOP, 2)
    assert engine.scheduler.allocator.num_free == engine.scheduler.allocator.num_usable


def test_a_repeat_after_the_text_keeps_the_frames_min_new_frames_asks_for(tiny_model, scripted):
    scripted({7: (3, True)})
    engine = guarded_engine(tiny_model)
    p = params(max_new_frames=30, min_new_frames=30)  # exactly 30 frames (as the benchmarks ask)
    engine.submit(random_prompt(tiny_model, 20, 1), p, "r", text_span=(0, 10))
    kept, end, taken = drive(engine, "r")
    assert (len(kept), taken, end.finish_reason, engine.loop_repeats) == (30, 0, FinishReason.LENGTH, 0)


def test_past_the_rewinds_allowed_a_repeat_stays_and_the_request_ends_loop(tiny_model, scripted):
    scripted({k: (3, False) for k in range(8, 400, 8)})  # a repeat every 8 frames fed
    engine = guarded_engine(tiny_model)
    engine.submit(random_prompt(tiny_model, 20, 2), params(max_new_frames=60), "r", text_span=(0, 10))
    kept, end, taken = drive(engine, "r")
    per_rewind = 3 + REWIND_EXTRA_FRAMES  # frames sampled again per rewind, one of them never handed out
    assert taken == (per_rewind - 1) * MAX_REWINDS and len(kept) == 60
    # 60 frames kept + 4 rewinds of 6 = 84 frames fed (the last one ends the request): 10 repeats
    assert end.finish_reason == FinishReason.LOOP and engine.loop_repeats == 10


def test_a_finished_rows_text_span_does_not_outlive_it(tiny_model, standin_graphs):
    """A pad row reads an empty span at the scratch block: after a request whose span lay far into a
    long prompt finishes, the padded steps of the others go on (stand-in graphs pad to bucket 4)."""
    engine = guarded_engine(tiny_model, max_batch=4, graphs="lazy", buckets=(4,))
    for i in range(2):
        engine.submit(random_prompt(tiny_model, 20, i), params(max_new_frames=12, seed=i), f"s{i}", (2, 15))
    engine.submit(random_prompt(tiny_model, 300, 9), params(max_new_frames=3, seed=9), "long", (200, 290))
    ends = {}
    while engine.has_work():
        ends |= {o.request_id: o.finish_reason for o in engine.step() if o.finished}
    assert ends == {"s0": FinishReason.LENGTH, "s1": FinishReason.LENGTH, "long": FinishReason.LENGTH}


def test_no_guard_without_a_span_an_aligner_or_with_the_guard_off(tiny_model):
    prompt = random_prompt(tiny_model, 20, 3)
    assert guarded_engine(tiny_model).submit(prompt, params(), "a").guard is None
    assert (
        guarded_engine(tiny_model, loop_guard=False).submit(prompt, params(), "b", text_span=(0, 5)).guard
        is None
    )
    assert (
        guarded_engine(tiny_model, aligner=None).submit(prompt, params(), "c", text_span=(0, 5)).guard is None
    )
    for engine in (guarded_engine(tiny_model), guarded_engine(tiny_model, loop_guard=False)):
        for bad in ((5, 25), (9, 3), (-1, 4), (1.5, 9.0)):  # past the prompt, reversed, negative, not ints
            with pytest.raises(ValueError, match="text_span"):
                engine.submit(prompt, params(), "d", text_span=bad)
    unguarded = guarded_engine(tiny_model, aligner=None)
    unguarded.submit(prompt, params(), "e")
    unguarded.step()
    assert int(unguarded.runner.buffers.out[0, unguarded.runner.out_layout.align]) == -1


# ---- through the job pipeline ------------------------------------------------------------------------------


def guarded_tts(tiny_bundle) -> TTS:
    bundle = dataclasses.replace(tiny_bundle, aligner=AlignerSpec(1, (0, 3)))
    return TTS(bundle, EngineConfig(max_batch=2, graphs="off", ignore_eos=True))


def test_a_synthesis_keeps_exactly_the_frames_left_after_each_take_back(tiny_bundle, scripted):
    """With rewinds inside a text chunk, the streamed audio chunks are contiguous, their codes are the
    frames the engine kept, and the audio has their length."""
    tts = guarded_tts(tiny_bundle)
    kept: list[torch.Tensor] = []
    original = tts.engine.step

    def step(*args):
        outs = original(*args)
        for o in outs:
            if o.retract:
                del kept[-o.retract :]
            kept.extend(o.codes)
        return outs

    scripted({12: (4, False), 30: (10, False)})
    tts.engine.step = step
    chunks = list(tts.stream("A few words of text to read.", seed=5, max_new_frames=60))
    codes = torch.cat([c.codes for c in chunks], dim=1)
    assert [c.frame_start for c in chunks] == [0] + [c.frame_end for c in chunks[:-1]]
    assert codes.shape[1] == 60  # max_new_frames counts the frames kept
    assert torch.equal(codes, torch.stack(kept).T)
    assert sum(len(c.samples) for c in chunks) == codes.shape[1] * tiny_bundle.codec.frame_length
    assert tts.engine.loop_repeats == 2


def codec_pieces(tts: TTS, text: str, **options) -> tuple[list[tuple[int, int]], int]:
    """(frames generated when each audio piece went to the codec, and its frames), and the frames of
    the synthesis."""
    generated, sent = [0], []
    decode = tts.runner.stage.decode

    def spy(slot, tag, codes, **kwargs):
        sent.append((generated[0], codes.shape[1]))
        return decode(slot, tag, codes, **kwargs)

    def progress(frames, chunk, chunks):
        generated[0] = frames

    tts.runner.stage.decode = spy
    return sent, tts.synthesize(text, progress=progress, **options).frames


def test_a_guarded_chunk_keeps_the_frames_its_guard_may_take_back_from_the_codec(tiny_bundle, scripted):
    """The first audio piece (4 frames) goes to the codec once the frames after it are all the guard may
    still take back (`hold`: 3, the most a rewind reaches before a fall that starts at the next frame;
    16 while one is under way); unguarded, at once. The frames held are released when the chunk ends."""
    for hold in (REWIND_EXTRA_FRAMES, RETRACT_MAX_FRAMES):
        scripted({}, hold=hold)
        # (a text long enough that its paced budget, tts.runtime.planner.PACE_BUDGET, is over 40 frames)
        text = "A few words of text to read."
        sent, frames = codec_pieces(guarded_tts(tiny_bundle), text, seed=1, max_new_frames=40)
        assert sent[0] == (4 + hold, 4) and sum(n for _, n in sent) == frames == 40
    sent, frames = codec_pieces(TTS(tiny_bundle), "Words.", seed=1, max_new_frames=40)
    assert sent[0] == (4, 4) and sum(n for _, n in sent) == frames == 40


def test_a_rewind_never_takes_back_frames_already_let_go(tiny_model, scripted):
    """With a guard that holds only 3 frames, a repeat of frames 6..9 found at frame 9 is taken back
    from frame 6: the 3 frames before it went out (the guard had said they were safe)."""
    scripted({9: (4, False)}, hold=3)
    engine = guarded_engine(tiny_model)
    request = engine.submit(
        random_prompt(tiny_model, 20, 0), params(max_new_frames=30), "r", text_span=(3, 12)
    )
    holds = []
    kept, end, taken = drive(engine, "r", lambda n, outs: holds.extend(o.hold for o in outs))
    assert request.guard.rewinds == [6] and taken == 3
    assert holds[:3] == [1, 2, 3] and set(holds[3:9]) == {3} and holds[9] == 0  # (the take-back's output)


def test_the_guard_may_take_back_more_while_a_repeat_is_suspected():
    guard = LoopGuard(214)
    before = reading(150, 212) + [212, 212]
    for p in before:
        guard.push(p)
    assert guard.retractable() == REWIND_EXTRA_FRAMES
    for n, p in enumerate([204, 204, 204], start=1):  # fell: reading again may follow
        guard.push(p)
        assert guard.retractable() == REWIND_EXTRA_FRAMES + n
    guard.push(212)
    guard.push(212)
    guard.push(212)
    guard.push(212)  # back for BACK_FRAMES frames: not a repeat
    assert guard.fall is None and guard.retractable() == REWIND_EXTRA_FRAMES


def test_a_chunk_with_a_repeat_left_in_ends_loop_and_warns(tiny_bundle, scripted):
    scripted({k: (2, False) for k in range(6, 200, 6)})
    tts = guarded_tts(tiny_bundle)
    result = tts.synthesize("Some words.", seed=1, max_new_frames=50)
    assert result.finish_reasons == [FinishReason.LOOP]
    assert any("repetition loop" in w for w in result.warnings)
