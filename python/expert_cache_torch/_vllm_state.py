"""vLLM's private provider state, rebuilt from the library's decisions (docs/python.md "Coming from
vLLM", compatibility views). No torch: tests/cli/test_vllm_state.py runs it with python3 alone.

vLLM's providers keep their state in Python attributes that tests and tools read directly:

    CachedWeightProvider     _lru = {expert: [slot, freq, last]} in insertion order (hits do not
                             reorder it), _clock, _free_slots = [0, 1, ..., C-1] popped from the end
                             (the first miss gets slot C-1), invalidate appends;
    RowCacheWeightProvider   _lru = OrderedDict {expert: slot} in LRU order (hits move to the end),
                             _free = [C-1, ..., 0] popped from the end (slot 0 first).

The library keeps the same state in its planner (Lfru / Lru) without exposing the order, the
counters or the free stack, so StateLedger follows every accepted plan: the experts in the
planner's processing order and the slot each one has afterwards. From those alone the vLLM
bookkeeping is determined (a miss takes the top of the free stack while it is not empty, else the
slot of the expert it evicts; every hit or miss advances the clock by one), and every step is
checked against what it implies; sync() compares the ledger with the live resident map. A ledger
that could not follow (a step that contradicts it, or calls on the cache it never saw) is rebuilt
from the live map by sync(): then `exact` is False, experts it no longer knows get freq and last
None and come last in slot order.
"""

from collections import OrderedDict

__all__ = ["StateLedger"]


class _Diverged(Exception):
    """A plan the ledger's state cannot have produced."""


class StateLedger:
    """recency False: CachedWeightProvider's bookkeeping (LFRU); True: the row provider's (LRU)."""

    def __init__(self, capacity, recency):
        capacity = int(capacity)
        if capacity <= 0:
            raise ValueError(f"StateLedger: capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.recency = bool(recency)
        self.clock = 0
        self.entries = OrderedDict()  # expert -> [slot, freq, last]
        self.owner = {}               # slot -> expert
        self.free = self._initial_free()
        self.exact = True

    def _initial_free(self):
        return list(range(self.capacity - 1, -1, -1)) if self.recency else list(range(self.capacity))

    # ---- the steps the provider reports ----
    def forward(self, order, slot_of):
        """One accepted plan: `order` the forward's unique experts in processing order (ascending
        for top-k ids, the given order for unique_ids), slot_of[e] the slot e holds after it."""
        self._apply(lambda: [self._touch(int(e), int(slot_of[e])) for e in order])

    def prefetched(self, predicted, resident):
        """One accepted prefetch: `predicted` the ids in the order given, resident[e] the live slot
        of every expert afterwards (-1 absent). Fills are the predicted experts that were absent
        and are resident now, taken in list order (the planner's); skipped ones change nothing."""
        def step():
            for e in predicted:
                e = int(e)
                if e in self.entries or not 0 <= e < len(resident) or resident[e] < 0:
                    continue
                self._insert(e, int(resident[e]))
        self._apply(step)

    def invalidate(self, expert):
        """vLLM's invalidate: the slot of a held expert goes on top of the free stack; anything
        else is a no-op."""
        entry = self.entries.pop(expert, None)
        if entry is not None:
            del self.owner[entry[0]]
            self.free.append(entry[0])

    # ---- against the live state ----
    def matches(self, resident):
        """Whether the ledger holds exactly the live residents (resident[e] = slot or -1) at their slots."""
        live = {e: s for e, s in enumerate(resident) if s >= 0}
        return live == {e: v[0] for e, v in self.entries.items()}

    def sync(self, resident):
        """Makes the ledger agree with the live resident map (a no-op while it does). Experts it
        knows at their live slot keep their order and counters; the others follow in slot order
        with freq and last None; the free stack keeps the order it knows, slots it did not know
        are free go below them in their initial order. Returns `exact`."""
        if self.matches(resident):
            return self.exact
        live = {e: s for e, s in enumerate(resident) if s >= 0}
        kept = OrderedDict((e, v) for e, v in self.entries.items() if live.get(e) == v[0])
        for e in sorted(live, key=live.get):
            if e not in kept:
                kept[e] = [live[e], None, None]
        used = set(live.values())
        known_free = [s for s in self.free if s not in used]
        seen = set(known_free)
        self.free = [s for s in self._initial_free() if s not in used and s not in seen] + known_free
        self.entries = kept
        self.owner = {v[0]: e for e, v in kept.items()}
        self.exact = False
        return False

    # ---- the vLLM views ----
    def lfru_view(self):
        """CachedWeightProvider._lru: {expert: [slot, freq, last]} in insertion order (a copy)."""
        return OrderedDict((e, list(v)) for e, v in self.entries.items())

    def lru_view(self):
        """RowCacheWeightProvider._lru: {expert: slot} in LRU order (a copy)."""
        return OrderedDict((e, v[0]) for e, v in self.entries.items())

    def free_view(self):
        """_free_slots / _free: the free stack, popped from the end (a copy)."""
        return list(self.free)

    # ---- internals ----
    def _apply(self, step):
        try:
            step()
        except _Diverged:
            # Left as far as it got; sync() rebuilds it from the live map on the next read.
            self.exact = False

    def _touch(self, e, slot):
        entry = self.entries.get(e)
        if entry is None:
            self._insert(e, slot)
            return
        if entry[0] != slot:
            raise _Diverged(f"expert {e} is held in slot {entry[0]}, the plan puts it in {slot}")
        self.clock += 1
        if entry[1] is not None:
            entry[1] += 1
        entry[2] = self.clock
        if self.recency:
            self.entries.move_to_end(e)

    def _insert(self, e, slot):
        if not 0 <= slot < self.capacity:
            raise _Diverged(f"expert {e} filled into slot {slot}, outside the {self.capacity} slots")
        if self.free:
            if self.free[-1] != slot:
                raise _Diverged(f"expert {e} filled into slot {slot}, the free stack's top is {self.free[-1]}")
            self.free.pop()
        else:
            victim = self.owner.get(slot)
            if victim is None:
                raise _Diverged(f"expert {e} filled into slot {slot}, which no held expert had")
            del self.entries[victim]
        self.clock += 1
        self.entries[e] = [slot, 1, self.clock]
        self.owner[slot] = e
