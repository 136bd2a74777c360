"""expert_cache_torch/_vllm_state.py without torch (python3 alone; meson test `vllm_state`).

StateLedger rebuilds vLLM's private provider state (_lru, _clock, _free_slots / _free) from the
slots the library's planner chose. Here an independent model of vLLM's two providers, written from
their documented behaviour (docs/reference_providers.md), makes the decisions; the ledger sees
only what the provider sees from the library (the processing order and the slots afterwards) and
must end up with the model's state at every step: random traces of forwards, explicit unique
lists, invalidations (held, absent, out of range) and prefetches, for both providers. Then a step
that contradicts the ledger, and a live map it never saw, are caught and rebuilt.
"""
import importlib.util
import os
import random
import sys
import unittest
from collections import OrderedDict

_HERE = os.path.dirname(os.path.abspath(__file__))
_spec = importlib.util.spec_from_file_location(
    "vllm_state", os.path.join(os.path.dirname(_HERE), "expert_cache_torch", "_vllm_state.py"))
vllm_state = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(vllm_state)  # the module alone: the package itself needs torch
StateLedger = vllm_state.StateLedger


class VllmModel:
    """vLLM's providers as documented. lfru: CachedWeightProvider (insertion-ordered
    {e: [slot, freq, last]}, victim = lowest freq / (clock - last + 1) outside the forward, first
    inserted on ties, free list [0..C-1] popped from the end). lru: the row provider (LRU order,
    hits move to the end, victim = least recent outside the forward, free list [C-1..0])."""

    def __init__(self, capacity, kind):
        self.kind = kind
        self.clock = 0
        self.table = OrderedDict()
        self.free = list(range(capacity)) if kind == "lfru" else list(range(capacity - 1, -1, -1))

    def _victim(self, protected):
        if self.kind == "lru":
            return next(e for e in self.table if e not in protected)
        best, best_score = None, None
        for e, (slot, freq, last) in self.table.items():
            if e in protected:
                continue
            score = freq / (self.clock - last + 1)
            if best is None or score < best_score:
                best, best_score = e, score
        return best

    def _fill(self, e, protected):
        if self.free:
            slot = self.free.pop()
        else:
            slot = self.table.pop(self._victim(protected))[0]
        self.clock += 1
        self.table[e] = [slot, 1, self.clock]

    def prepare(self, unique):
        protected = set(unique)
        for e in unique:
            if e in self.table:
                self.clock += 1
                self.table[e][1] += 1
                self.table[e][2] = self.clock
                if self.kind == "lru":
                    self.table.move_to_end(e)
            else:
                self._fill(e, protected)
        return {e: self.table[e][0] for e in unique}

    def prefetch(self, predicted, max_fills, protected):
        """The library's prefetch on these rules: absent predicted experts in list order, at most
        max_fills, never evicting `protected` (the last forward's experts) or any expert this list
        names, wherever it is listed."""
        protected = set(protected) | {e for e in predicted if e in self.table}
        fills = 0
        for e in predicted:
            if e in self.table:
                protected.add(e)
                continue
            if fills == max_fills or (not self.free and all(x in protected for x in self.table)):
                break
            self._fill(e, protected)
            protected.add(e)
            fills += 1

    def invalidate(self, e):
        if e in self.table:
            self.free.append(self.table.pop(e)[0])

    def resident(self, experts):
        m = [-1] * experts
        for e, v in self.table.items():
            m[e] = v[0]
        return m


class StateLedgerTest(unittest.TestCase):
    def assert_same(self, ledger, model, experts):
        self.assertTrue(ledger.matches(model.resident(experts)))
        self.assertTrue(ledger.sync(model.resident(experts)), "an exact ledger stays exact")
        self.assertEqual(ledger.free_view(), model.free)
        if model.kind == "lfru":
            self.assertEqual(list(ledger.lfru_view().items()), [(e, list(v)) for e, v in model.table.items()])
            self.assertEqual(ledger.clock, model.clock)
        else:
            self.assertEqual(list(ledger.lru_view().items()), [(e, v[0]) for e, v in model.table.items()])

    def test_random_traces_follow_both_providers(self):
        for kind in ("lfru", "lru"):
            for seed in range(40):
                with self.subTest(kind=kind, seed=seed):
                    rng = random.Random(seed)
                    experts, capacity = rng.choice([(6, 1), (8, 3), (12, 4), (16, 8), (5, 5)])
                    model, ledger = VllmModel(capacity, kind), StateLedger(capacity, recency=kind == "lru")
                    self.assert_same(ledger, model, experts)
                    last_forward = []
                    for _ in range(60):
                        op = rng.random()
                        if op < 0.55:    # top-k ids: the unique set in ascending order
                            unique = sorted(rng.sample(range(experts), rng.randint(0, capacity)))
                            ledger.forward(unique, model.prepare(unique))
                            last_forward = unique
                        elif op < 0.75:  # an explicit unique list, in its own order
                            unique = rng.sample(range(experts), rng.randint(1, capacity))
                            ledger.forward(unique, model.prepare(unique))
                            last_forward = unique
                        elif op < 0.9:   # held, absent and out-of-range ids alike
                            e = rng.randint(-2, experts + 1)
                            model.invalidate(e)
                            ledger.invalidate(e)
                        else:
                            predicted = rng.sample(range(experts), rng.randint(1, experts))
                            model.prefetch(predicted, rng.randint(0, capacity), last_forward)
                            ledger.prefetched(predicted, model.resident(experts))
                        self.assert_same(ledger, model, experts)
                    self.assertTrue(ledger.exact)

    def test_documented_examples(self):
        # docs/reference_providers.md: the first miss gets slot C-1, freed slots are reused LIFO.
        ledger = StateLedger(4, recency=False)
        ledger.forward([2, 5], {2: 3, 5: 2})
        self.assertEqual(ledger.lfru_view(), OrderedDict([(2, [3, 1, 1]), (5, [2, 1, 2])]))
        self.assertEqual(ledger.free_view(), [0, 1])
        ledger.forward([5], {5: 2})  # a hit: freq 2, last 3, order unchanged
        self.assertEqual(list(ledger.lfru_view().items()), [(2, [3, 1, 1]), (5, [2, 2, 3])])
        ledger.invalidate(2)
        self.assertEqual(ledger.free_view(), [0, 1, 3])
        ledger.forward([7], {7: 3})
        self.assertEqual(list(ledger.lfru_view()), [5, 7])
        self.assertEqual(ledger.clock, 4)
        # The row provider: slot 0 first, a hit moves to the end.
        row = StateLedger(3, recency=True)
        row.forward([1, 4], {1: 0, 4: 1})
        row.forward([1], {1: 0})
        self.assertEqual(list(row.lru_view().items()), [(4, 1), (1, 0)])
        self.assertEqual(row.free_view(), [2])

    def test_contradicting_step_is_caught_and_rebuilt_from_the_live_map(self):
        ledger = StateLedger(3, recency=False)
        ledger.forward([0, 1], {0: 2, 1: 1})
        ledger.forward([4], {4: 2})  # slot 2 is held by 0 while slot 0 is still free: impossible
        self.assertFalse(ledger.exact)
        live = [-1] * 6
        live[0], live[1], live[4] = 2, 1, 0  # what the cache says
        self.assertFalse(ledger.sync(live))
        self.assertTrue(ledger.matches(live))
        self.assertEqual(ledger.lfru_view(), OrderedDict([(0, [2, 1, 1]), (1, [1, 1, 2]), (4, [0, None, None])]))
        self.assertEqual(ledger.free_view(), [])
        # Later steps are followed again from the rebuilt state; exact stays False.
        ledger.invalidate(1)
        ledger.forward([3, 4], {3: 1, 4: 0})
        self.assertEqual(ledger.lfru_view()[4], [0, None, 4])
        self.assertFalse(ledger.exact)

    def test_unseen_changes_are_rebuilt(self):
        ledger = StateLedger(4, recency=True)
        ledger.forward([0, 1, 2], {0: 0, 1: 1, 2: 2})
        live = [-1] * 8
        live[1], live[2], live[6] = 1, 2, 0  # 0 dropped and 6 filled behind the ledger's back
        self.assertFalse(ledger.matches(live))
        self.assertFalse(ledger.sync(live))
        self.assertEqual(list(ledger.lru_view().items()), [(1, 1), (2, 2), (6, 0)])
        self.assertEqual(ledger.free_view(), [3])
        self.assertTrue(ledger.matches(live))

    def test_bad_capacity_refused(self):
        for capacity in (0, -3):
            with self.assertRaises(ValueError) as cm:
                StateLedger(capacity, recency=False)
            self.assertIn(f"capacity must be positive, got {capacity}", str(cm.exception))


if __name__ == "__main__":
    result = unittest.main(exit=False, verbosity=2).result
    ok = result.wasSuccessful() and result.testsRun > 0
    print(f"SUMMARY: {result.testsRun} tests, {len(result.failures)} failures, {len(result.errors)} errors -> "
          f"{'PASS' if ok else 'FAIL'}")
    sys.exit(0 if ok else 1)
