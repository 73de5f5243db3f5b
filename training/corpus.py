"""Build the default voice's training corpus: text -> teacher speech -> log-mel -> codec codes.

The teacher is espeak-ng (the shipped model's) or, with `text --teacher flite`, flite: the same texts
and speakers, spoken by CMU's voices.

Stages (each resumable; outputs under --work, default `training/work/`, git-ignored):

  text     sentences.jsonl: every utterance (id, raw text, normalized text, phonemes, speaker, rate,
           pitch, split); with --paragraphs N also N utterances of 2-4 training sentences each. Sources, both
           reproducible and legally clean:
           * the example sentences in WordNet 3.0's glosses (Debian package `wordnet-base`,
             /usr/share/wordnet/data.*; WordNet 3.0 license: use, copy, modify and distribute for any
             purpose with the copyright notice kept; see training/README.md);
           * sentences generated here from templates with numbers, dates, times, currency, percentages,
             ordinals, years and abbreviations (seeded, so always the same).
           All text goes through the runtime's normalizer `tts.text.normalize.normalize_text`, then through
           the runtime's phoneme frontend (`tts.text.phonemes`), exactly as at inference.
  addon    sentences.jsonl of a corpus to fine-tune a trained model with (`--base` names the corpus it
           was trained on): short utterances, everyday sentences with varied final phrases, a replay of
           the base; never a text of samples/eval/ (`build_addon`; training/README.md).
  synth    shards/mel-XXXX.pt: the teacher (Debian package `espeak-ng` or `flite`) speaks every
           utterance with its speaker's voice, rate and pitch at 22050 Hz; each clip becomes a log-mel
           `[4T, 80]` float16 (`tts.codec.melrvq.LogMel`). Audio itself is never stored.
  codec    codec/: fits the residual-VQ codebooks by k-means on a sample of training frames
           (`tts.codec.melrvq.fit_rvq`) and writes codec.json + codec.safetensors.
  encode   codes/: per shard, codes `[N, T]` int16 and token ids, the training input of train.py
           (which needs neither espeak-ng, phonemizer nor soundfile).

Run everything:  python training/corpus.py all --work training/work --jobs 2
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from tts_tools.evaluate import FLITE_SPEAKERS as FLITE_VOICES  # noqa: E402
from tts_tools.evaluate import espeak_audio, flite_audio  # noqa: E402

WORDNET_DIR = Path("/usr/share/wordnet")
SHARD_SIZE = 1000

# Speakers: espeak-ng en-us with different voice variants, a base pitch (0-99) and rate (words/min).
# Speaker 0 is the default voice (the model's voice when no reference is given).
SPEAKERS = [
    {"name": "ava", "voice": "en-us+f3", "pitch": 55, "rate": 165},
    {"name": "ben", "voice": "en-us+m3", "pitch": 40, "rate": 170},
    {"name": "cora", "voice": "en-us+f1", "pitch": 68, "rate": 160},
    {"name": "dave", "voice": "en-us+m1", "pitch": 32, "rate": 175},
    {"name": "emma", "voice": "en-us+f4", "pitch": 50, "rate": 180},
    {"name": "finn", "voice": "en-us+m7", "pitch": 48, "rate": 160},
    {"name": "gwen", "voice": "en-us+f2", "pitch": 60, "rate": 170},
    {"name": "hank", "voice": "en-us+klatt2", "pitch": 42, "rate": 165},
]
# The same eight speakers spoken by flite (Debian package `flite` 2.2, Carnegie Mellon University's
# synthesizer and its CMU ARCTIC voices, under a free license: training/README.md), the teacher of
# `--teacher flite`: a voice, a duration stretch (1.0 = the voice's own rate; larger is slower) and a
# mean F0 target in Hz (0 = the voice's own; flite's slt and kal16 follow it, its rms and awb do not).
# Defined once, in `tts_tools.evaluate` (its voice check speaks with them too).
FLITE_SPEAKERS = [
    {"name": name, "voice": voice, "stretch": stretch, "f0": f0}
    for name, (voice, stretch, f0) in FLITE_VOICES.items()
]
TEACHERS = ("espeak", "flite")
DEFAULT_SPEAKER_SHARE = 0.3
SECOND_READING_SHARE = 0.05  # share of training sentences read a second time by another speaker
HELDOUT = 60


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


# ---- text ------------------------------------------------------------------------------------------


def wordnet_sentences() -> list[str]:
    """The quoted example sentences of WordNet 3.0's glosses, deduplicated, in sorted order."""
    if not WORDNET_DIR.is_dir():
        raise SystemExit("WordNet data not found: apt-get install -y wordnet-base")
    found = set()
    for name in ("data.noun", "data.verb", "data.adj", "data.adv"):
        for line in (WORDNET_DIR / name).read_text(encoding="latin-1").splitlines():
            if line.startswith("  ") or "|" not in line:
                continue
            for s in re.findall(r'"([^"]+)"', line.split("|", 1)[1]):
                s = s.strip().strip(";").strip()
                if 4 <= len(s.split()) <= 28 and re.fullmatch(r"[A-Za-z0-9 ,.;:'!?$%&/\-]+", s):
                    found.add(s)
    out = []
    for s in sorted(found):
        s = s[0].upper() + s[1:]
        if s[-1] not in ".!?":
            s += "."
        out.append(s)
    return out


_NAMES = (
    "Alice Bob Carla David Elena Frank Grace Henry Irene Jack Karen Leo Maria Nick Olga Peter Rosa Sam Tina "
    "Victor"
).split()
_CITIES = "Boston Denver Chicago Seattle Houston Portland Dallas Atlanta Miami Phoenix Austin Detroit".split()
_THINGS = "tickets chairs books apples boxes bottles lamps pencils shirts plates cups bikes".split()
_MONTHS = "January February March April May June July August September October November December".split()
_TITLES = ["Dr.", "Mr.", "Mrs.", "Ms.", "Prof."]
_SURNAMES = "Smith Jones Brown Miller Davis Wilson Moore Taylor Clark Lewis Walker Hall".split()


def template_sentences(n: int, seed: int = 0) -> list[str]:
    """`n` distinct sentences with numbers, dates, times, money, percentages, ordinals, years and
    abbreviations, drawn from fixed templates with a seeded generator."""
    r = random.Random(seed)

    def num():
        return r.choice(
            [str(r.randint(2, 99)), str(r.randint(100, 999)), f"{r.randint(1, 99)},{r.randint(0, 999):03d}"]
        )

    def date():
        y, m, d = r.randint(1950, 2035), r.randint(1, 12), r.randint(1, 28)
        return r.choice([f"{y}-{m:02d}-{d:02d}", f"{m}/{d}/{y}", f"{_MONTHS[m - 1]} {d}, {y}"])

    def time_():
        h, mi = r.randint(1, 12), r.choice([0, 5, 10, 15, 20, 30, 45, r.randint(1, 59)])
        return f"{h}:{mi:02d}" + r.choice(["", " a.m.", " p.m.", " AM", " PM"])

    def money():
        cur = r.choice(["$", "$", "£", "€"])
        return cur + r.choice(
            [
                str(r.randint(1, 999)),
                f"{r.randint(1, 99)}.{r.randint(1, 99):02d}",
                f"{r.randint(1, 9)},{r.randint(0, 999):03d}",
            ]
        )

    def pct():
        return r.choice([f"{r.randint(1, 99)}%", f"{r.randint(1, 20)}.{r.randint(1, 9)}%"])

    def ordinal():
        d = r.randint(1, 31)
        suf = "th" if 10 <= d % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(d % 10, "th")
        return f"{d}{suf}"

    def person():
        return r.choice([r.choice(_NAMES), f"{r.choice(_TITLES)} {r.choice(_SURNAMES)}"])

    templates = [
        lambda: f"The meeting with {person()} is on {date()} at {time_()}.",
        lambda: f"{r.choice(_NAMES)} bought {num()} {r.choice(_THINGS)} for {money()}.",
        lambda: f"Prices in {r.choice(_CITIES)} rose by {pct()} last year.",
        lambda: f"Please call {person()} before {time_()} tomorrow.",
        lambda: f"The train to {r.choice(_CITIES)} leaves at {time_()} from platform {r.randint(1, 12)}.",
        lambda: f"Our office opened in {r.randint(1890, 2020)} and moved on {date()}.",
        lambda: f"Is the report due on the {ordinal()} of {r.choice(_MONTHS)}?",
        lambda: f"The total came to {money()}, which is {pct()} more than we planned.",
        lambda: f"We sold {num()} {r.choice(_THINGS)} in the {r.randint(196, 201)}0s!",
        lambda: f"{person()} was born on {date()} in {r.choice(_CITIES)}.",
        lambda: f"Room {r.randint(100, 999)} is on the {ordinal()} floor; take the stairs.",
        lambda: f"About {pct()} of the {num()} voters said yes.",
        lambda: (
            f"The package weighs {r.randint(2, 80)}.{r.randint(1, 9)} pounds and costs {money()} to ship."
        ),
        lambda: (
            f"Wait, did {r.choice(_NAMES)} really pay {money()} for {r.randint(2, 9)} {r.choice(_THINGS)}?"
        ),
        lambda: f"Store hours: {time_()} to {time_()}, except on the {ordinal()}.",
        lambda: f"In {r.randint(1900, 2030)}, the town had {num()} people and {r.randint(2, 40)} schools.",
        lambda: f"Flight {r.randint(10, 999)} to {r.choice(_CITIES)} is delayed until {time_()}.",
        lambda: (
            f"{person()} scored {r.randint(50, 100)}% on the test, and {r.choice(_NAMES)} scored "
            f"{r.randint(40, 100)}%."
        ),
        lambda: f"Your appointment is {date()} at {time_()}; please arrive early.",
        lambda: f"The bill was {money()} plus a tip of {money()}.",
    ]
    out: set[str] = set()
    while len(out) < n:
        out.add(r.choice(templates)())
    return sorted(out)


def paragraphs(rows: list[dict], n: int, max_bytes: int, seed: int) -> list[dict]:
    """Up to `n` distinct multi-sentence rows (source "paragraph"): 2-4 of `rows` (each at most once per
    paragraph, in drawn order) joined by spaces, raw and normalized text alike, at most `max_bytes`
    UTF-8 bytes of normalized text: the chunks `tts synthesize` feeds the model (up to the bundle's
    `chunk_length`, 200 bytes), where training had single sentences. Drawn with their own seeded
    generator, so that the single-sentence corpus is the same with or without them."""
    r = random.Random(seed)
    out: dict[str, dict] = {}
    for _ in range(50 * n):
        if len(out) >= n or len(rows) < 2:
            break
        picked = r.sample(rows, r.randint(2, min(4, len(rows))))
        while len(picked) > 2 and len(" ".join(p["text"] for p in picked).encode()) > max_bytes:
            picked.pop()
        text = " ".join(p["text"] for p in picked)
        if len(text.encode()) <= max_bytes and text not in out:
            out[text] = {"source": "paragraph", "raw": " ".join(p["raw"] for p in picked), "text": text}
    return [out[t] for t in sorted(out)]


# ---- add-on corpus for fine-tuning the shipped model --------------------------------------------------
# Short utterances (1-4 words, with and without terminal punctuation) and everyday sentences whose last
# phrase varies (prices, "order of N things", "an" + a vowel-initial noun, lists, times, weekdays and
# dates at the end, phone-menu phrases, questions), plus a replay of the base corpus so that long
# reading is not forgotten. Never any text of the held-out evaluation (samples/eval/everyday.txt,
# samples/eval/heldout.txt): see `heldout_keys`.

_GREETINGS = [
    "Hello", "Hey", "Hi there", "Hey there", "Hello again", "Good morning", "Good afternoon",
    "Good evening", "Good night", "Morning", "Evening", "Welcome back", "Welcome home", "Howdy",
    "Greetings", "Bye", "Bye bye", "Goodbye for now", "See you", "See you later", "See you soon",
    "Take care", "Cheers", "Farewell", "Nice to meet you", "Hello everyone", "Hi everyone", "Hi folks",
    "Good to see you", "Long time no see", "Welcome aboard", "Safe travels", "Sleep well", "Sweet dreams",
    "Get well soon", "Happy holidays", "Happy new year", "Happy anniversary", "Happy Friday",
    "Merry Christmas", "Have a nice day", "Have fun", "Enjoy",
]  # fmt: skip
_REPLIES = [
    "Sure", "Okay then", "Alright", "All right", "Got it", "Thank you", "Thanks a lot", "Thank you so much",
    "Many thanks", "You're welcome", "No problem", "Of course", "Sounds good", "Great", "Perfect", "Fine",
    "Right", "Understood", "I see", "Absolutely", "Certainly", "Sorry", "I'm sorry", "Excuse me",
    "Pardon me", "Please", "Yes please", "No thanks", "No thank you", "Maybe", "Maybe later", "Not yet",
    "Never mind", "Exactly", "Agreed", "Done", "All done", "Ready", "I'm ready", "Wait", "Stop", "Help",
    "Well done", "Congratulations", "Good luck", "Bless you", "Good job", "Nice work", "One moment",
    "Just a second", "Hold on", "No", "Yeah", "Nope", "Yes indeed", "No way", "Not really",
    "Of course not", "I agree", "I don't know", "I think so", "I hope so", "Me too", "Same here", "Cool",
    "Awesome", "Wonderful", "Excellent", "Amazing", "Oops", "Wow", "Indeed", "Correct", "Wrong", "True",
    "False", "Enough", "Again", "Next", "Finished", "Cancel", "Confirm", "Continue", "Try again",
    "Not bad", "Fair enough", "Why not", "Good idea", "My pleasure", "Anytime", "Lunch is ready",
    "Coffee is ready", "It's done", "It works", "All good", "Almost there", "On my way", "Be right back",
]  # fmt: skip
_COMMANDS = [
    "Hurry up", "Come in", "Sit down", "Listen", "Look out", "Be careful", "Watch out", "Let's go",
    "Let me see", "Follow me", "Go ahead", "Keep going", "Come here", "Call me", "Wait here",
    "Open the door", "Close the window", "Turn it off", "Turn it on", "Read this", "Sign here",
    "Stay there", "Don't move", "Take a seat", "Slow down", "Speak up", "Look at this", "Pick one",
    "Try this", "Go left", "Turn right", "Press start", "Hang up", "Check again", "Lock the door",
]  # fmt: skip
_QUESTIONS = [
    "Are you sure", "Who is it", "What time is it", "Where are you", "Ready", "Really", "Why", "How much",
    "How many", "What's up", "How are you", "Can I help", "Is it done", "Anyone home", "Are you there",
    "What happened", "Any news", "Which one", "When", "Where", "Who", "What", "Are you okay",
    "Is that right", "Can you help me", "What's next", "Did it work", "Any questions", "Shall we",
    "Coffee or tea", "Ready to go", "What's your name", "How was it", "Is everything okay", "Where to",
    "How long", "How far", "Seriously", "Right now", "Is that all", "Need help", "Got a minute",
    "Can you hear me", "Do you copy", "Is anyone there", "Yes or no", "Which way",
]  # fmt: skip
_WORDS = (
    "Coffee Tea Water Music Pizza Breakfast Lunch Dinner Today Tonight Tomorrow Yesterday Weekend Apples "
    "Bread Milk Hospital Station Airport Kitchen Garden Window Umbrella Weather Traffic Schedule Password "
    "Message Email Receipt Invoice Delivery Ticket Library Office Meeting Appointment Holiday Vacation "
    "Doctor Teacher Family Friends Everyone Nobody Somebody Anything Everything Nothing Always Never "
    "Sometimes Definitely Probably Hopefully Actually Finally Quickly Slowly Quietly Carefully Beautiful "
    "Delicious Interesting Important Impossible Incredible Fantastic Terrible Brilliant Lovely Hungry "
    "Tired Busy Late Early Open Closed Left Up Down Forward North South East West Upstairs Downstairs "
    "Inside Outside Here There Now Later Soon Almost Attention Silence Action Surprise Cheese Dessert "
    "Elevator Exit Entrance Agent Operator Billing Support Sales Emergency Reception Checkout"
).split()
_WEEKDAYS = "Monday Tuesday Wednesday Thursday Friday Saturday Sunday".split()
_GROCERIES = (
    "milk eggs bread butter cheese rice pasta coffee tea sugar flour onions carrots potatoes tomatoes "
    "bananas oranges grapes yogurt cereal juice chicken beans lettuce peppers cookies soap napkins"
).split()
_UNITS = "pounds bags boxes bottles cans packs jars cartons kilos liters gallons loaves".split()
_AN_NOUNS = [
    "agent", "engineer", "email", "hour", "update", "order", "apple", "umbrella", "invoice", "account",
    "appointment", "error", "offer", "answer", "idea", "item", "envelope", "elevator", "exit", "airport",
    "office", "operator", "assistant", "alarm", "application", "estimate", "interview", "issue", "outage",
    "owner", "extra towel", "old friend", "open seat", "easy question", "early flight", "empty box",
    "honest mistake", "orange", "uncle", "electrician", "usher", "editor", "officer", "hour or two",
]  # fmt: skip
_A_NOUNS = [
    "manager", "technician", "receipt", "driver", "doctor", "nurse", "ticket", "table", "refund",
    "package", "parking spot", "new card", "quick question", "short delay", "message", "window seat",
]  # fmt: skip
_SENT = ["email", "invoice", "update", "estimate", "application", "envelope", "order", "alarm", "offer"]
_COMPANIES = [
    "Acme Bank", "City Water", "Blue Sky Airlines", "Green Valley Clinic", "Metro Gas",
    "North Star Insurance", "Sunrise Dental", "River Phone", "Harbor Hotel", "Pine Street Pharmacy",
    "Lakeside Library",
]  # fmt: skip
_LABELS = (
    "Room Gate Page Table Platform Chapter Number Level Floor Flight Bus Line Option Press Aisle".split()
)
_PLACES = "store bank pharmacy library museum pool gym bakery post office clinic cafe".split(" ")


def _words_key(text: str) -> str:
    """The words of a normalized text, lowercased, without punctuation: "Hi!" and "hi" share one key."""
    return " ".join(re.sub(r"[^a-z0-9']+", " ", text.lower()).split())


def heldout_keys() -> set[str]:
    """`_words_key` of every text of the held-out evaluation (samples/eval/everyday.txt and heldout.txt,
    normalized as the runtime does): no add-on text may have one of them, whatever its punctuation."""
    return {_words_key(t) for t in _heldout_norms()}


def short_texts(n: int, seed: int) -> list[str]:
    """`n` distinct short texts (1-4 words once normalized) as users type them: greetings,
    acknowledgements, single words, yes/no, names, numbers, short questions and commands, about a third
    without terminal punctuation and some in lower case. Seeded; held-out texts are never among them."""
    r = random.Random(seed)
    keys = heldout_keys()

    def name():
        return r.choice([r.choice(_NAMES), r.choice(_NAMES), f"{r.choice(_TITLES)} {r.choice(_SURNAMES)}"])

    def number():
        k = r.randint(1, 99) if r.random() < 0.7 else r.randint(100, 2030)
        return r.choice(
            [
                str(k),
                f"{r.choice(_LABELS)} {k}",
                f"{r.choice(_LABELS)} {k}",
                f"${r.randint(1, 99)}" + (f".{r.randint(0, 99):02d}" if r.random() < 0.3 else ""),
                f"{r.randint(1, 12)}:{r.choice([0, 15, 30, 45]):02d}" + r.choice(["", " a.m.", " p.m."]),
                f"{r.randint(1, 99)}%",
                f"{r.choice(_WEEKDAYS)}",
                f"{r.choice(_MONTHS)} {r.randint(1, 28)}",
                f"In {r.randint(2, 59)} minutes",
                f"{r.randint(2, 12)} hours",
            ]
        )

    kinds = [
        (0.22, lambda: r.choice(_WORDS + _NAMES + _CITIES)),
        (0.14, lambda: r.choice(_GREETINGS)),
        (0.16, lambda: r.choice(_REPLIES)),
        (0.14, lambda: r.choice(_QUESTIONS) + "?"),
        (0.06, lambda: r.choice(_COMMANDS)),
        (0.14, lambda: f"{r.choice(_GREETINGS + _REPLIES[:40])}, {name()}"),
        (0.04, lambda: r.choice([f"This is {name()}", f"{name()} here", f"Call {name()}", f"{name()}?"])),
        (0.10, number),
    ]
    weights = [w for w, _ in kinds]
    out: dict[str, None] = {}
    for _ in range(200 * n):
        if len(out) >= n:
            break
        text = r.choices(kinds, weights)[0][1]()
        q = text.endswith("?")
        text = text.rstrip("?")
        roll = r.random()
        if roll < 0.35:
            pass  # no terminal punctuation, as typed in a chat box
        elif q:
            text += "?"
        else:
            text += r.choice([".", ".", "!", "..."])
        if r.random() < 0.15:
            text = text.lower()
        if _short_ok(text, keys):
            out[text] = None
    return list(out)


def _short_ok(text: str, keys: set[str]) -> bool:
    from tts.text.normalize import TextError, normalize_text

    try:
        norm = normalize_text(text)
    except TextError:
        return False
    return 1 <= len(norm.split()) <= 4 and _words_key(norm) not in keys


def everyday_texts(n: int, seed: int, max_bytes: int = 200) -> list[str]:
    """`n` distinct everyday sentences of up to about 25 words (at most `max_bytes` once normalized)
    whose last phrase varies: prices inside longer sentences, "order of N things", "an" + vowel-initial
    nouns, lists ending "and N units of X", times "in N minutes", weekdays and dates at the end,
    phone-menu phrases, questions, "see you ...". Seeded; held-out texts are never among them."""
    from tts.text.normalize import TextError, normalize_text

    r = random.Random(seed)
    keys = heldout_keys()
    ch = r.choice

    def n_(lo: int = 1, hi: int = 20) -> str:
        k = r.randint(lo, hi) if r.random() < 0.8 else r.randint(lo, 10 * hi)
        return str(k) if r.random() < 0.6 else _NUMBER_WORDS.get(k, str(k))

    def money() -> str:
        return ch(["$", "$", "$", "£", "€"]) + ch(
            [f"{r.randint(1, 99)}.{r.randint(0, 99):02d}", str(r.randint(1, 500)), f"{r.randint(1, 9)}.99"]
        )

    def ordinal() -> str:
        d = r.randint(1, 31)
        return f"{d}{'th' if 10 <= d % 100 <= 20 else {1: 'st', 2: 'nd', 3: 'rd'}.get(d % 10, 'th')}"

    def day() -> str:  # a weekday and/or a date, the way a sentence ends with it
        return ch(
            [
                f"{ch(_WEEKDAYS)}, {ch(_MONTHS)} {ordinal()}",
                f"{ch(_WEEKDAYS)}",
                f"{ch(_MONTHS)} {ordinal()}",
                f"{ch(_WEEKDAYS)} the {ordinal()}",
                f"{ch(_WEEKDAYS)} morning",
                f"{ch(_WEEKDAYS)} afternoon",
                f"{ch(_WEEKDAYS)} at {time_()}",
            ]
        )

    def time_() -> str:
        return f"{r.randint(1, 12)}:{ch([0, 5, 10, 15, 20, 30, 45, 50]):02d}" + ch(["", " a.m.", " p.m."])

    def when() -> str:  # a final phrase of time
        return ch(
            [
                f"on {day()}",
                f"by {ch(_WEEKDAYS)}",
                f"in {n_(2, 59)} minutes",
                f"in {n_(2, 12)} hours",
                f"in about {n_(2, 30)} minutes",
                "in an hour",
                f"at {time_()}",
                f"at {time_()} on {ch(_WEEKDAYS)}",
                f"next {ch(_WEEKDAYS + ['week', 'month', 'year'])}",
                f"this {ch(['morning', 'afternoon', 'evening', 'weekend'])}",
                "tonight",
                "tomorrow morning",
                "later today",
                "right away",
                "as soon as possible",
                f"before {time_()}",
                f"within {n_(2, 10)} business days",
            ]
        )

    def things() -> str:
        return ch(_THINGS + ["bags of rice", "jars of honey", "notebooks", "towels", "packs of paper"])

    def an_noun() -> str:
        return f"an {ch(_AN_NOUNS)}"

    def grocery_list() -> str:
        a, b, c, d = r.sample(_GROCERIES, 4)
        return f"{a}, {b}, {c} and {n_(2, 6)} {ch(_UNITS)} of {d}"

    def person() -> str:
        return ch([ch(_NAMES), f"{ch(_TITLES)} {ch(_SURNAMES)}"])

    def of(*options: str) -> str:
        return ch(options)

    def weekday() -> str:
        return ch(_WEEKDAYS)

    def a_or_an() -> str:
        return ch([f"a {ch(_A_NOUNS)}", an_noun()])

    templates = [
        lambda: f"Your order of {n_()} {things()} costs {money()} and will arrive {when()}.",
        lambda: f"Your order of {n_()} {things()} has shipped and should arrive {when()}.",
        lambda: f"We received an order of {n_()} {things()} {when()}.",
        lambda: f"An order of {n_()} {things()} comes to {money()} with shipping.",
        lambda: f"The order of {n_()} {things()} will be ready for pickup {when()}.",
        lambda: f"{of('I', 'We', 'She', 'He', 'They')} ordered {n_()} {things()} for {money()}.",
        lambda: f"That comes to {money()}; would you like {of('a receipt', 'a bag', 'to pay by card')}?",
        lambda: f"Tickets cost {money()} for adults and {money()} for children under {n_(5, 16)}.",
        lambda: f"Add {money()} for shipping, and the total is {money()}.",
        lambda: (
            f"The {of('repair', 'taxi', 'dinner', 'room', 'course', 'jacket')} cost {money()} in the end."
        ),
        lambda: f"Please wait, {an_noun()} will be with you {of('shortly', 'in a moment', 'soon', when())}.",
        lambda: f"We sent you an {ch(_SENT)} {when()}.",
        lambda: f"There is {an_noun()} waiting for you at the {of('front desk', 'door', 'counter', 'gate')}.",
        lambda: f"I need {an_noun()} and {a_or_an()} for {of('the trip', 'tomorrow', 'the meeting', 'Sam')}.",
        lambda: (
            f"{of('She', 'He', 'Grace')} left {an_noun()} {of('on the bus', 'at the office', 'in the car')}."
        ),
        lambda: f"Can you get me {an_noun()}, please?",
        lambda: f"We need {grocery_list()}{of('', ' from the market', ' on the way home', ' for tonight')}.",
        lambda: (
            f"Please pick up {grocery_list()}{of('', ' after work', ' if they have any', ' for Saturday')}."
        ),
        lambda: f"The list says {grocery_list()}.",
        lambda: (
            f"{of('We will', 'She will', 'They will', 'The driver will', 'Dinner will')} be "
            f"{of('there', 'here', 'ready', 'back', 'home', 'done')} in {n_(2, 59)} "
            f"{of('minutes', 'minutes', 'hours', 'seconds')}."
        ),
        lambda: f"I'll be {of('back', 'home', 'ready', 'done', 'outside')} in {n_(2, 59)} minutes.",
        lambda: (
            f"The {of('bus', 'store', 'shuttle', 'show', 'game')} "
            f"{of('comes', 'closes', 'opens', 'starts', 'ends')} in {n_(2, 59)} minutes."
        ),
        lambda: f"Your appointment with {person()} is on {day()}.",
        lambda: f"The {of('meeting', 'call', 'class', 'party', 'interview')} moved to {time_()} on {day()}.",
        lambda: f"The package will arrive on {day()}.",
        lambda: f"{of('We', 'I', 'They')} fly to {ch(_CITIES)} on {day()}.",
        lambda: (
            f"Could you send me the {of('invoice', 'slides', 'photos', 'contract', 'notes', 'tickets')} by "
            f"{of(weekday(), 'tonight', 'noon', 'the end of the day')}?"
        ),
        lambda: (
            "See you "
            + of(
                f"on {weekday()}",
                "next week",
                "at noon",
                f"at {time_()}",
                "in the morning",
                "tonight",
                "this weekend",
                "at the station",
                "soon",
                "after lunch",
                f"on the {ordinal()}",
                f"in {ch(_MONTHS)}",
                f"later, {ch(_NAMES)}",
                "there",
            )  # fmt: skip
            + "."
        ),
        lambda: f"Thank you for calling {ch(_COMPANIES)}, {ch(_MENU)}.",
        lambda: f"{ch(_MENU).capitalize()}, and {ch(_MENU)}.",
        lambda: (
            f"Press {n_(1, 9)} for {of('billing', 'sales', 'support', 'a new account')}, or press "
            f"{n_(1, 9)} for {of('appointments', 'an operator', 'an agent', 'anything else')}."
        ),
        lambda: f"Your estimated wait time is {n_(2, 30)} minutes.",
        lambda: (
            f"Please {of('call me back', 'text me', 'email me', 'let me know')} "
            f"{of('when you get a chance', 'after lunch', 'before five', 'as soon as you can', when())}."
        ),
        lambda: (
            f"Don't forget to {of('pay the rent', 'water the plants', 'call your mother', 'feed the cat')} "
            f"{when()}."
        ),
        lambda: (
            f"It's going to {of('snow', 'be sunny', 'be windy', 'be cold', 'storm', 'rain')} "
            f"{of('tonight', 'this afternoon', f'on {weekday()}', 'later')}, so "
            f"{of('bring a jacket', 'wear boots', 'take a hat', 'drive carefully', 'stay inside')}."
        ),
        lambda: (
            f"Turn {of('left', 'right')} at the {of('bank', 'church', 'gas station', 'corner')}, then "
            f"{of('go straight', 'keep going', 'drive')} for {n_(2, 9)} {of('blocks', 'miles', 'minutes')}."
        ),
        lambda: (
            f"The {of('train', 'bus', 'ferry', 'flight')} to {ch(_CITIES)} leaves from "
            f"{of('platform', 'gate', 'stop', 'pier')} {n_(1, 30)} at {time_()}"
            f"{of('', ' tonight', ' in the evening', f' on {weekday()}')}."
        ),
        lambda: f"What time does the {ch(_PLACES)} open on {weekday()}?",
        lambda: f"How much does {a_or_an()} cost?",
        lambda: f"Is {person()} coming to the {of('party', 'meeting', 'game', 'dinner')} on {weekday()}?",
        lambda: f"Do you want {ch(_GROCERIES)} or {ch(_GROCERIES)}?",
        lambda: f"Have you seen my {of('keys', 'phone', 'glasses', 'wallet', 'umbrella', 'charger')}?",
        lambda: f"Would you like {a_or_an()} with that?",
        lambda: f"{ch(_NAMES)} will meet you at the {ch(_PLACES)} {when()}.",
        lambda: f"The {ch(_PLACES)} is open from {time_()} to {time_()}.",
        lambda: f"{of('Hi', 'Hello', 'Hey')} {ch(_NAMES)}, {of('are you free', 'can we talk')} {when()}?",
    ]
    out: dict[str, None] = {}
    for _ in range(50 * n):
        if len(out) >= n:
            break
        text = ch(templates)()
        text = text[:-1] if text.endswith("..") else text  # ("... at 5 p.m.")
        try:
            norm = normalize_text(text)
        except TextError:
            continue
        if len(norm.split()) <= 25 and len(norm.encode()) <= max_bytes and _words_key(norm) not in keys:
            out[text] = None
    return list(out)


_TH_NUMBERS = [3, 13, 30, 33, 3000, 300, 23, 31, 36]  # (three, thirteen, thirty, ...: /θ/ after a weak word)
_TH_WORDS = [
    "thanks", "things", "thoughts", "thunder", "theater", "therapy", "theory", "thumb", "thread", "throat",
    "thistle", "thermos", "thimble", "thicket", "thousand", "thriller", "throne", "theme", "thief", "thorn",
]  # fmt: skip
_AN_PEOPLE = [
    "agent", "officer", "engineer", "assistant", "operator", "usher", "editor", "advisor", "analyst",
    "architect", "artist", "actor", "attendant", "inspector", "intern", "expert", "organizer", "umpire",
    "electrician", "employee", "instructor", "auditor", "official", "announcer", "escort", "agent",
]  # fmt: skip


def _sentences(templates: list, n: int, r: random.Random, max_bytes: int, keys: set[str]) -> list[str]:
    """`n` distinct texts drawn from `templates` (callables) with `r`: each of 6 to 25 words and at most
    `max_bytes` once normalized, none whose words are a held-out text's (`keys`); fewer where 50 x `n`
    draws do not find them."""
    from tts.text.normalize import TextError, normalize_text

    out: dict[str, None] = {}
    for _ in range(50 * n):
        if len(out) >= n:
            break
        text = r.choice(templates)()
        try:
            norm = normalize_text(text)
        except TextError:
            continue
        if 6 <= len(norm.split()) <= 25 and len(norm.encode()) <= max_bytes and _words_key(norm) not in keys:
            out[text] = None
    return list(out)


def weak_texts(n: int, seed: int, max_bytes: int = 200) -> list[str]:
    """`n` distinct sentences of 8 to 25 words whose weak words carry the meaning: "and an" / "with an"
    / "for an" before a vowel-initial noun in the middle of a longer sentence ("... and an officer will
    ..."), and /θ/ after an unstressed word ("of three", "of thirty", "the third", "some thread"), each
    followed by more words. Seeded; held-out texts are never among them."""
    r = random.Random(seed)
    keys = heldout_keys()
    ch = r.choice

    def num() -> str:
        k = ch(_TH_NUMBERS) if r.random() < 0.8 else r.randint(2, 40)
        return str(k) if r.random() < 0.5 else _NUMBER_WORDS.get(k, str(k))

    def an() -> str:
        return f"an {ch(_AN_PEOPLE + _AN_NOUNS)}"

    def an_person() -> str:
        return f"an {ch(_AN_PEOPLE)}"

    def lead() -> str:  # a clause before the weak phrase, so that it is not at the start
        return ch(
            [
                f"Thank you for {ch(['waiting', 'calling', 'your patience', 'holding'])}",
                f"Please {ch(['hold', 'stay on the line', 'wait here', 'take a seat', 'sign in'])}",
                f"Your {ch(['call', 'visit', 'request', 'order', 'ticket'])} matters to us",
                f"We are {ch(['sorry for the delay', 'open late today', 'almost there', 'right here'])}",
                f"{ch(_NAMES)} called {ch(['this morning', 'again', 'twice', 'from the office'])}",
                "The line is busy",
                "The office is closed",
                f"It is {ch(['raining', 'late', 'early', 'quiet'])} {ch(['today', 'tonight', 'now'])}",
            ]
        )

    def will() -> str:
        return ch(
            [
                "will be with you shortly",
                "will call you back",
                "will help you soon",
                "will take your call",
                "will meet you there",
                "will answer in a moment",
                "will be right with you",
                "will check on it",
                "is on the way",
                "is waiting downstairs",
                "can see you now",
                "has your file",
            ]
        )

    def end() -> str:
        return ch(["", f" {ch(['today', 'tomorrow', 'tonight', 'this week', 'on ' + ch(_WEEKDAYS)])}"])

    templates = [
        lambda: f"{lead()}, and {an_person()} {will()}.",
        lambda: f"{lead()} and {an_person()} {will()}{end()}.",
        lambda: (
            f"{lead()}, {ch(['please', 'then', 'so'])} {ch(['wait', 'hold', 'stay'])} and "
            f"{an_person()} {will()}."
        ),
        lambda: (
            f"We will send {an_person()} and {ch(['a driver', 'a nurse', 'a manager'])} "
            f"{end().strip() or 'soon'}."
        ),
        lambda: f"She came with {an()} and left with {an()}{end()}.",
        lambda: (
            f"I asked for {an()}, and they sent {an_person()} {ch(['instead', 'as well', 'right away'])}."
        ),
        lambda: f"There was {an()} and {an()} at the {ch(_PLACES)}{end()}.",
        lambda: f"He works as {an_person()} for {ch(_COMPANIES)} in {ch(_CITIES)}.",
        lambda: (
            f"Is there {an_person()} {ch(['here', 'nearby', 'on duty', 'we can ask'])} "
            f"{ch(['today', 'now', 'tonight'])}?"
        ),
        lambda: f"It took {ch(['about', 'almost', 'more than', 'less than'])} an hour and {an()} to fix it.",
        lambda: (
            f"Your order of {num()} {ch(_THINGS)} "
            f"{ch(['is ready', 'has shipped', 'was delayed', 'is on hold'])}{end()}."
        ),
        lambda: (
            f"A box of {num()} {ch(_THINGS)} costs {ch(['$', '$', '€'])}{r.randint(2, 99)}."
            f"{r.randint(0, 99):02d} {ch(['today', 'online', 'at the store', 'with tax'])}."
        ),
        lambda: (
            f"One of {num()} {ch(_THINGS)} {ch(['was broken', 'is missing', 'came late', 'looks wrong'])}, "
            f"so we {ch(['sent another', 'called them', 'gave a refund'])}."
        ),
        lambda: (
            f"We have a set of {num()} {ch(_THINGS)} and {num()} {ch(_THINGS)} "
            f"{ch(['left', 'in stock', 'for you'])}."
        ),
        lambda: (
            f"{ch(['Take', 'Bring', 'Buy', 'Order'])} {num()} {ch(_THINGS)} and {num()} {ch(_THINGS)} "
            f"{ch(['for the party', 'for the trip', 'by Friday', 'on the way home'])}."
        ),
        lambda: (
            f"The {ch(['meeting', 'class', 'party', 'visit'])} is on the third of {ch(_MONTHS)} at "
            f"{r.randint(1, 12)} {ch(['a.m.', 'p.m.', 'sharp'])}."
        ),
        lambda: (
            f"{ch(['Turn', 'Go', 'Walk'])} {ch(['left', 'right'])} at the third "
            f"{ch(['light', 'corner', 'stop sign', 'door'])} and "
            f"{ch(['wait there', 'keep going', 'call me'])}."
        ),
        lambda: (
            f"{ch(['Thanks', 'Thank you'])} for the {ch(_TH_WORDS)}, it "
            f"{ch(['helped a lot', 'was lovely', 'came just in time'])}."
        ),
        lambda: (
            f"I think the {ch(_TH_WORDS)} {ch(['is', 'was'])} "
            f"{ch(['in the car', 'on the table', 'at home', 'gone'])}, "
            f"{ch(['but check again', 'so look there', 'I think'])}."
        ),
        lambda: (
            f"We drove through {ch(_CITIES)} on {ch(_WEEKDAYS)} and "
            f"{ch(['stopped for lunch', 'saw the lake', 'met a friend'])}."
        ),
        lambda: (
            f"{ch(['Three', 'Thirty', 'Thirteen'])} {ch(_THINGS)} "
            f"{ch(['arrived', 'are waiting', 'were sold'])} "
            f"{ch(['this morning', 'on Thursday', 'last night', 'in an hour'])}."
        ),
        lambda: f"Please bring {num()} {ch(_THINGS)} and {an()} to the {ch(_PLACES)} on Thursday.",
        lambda: (
            f"The {ch(['bill', 'total', 'ticket', 'fee'])} for {num()} {ch(_THINGS)} is {ch(['$', '£'])}"
            f"{r.randint(3, 90)}.{r.randint(0, 99):02d}, and it "
            f"{ch(['includes tax', 'is due Thursday', 'ships free'])}."
        ),
    ]
    return _sentences(templates, n, r, max_bytes, keys)


_GLUE_SUBJECTS = [
    "my sister", "the driver", "our neighbor", "the kids", "a friend of mine", "the manager", "she", "he",
    "we", "they", "my uncle", "the nurse", "the new intern", "our teacher", "the old man", "her brother",
]  # fmt: skip
_GLUE_VERBS = [
    ("bought", "buy"), ("brought", "bring"), ("found", "find"), ("packed", "pack"), ("ordered", "order"),
    ("carried", "carry"), ("lost", "lose"), ("picked up", "pick up"), ("sent", "send"), ("left", "leave"),
    ("fixed", "fix"), ("cleaned", "clean"), ("needed", "need"), ("asked for", "ask for"), ("sold", "sell"),
    ("borrowed", "borrow"), ("wrapped", "wrap"), ("moved", "move"), ("painted", "paint"), ("hid", "hide"),
]  # fmt: skip
_GLUE_NOUNS = [
    "lamp", "chair", "coat", "bag", "book", "cake", "map", "key", "box", "cup", "plate", "ticket", "shirt",
    "pen", "desk", "bike", "rug", "jar", "card", "phone", "radio", "clock", "hat", "sandwich", "candle",
]  # fmt: skip
_GLUE_AN = [
    "apple", "orange", "egg", "envelope", "umbrella", "onion", "oven", "ax", "iron", "eraser", "igloo",
    "inch", "owl", "ostrich", "easel", "outfit", "album", "anchor", "engine", "atlas", "ice cube", "hour",
    "old coat", "empty jar", "extra key", "open box", "odd sock", "ugly lamp", "early train", "icy road",
]  # fmt: skip
_GLUE_PLACES = [
    "kitchen", "garage", "car", "office", "hallway", "closet", "garden", "basement", "attic", "drawer",
    "shed", "lobby", "train", "bus", "shop", "park",
]  # fmt: skip
_GLUE_AN_PLACES = ["office", "attic", "airport", "inn", "empty room", "old barn", "open field", "elevator"]
_GLUE_DRINKS = ["tea", "coffee", "milk", "water", "juice", "soup", "cocoa"]
_GLUE_CLOCK = ["a.m.", "p.m.", "o'clock"]


def glue_texts(n: int, seed: int, max_bytes: int = 200) -> list[str]:
    """`n` distinct sentences of 6 to 25 words in which short unstressed words sit between content
    words in many constructions: articles after conjunctions and prepositions ("and an egg", "or a
    map", "in an old barn", "of the keys"), numbers after "and" ("and two cups"), pronouns and "it"
    after "and" ("and I", "and it"), in lists, pairs, prepositional phrases and questions, each with
    words after it. Seeded; held-out texts are never among them."""
    r = random.Random(seed)
    keys = heldout_keys()
    ch = r.choice

    def num() -> str:
        k = r.randint(2, 12) if r.random() < 0.7 else ch(_TH_NUMBERS + [20, 40, 50, 100])
        return str(k) if r.random() < 0.4 else _NUMBER_WORDS.get(k, str(k))

    def a() -> str:  # a noun phrase with a short determiner
        return ch(
            [
                f"a {ch(_GLUE_NOUNS)}",
                f"an {ch(_GLUE_AN)}",
                f"an {ch(_GLUE_AN)}",
                f"the {ch(_GLUE_NOUNS + _GLUE_AN)}",
                f"{num()} {plural(ch(_GLUE_NOUNS))}",
                f"{num()} {ch(_UNITS)} of {ch(_GROCERIES)}",
                f"a cup of {ch(_GLUE_DRINKS)}",
                f"a bag of {ch(_GROCERIES)}",
                f"one of the {plural(ch(_GLUE_NOUNS))}",
                f"two of the {plural(ch(_GLUE_NOUNS))}",
                f"some {ch(_GROCERIES)}",
                f"his {ch(_GLUE_NOUNS)}",
                f"her {ch(_GLUE_AN)}",
                f"an {ch(_AN_NOUNS)}",
            ]
        )

    def pp() -> str:  # a short preposition and article before a place
        return ch(
            [
                f"in the {ch(_GLUE_PLACES)}",
                f"in {art(ch(_GLUE_PLACES))}",
                f"in an {ch(_GLUE_AN_PLACES)}",
                f"at an {ch(_GLUE_AN_PLACES)}",
                f"at the {ch(_GLUE_PLACES + _PLACES)}",
                f"on a {ch(['shelf', 'table', 'bench', 'chair', 'tray'])}",
                f"to the {ch(_PLACES)}",
                f"from an {ch(_GLUE_AN_PLACES)}",
                f"by a {ch(['window', 'door', 'tree', 'wall'])}",
                f"near an {ch(_GLUE_AN_PLACES)}",
                f"for an {ch(['hour', 'aunt', 'uncle', 'artist', 'old friend', 'event'])}",
                f"for a {ch(['friend', 'week', 'party', 'neighbor', 'trip'])}",
            ]
        )

    def tail() -> str:
        return ch(
            [
                "",
                " today",
                " this morning",
                f" on {ch(_WEEKDAYS)}",
                " before lunch",
                " after work",
                " last night",
                " in a hurry",
                " for the trip",
                f" at {r.randint(1, 12)} {ch(_GLUE_CLOCK)}",
            ]
        )

    def subj() -> str:
        s = ch(_GLUE_SUBJECTS + _NAMES)
        return s[0].upper() + s[1:]

    def conj() -> str:
        return ch(["and", "and", "and", "or", "with", "but not", "as well as", "and then"])

    def art(noun: str) -> str:  # the noun with its indefinite article
        return f"{'an' if noun[0] in 'aeiou' or noun.startswith('hour') else 'a'} {noun}"

    def plural(noun: str) -> str:
        return noun + ("es" if noun.endswith(("x", "ch", "sh", "s")) else "s")

    def verb() -> tuple[str, str]:
        return ch(_GLUE_VERBS)

    templates = [
        lambda: f"{subj()} {verb()[0]} {a()} {conj()} {a()} {pp()}{tail()}.",
        lambda: f"{subj()} {verb()[0]} {a()}, {a()} and {a()} {pp()}.",
        lambda: f"{subj()} {verb()[0]} {a()} {pp()} and {verb()[0]} {a()}{tail()}.",
        lambda: f"There is {a()} and {a()} {pp()}{tail()}.",
        lambda: f"There was {a()} {pp()} and {a()} {pp()}.",
        lambda: f"Can you {verb()[1]} {a()} and {a()} {pp()}{tail()}?",
        lambda: f"Did you {verb()[1]} {a()} or {a()}{tail()}?",
        lambda: f"Please {verb()[1]} {a()} {conj()} {a()}{tail()}.",
        lambda: f"I need {a()} and {a()} for {a()}{tail()}.",
        lambda: f"{subj()} gave {a()} to {ch(_NAMES)} and {a()} to {ch(_NAMES)}{tail()}.",
        lambda: (
            f"It was {ch(['an old', 'an odd', 'an easy', 'a long', 'a cold', 'an early'])} "
            f"{ch(['day', 'trip', 'night', 'week', 'game'])} and "
            f"{ch(['an awful', 'an endless', 'an odd', 'a short', 'a quiet', 'an honest'])} "
            f"{ch(['ride', 'talk', 'end', 'wait'])}."
        ),
        lambda: (
            f"{subj()} {ch(['works as', 'worked as', 'met', 'called'])} "
            f"{art(ch(_AN_PEOPLE + ['nurse', 'driver', 'teacher']))} and "
            f"{art(ch(_AN_PEOPLE + ['cook', 'singer', 'pilot']))}{tail()}."
        ),
        lambda: f"We waited for an hour and {num()} minutes {pp()}{tail()}.",
        lambda: (
            f"{subj()} put {a()} in the {ch(_GLUE_PLACES)} and {a()} on the "
            f"{ch(['table', 'shelf', 'floor', 'bed'])}."
        ),
        lambda: (
            f"Add {num()} {ch(_UNITS)} of {ch(_GROCERIES)} and {num()} {ch(_UNITS)} of "
            f"{ch(_GROCERIES)} to the {ch(['list', 'cart', 'order', 'soup'])}{tail()}."
        ),
        lambda: (
            f"{subj()} called, and {ch(['I', 'it', 'he', 'she', 'we', 'an agent', 'an officer'])} "
            f"{ch(['said', 'will call', 'went', 'came'])} {ch(['back', 'over', 'home', 'in'])}{tail()}."
        ),
        lambda: (
            f"Open {a()} and {ch(['it', 'that', 'one more'])} "
            f"{ch(['will help', 'should do', 'is enough', 'helps a lot'])}{tail()}."
        ),
        lambda: (
            f"{subj()} {verb()[0]} it and "
            f"{ch([art(ch(_GLUE_NOUNS + _GLUE_AN)), 'the ' + ch(_GLUE_NOUNS + _GLUE_AN)])} "
            f"{ch(['as well', 'too', 'for me', 'in a box'])}."
        ),
        lambda: (
            f"Between {r.randint(1, 11)} and {r.randint(2, 12)} {ch(['a.m.', 'p.m.'])} "
            f"{ch(['the shop is open', 'we are out', 'the line is busy', 'I am at an event'])}."
        ),
        lambda: (
            f"{subj()} took {ch(['one', 'two', 'a few', 'all'])} of {ch(['the', 'her', 'his', 'our'])} "
            f"{plural(ch(_GLUE_NOUNS))} and {ch(['left', 'ran', 'smiled', 'sat down'])}{tail()}."
        ),
    ]
    return _sentences(templates, n, r, max_bytes, keys)


_NUMBER_WORDS = dict(
    enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen "
        "sixteen seventeen eighteen nineteen twenty".split()
    )
)
_MENU = [
    "your call is important to us",
    "please listen carefully as our options have changed",
    "please hold and the next available agent will take your call",
    "all of our agents are busy right now",
    "calls may be recorded for training purposes",
    "you can also visit our website",
    "an operator will answer in a moment",
    "stay on the line to speak with an agent",
    "press zero at any time to return to the main menu",
    "we will call you back within the hour",
    "our office is open Monday to Friday",
]


def build_addon(
    work: Path,
    base: Path,
    n_short: int,
    n_everyday: int,
    n_replay: int,
    n_paragraphs: int,
    seed: int,
    n_weak: int = 0,
    n_glue: int = 0,
) -> None:
    """The add-on corpus in work/sentences.jsonl (then `synth` and `encode` as for any corpus): the
    sentences of samples/eval/heldout.txt (split "heldout": train.py's held-out loss), `n_short` short
    and `n_everyday` everyday utterances (`short_texts`, `everyday_texts`: normalized and phonemized
    exactly as the runtime prompts them, so a text without terminal punctuation gets the runtime's full
    stop), spoken by the base corpus's teacher and speakers
    (speaker 0 with its DEFAULT_SPEAKER_SHARE), and a replay of `n_replay` base training utterances, of
    which `n_paragraphs` are paragraphs, as the base corpus has them (voice, jitter). Seeded. Raises
    SystemExit when a row would have a held-out text."""
    from tts.text.normalize import normalize_text
    from tts.text.phonemes import PhonemeFrontend

    base_rows = read_utterances(base)  # (`text --paragraphs N --teacher T` of the model's corpus)
    teacher = base_rows[0].get("teacher", "espeak")
    keys = heldout_keys()
    r = random.Random(seed)
    singles = [u for u in base_rows if u["split"] == "train" and u["source"] != "paragraph"]
    multi = [u for u in base_rows if u["split"] == "train" and u["source"] == "paragraph"]
    if not 0 <= n_paragraphs <= min(n_replay, len(multi)) or n_replay - n_paragraphs > len(singles):
        raise SystemExit(
            f"--replay {n_replay} with --replay-paragraphs {n_paragraphs}: the base has {len(singles)} "
            f"single sentences and {len(multi)} paragraphs to replay"
        )
    frontend = PhonemeFrontend()
    held_phonemes = {_phoneme_key(p) for p in frontend.sentences(_heldout_norms())}
    replay = r.sample(singles, n_replay - n_paragraphs) + r.sample(multi, n_paragraphs)
    replay = [
        u
        for u in replay
        if _words_key(u["text"]) not in keys and _phoneme_key(u["phonemes"]) not in held_phonemes
    ]
    new = [("short", t) for t in short_texts(n_short, seed + 10)]
    new += [("everyday", t) for t in everyday_texts(n_everyday, seed + 11)]
    new += [("weak", t) for t in weak_texts(n_weak, seed + 12)]
    new += [("glue", t) for t in glue_texts(n_glue, seed + 13)]
    norms = [normalize_text(t) for _, t in new]
    phonemes = frontend.sentences(norms)  # (the runtime's frontend: a full stop where none is)
    # The held-out rows are samples/eval/heldout.txt itself, spoken as build_text speaks its held-out
    # sentences (speaker 0, no jitter): a base rebuilt with another normalizer holds out other sentences.
    held_text = _heldout_norms(everyday=False)
    utts = [
        _utterance(
            {"source": "heldout", "raw": t, "text": t, "phonemes": ph, "split": "heldout"},
            0,
            r,
            teacher,
            False,
        )
        for t, ph in zip(held_text, frontend.sentences(held_text), strict=True)
    ]
    added = []
    for (source, raw), norm, ph in zip(new, norms, phonemes, strict=True):
        if _phoneme_key(ph) in held_phonemes:
            continue  # ("Okay." reads as the held-out "OK")
        row = {"source": source, "raw": raw, "text": norm, "phonemes": ph, "split": "train"}
        spk = 0 if r.random() < DEFAULT_SPEAKER_SHARE else r.randrange(1, len(SPEAKERS))
        added.append(_utterance(row, spk, r, teacher))
    train = added + [{**u, "base_id": u["id"]} for u in replay]
    r.shuffle(train)
    utts += train
    bad = [
        u["raw"]
        for u in train
        if _words_key(u["text"]) in keys or _phoneme_key(u["phonemes"]) in held_phonemes
    ]
    if bad:
        raise SystemExit(f"held-out texts in the add-on corpus: {bad[:5]}")
    for i, u in enumerate(utts):
        u["id"] = i
    work.mkdir(parents=True, exist_ok=True)
    with open(work / "sentences.jsonl", "w") as f:
        for u in utts:
            f.write(json.dumps(u) + "\n")
    counts = {
        k: sum(u["source"] == k for u in train) for k in ("short", "everyday", "weak", "glue", "paragraph")
    }
    log(
        f"wrote {len(utts)} utterances to {work / 'sentences.jsonl'}: {len(held_text)} held out, "
        f"{counts['short']} short, {counts['everyday']} everyday, {counts['weak']} weak, "
        f"{counts['glue']} glue, "
        f"{len(replay)} replayed "
        f"({counts['paragraph']} paragraphs)"
    )


def _heldout_norms(everyday: bool = True) -> list[str]:
    """Every text of samples/eval/heldout.txt (and, with `everyday`, of everyday.txt), normalized as the
    runtime does."""
    from tts_tools.evaluate import EVERYDAY, HELDOUT, read_sentences

    from tts.text.normalize import normalize_text

    paths = (HELDOUT, EVERYDAY) if everyday else (HELDOUT,)
    return [normalize_text(t) for path in paths for t in read_sentences(path, None)]


def _phoneme_key(phonemes: str) -> str:
    """Phonemes without punctuation, stress marks or spaces: what no add-on text may share with a
    held-out text ("Okay" and "OK" read alike)."""
    return re.sub(r"[\s.,;:!?…\"'()\[\]\-ˈˌ]+", "", phonemes)


def build_text(
    work: Path,
    n_templates: int,
    seed: int,
    n_paragraphs: int = 0,
    max_bytes: int = 200,
    teacher: str = "espeak",
) -> None:
    from tts.text.normalize import TextError, normalize_text
    from tts.text.phonemes import PhonemeFrontend

    frontend = PhonemeFrontend()
    raw = [("wordnet", s) for s in wordnet_sentences()] + [
        ("template", s) for s in template_sentences(n_templates, seed)
    ]
    rows, seen = [], set()
    for source, s in raw:
        try:
            norm = normalize_text(s)
        except TextError:
            continue
        if norm in seen or not re.fullmatch(r"[A-Za-z0-9 ,.;:'!?\-]+", norm):
            continue
        seen.add(norm)
        rows.append({"source": source, "raw": s, "text": norm})
    log(f"{len(rows)} distinct sentences ({sum(r['source'] == 'template' for r in rows)} from templates)")
    r = random.Random(seed)
    r.shuffle(rows)
    # Held-out evaluation sentences: 6+ words, never used for training (48 WordNet + 12 template).
    held, train = [], []
    want = {"wordnet": HELDOUT * 4 // 5, "template": HELDOUT - HELDOUT * 4 // 5}
    for row in rows:
        if want.get(row["source"], 0) > 0 and len(row["text"].split()) >= 6:
            want[row["source"]] -= 1
            held.append(row)
        else:
            train.append(row)
    multi = paragraphs(train, n_paragraphs, max_bytes, seed + 1)  # (training sentences only)
    if multi:
        log(f"{len(multi)} paragraphs of 2-4 training sentences, at most {max_bytes} bytes")
    phonemes = frontend.phonemize_batch([row["text"] for row in held + train + multi])
    utts = []
    for i, row in enumerate(held + train + multi):
        row["phonemes"] = phonemes[i]
        row["split"] = "heldout" if i < len(held) else "train"
    for row in held:  # held-out sentences are spoken by the default speaker (the espeak reference)
        utts.append(_utterance(row, 0, r, teacher, jitter=False))
    for row in train:
        spk = 0 if r.random() < DEFAULT_SPEAKER_SHARE else r.randrange(1, len(SPEAKERS))
        utts.append(_utterance(row, spk, r, teacher))
        if r.random() < SECOND_READING_SHARE:
            other = r.choice([s for s in range(len(SPEAKERS)) if s != spk])
            utts.append(_utterance(row, other, r, teacher))
    rp = random.Random(seed + 2)  # (paragraph speakers: the single-sentence utterances stay as they were)
    for row in multi:
        utts.append(
            _utterance(
                row, 0 if rp.random() < DEFAULT_SPEAKER_SHARE else rp.randrange(1, len(SPEAKERS)), rp, teacher
            )
        )
    for i, u in enumerate(utts):
        u["id"] = i
    work.mkdir(parents=True, exist_ok=True)
    with open(work / "sentences.jsonl", "w") as f:
        for u in utts:
            f.write(json.dumps(u) + "\n")
    log(f"wrote {len(utts)} utterances ({len(held)} held out) to {work / 'sentences.jsonl'}")


def _utterance(row: dict, speaker: int, r: random.Random, teacher: str, jitter: bool = True) -> dict:
    """`row` spoken by `speaker` of `teacher`, with a jittered rate and pitch. Both teachers draw the
    same two numbers, so one seed gives the same texts and speakers whichever teacher speaks them."""
    d_rate = r.randint(-10, 10) if jitter else 0
    d_pitch = r.randint(-4, 4) if jitter else 0
    if teacher == "flite":
        spk = FLITE_SPEAKERS[speaker]
        return {
            **row,
            "speaker": speaker,
            "teacher": "flite",
            "voice": spk["voice"],
            "stretch": round(spk["stretch"] * (1 - d_rate / 165), 3),  # espeak's +-10 of 165 words/min
            "f0": spk["f0"] + 3 * d_pitch if spk["f0"] else 0,
        }
    spk = SPEAKERS[speaker]
    return {
        **row,
        "speaker": speaker,
        "voice": spk["voice"],
        "rate": spk["rate"] + d_rate,
        "pitch": spk["pitch"] + d_pitch,
    }


def read_utterances(work: Path) -> list[dict]:
    with open(work / "sentences.jsonl") as f:
        return [json.loads(line) for line in f]


# ---- synthesis -------------------------------------------------------------------------------------


def espeak(text: str, voice: str, rate: int, pitch: int):
    """Speak `text` with the espeak-ng binary (`tts_tools.evaluate.espeak_audio`); returns float32 mono audio
    at 22050 Hz."""
    audio, sr = espeak_audio(text, voice, rate, pitch)
    if sr != 22050:
        raise RuntimeError(f"espeak-ng wrote {sr} Hz, expected 22050")
    return audio


def flite(text: str, voice: str, stretch: float = 1.0, f0: int = 0):
    """Speak `text` with the flite binary (`tts_tools.evaluate.flite_audio`: `voice` one of `flite -lv`,
    durations scaled by `stretch`, mean pitch `f0` Hz or the voice's own), resampled by torchaudio to float32
    mono audio at 22050 Hz."""
    import torch
    import torchaudio

    audio, sr = flite_audio(text, voice, stretch, f0)
    return torchaudio.functional.resample(torch.from_numpy(audio), sr, 22050).numpy()


def speak(u: dict):
    """The audio (float32 at 22050 Hz) of utterance row `u` by its teacher (espeak-ng unless the row
    names flite)."""
    if u.get("teacher") == "flite":
        return flite(u["text"], u["voice"], u["stretch"], u["f0"])
    return espeak(u["text"], u["voice"], u["rate"], u["pitch"])


def _synth_shard(args: tuple[Path, int, list[dict]]) -> str:
    import torch

    torch.set_num_threads(1)
    from tts.codec.mel import LogMel

    work, shard, utts = args
    path = work / "shards" / f"mel-{shard:04d}.pt"
    if path.exists():
        return f"shard {shard} exists"
    logmel = LogMel()
    mels, ids, seconds = [], [], []
    for u in utts:
        audio = speak(u)
        mels.append(logmel(torch.from_numpy(audio)).to(torch.float16))
        ids.append(u["id"])
        seconds.append(len(audio) / 22050)
    tmp = path.with_suffix(".tmp")
    torch.save({"ids": ids, "seconds": seconds, "mels": mels}, tmp)
    os.replace(tmp, path)
    return f"shard {shard}: {len(utts)} clips, {sum(seconds) / 3600:.2f} h"


def synth(work: Path, jobs: int, max_utterances: int | None) -> None:
    from multiprocessing import Pool

    utts = read_utterances(work)[:max_utterances]
    (work / "shards").mkdir(parents=True, exist_ok=True)
    tasks = [(work, i // SHARD_SIZE, utts[i : i + SHARD_SIZE]) for i in range(0, len(utts), SHARD_SIZE)]
    t0 = time.time()
    with Pool(jobs) as pool:
        for k, msg in enumerate(pool.imap_unordered(_synth_shard, tasks), 1):
            log(f"[{k}/{len(tasks)}] {msg} ({time.time() - t0:.0f} s)")


def load_shards(work: Path, max_utterances: int | None = None):
    import torch

    n_shards = math.ceil(max_utterances / SHARD_SIZE) if max_utterances else None
    for path in sorted((work / "shards").glob("mel-*.pt"))[:n_shards]:
        yield path, torch.load(path)


# ---- codec -----------------------------------------------------------------------------------------


def fit_codec(
    work: Path,
    num_codebooks: int,
    codebook_size: int,
    sample_frames: int,
    iters: int,
    seed: int,
    max_utterances: int | None,
    device: str = "cpu",
) -> None:
    """The k-means codec (`tts.codec.melrvq`) into work/codec (the learned one: train_codec.py)."""
    import torch

    from tts.codec.mel import stack_frames
    from tts.codec.melrvq import MelRVQCodec, fit_rvq

    utts = {u["id"]: u for u in read_utterances(work)}
    vecs = []
    for _, shard in load_shards(work, max_utterances):
        for uid, mel in zip(shard["ids"], shard["mels"], strict=True):
            if utts[uid]["split"] == "train":
                vecs.append(stack_frames(mel.float()))
    allv = torch.cat(vecs)
    g = torch.Generator().manual_seed(seed)
    sample = allv[torch.randperm(allv.shape[0], generator=g)[:sample_frames]]
    mean, std = sample.mean(0), sample.std(0).clamp_min(1e-3)
    log(f"fitting {num_codebooks} x {codebook_size} RVQ on {sample.shape[0]} of {allv.shape[0]} frames")
    normed = ((sample - mean) / std).to(device)
    books = fit_rvq(normed, num_codebooks, codebook_size, iters=iters, seed=seed, log=log).cpu()
    out = work / "codec"
    out.mkdir(parents=True, exist_ok=True)
    MelRVQCodec(books, mean, std).save(out)
    log(f"wrote {out}")


# ---- encode ----------------------------------------------------------------------------------------


def encode(
    work: Path, max_utterances: int | None, codec_dir: Path, out: Path, threads: int = 1, device: str = "cpu"
) -> None:
    """Codes of every clip through the codec in `codec_dir` (any type `tts.checkpoints.bundle.load_codec`
    knows)."""
    import torch

    from tts.checkpoints.bundle import load_codec
    from tts.text.tokenizer import build_byte_tokenizer

    torch.set_num_threads(threads)  # several threads crawl on a busy 2-core machine
    codec = load_codec(codec_dir)
    if hasattr(codec, "to"):
        codec.to(device)
    tokenizer = build_byte_tokenizer(codec.codebook_size)
    utts = {u["id"]: u for u in read_utterances(work)}
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(out / "tokenizer.json")
    total = 0.0
    for path, shard in load_shards(work, max_utterances):
        dst = out / path.name.replace("mel-", "codes-")
        if dst.exists():
            continue
        items = []
        for uid, mel, sec in zip(shard["ids"], shard["mels"], shard["seconds"], strict=True):
            u = utts[uid]
            codes = codec.encode_logmel(mel.float())
            items.append(
                {
                    "id": uid,
                    "speaker": u["speaker"],
                    "split": u["split"],
                    "seconds": sec,
                    "tokens": torch.tensor(tokenizer.encode(u["phonemes"]), dtype=torch.int16),
                    "codes": codes.to(torch.int16),
                }
            )
            total += sec
        torch.save(items, dst)
        log(f"{dst.name}: {len(items)} utterances")
    log(f"encoded {total / 3600:.2f} h")


def merge(sources: list[Path], out: Path) -> None:
    """One codes folder (`encode`'s layout) from several: the utterances of every folder in `sources`,
    in order, in new shards of SHARD_SIZE, numbered again from 0 (their `id`s no longer point into one
    sentences.jsonl, so `export.py` needs `--voices-from`). Kept once: an utterance found twice (the same
    phonemes and codes, as an add-on corpus's replay of base rows: the first folder's copy stays). Held
    out: only the first folder's held-out utterances (later folders' are dropped, so train.py's held-out
    loss is the first's). Left out: training utterances whose phonemes are those of a held-out or
    everyday text (a base built with another normalizer can hold them). Raises SystemExit when the
    folders' tokenizers differ, or `out` is one of them or already holds shards."""
    import hashlib

    import torch

    from tts.text.phonemes import PhonemeFrontend
    from tts.text.tokenizer import TextTokenizer

    if any(out.resolve() == d.resolve() for d in sources) or any(out.glob("codes-*.pt")):
        raise SystemExit(f"{out} is a source or already holds codes shards: merge into a new folder")
    tokenizers = {(d / "tokenizer.json").read_bytes() for d in sources}
    if len(tokenizers) != 1:
        raise SystemExit(f"the codes folders {[str(d) for d in sources]} have different tokenizers")
    tokenizer = TextTokenizer.from_file(sources[0] / "tokenizer.json")
    held_phonemes = {_phoneme_key(p) for p in PhonemeFrontend().sentences(_heldout_norms())}
    out.mkdir(parents=True, exist_ok=True)
    (out / "tokenizer.json").write_bytes(tokenizers.pop())
    seen: set[bytes] = set()
    kept: list[dict] = []
    counts = {"twice": 0, "held-out text": 0, "other held-out": 0}
    shard = n_kept = 0

    def flush(final: bool) -> None:
        nonlocal shard, kept
        while len(kept) >= SHARD_SIZE or (final and kept):
            torch.save(kept[:SHARD_SIZE], out / f"codes-{shard:04d}.pt")
            kept, shard = kept[SHARD_SIZE:], shard + 1

    for k, d in enumerate(sources):
        for path in sorted(d.glob("codes-*.pt")):
            for u in torch.load(path):
                shape = f"{len(u['tokens'])} {tuple(u['codes'].shape)}".encode()
                key = hashlib.sha1(
                    shape + u["tokens"].numpy().tobytes() + u["codes"].numpy().tobytes()
                ).digest()
                if key in seen:
                    counts["twice"] += 1
                    continue
                seen.add(key)
                if u["split"] != "train":
                    if k:
                        counts["other held-out"] += 1
                        continue
                elif _phoneme_key(tokenizer.decode(u["tokens"].long().tolist())) in held_phonemes:
                    counts["held-out text"] += 1
                    continue
                kept.append({**u, "id": n_kept})
                n_kept += 1
            flush(False)
    flush(True)
    log(
        f"merged into {shard} shards in {out}; left out: {counts['twice']} found twice, "
        f"{counts['held-out text']} with a held-out or everyday text, {counts['other held-out']} held out "
        "by a later folder"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("stage", choices=["text", "addon", "synth", "codec", "encode", "merge", "all"])
    p.add_argument("--work", type=Path, default=ROOT / "training" / "work")
    p.add_argument("--jobs", type=int, default=2)
    p.add_argument("--templates", type=int, default=6000, help="number of templated sentences")
    p.add_argument(
        "--paragraphs",
        type=int,
        default=0,
        help="also this many utterances of 2-4 training sentences, up to --paragraph-bytes of text (the "
        "multi-sentence chunks long text is synthesized in; default 0, the shipped model's corpus)",
    )
    p.add_argument(
        "--teacher",
        choices=TEACHERS,
        default="espeak",
        help="the synthesizer that speaks the corpus (text stage; default espeak, the shipped model's)",
    )
    p.add_argument("--paragraph-bytes", type=int, default=200, help="(default 200, the chunk length)")
    p.add_argument(
        "--base", type=Path, default=None, help="addon: the corpus work folder whose text is replayed"
    )
    p.add_argument("--short", type=int, default=4500, help="addon: short utterances (1-4 words)")
    p.add_argument("--everyday", type=int, default=4500, help="addon: everyday sentences")
    p.add_argument(
        "--weak",
        type=int,
        default=0,
        help='addon: sentences with weak words before vowels and /θ/ ("and an officer", "of three"; '
        "default 0, the v4 corpus; v5: 4000)",
    )
    p.add_argument(
        "--glue",
        type=int,
        default=0,
        help="addon: sentences with short unstressed words between content words in many constructions "
        '("and an egg", "or a map", "in an old barn", "and two cups"; default 0)',
    )
    p.add_argument("--replay", type=int, default=5500, help="addon: base training utterances replayed")
    p.add_argument("--replay-paragraphs", type=int, default=1500, help="addon: of them, paragraphs")
    p.add_argument("--num-codebooks", type=int, default=4)
    p.add_argument("--codebook-size", type=int, default=1024)
    p.add_argument("--sample-frames", type=int, default=60_000, help="frames used to fit the codebooks")
    p.add_argument("--kmeans-iters", type=int, default=12, help="Lloyd iterations per codebook")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--codec-dir", type=Path, default=None, help="codec to encode with (default: WORK/codec)")
    p.add_argument("--codes-dir", type=Path, default=None, help="where encode writes (default: WORK/codes)")
    p.add_argument(
        "--merge",
        type=Path,
        nargs="+",
        default=None,
        help="merge: the codes folders to merge into --codes-dir (the first one's held-out rows are kept)",
    )
    p.add_argument("--threads", type=int, default=1, help="torch threads of the codec and encode stages")
    p.add_argument("--device", default="cpu", help="torch device of the codec and encode stages")
    p.add_argument(
        "--max-utterances",
        type=int,
        default=None,
        help="use only the first utterances of sentences.jsonl (whole shards of 1000; default: all)",
    )
    a = p.parse_args()
    if a.stage in ("text", "all"):
        if (a.work / "sentences.jsonl").exists():  # (resumable: an existing text list is kept)
            log(f"{a.work / 'sentences.jsonl'} exists, kept (delete it to build the text again)")
        else:
            build_text(a.work, a.templates, a.seed, a.paragraphs, a.paragraph_bytes, a.teacher)
    if a.stage == "addon":
        if a.base is None:
            p.error("addon needs --base (the work folder of the corpus the model was trained on)")
        if (a.work / "sentences.jsonl").exists():
            log(f"{a.work / 'sentences.jsonl'} exists, kept (delete it to build the text again)")
        else:
            build_addon(
                a.work, a.base, a.short, a.everyday, a.replay, a.replay_paragraphs, a.seed, a.weak, a.glue
            )
    if a.stage == "merge":
        if not a.merge or a.codes_dir is None:
            p.error("merge needs --merge DIR [DIR ...] and --codes-dir OUT")
        merge(a.merge, a.codes_dir)
    if a.stage in ("synth", "all"):
        synth(a.work, a.jobs, a.max_utterances)
    if a.stage in ("codec", "all"):
        fit_codec(
            a.work,
            a.num_codebooks,
            a.codebook_size,
            a.sample_frames,
            a.kmeans_iters,
            a.seed,
            a.max_utterances,
            a.device,
        )
    if a.stage in ("encode", "all"):
        codec_dir = a.codec_dir or a.work / "codec"
        encode(a.work, a.max_utterances, codec_dir, a.codes_dir or a.work / "codes", a.threads, a.device)


if __name__ == "__main__":
    main()
