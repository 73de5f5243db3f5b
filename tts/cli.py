"""The `tts` command line: synthesize, voices, info, and the subcommands other modules register
(bench, serve, client, write-checkpoint, eval).

Every failure a user can cause ends with one line `tts: error: <reason>` on stderr and a non-zero exit
(2 for bad input, 1 for a failure while running), and never leaves a partial output file.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
import time
from collections import Counter
from pathlib import Path

from .errors import UserError  # noqa: E402,F401 - defined there so `python -m tts.cli` raises the same class

EXIT_BAD_INPUT = 2
EXIT_FAILED = 1

# Modules that add subcommands: each has `add_parser(subparsers)` setting `func` on its parser.
_SUBCOMMAND_MODULES = ("tts.bench", "service.cli", "tts.fish.cli", "tts.eval")


def add_model_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model", default="default",
        help="'default' (the embedded model), 'tiny' (random weights, for tests) or a checkpoint directory",
    )  # fmt: skip
    p.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda, cuda:1 (default: cpu)")
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], default=None,
        help="weights and activations dtype (default: float32 on CPU, bfloat16 on CUDA)",
    )  # fmt: skip


def int_list(s: str) -> list[int]:
    """argparse type: comma-separated positive integers."""
    try:
        values = [int(x) for x in s.split(",") if x.strip()]
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {s!r}") from exc
    if not values or min(values) < 1:
        raise argparse.ArgumentTypeError("values must be positive integers")
    return values


def add_engine_args(p: argparse.ArgumentParser) -> None:
    from graphs.runner import DEFAULT_BUCKETS

    g = p.add_argument_group("engine (CUDA graphs; ignored on CPU)")
    g.add_argument(
        "--graphs", choices=["on", "off"], default="on", help="replay one CUDA graph per batch bucket"
    )
    g.add_argument(
        "--capture", choices=["lazy", "startup"], default="lazy",
        help="capture a bucket on its second use (lazy) or every bucket at start-up, largest first",
    )  # fmt: skip
    g.add_argument(
        "--buckets", type=int_list, default=list(DEFAULT_BUCKETS),
        help="batch sizes to capture (default 1,2,4,8,16,24,32,48,64); larger batches run eagerly",
    )  # fmt: skip
    g.add_argument(
        "--threads", type=int, default=None,
        help="CPU intra-op threads (default: 1 for models under 100 M parameters on a CPU, whose decode "
        "step is a chain of small ops that extra threads only slow down; otherwise torch's default)",
    )  # fmt: skip


def engine_kwargs(args: argparse.Namespace) -> dict:
    return {"graphs": args.graphs == "on", "capture": args.capture, "buckets": args.buckets}


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
        if threads < 1:
            raise UserError("--threads must be >= 1")
        torch.set_num_threads(threads)


def add_sampling_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("sampling (defaults come from the model)")
    g.add_argument("--seed", type=int, default=None, help="seed for reproducible output (default: random)")
    g.add_argument("--temperature", type=float, default=None, help=">= 0; 0 is greedy")
    g.add_argument("--top-p", type=float, default=None, help="nucleus mass in (0, 1]")
    g.add_argument("--top-k", type=int, default=None, help=">= 0; 0 = no limit")
    g.add_argument("--max-new-frames", type=int, default=None, help="frame budget per text chunk, > 0")


def sampling_kwargs(args: argparse.Namespace) -> dict:
    return {
        "seed": args.seed, "temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k,
        "max_new_frames": args.max_new_frames,
    }  # fmt: skip


def torch_dtype(name: str | None):
    import torch

    return None if name is None else getattr(torch, name)


def check_device(device: str) -> None:
    import torch

    try:
        d = torch.device(device)
    except RuntimeError as exc:
        raise UserError(f"bad --device {device!r}: {exc}") from exc
    if d.type == "cuda" and not torch.cuda.is_available():
        raise UserError(f"--device {device}: no CUDA device is available here")
    if d.type == "cuda" and d.index is not None and d.index >= torch.cuda.device_count():
        raise UserError(f"--device {device}: only {torch.cuda.device_count()} CUDA device(s) exist")


# ---- synthesize --------------------------------------------------------------------------------------


def read_text_arg(args) -> str:
    """The text of TEXT or --text-file (exactly one; `--text-file -` reads stdin); raises UserError."""
    if args.text is not None and args.text_file is not None:
        raise UserError("give TEXT or --text-file, not both")
    if args.text_file == "-":  # ---- stdin (audio formats change)
        try:
            return sys.stdin.buffer.read().decode("utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"cannot read the text from stdin: {exc}") from exc  # ---- end
    if args.text_file is not None:
        try:
            return Path(args.text_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise UserError(f"cannot read --text-file: {exc}") from exc
    if args.text is None:
        raise UserError("nothing to synthesize: give TEXT or --text-file")
    return args.text


# ---- output formats (audio formats change) ----

OUTPUT_HELP = (
    "output file, written atomically; its extension picks the format (.wav .mp3 .opus/.ogg .aac .flac .pcm/.raw) "
    "unless --format is given; - writes to stdout (WAV unless --format)"
)


def add_output_args(p: argparse.ArgumentParser) -> None:
    """-o/--output and --format (tts synthesize, tts client)."""
    from .audio_formats import FORMATS

    p.add_argument("-o", "--output", required=True, help=OUTPUT_HELP)
    p.add_argument(
        "--format", choices=list(FORMATS), default=None,
        help="output format (default: from the extension of --output); pcm = raw 16-bit little-endian mono",
    )  # fmt: skip


def output_format(args: argparse.Namespace):
    """The AudioFormat to write `args.output` in (tts.audio_formats); raises UserError."""
    from .audio_formats import AudioFormatError, format_for_path

    try:
        return format_for_path(args.output, args.format)
    except AudioFormatError as exc:
        raise UserError(str(exc)) from exc


def summary_stream(args: argparse.Namespace):
    """Where the summary line goes: stdout, or stderr when the audio goes to stdout (`-o -`)."""
    return sys.stderr if args.output == "-" else sys.stdout


# ---- end output formats


def check_output_path(path: str) -> Path:
    """An output file path whose directory exists and that is not a directory (or `-`, stdout); raises
    UserError."""
    if path == "-":
        return Path("-")
    out = Path(path)
    if not (out.parent if str(out.parent) else Path(".")).is_dir():
        raise UserError(f"output directory {out.parent} does not exist")
    if out.is_dir():
        raise UserError(f"output path {out} is a directory")
    return out


def cmd_synthesize(args: argparse.Namespace) -> int:
    from .api import TTS
    from .audio import read_audio
    from .audio_formats import write_audio_file
    from .bundle import load_bundle
    from .engine import EngineConfig, SamplingParams
    from .text import normalize_text

    # Check everything that does not need the model before loading it.
    text = read_text_arg(args)
    normalize_text(text)
    out = check_output_path(args.output)
    fmt = output_format(args)
    if (args.reference_audio is None) != (args.reference_text is None):
        raise UserError("--reference-audio and --reference-text go together")
    if args.voice is not None and args.reference_audio is not None:
        raise UserError("give --voice or --reference-audio, not both")
    reference_audio = read_audio(Path(args.reference_audio)) if args.reference_audio else None
    check_device(args.device)
    SamplingParams(**{k: v for k, v in sampling_kwargs(args).items() if v is not None}).validate()

    t_load = time.perf_counter()
    bundle = load_bundle(args.model, device=args.device, dtype=torch_dtype(args.dtype))
    apply_threads(args, bundle)
    tts = TTS(bundle, EngineConfig(max_batch=1, **engine_kwargs(args)))
    voice = args.voice
    if reference_audio is not None:
        audio, sr = reference_audio
        voice = tts.reference_from_audio(audio, sr, args.reference_text)
    plan = tts.prepare(text, voice=voice, **sampling_kwargs(args))  # every check before any work
    load_seconds = time.perf_counter() - t_load
    if not args.quiet:
        print(f"model: {bundle.describe()} (loaded in {load_seconds:.2f} s)", file=sys.stderr)

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

    result = tts.synthesize(plan, progress=progress)
    if progress_bar is not None:
        progress_bar.n = len(plan.chunks)
        progress_bar.close()
    write_audio_file(out, result.audio, result.sample_rate, fmt)
    print(
        f"wrote {'stdout' if args.output == '-' else out} ({fmt.name}): {result.frames} frames, "
        f"{result.audio_seconds:.2f} s audio at {result.sample_rate} Hz, "
        f"{result.wall_seconds:.2f} s wall, RTF {result.rtf:.3f}, "
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
                file=self.stream, flush=True,
            )  # fmt: skip


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


def cmd_voices(args: argparse.Namespace) -> int:
    """List preset voices: name, length in frames, transcript (read from the files; no model load for
    a checkpoint directory)."""
    from .bundle import PRESETS, load_bundle, load_voices

    if args.model in PRESETS:
        voices = load_bundle(args.model, device="cpu").voices
    else:
        if not Path(args.model).is_dir():
            raise UserError(f"{args.model} is neither a preset ({', '.join(PRESETS)}) nor a directory")
        voices = load_voices(Path(args.model) / "voices")
    if not voices:
        print("no preset voices (use --reference-audio and --reference-text to clone a voice)")
    for name, voice in sorted(voices.items()):
        print(f"{name}\t{voice.codes.shape[1]} frames\t{voice.text}")
    return 0


def cmd_info(args: argparse.Namespace) -> int:
    from .bundle import load_bundle

    check_device(args.device)
    bundle = load_bundle(args.model, device=args.device, dtype=torch_dtype(args.dtype))
    print(bundle.describe())
    c = bundle.model.config
    print(
        f"slow AR: {c.n_layer} layers, dim {c.dim}, heads {c.n_head}/{c.n_local_heads}, max_seq_len {c.max_seq_len}; "
        f"fast AR: {c.n_fast_layer} layer{'s' if c.n_fast_layer != 1 else ''}, dim {c.fast_dim}; codebooks {c.num_codebooks} x {c.codebook_size}"
    )
    return 0


# ---- parser and entry point --------------------------------------------------------------------------


class OneLineErrorParser(argparse.ArgumentParser):
    """argparse with the CLI's error convention: one line on stderr (no usage block), exit code 2.
    Sub-command parsers inherit the class."""

    def error(self, message: str):
        self.exit(EXIT_BAD_INPUT, f"{self.prog}: error: {message} (see {self.prog} --help)\n")


def package_version() -> str:
    """The installed distribution's version, or "unknown" when run from an uninstalled tree."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("dualar-tts")
    except PackageNotFoundError:
        return "unknown"


def build_parser() -> argparse.ArgumentParser:
    parser = OneLineErrorParser(
        prog="tts", description="Dual-AR text-to-speech runtime: synthesize, serve, benchmark."
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log debug messages")
    parser.add_argument("--version", action="version", version=f"tts {package_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser(
        "synthesize", help="synthesize text to an audio file (WAV, MP3, Opus, AAC, FLAC, PCM)",
        description="Synthesize text to a mono audio file.",
    )  # fmt: skip
    p.add_argument("text", nargs="?", help="text to speak (or use --text-file)")
    add_output_args(p)
    p.add_argument("--text-file", help="read the text from this UTF-8 file (- = stdin)")
    p.add_argument("--voice", help="preset voice name (see `tts voices`)")
    p.add_argument("--reference-audio", help="WAV/FLAC clip of the voice to clone (with --reference-text)")
    p.add_argument("--reference-text", help="transcript of --reference-audio")
    p.add_argument("-q", "--quiet", action="store_true", help="print only the summary line")
    add_model_args(p)
    add_engine_args(p)
    add_sampling_args(p)
    p.set_defaults(func=cmd_synthesize)

    p = sub.add_parser("voices", help="list the model's preset voices")
    p.add_argument("--model", default="default")
    p.set_defaults(func=cmd_voices)

    p = sub.add_parser("info", help="describe a model")
    add_model_args(p)
    p.set_defaults(func=cmd_info)

    for name in _SUBCOMMAND_MODULES:
        try:
            module = importlib.import_module(name)
        except ImportError:
            continue
        module.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s"
    )
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_BAD_INPUT
    from .errors import BAD_INPUT_ERRORS

    try:
        return args.func(args)
    except BAD_INPUT_ERRORS as exc:
        print(f"tts: error: {exc}", file=sys.stderr)
        return EXIT_BAD_INPUT
    except KeyboardInterrupt:
        print("tts: interrupted", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - one line for the user; -v shows the traceback
        logging.getLogger("tts").debug("failure", exc_info=True)
        print(f"tts: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_FAILED


if __name__ == "__main__":
    sys.exit(main())
