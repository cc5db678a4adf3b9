"""Moved to `jaxinfer.speculative.train` (loading: `jaxinfer.speculative.checkpoint`); kept for
one release. Serving never imports this module."""

from jaxinfer.speculative.train import *  # noqa: F403  (the same public names as before)
