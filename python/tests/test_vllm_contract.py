"""vLLM's CachedWeightProvider contract, call by call, against expert_cache_torch.vllm: a test suite
in the style of vLLM's own provider tests, written here from vLLM's documented and implemented
behaviour (docs/reference_providers.md, docs/python.md "Coming from vLLM"), reading the provider's
private state through the compatibility views (_lru, _free_slots, _free, _clock, _cpu_*) as vLLM's
tests do. Plain unittest; exits 77 (skip) when torch or a CUDA device is missing. Run from python/
after `python setup.py build_ext --inplace` (python/run_gpu_tests.sh does both).
"""
import dataclasses
import sys
import unittest

from cuda_or_skip import torch, ev

HIDDEN, INTER = 16, 32


def weights(experts, dtype=torch.bfloat16, seed=42):
    g = torch.Generator().manual_seed(seed)
    w13 = torch.randn(experts, 2 * INTER, HIDDEN, generator=g).to(dtype)
    w2 = torch.randn(experts, HIDDEN, INTER, generator=g).to(dtype)
    return w13, w2


def scales(experts, seed=7):
    g = torch.Generator().manual_seed(seed)
    return torch.rand(experts, 1, generator=g), torch.rand(experts, 1, generator=g)


def make(experts=8, capacity=4, dtype=torch.bfloat16, with_scales=False, split="token", cls=None):
    w13, w2 = weights(experts, dtype)
    kw = dict(capacity=capacity, w13_weight=w13, w2_weight=w2, split=split)
    sc = None
    if with_scales:
        sc = scales(experts)
        kw.update(w13_scale=sc[0], w2_scale=sc[1])
    return (cls or ev.CachedWeightProvider)(**kw), w13, w2, sc


def topk(ids):
    return torch.tensor(ids, dtype=torch.int32, device="cuda").unsqueeze(0)


def rows(r):
    return torch.tensor(r, dtype=torch.int32, device="cuda")


class CachedWeightProviderContract(unittest.TestCase):
    def assert_slot_holds(self, provider, expert, w13, w2):
        torch.cuda.synchronize()
        slot = provider._lru[expert][0]
        self.assertTrue(torch.equal(provider.buf_w13[slot].cpu(), w13[expert]), f"w13 of expert {expert}")
        self.assertTrue(torch.equal(provider.buf_w2[slot].cpu(), w2[expert]), f"w2 of expert {expert}")

    # ---- the cache ----
    def test_cold_misses_then_warm_hits(self):
        for experts in (8, 64):
            for capacity in (1, 4):
                for dtype in (torch.bfloat16, torch.float16):
                    with self.subTest(experts=experts, capacity=capacity, dtype=dtype):
                        p, w13, w2, _ = make(experts, capacity, dtype)
                        ids = list(range(capacity))
                        r = p.prepare(topk(ids))
                        self.assertEqual((p.hits, p.misses), (0, capacity))
                        self.assertIsInstance(r, ev.ExpertWeightResult)
                        self.assertIs(r.w1, p.buf_w13)
                        self.assertIs(r.w2, p.buf_w2)
                        self.assertEqual(tuple(r.expert_map.shape), (experts,))
                        for e in ids:
                            self.assert_slot_holds(p, e, w13, w2)
                        p.prepare(topk(ids))
                        self.assertEqual((p.hits, p.misses), (capacity, capacity))

    def test_capacity_equal_to_experts_never_evicts(self):
        p, *_ = make(8, 8)
        p.prepare(topk(list(range(8))))
        self.assertEqual(p.misses, 8)
        self.assertEqual(p._free_slots, [])
        p.prepare(topk(list(range(8))))
        self.assertEqual(p.hits, 8)
        self.assertEqual(p.stats()["evictions"], 0)

    def test_expert_map_names_this_forwards_experts_only(self):
        p, *_ = make(8, 4)
        p.prepare(topk([0, 1, 2]))
        r = p.prepare(topk([1, 3]))
        torch.cuda.synchronize()
        mapping = r.expert_map.cpu().tolist()
        self.assertEqual(r.expert_map.dtype, torch.int32)
        for e in range(8):
            self.assertEqual(mapping[e], p._lru[e][0] if e in (1, 3) else -1, f"expert {e}")
        self.assertIn(0, p._lru)  # resident, but not this forward's: -1 above

    def test_either_id_dtype(self):
        for dtype in (torch.int32, torch.int64):
            p, *_ = make()
            r = p.prepare(torch.tensor([[0, 1]], dtype=dtype, device="cuda"))
            self.assertEqual(r.expert_map.dtype, torch.int32)
            self.assertEqual(r.topk_ids.dtype, dtype)

    def test_first_miss_takes_the_last_slot_and_freed_slots_come_back_first(self):
        p, *_ = make(8, 4)
        self.assertEqual(p._free_slots, [0, 1, 2, 3])
        p.prepare(topk([5]))
        self.assertEqual(p._lru[5], [3, 1, 1])
        self.assertEqual(p._free_slots, [0, 1, 2])
        p.prepare(topk([2, 5]))  # 2 misses (slot 2), 5 hits: freq 2, last 3
        self.assertEqual(list(p._lru.items()), [(5, [3, 2, 3]), (2, [2, 1, 2])])
        self.assertEqual(p._clock, 3)
        p.invalidate(5)
        self.assertEqual(p._free_slots, [0, 1, 3])
        p.prepare(topk([7]))
        self.assertEqual(p._lru[7][0], 3)

    # ---- LFRU ----
    def test_frequency_beats_recency(self):
        p, w13, _, _ = make(capacity=2)
        p.prepare(topk([0, 1]))
        for _ in range(4):
            p.prepare(topk([0]))      # 0: freq 5
        p.prepare(topk([1]))          # 1: the most recent, freq 2
        p.prepare(topk([2]))
        self.assertIn(0, p._lru)
        self.assertIn(2, p._lru)
        self.assertNotIn(1, p._lru)
        torch.cuda.synchronize()
        self.assertTrue(torch.equal(p.buf_w13[p._lru[2][0]].cpu(), w13[2]))

    def test_stale_frequent_expert_loses(self):
        p, *_ = make(capacity=2)
        for _ in range(11):
            p.prepare(topk([0]))
        for _ in range(51):
            p.prepare(topk([1]))
        p.prepare(topk([2]))  # scores at clock 62: 0: 11 / 52, 1: 51 / 1
        self.assertIn(1, p._lru)
        self.assertNotIn(0, p._lru)

    def test_capacity_one_replaces_every_time(self):
        p, *_ = make(capacity=1)
        for e in range(5):
            p.prepare(topk([e]))
        self.assertEqual((p.hits, p.misses), (0, 5))
        self.assertEqual(list(p._lru), [4])

    def test_eviction_reuses_the_victims_slot(self):
        p, w13, w2, _ = make(capacity=4)
        p.prepare(topk([0, 1, 2, 3]))
        p.prepare(topk([1, 2, 3]))
        slot_of_0 = p._lru[0][0]
        p.prepare(topk([7]))
        self.assertEqual(p._lru[7][0], slot_of_0)
        self.assert_slot_holds(p, 7, w13, w2)

    def test_a_forward_never_evicts_its_own_experts(self):
        p, w13, w2, _ = make(8, 4)
        for _ in range(50):
            p.prepare(topk([0, 1, 2, 3]))
        batch = [4, 5, 6, 7]
        r = p.prepare(topk(batch))
        torch.cuda.synchronize()
        mapping = r.expert_map.cpu().tolist()
        for e in batch:
            self.assertGreaterEqual(mapping[e], 0)
            self.assert_slot_holds(p, e, w13, w2)

    # ---- scales ----
    def test_scales_follow_their_expert(self):
        p, _, _, (s13, s2) = make(8, 4, with_scales=True)
        self.assertEqual(p.buf_w13_scale.device.type, "cuda")
        r = p.prepare(topk([3, 6]))
        torch.cuda.synchronize()
        for e in (3, 6):
            slot = p._lru[e][0]
            self.assertTrue(torch.equal(r.w1_scale[slot].cpu(), s13[e]))
            self.assertTrue(torch.equal(r.w2_scale[slot].cpu(), s2[e]))
        p.prepare(topk([0, 1]))
        p.prepare(topk([3, 6, 0]))
        p.prepare(topk([7]))  # 1 is the stalest
        self.assertNotIn(1, p._lru)
        torch.cuda.synchronize()
        slot = p._lru[7][0]
        self.assertTrue(torch.equal(p.buf_w13_scale[slot].cpu(), s13[7]))
        self.assertTrue(torch.equal(p.buf_w2_scale[slot].cpu(), s2[7]))

    def test_no_scales_means_none(self):
        p, *_ = make()
        self.assertIsNone(p.buf_w13_scale)
        self.assertIsNone(p.buf_w2_scale)
        r = p.prepare(topk([0]))
        self.assertIsNone(r.w1_scale)
        self.assertIsNone(r.w2_scale)

    # ---- invalidate ----
    def test_invalidate_returns_the_slot(self):
        p, *_ = make()
        p.prepare(topk([0, 1, 2, 3]))
        slot = p._lru[2][0]
        p.invalidate(2)
        self.assertNotIn(2, p._lru)
        self.assertIn(slot, p._free_slots)
        self.assertEqual(p._free_slots[-1], slot)

    def test_invalidate_of_an_expert_not_held_does_nothing(self):
        p, *_ = make(8, 4)
        p.prepare(topk([0, 1]))
        before = (dict(p._lru), p._free_slots, p._clock, p.stats())
        for e in (5, 99, 8, -1, -8, 2**63, -2**63 - 1):
            p.invalidate(e)  # must not raise
            self.assertEqual((dict(p._lru), p._free_slots, p._clock, p.stats()), before, f"invalidate({e})")

    # ---- overflow ----
    def test_more_experts_than_slots_raises(self):
        p, *_ = make(capacity=2)
        with self.assertRaisesRegex(RuntimeError, "unique experts"):
            p.prepare(topk([0, 1, 2, 3]))
        self.assertEqual(dict(p._lru), {})
        self.assertEqual((p.hits, p.misses), (0, 0))

    # ---- host sources ----
    def test_host_sources_are_pinned(self):
        p, w13, w2, _ = make(with_scales=True)
        for t, src in ((p._cpu_w13, w13), (p._cpu_w2, w2)):
            self.assertTrue(t.is_pinned())
            self.assertTrue(torch.equal(t, src))
        self.assertTrue(p._cpu_w13_scale.is_pinned())
        self.assertIsNone(p._cpu_w13_scale_2)

    def test_views_are_read_only(self):
        p, *_ = make()
        p.prepare(topk([1]))
        with self.assertRaises(TypeError):
            p._lru[1] = [0, 1, 1]
        with self.assertRaises(AttributeError):
            p._free_slots = []
        p._free_slots.append(3)  # a copy: the cache does not see it
        self.assertEqual(p._free_slots, [0, 1, 2])

    # ---- the expert split ----
    def test_one_group_when_the_experts_fit(self):
        p, *_ = make(8, 4, split="expert")
        self.assertEqual(p.plan_expert_groups(rows([[0, 1], [1, 2], [2, 3]])), [[0, 1, 2, 3]])

    def test_groups_partition_the_experts(self):
        p, *_ = make(8, 3, split="expert")
        ids = rows([[0, 1], [2, 3], [4, 5], [6, 7]])
        groups = p.plan_expert_groups(ids)
        self.assertGreater(len(groups), 1)
        flat = [e for g in groups for e in g]
        self.assertEqual(sorted(flat), list(range(8)))
        self.assertEqual(len(flat), len(set(flat)))
        self.assertTrue(all(len(g) <= p.capacity for g in groups))
        many = rows([[0, 1], [2, 3], [4, 5], [6, 7]] * 50)
        self.assertEqual(len(p.plan_expert_groups(many)), len(groups))

    def test_each_group_sees_only_its_experts(self):
        p, w13, _, _ = make(8, 3, split="expert")
        ids = rows([[0, 1], [2, 3], [4, 5], [6, 7]])
        for group in p.plan_expert_groups(ids):
            r = p.prepare(ids, group)
            torch.cuda.synchronize()
            mapping = r.expert_map.cpu().tolist()
            self.assertEqual({e for e, s in enumerate(mapping) if s >= 0}, set(group))
            for e in group:
                self.assertTrue(torch.equal(r.w1[mapping[e]].cpu(), w13[e]))

    def test_expert_split_covers_every_pair_once(self):
        for split in ("expert", "token"):
            with self.subTest(split=split):
                p, *_ = make(8, 3, split=split)
                ids = rows([[0, 1], [2, 3], [4, 5], [6, 7]])
                seen, shared = [], []

                def run(result, r, include_shared):
                    shared.append(include_shared)
                    seen.extend(e for e, s in enumerate(result.expert_map.cpu().tolist()) if s >= 0)
                    return torch.zeros(ids[r].shape[0], 4, device="cuda")

                out = ev.run_with_expert_cache(p, ids, run)
                self.assertEqual(sorted(seen), list(range(8)))
                self.assertEqual(tuple(out.shape), (4, 4))
                if split == "expert":
                    self.assertTrue(shared[0])
                    self.assertFalse(any(shared[1:]), "shared work belongs to one round only")

    def test_single_group_output_is_runs_own(self):
        p, *_ = make(8, 4, split="expert")
        out = torch.arange(6, dtype=torch.float64, device="cuda").view(2, 3) / 3
        got = ev.run_with_expert_cache(p, rows([[0, 1], [2, 3]]), lambda r, rr, s: out)
        self.assertIs(got, out)

    # ---- the token split ----
    def test_one_chunk_when_the_batch_fits(self):
        p, *_ = make(8, 4)
        plan = p.plan_chunks(rows([[0, 1], [1, 2], [2, 3]]))
        self.assertEqual([r for r, _ in plan], [slice(0, 3)])
        self.assertEqual(plan[0][1], [0, 1, 2, 3])
        self.assertEqual(p.plan_chunks(rows([[0, 1]])[:0]), [(slice(0, 0), [])])

    def test_chunks_tile_the_batch(self):
        p, *_ = make(8, 4)
        ids = rows([[0, 1], [2, 3], [4, 5], [6, 7]])
        plan = p.plan_chunks(ids)
        chunks = [r for r, _ in plan]
        self.assertGreater(len(chunks), 1)
        self.assertEqual(chunks[0].start, 0)
        self.assertEqual(chunks[-1].stop, 4)
        for a, b in zip(chunks, chunks[1:]):
            self.assertEqual(a.stop, b.start)
        for r, unique in plan:
            self.assertLessEqual(ids[r].unique().numel(), p.capacity)
            self.assertEqual(unique, sorted(ids[r].unique().tolist()))

    def test_a_token_wider_than_the_cache_cannot_be_split(self):
        p, *_ = make(8, 2)
        with self.assertRaisesRegex(RuntimeError, "one token routes to"):
            p.plan_chunks(rows([[0, 1, 2, 3]]))

    def test_negative_ids_are_padding(self):
        p, *_ = make(8, 4)
        ids = rows([[0, 1], [-1, 2], [-1, -1]])
        plan = p.plan_chunks(ids)
        self.assertTrue(all(e >= 0 for _, u in plan for e in u))
        r = p.prepare(ids, plan[0][1])
        torch.cuda.synchronize()
        self.assertEqual({e for e, s in enumerate(r.expert_map.cpu().tolist()) if s >= 0}, {0, 1, 2})
        self.assertNotIn(7, p._lru)  # -1 never reached the last expert
        self.assertTrue(all(e >= 0 for g in p.plan_expert_groups(ids) for e in g))

    # ---- the result and prepare's arguments ----
    def test_result_is_vllms_dataclass(self):
        names = [f.name for f in dataclasses.fields(ev.ExpertWeightResult)]
        self.assertEqual(names[:5], ["w1", "w2", "expert_map", "w1_scale", "w2_scale"])
        p, *_ = make()
        r = p.prepare(topk([1]))
        again = ev.ExpertWeightResult(r.w1, r.w2, r.expert_map)
        self.assertIs(again.expert_map, r.expert_map)
        self.assertIsNone(again.w1_scale)

    def test_unique_ids_without_topk_ids(self):
        p, *_ = make(8, 4)
        r = p.prepare(None, [6, 2])  # processed in this order: 6 takes slot 3, 2 slot 2
        self.assertIsNone(r.topk_ids)
        self.assertEqual(list(p._lru.items()), [(6, [3, 1, 1]), (2, [2, 1, 2])])


class RowCacheWeightProviderContract(unittest.TestCase):
    def test_lru_order_and_free_list(self):
        p, w13, w2, _ = make(8, 3, cls=ev.RowCacheWeightProvider)
        self.assertEqual(p._free, [2, 1, 0])
        p.prepare(topk([4, 1]))  # ascending: 1 -> slot 0, 4 -> slot 1
        self.assertEqual(list(p._lru.items()), [(1, 0), (4, 1)])
        p.prepare(topk([1]))
        self.assertEqual(list(p._lru), [4, 1])
        p.prepare(topk([6, 7]))  # 6 takes the last free slot, 7 evicts the least recent (4)
        self.assertEqual(list(p._lru.items()), [(1, 0), (6, 2), (7, 1)])
        self.assertEqual(p._free, [])
        p.invalidate(6)
        p.invalidate(60)
        self.assertEqual(p._free, [2])
        self.assertEqual(set(p._cpu), {"w13", "w2", "w13_scale", "w2_scale", "w13_scale_2", "w2_scale_2"})
        self.assertTrue(torch.equal(p._cpu["w13"], w13))
        with self.assertRaises(AttributeError):
            p._free_slots  # CachedWeightProvider's name; the row provider's is _free


if __name__ == "__main__":
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, device {torch.cuda.get_device_name()}")
    result = unittest.main(exit=False, verbosity=2).result
    ok = result.wasSuccessful() and result.testsRun > 0
    print(f"SUMMARY: {result.testsRun} tests, {len(result.failures)} failures, {len(result.errors)} errors, "
          f"{len(result.skipped)} skipped -> {'PASS' if ok else 'FAIL'}")
    sys.exit(0 if ok else 1)
