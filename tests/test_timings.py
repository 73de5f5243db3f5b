"""Word timings of a chunk (tts/runtime/timings.py), on synthetic aligner positions: where a measured word
starts (the middle of the first frame whose position reached the word's first token, on the audio's clock,
which lags the frames by the codec's delay), which span token a word begins at (its place in the chunk's
model text, whose words the frontend may join), and when a word is final."""

import pytest

from tts.runtime.timings import ChunkTimer, word_first_tokens

FL, RATE = 100, 1000  # samples per frame, Hz (synthetic)


def timer(first_tokens, delay=0, start=1000, weights=None):
    words = [f"w{i}" for i in range(len(first_tokens))]
    return ChunkTimer(
        words,
        weights or [1] * len(words),
        span_tokens=20,
        start_sample=start,
        frame_length=FL,
        sample_rate=RATE,
        chunk=0,
        first_tokens=first_tokens,
        delay=delay,
    )


def spans(words):
    return [(w.text, w.start_sample, w.end_sample, w.estimated) for w in words]


def test_a_measured_word_starts_mid_frame_on_the_audio_clock():
    # word 1 starts at token 4, first reached at frame 2; word 2 at token 9, reached at frame 5. The
    # codec's audio lags its frames by 30 samples: frame f's sound is at [100 f + 30, 100 f + 130).
    t = timer([0, 4, 9], delay=30)
    out = t.audio(4, 400, [0, 1, 4, 5])
    assert spans(out) == [("w0", 1000, 1000 + 280, False)]  # 2 * 100 + 50 + 30
    out = t.audio(4, 400, [6, 9, 9, 10])
    assert spans(out) == [("w1", 1280, 1000 + 580, False)]  # 5 * 100 + 50 + 30
    assert spans(t.finish()) == [("w2", 1580, 1800, False)]  # the last word: to the chunk's end
    assert out[0].start == 1.28 and out[0].end == 1.58  # seconds at RATE


def test_the_running_maximum_places_a_word_at_its_first_frame_reached():
    t = timer([0, 4, 9])
    out = t.audio(6, 600, [0, 5, 3, 3, 9, 4])  # a glance back after each step forward
    assert [w.start_sample for w in out + t.finish()] == [1000, 1150, 1450]


def test_a_word_is_final_only_once_its_end_lies_in_the_audio_sent():
    # with an 80-sample delay, the start of word 1 (reached at frame 3) is at sample 430 of the chunk
    t = timer([0, 4], delay=80)
    assert t.audio(4, 400, [0, 1, 2, 4]) == []  # 430 > 400: not sent yet
    assert spans(t.audio(1, 100, [5])) == [("w0", 1000, 1430, False)]
    assert spans(t.finish()) == [("w1", 1430, 1500, False)]


def test_a_start_past_the_audio_sent_is_held_inside_it_at_the_chunk_end():
    t = timer([0, 4], delay=80)
    t.audio(4, 400, [0, 1, 2, 4])  # the chunk ends here: word 1's start (430) lies past its audio
    out = t.finish()
    assert spans(out) == [("w0", 1000, 1400, False), ("w1", 1400, 1400, False)]


def test_words_never_reached_share_the_rest_by_weight_and_say_estimated():
    t = timer([0, 4, 9, 12], weights=[1, 2, 1, 3])
    out = t.audio(4, 400, [0, 2, 4, 5])  # word 1 reached at frame 2 (250); words 2 and 3 never
    out = spans(out + t.finish())
    # word 1 and those after it share [250, 400) by weights 2 : 1 : 3
    assert out == [("w0", 1000, 1250, False), ("w1", 1250, 1300, True), ("w2", 1300, 1325, True),
                   ("w3", 1325, 1400, True)]  # fmt: skip


def test_without_positions_every_word_is_estimated_by_its_share_of_the_audio():
    t = timer([0, 4, 9], delay=30, weights=[1, 1, 2])
    assert t.audio(2, 200, None) == [] and t.audio(2, 200, None) == []
    assert spans(t.finish()) == [("w0", 1000, 1100, True), ("w1", 1100, 1200, True), ("w2", 1200, 1400, True)]


def test_proportional_first_tokens_without_a_layout():
    t = ChunkTimer(["a", "bbb"], [1, 3], 8, 0, FL, RATE, 0)
    assert t.first_token == [0, 2]


ISOLATED = {"hello": "həlˈoʊ.", "of": "ʌv.", "the": "ðə.", "big": "bˈɪɡ.", "world.": "wˈɜːld."}


def byte_tokens(s):
    return list(s.encode())


def test_first_tokens_are_where_each_word_begins_in_the_chunks_model_text():
    words = ["hello", "the", "world."]
    text = "həlˈoʊ ðə wˈɜːld."
    firsts = word_first_tokens(words, ISOLATED.__getitem__, text, byte_tokens, len(text.encode()))
    assert firsts == [0, len("həlˈoʊ ".encode()), len("həlˈoʊ ðə ".encode())]


def test_words_the_frontend_joins_split_their_piece_by_their_own_length():
    # espeak reads "of the" as one word, "ʌvðə": each of the two gets its share of it (2 letters each)
    words = ["hello", "of", "the", "big", "world."]
    text = "həlˈoʊ ʌvðə bˈɪɡ wˈɜːld."
    firsts = word_first_tokens(words, ISOLATED.__getitem__, text, byte_tokens, len(text.encode()))
    at = [
        len(text[:i].encode())
        for i in (0, text.index("ʌ"), text.index("ð"), text.index("b"), text.index("w"))
    ]
    assert firsts == at


@pytest.mark.parametrize(
    "text, span",
    [
        ("həlˈoʊ ðə wˈɜːld ɐ ɡˈɛn.", None),  # more pieces than words: no layout
        ("həlˈoʊ ðə wˈɜːld.", 3),  # the span is not this text's tokens
        ("", None),
    ],
)
def test_no_layout_where_the_model_text_does_not_fit_the_words(text, span):
    words = ["hello", "the", "world."]
    span = len(text.encode()) if span is None else span
    assert word_first_tokens(words, ISOLATED.__getitem__, text, byte_tokens, span) is None


def test_a_frontend_that_fails_on_a_word_counts_its_characters():
    def frontend(w):
        if w == "the":
            raise RuntimeError("no frontend here")
        return ISOLATED[w]

    text = "həlˈoʊ ðə wˈɜːld."
    assert word_first_tokens(["hello", "the", "world."], frontend, text, byte_tokens, len(text.encode())) == [
        0,
        len("həlˈoʊ ".encode()),
        len("həlˈoʊ ðə ".encode()),
    ]
