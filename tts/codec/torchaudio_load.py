"""torchaudio, imported for the codecs in this one place, so that an install that cannot load it ends
every command with one line that says how to mend it instead of a long traceback.

The usual cause is a mixed install: a CPU build of torch beside a CUDA build of torchaudio (or two CUDA
versions), whose native library then fails to load (`OSError: libc10_cuda.so: cannot open shared object
file`) or whose import refuses the pair (RuntimeError). torch and torchaudio must come from the same
package index.
"""

from __future__ import annotations

import importlib.metadata


class TorchaudioLoadError(RuntimeError):
    """torchaudio is missing or cannot load; the message is one line with the cause and the fix."""

    # tts.cli.main prints an error that has this attribute as its message alone, in one line; it checks
    # the attribute rather than the class so that it never imports this module (or torch) itself.
    install_error = True


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def load_error(exc: BaseException) -> TorchaudioLoadError:
    """The error for a failed `import torchaudio`: its cause (first line), the installed versions of torch
    and torchaudio, and the command that installs a matching pair."""
    import torch

    reason = (str(exc).strip().splitlines() or [""])[0]
    cuda = torch.version.cuda
    index = "cpu" if cuda is None else "cu" + cuda.replace(".", "")
    return TorchaudioLoadError(
        f"torchaudio cannot load ({type(exc).__name__}: {reason}; torch {_version('torch')}, torchaudio "
        f"{_version('torchaudio')}): install torch and torchaudio from the same index, e.g. pip install "
        f"--force-reinstall torch torchaudio --index-url https://download.pytorch.org/whl/{index}"
    )


try:
    import torchaudio
except (OSError, ImportError, RuntimeError) as _exc:
    raise load_error(_exc) from _exc

__all__ = ["TorchaudioLoadError", "load_error", "torchaudio"]
