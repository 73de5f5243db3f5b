"""Word timings of a chunk (tts/runtime/timings.py), on synthetic aligner positions: where a measured word
starts (the middle of the first frame whose position reached the word's first token, on the audio's clock,
which lags the frames by the codec's delay), which span token a word begins at (its place in the chunk's
model text, whose words the frontend may join), and when a word is final."""

import json
import random

import pytest
from tokenizers import Tokenizer

from tts.checkpoints.fish.tokenizer import S1_SPECIAL_TOKENS, TiktokenTokenizer
from tts.checkpoints.fish.writer import s2_tokenizer_json
from tts.runtime import timings
from tts.runtime.timings import ChunkTimer, word_first_tokens
from tts.text.tokenizer import TextTokenizer, build_byte_tokenizer

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


byte_tokens = build_byte_tokenizer(4).token_ends  # the default model's tokenizer: one token a byte


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


def fish_tokenizer():
    """fish-speech's tiktoken tokenizer (`FISH_TIKTOKEN_PATTERN` splits the text), with merges that join
    a word's leading space to it: " do" and " it" are one token each, as in real Fish vocabularies."""
    ranks = {bytes([b]): b for b in range(256)}
    for merged in (b" d", b" do", b" i", b" it"):
        ranks[merged] = len(ranks)
    tok = TiktokenTokenizer(ranks, S1_SPECIAL_TOKENS)
    assert tok.encode("I do it") == [ord("I"), 257, 259]  # I | " do" | " it"
    return tok


def test_a_word_whose_token_carries_its_leading_space_starts_at_that_token():
    # Fish models read the characters; the space before "do" is part of the token " do", not a token
    # of its own, so "do" starts at token 1 and "it" at token 2 (the last token)
    tok = fish_tokenizer()
    words = ["I", "do", "it"]
    assert word_first_tokens(words, lambda w: w, "I do it", tok.token_ends, 3) == [0, 1, 2]


def test_qwen_style_tokens_with_leading_spaces():
    # S2-Pro's Qwen BPE (a tokenizer.json, offsets from the Hugging Face tokenizer): t|he| speech| of|...
    tok = TextTokenizer(Tokenizer.from_str(json.dumps(s2_tokenizer_json(4))))
    text = "the speech of the voice"
    tokens = tok.tokenizer.encode(text, add_special_tokens=False).tokens
    assert tokens == ["t", "he", "Ġspeech", "Ġof", "Ġthe", "Ġvoice"]
    assert word_first_tokens(text.split(), lambda w: w, text, tok.token_ends, 6) == [0, 2, 3, 4, 5]


@pytest.mark.parametrize("tok", [build_byte_tokenizer(4), fish_tokenizer()], ids=["bytes", "tiktoken"])
def test_token_ends_are_in_characters_and_a_split_character_ends_both_its_tokens(tok):
    text = "a ˈb <|im_end|> do"
    ends = tok.token_ends(text)
    assert len(ends) == len(tok.encode(text))
    assert ends[-1] == len(text) and ends == sorted(ends)
    assert ends[2:4] == [3, 3]  # "ˈ" is two bytes, two tokens: both end after it
    assert text.index(">") + 1 in ends  # the special token is one token


def pattern(n):
    """n words as a frontend reading them as a whole might give them: every "of the" read as one piece."""
    base = ["hello", "of", "the", "big", "world."]
    words = (base * (n // len(base) + 1))[:n]
    text = " ".join(words).replace("of the", "ofthe")
    return words, text


def test_matching_pieces_to_words_takes_work_in_proportion_to_the_words(monkeypatch):
    # Every candidate (a run of words for a piece) is scored once, by `abs` of its length difference:
    # count them, and the tokenizer's calls, for a 300-word chunk and one twice as long (60 and 120
    # joined pairs: more than the joins tried around an even spread)
    def count(n):
        words, text = pattern(n)
        calls = {"abs": 0, "encode": 0}

        def counting_abs(x):
            calls["abs"] += 1
            return abs(x)

        def ends(s):
            calls["encode"] += 1
            return byte_tokens(s)

        monkeypatch.setattr(timings, "abs", counting_abs, raising=False)
        firsts = word_first_tokens(words, lambda w: w, text, ends, len(text.encode()))
        monkeypatch.undo()
        # the layout is right: each word starts at its own place, "the" after "of" in their shared piece
        at, c = [], 0
        for piece in text.split():
            at += [c, c + 2] if piece == "ofthe" else [c]
            c += len(piece) + 1
        assert firsts == at
        assert calls["encode"] == 1  # the chunk's text is encoded once, not once a word
        assert calls["abs"] >= len(text.split())  # each piece scored at least once
        return calls["abs"]

    assert count(300) <= 100 * 300  # a bounded number of candidates a word
    assert count(600) <= 2.2 * count(300)  # twice the words: about twice the work


def best_grouping_cost(own, size):
    """The least total difference over every grouping of the words into the pieces (1 to MAX_JOINED
    words each), by trying them all."""
    best = None

    def walk(j, i, cost):
        nonlocal best
        if j == len(size):
            if i == len(own) and (best is None or cost < best):
                best = cost
            return
        for g in range(1, timings.MAX_JOINED + 1):
            if i + g <= len(own):
                walk(j + 1, i + g, cost + abs(size[j] - sum(own[i : i + g])))

    walk(0, 0, 0)
    return best


def test_the_grouping_is_the_best_fit_when_the_joins_are_within_the_band():
    rng = random.Random(7)
    for _ in range(300):
        k = rng.randint(1, 8)
        n = rng.randint(k, min(k + timings.JOIN_BAND, k * timings.MAX_JOINED))
        own = [rng.randint(1, 6) for _ in range(n)]
        size = [rng.randint(1, 12) for _ in range(k)]
        groups = timings._group(own, size)
        assert groups is not None and sum(groups) == n and all(1 <= g <= timings.MAX_JOINED for g in groups)
        cost, i = 0, 0
        for piece, g in zip(size, groups, strict=True):
            cost += abs(piece - sum(own[i : i + g]))
            i += g
        assert cost == best_grouping_cost(own, size)


def test_no_layout_where_a_piece_would_hold_more_words_than_a_frontend_joins():
    words = ["a", "b", "c", "d", "e"]
    assert word_first_tokens(words, lambda w: w, "abcde", byte_tokens, 5) is None
    assert word_first_tokens(words[:4], lambda w: w, "abcd", byte_tokens, 4) == [0, 1, 2, 3]
