"""The one exception type every checkpoint loader raises."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator


class CheckpointError(ValueError):
    """A checkpoint cannot be loaded: missing or misshapen tensor, truncated or corrupt file,
    unsupported architecture, missing config field, unknown format.

    Messages name the file and the tensor or field at fault.
    """


@contextlib.contextmanager
def as_checkpoint_error(path: str | os.PathLike) -> Iterator[None]:
    """Re-raise a `ValueError` from `ModelConfig` (bad field value) or `build_params`
    (misshapen tensor) as a `CheckpointError` that also names `path`; the field or tensor
    is already named in the original message."""
    try:
        yield
    except CheckpointError:
        raise
    except ValueError as error:
        raise CheckpointError(f"{os.fspath(path)}: {error}") from error
