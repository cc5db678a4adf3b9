"""Device-resident block tables: the host sends only the entries that changed.

`PagedKVState.block_tables` (i32[max_slots, max_pages_per_seq]) lives on the device between
steps. The scheduler owns each request's page list (`Request.pages`) and names the slots
whose list it changed (`Scheduler.take_changed_slots`); `TableMirror` keeps the host's copy
of what the device holds, diffs only those slots against it and packs the differences as
fixed-size (slot, column, page) triples that `apply_table_updates` scatters on the device::

    device row of slot 3   [7, 2, NULL, NULL]      request's pages  [7, 2, 9]
    triple                 (3, 2, 9)               -> [7, 2, 9, NULL]
    slot 3 freed           (3, 0, NULL), (3, 1, NULL), (3, 2, NULL)

A step that appends a page to a few slots sends a few triples instead of the whole
[max_slots, width] table. A reassigned slot or a prefix hit sends its row's changed columns;
more triples than one update holds go as several updates (same shape: no new program).
Unused triples name slot `max_slots`, which the scatter drops.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable

import jax
import numpy as np
from flax import struct

from jaxinfer.kv.pages import NULL_PAGE


@struct.dataclass
class TableUpdates:
    slots: jax.Array  # i32[N]: row of each entry (max_slots: padding, dropped)
    columns: jax.Array  # i32[N]: block-table column of each entry
    pages: jax.Array  # i32[N]: the page the entry now names


@functools.partial(jax.jit, donate_argnums=0)
def apply_table_updates(tables: jax.Array, updates: TableUpdates) -> jax.Array:
    """tables i32[max_slots, max_pages_per_seq] with `updates` written in; donates `tables`."""
    return tables.at[updates.slots, updates.columns].set(updates.pages, mode="drop")


def updates_size(max_slots: int, page_size: int, max_chunk: int) -> int:
    """Triples in one update: every slot gaining the most pages one step can add to it
    (a chunk of `max_chunk` tokens straddles at most ceil(max_chunk / page_size) + 1 pages)."""
    return max_slots * (-(-max_chunk // page_size) + 1)


class TableMirror:
    """The host's copy of the device's block tables, and the updates that keep them equal."""

    def __init__(self, max_slots: int, max_pages_per_seq: int, size: int):
        self.rows = np.full((max_slots, max_pages_per_seq), NULL_PAGE, np.int32)  # i32[max_slots, max_pages_per_seq]
        self.used = np.zeros(max_slots, np.int64)  # i64[max_slots]: columns that may be non-null per row
        self.size = size

    def idle(self) -> TableUpdates:
        """An update that changes nothing (warm-up compiles the update program with it)."""
        pad = np.full(self.size, self.rows.shape[0], np.int32)
        zeros = np.zeros(self.size, np.int32)
        return TableUpdates(slots=pad, columns=zeros, pages=zeros.copy())

    def updates(self, rows: Iterable[tuple[int, list[int]]]) -> list[TableUpdates]:
        """Updates that make the device rows equal (slot, pages) for each changed slot given
        (pages [] for a freed slot), in updates of `size` triples; [] when nothing differs.
        The mirror takes the new rows as sent."""
        triples = [self._take_row(slot, pages) for slot, pages in rows]
        if not triples or not sum(len(t[0]) for t in triples):
            return []
        slots, columns, pages = (np.concatenate(part) for part in zip(*triples))  # i32[T] each
        return [self._pack(slots[i: i + self.size], columns[i: i + self.size], pages[i: i + self.size])
                for i in range(0, len(slots), self.size)]

    def _take_row(self, slot: int, new: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Slot `slot`'s row becomes `new` (NULL_PAGE after it) -> the (slots, columns, pages)
        i32[c] of its c entries that differ from what the device holds."""
        n = max(len(new), int(self.used[slot]))
        row = np.full(n, NULL_PAGE, np.int32)  # i32[n]
        row[: len(new)] = new
        changed = np.flatnonzero(self.rows[slot, :n] != row).astype(np.int32)  # i32[c]
        self.rows[slot, :n] = row
        self.used[slot] = len(new)
        return np.full(len(changed), slot, np.int32), changed, row[changed]

    def _pack(self, slots: np.ndarray, columns: np.ndarray, pages: np.ndarray) -> TableUpdates:
        """Up to `size` triples (i32[<= size] each), padded to one update."""
        update = self.idle()
        update.slots[: len(slots)], update.columns[: len(slots)], update.pages[: len(slots)] = slots, columns, pages
        return update
