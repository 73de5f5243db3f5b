"""Voices a request can name, and encoded reference clips kept for reuse.

* `VoiceRegistry`: the model's preset voices (read-only, from the bundle) plus **registered voices**: a
  clip and its transcript encoded once and kept as codes. With a directory they are persisted as
  `NAME.safetensors` (codes `[N, T]` int64, the transcript and a codec fingerprint in the metadata,
  the same file layout as a bundle's presets), so they survive a restart; a file written for another
  codec is skipped with a warning. The directory is the truth: a voice another process adds, replaces
  or deletes there (`tts voices add` while `tts serve` runs) is seen at the next lookup or listing.
  Thread-safe: request handlers read it while others add or delete.
* `ReferenceCache`: encoded reference clips keyed by a content hash of (clip bytes, transcript, codec
  fingerprint), least recently used evicted beyond a byte budget, one encode per key at a time
  (a second request for a key being encoded waits for the first encode instead of repeating it).

Neither does device work: encoding is the codec stage's (`tts.runtime.codec_stage`); these only store.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import tempfile
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from tts.codec import Codec
from tts.params import InvalidRequest
from tts.text.normalize import shorten
from tts.text.prompt import VoiceReference

log = logging.getLogger(__name__)

VOICE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
VOICE_NAME_RULE = "1-64 characters: letters, digits, '.', '_' and '-', starting with a letter or digit"


class VoiceNotFound(KeyError):
    """An unknown voice name. Maps to NOT_FOUND."""

    def __str__(self) -> str:
        return str(self.args[0])


class VoiceExists(ValueError):
    """A registered voice of that name exists and replacing was not asked for. Maps to ALREADY_EXISTS."""


def codec_fingerprint(codec: Codec) -> str:
    """A short hash of the codec's identity (its config and, where it has them, a sample of its
    weights): codes are only meaningful to the codec that made them."""
    h = hashlib.sha256(json.dumps(codec.config(), sort_keys=True, default=str).encode())
    for tensor in _weights_sample(codec):
        h.update(tensor.detach().float().cpu().numpy().tobytes())
    return h.hexdigest()[:16]


def _weights_sample(codec: Codec) -> list[torch.Tensor]:
    for attr in ("model", "net"):
        module = getattr(codec, attr, None)
        if isinstance(module, torch.nn.Module):
            params = list(module.parameters())
            return [p.reshape(-1)[:64] for p in params[:: max(1, len(params) // 8)]]
    for attr in ("tables", "codebooks"):
        tables = getattr(codec, attr, None)
        if isinstance(tables, torch.Tensor):
            return [tables.reshape(-1)[:256]]
    return []


@dataclass
class VoiceEntry:
    """A voice as listed: `kind` is "preset" (ships with the model) or "registered"; `replaced` is
    true for what `VoiceRegistry.add` returns when it replaced a registered voice of that name."""

    name: str
    kind: str
    voice: VoiceReference
    replaced: bool = False

    def seconds(self, frame_rate: float) -> float:
        return self.voice.codes.shape[1] / frame_rate


class VoiceRegistry:
    """Preset voices plus registered ones (see the module docstring).

    presets: the bundle's voices (never replaced or deleted). directory: where registered voices are
    persisted (None: in memory only). fingerprint: `codec_fingerprint(codec)`; None reads every file
    without checking (for listing and deleting without loading the codec; `add` then refuses).
    codebooks: (num_codebooks, codebook_size) of the codec: a file whose codes are not `[num_codebooks,
    T]` integers in 0..codebook_size-1 (T >= 1) is refused when read (None: only the form is checked).
    `refused` counts the file versions refused (another codec's, unreadable or malformed), each once.

    Adding a new name is atomic across processes sharing the directory: the file is written under a
    temporary name and linked to its own (create-exclusive), so of two adds of one name exactly one
    wins and the other gets VoiceExists.
    """

    def __init__(
        self,
        presets: dict[str, VoiceReference],
        directory: str | Path | None,
        fingerprint: str | None,
        codebooks: tuple[int, int] | None = None,
    ):
        self.presets = dict(presets)
        self.directory = Path(directory) if directory is not None else None
        self.fingerprint = fingerprint
        self._lock = threading.Lock()  # guards the dictionaries below
        self._write_lock = threading.Lock()  # one add or delete at a time (held across the file write)
        self._registered: dict[str, VoiceReference] = {}
        self._stamps: dict[str, tuple[int, int]] = {}  # name -> (mtime_ns, size) of the file read
        self._skipped: set[tuple[Path, tuple[int, int]]] = set()  # files warned about once
        self._refused: dict[str, str] = {}  # name -> why its file was refused (for lookups of it)
        self.codebooks = codebooks
        self.refused = 0  # file versions refused (see the class docstring)
        self._refresh()

    def _read_file(self, f: Path, stamp: tuple[int, int]) -> VoiceReference | None:
        """The voice in file `f`, or None (warned once per file version) when it is another codec's or
        unreadable."""
        try:
            with safe_open(str(f), "pt") as h:
                meta = h.metadata() or {}
                if self.fingerprint is None or meta.get("codec") == self.fingerprint:
                    codes = h.get_tensor("codes")
                    problem = self._codes_problem(codes)
                    if problem is None:
                        self._refused.pop(f.stem, None)
                        return VoiceReference(codes=codes, text=meta.get("text", ""))
                else:
                    problem = "made for another codec"
        except Exception as exc:  # noqa: BLE001 - one broken file must not stop the server
            problem = f"unreadable: {exc}"
        self._refused[f.stem] = problem
        if (f, stamp) not in self._skipped:
            self._skipped.add((f, stamp))
            self.refused += 1
            log.warning("refusing voice file %s: %s", f, problem)
        return None

    def _codes_problem(self, codes: torch.Tensor) -> str | None:
        """Why `codes` read from a file cannot be a voice of this codec, or None."""
        rows = self.codebooks[0] if self.codebooks is not None else None
        form = f"[{rows if rows is not None else 'N'}, T]"
        shape = "[" + ", ".join(map(str, codes.shape)) + "]"
        if codes.dim() != 2 or codes.shape[1] < 1 or (rows is not None and codes.shape[0] != rows):
            return f"its codes are {shape}; this codec's are {form} with T >= 1"
        if codes.dtype.is_floating_point or codes.dtype.is_complex or codes.dtype == torch.bool:
            return f"its codes are {codes.dtype}, not integers"
        if self.codebooks is not None:
            low, high = int(codes.min()), int(codes.max())
            if low < 0 or high >= self.codebooks[1]:
                return f"it has codes outside 0..{self.codebooks[1] - 1} (from {low} to {high})"
        return None

    def _sync(self, name: str) -> None:
        """Bring `name`'s entry in line with its file: read it if new or changed, drop it if gone."""
        if self.directory is None or not VOICE_NAME.fullmatch(name):
            return
        f = self.directory / f"{name}.safetensors"
        try:
            st = f.stat()
        except OSError:
            with self._lock:
                self._registered.pop(name, None)
                self._stamps.pop(name, None)
                self._refused.pop(name, None)
            return
        stamp = (st.st_mtime_ns, st.st_size)
        with self._lock:
            if self._stamps.get(name) == stamp:
                return
        voice = self._read_file(f, stamp)
        with self._lock:
            if voice is None:
                self._registered.pop(name, None)
            else:
                self._registered[name] = voice
            self._stamps[name] = stamp

    def _refresh(self) -> None:
        """Sync every voice the directory holds now, and drop those whose files are gone."""
        if self.directory is None:
            return
        on_disk = {f.stem for f in self.directory.glob("*.safetensors")} if self.directory.is_dir() else set()
        with self._lock:
            known = set(self._stamps)  # (every voice read from or written to the directory has a stamp)
        for name in sorted(on_disk | known):
            self._sync(name)

    def get(self, name: str) -> VoiceReference:
        """The voice called `name` (preset first); raises VoiceNotFound naming a few that exist."""
        if name not in self.presets:
            self._sync(name)
        with self._lock:
            voice = self.presets.get(name) or self._registered.get(name)
            if voice is not None:
                return voice
            names = sorted(self.presets) + sorted(self._registered)
        why = self._refused.get(name)
        if why is not None and self.directory is not None:
            raise VoiceNotFound(f"voice {name!r} is not usable: its file was refused: {why}")
        listed = ", ".join(names[:20]) + (f", ... ({len(names)} in all)" if len(names) > 20 else "")
        raise VoiceNotFound(f"unknown voice {shorten(name, 60)!r} (available: {listed or 'none'})")

    def kind(self, name: str) -> str:
        with self._lock:
            return "preset" if name in self.presets else "registered"

    def list(self) -> list[VoiceEntry]:
        """Presets, then registered voices (as the directory holds them now), each sorted by name."""
        self._refresh()
        with self._lock:
            return [VoiceEntry(n, "preset", v) for n, v in sorted(self.presets.items())] + [
                VoiceEntry(n, "registered", v) for n, v in sorted(self._registered.items())
            ]

    def check_new(self, name: str, replace: bool = False) -> None:
        """Raise InvalidRequest for a bad name or a preset's name, VoiceExists for a registered name
        without `replace` (before any encoding work)."""
        if not VOICE_NAME.fullmatch(name):
            raise InvalidRequest(f"voice name {shorten(name, 60)!r} is not valid: {VOICE_NAME_RULE}")
        with self._lock:
            if name in self.presets:
                raise InvalidRequest(f"{name!r} is a preset voice of the model; choose another name")
            if name in self._registered and not replace:
                raise VoiceExists(
                    f"a voice named {name!r} exists (to replace it, add it again with replace set)"
                )

    def add(self, name: str, voice: VoiceReference, replace: bool = False) -> VoiceEntry:
        """Register (and persist) `voice` as `name`. Raises as `check_new` (a file another process wrote
        counts), OSError if the file cannot be written (nothing is registered then)."""
        if self.fingerprint is None:
            raise RuntimeError("this registry was opened without the codec's fingerprint; it cannot add")
        with self._write_lock:  # adds and deletes of this registry, one at a time
            self._sync(name)
            self.check_new(name, replace)
            replaced = name in self._registered
            stamp = None
            if self.directory is not None:
                self.directory.mkdir(parents=True, exist_ok=True)
                fd, tmp = tempfile.mkstemp(dir=self.directory, prefix=f".{name}.", suffix=".tmp")
                os.close(fd)
                try:
                    save_file(
                        {"codes": voice.codes.to(torch.int64).contiguous()},
                        tmp,
                        metadata={"text": voice.text, "codec": self.fingerprint},
                    )
                    st = os.stat(tmp)
                    final = self.directory / f"{name}.safetensors"
                    if replace:
                        os.replace(tmp, final)
                    else:
                        # create-exclusive: fails if another process made the name since check_new
                        try:
                            os.link(tmp, final)
                        except FileExistsError:
                            raise VoiceExists(
                                f"a voice named {name!r} exists (to replace it, add it again with replace "
                                "set)"
                            ) from None
                        finally:
                            Path(tmp).unlink(missing_ok=True)
                except BaseException:
                    Path(tmp).unlink(missing_ok=True)
                    raise
                stamp = (st.st_mtime_ns, st.st_size)
            with self._lock:
                self._registered[name] = voice
                if stamp is not None:
                    self._stamps[name] = stamp  # (its own file: no re-read at the next lookup)
        return VoiceEntry(name, "registered", voice, replaced)

    def delete(self, name: str) -> None:
        """Remove a registered voice (and its file). Raises VoiceNotFound, or InvalidRequest for a preset.
        Requests already using it keep their copy of the codes."""
        if name in self.presets:
            raise InvalidRequest(f"{name!r} is a preset voice of the model and cannot be deleted")
        with self._write_lock:
            self._sync(name)
            with self._lock:
                if name not in self._registered:
                    raise VoiceNotFound(f"no registered voice named {shorten(name, 60)!r}")
            if self.directory is not None:  # the file first: a lookup meanwhile finds it gone and drops it
                (self.directory / f"{name}.safetensors").unlink(missing_ok=True)
            with self._lock:
                self._registered.pop(name, None)
                self._stamps.pop(name, None)


def default_voices_dir(model_name: str) -> Path:
    """Where `tts voices add`, `tts synthesize` and `tts serve` keep registered voices by default:
    `$XDG_DATA_HOME/dualar-tts/voices/<model name>` (~/.local/share when XDG_DATA_HOME is unset). Files
    made with another codec under the same model name are skipped (their codec fingerprint differs)."""
    base = Path(os.environ.get("XDG_DATA_HOME") or Path.home() / ".local" / "share")
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", model_name)[:64] or "model"
    return base / "dualar-tts" / "voices" / safe


# ---- the reference cache ------------------------------------------------------------------------------


def reference_key(audio: bytes, text: str, fingerprint: str) -> str:
    """The cache key of a clip: sha256 over the codec fingerprint, the clip's bytes and its transcript
    (length-prefixed, so no two different pairs collide by concatenation)."""
    h = hashlib.sha256(b"tts-reference-v1\0" + fingerprint.encode() + b"\0")
    for part in (audio, text.encode("utf-8")):
        h.update(len(part).to_bytes(8, "little"))
        h.update(part)
    return h.hexdigest()


class ReferenceCache:
    """Encoded clips by content (see the module docstring). capacity_bytes: the budget for the codes
    kept (0 disables caching; concurrent encodes of one key are still shared)."""

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._lock = threading.Lock()
        self._entries: OrderedDict[str, VoiceReference] = OrderedDict()
        self._inflight: dict[str, Future] = {}
        self.bytes = 0
        self.hits = 0
        self.misses = 0

    @staticmethod
    def _size(voice: VoiceReference) -> int:
        return voice.codes.numel() * voice.codes.element_size() + len(voice.text.encode()) + 64

    def get_or_encode(self, key: str, encode: Callable[[], Future]) -> Future:
        """A future of the VoiceReference for `key`: done at once on a hit; otherwise the future of an
        encode already running for the key, or of a new one started by `encode()` (whose result is
        stored when it completes). A failed encode is not cached."""
        with self._lock:
            voice = self._entries.get(key)
            if voice is not None:
                self._entries.move_to_end(key)
                self.hits += 1
                done: Future = Future()
                done.set_result(voice)
                return done
            running = self._inflight.get(key)
            if running is not None:
                self.hits += 1  # no second encode
                return running
            self.misses += 1
            future = encode()
            self._inflight[key] = future
        future.add_done_callback(lambda f: self._finished(key, f))
        return future

    def _finished(self, key: str, future: Future) -> None:
        with self._lock:
            self._inflight.pop(key, None)
            if future.cancelled() or future.exception() is not None:
                return
            voice = future.result()
            size = self._size(voice)
            if size > self.capacity_bytes or key in self._entries:
                return
            self._entries[key] = voice
            self.bytes += size
            while self.bytes > self.capacity_bytes and self._entries:
                _, old = self._entries.popitem(last=False)
                self.bytes -= self._size(old)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)
