"""How well the gates' ASR hears each teacher speaker itself: the ceiling a model trained on it copies.

    python training/teacher_check.py --out teachers.json

Every speaker of both teachers (corpus.py SPEAKERS for espeak-ng, FLITE_SPEAKERS for flite, without
jitter) reads the held-out sentences (`samples/eval/heldout.txt`, normalized as `tts eval` does), the
README's quick-start sentence and "The signifier is linked to the signified." (the sentence the v2 model's
short-text loops came from); Whisper tiny.en (`tts_tools.evaluate.ASR`, greedy, as the gates) transcribes each
clip, and WER is scored by `tts_tools.evaluate.wer` on `tts_tools.evaluate.words`, as in the gates. Needs the
tools extra and the espeak-ng and flite binaries.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from corpus import FLITE_SPEAKERS, SPEAKERS, _utterance, speak  # noqa: E402
from tts_tools.evaluate import ASR, HELDOUT, loops, read_sentences, wer, words  # noqa: E402

from tts.text.normalize import normalize_text  # noqa: E402

QUICK_START = "Hello there, this is a test of the default voice."
RARE_WORDS = "The signifier is linked to the signified."


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--speakers", default="ava", help="comma-separated speaker names, or 'all' (default ava)")
    p.add_argument("--threads", type=int, default=1, help="ASR threads")
    a = p.parse_args()
    asr = ASR(threads=a.threads)
    texts = [normalize_text(t) for t in read_sentences(HELDOUT, None)]
    result = {
        "asr": "Whisper tiny.en int8, greedy (tts_tools.evaluate.ASR)",
        "sentences": len(texts),
        "speakers": [],
    }
    for teacher, table in (("espeak", SPEAKERS), ("flite", FLITE_SPEAKERS)):
        for index, speaker in enumerate(table):
            if a.speakers != "all" and speaker["name"] not in a.speakers.split(","):
                continue
            # The speaker's utterance fields as the corpus writes them, unjittered (the held-out rows').
            base, t0 = _utterance({}, index, random.Random(0), teacher, jitter=False), time.time()
            heard = [asr.transcribe(speak({**base, "text": t}), 22050) for t in texts]
            quick = asr.transcribe(speak({**base, "text": QUICK_START}), 22050)
            rare = asr.transcribe(speak({**base, "text": RARE_WORDS}), 22050)
            entry = {
                "teacher": teacher,
                "name": speaker["name"],
                **base,
                "heldout_wer": wer([words(t) for t in texts], [words(h) for h in heard]),
                "quick_start": quick,
                "quick_start_exact": words(quick) == words(QUICK_START),
                "rare_words": rare,
                "rare_words_loops": loops(words(RARE_WORDS), words(rare)),
            }
            result["speakers"].append(entry)
            print(
                f"{teacher} {speaker['name']}: held-out WER {entry['heldout_wer']:.3f}; quick-start "
                f"{quick!r}; rare words {rare!r} ({time.time() - t0:.0f} s)",
                flush=True,
            )
    a.out.parent.mkdir(parents=True, exist_ok=True)
    a.out.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
