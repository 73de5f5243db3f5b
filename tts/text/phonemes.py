"""Text frontends: what a model reads in place of the normalized text.

A bundle's `tts_runtime.frontend` names one (absent or "text" = the normalized text itself, as Fish
models read it). The default model reads phonemes: `PhonemeFrontend` turns normalized English text into
espeak-ng IPA with stress marks and the punctuation kept, e.g.
`"Hello there, friend."` -> `"həlˈoʊ ðˈɛɹ, fɹˈɛnd."`. It needs no system package: the espeak-ng library
and its data come from the `espeakng-loader` wheel, driven through `phonemizer`.
"""

from __future__ import annotations

import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable

from tts.text.normalize import TAG

Frontend = Callable[[str], str]


class FrontendError(RuntimeError):
    """A frontend that cannot run here (a missing package)."""


class PhonemeFrontend:
    """espeak-ng IPA phonemes (phonemizer + espeakng-loader), `language` an espeak voice such as en-us.

    `__call__(text)` -> phoneme string; thread-safe (one espeak instance behind a lock). Raises
    FrontendError when phonemizer or espeakng-loader is not installed. The last CACHE_TEXTS texts' phonemes
    are kept: a session's prompt holds its earlier turns, rebuilt for every chunk on the engine thread.
    """

    CACHE_TEXTS = 4096

    name = "espeak-ipa"

    def __init__(self, language: str = "en-us"):
        self.language = language
        self.spec = f"{self.name}:{language}"  # what `get_frontend` turns back into this object
        self._backend = None
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, str] = OrderedDict()

    def _get_backend(self):
        if self._backend is None:
            try:
                import espeakng_loader
                from phonemizer.backend import EspeakBackend
                from phonemizer.backend.espeak.wrapper import EspeakWrapper
            except ImportError as exc:
                raise FrontendError(
                    "the phoneme frontend needs the packages phonemizer and espeakng-loader "
                    "(pip install phonemizer espeakng-loader)"
                ) from exc
            EspeakWrapper.set_library(espeakng_loader.get_library_path())
            EspeakWrapper.set_data_path(espeakng_loader.get_data_path())
            quiet = logging.getLogger("phonemizer.quiet")
            quiet.setLevel(logging.ERROR)
            self._backend = EspeakBackend(
                self.language, preserve_punctuation=True, with_stress=True, logger=quiet
            )
        return self._backend

    def phonemize_batch(self, texts: list[str]) -> list[str]:
        """Phonemes of each text (one espeak call for the whole list)."""
        with self._lock:
            out = self._get_backend().phonemize(list(texts), strip=True)
        return [" ".join(s.split()) for s in out]

    def __call__(self, text: str) -> str:
        """The phonemes of `text` as a sentence: ending with terminal punctuation (a full stop where the
        text has none, in place of a trailing comma, colon or semicolon). The default model learned
        from punctuated sentences; without it a text of a word or two ("hi", "OK") was read on into
        babble before the end token came, and with it ("Hi.") it ends."""
        with self._lock:
            cached = self._cache.get(text)
            if cached is not None:
                self._cache.move_to_end(text)
                return cached
        phonemes = self.sentences([text])[0]
        with self._lock:
            self._cache[text] = phonemes
            if len(self._cache) > self.CACHE_TEXTS:
                self._cache.popitem(last=False)
        return phonemes

    def sentences(self, texts: list[str]) -> list[str]:
        """`__call__` of each text, with one espeak call for the whole list (what a training corpus
        needs to give its texts exactly as the runtime prompts them)."""
        return [as_sentence(p) for p in self.phonemize_batch(texts)]


def as_sentence(phonemes: str) -> str:
    """`phonemes` ending with terminal punctuation: a full stop appended (in place of a trailing comma,
    colon or semicolon) where it has none; "" stays ""."""
    if phonemes and phonemes[-1] not in _TERMINAL:
        phonemes = phonemes.rstrip(",;: ") + "."
    return phonemes


# Punctuation that ends a sentence as espeak-ng keeps it (with closing quotes and brackets after it).
_TERMINAL = frozenset(".!?…\"')]")


def identity(text: str) -> str:
    """The text frontend of Fish models: the normalized text itself."""
    return text


_SPECIAL = re.compile(f"({TAG.pattern})")  # (split keeps the tags)


def apply_frontend(frontend: Frontend, text: str) -> str:
    """`frontend` applied to the plain-text pieces of `text`; special tokens (`<|speaker:0|>`, ...)
    are kept as they are."""
    if frontend is identity:
        return text
    pieces = _SPECIAL.split(text)
    return "".join(p if _SPECIAL.fullmatch(p) or not p.strip() else frontend(p) for p in pieces)


def get_frontend(name: str | None) -> Frontend:
    """The frontend a bundle names: None/"text" -> identity, "espeak-ipa[:LANG]" -> PhonemeFrontend."""
    if name in (None, "", "text"):
        return identity
    kind, _, language = name.partition(":")
    if kind == PhonemeFrontend.name:
        return PhonemeFrontend(language or "en-us")
    raise ValueError(f"unknown text frontend {name!r} (expected 'text' or 'espeak-ipa[:LANGUAGE]')")
