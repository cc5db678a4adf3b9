"""One scheduler for many hosts: process 0 decides every step, the others run what it decided.

When the engine's mesh spans several processes (`jax.distributed`), every process must call
each jitted program with the same arguments in the same order: the programs are one SPMD
computation over all devices. Only process 0, the *leader*, has requests, a scheduler and
(in `jaxinfer serve`) the HTTP server. Before each device call it publishes what it is about
to run on a `StepChannel`; the other processes, *followers* (`Engine.follow`), receive it and
run exactly that. No process schedules on its own, so they cannot disagree.

The channel is the `jax.distributed` coordination service's key-value store: host-to-host
messages outside the devices, so a follower can wait through an idle server without a
collective timing out. Message n is stored under its own key; the leader deletes message
n - 2 when it publishes message n (a follower has read it: message n - 1 was a program, or
the logprob program, every process had to join).
"""

from __future__ import annotations

import itertools
import pickle
from typing import Any

import jax

_channels = itertools.count()  # engines made in this process, numbered alike on every process


def spans_processes(mesh: jax.sharding.Mesh | None) -> bool:
    """True when `mesh` holds devices of more than one process."""
    return mesh is not None and len({d.process_index for d in mesh.devices.flat}) > 1


class StepChannel:
    """Ordered messages from process 0 to every other process of the job."""

    def __init__(self, poll_s: float = 1.0):
        from jax._src import distributed  # the coordination service client; no public API wraps it

        self._client = distributed.global_state.client
        if self._client is None:
            raise RuntimeError("a mesh spans several processes but jax.distributed is not initialized")
        self._prefix = f"jaxinfer/engine{next(_channels)}/"
        self._sent = itertools.count()
        self._received = 0
        self.poll_ms = int(poll_s * 1000)
        self.is_leader = jax.process_index() == 0

    def publish(self, message: tuple[Any, ...]) -> None:
        """Leader: append `message` (picklable: numpy batches, strings)."""
        n = next(self._sent)
        self._client.key_value_set_bytes(f"{self._prefix}{n}", pickle.dumps(message))
        if n >= 2:
            self._client.key_value_delete(f"{self._prefix}{n - 2}")

    def receive(self) -> tuple[Any, ...]:
        """Follower: the next message, waiting for it as long as it takes."""
        key = f"{self._prefix}{self._received}"
        while True:
            try:
                data = self._client.blocking_key_value_get_bytes(key, self.poll_ms)
                break
            except Exception as e:  # a timeout: nothing published yet (an idle leader); wait again
                if "DEADLINE_EXCEEDED" not in str(e) and "timed out" not in str(e).lower():
                    raise
        self._received += 1
        return pickle.loads(data)
