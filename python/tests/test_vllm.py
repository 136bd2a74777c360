"""GPU tests of expert_cache_torch.vllm (vLLM's provider surface), prefetch, the model-level cache
and policy choice by name. Plain unittest; exits 77 (skip) when torch or a CUDA device is missing.
Run from python/ after `python setup.py build_ext --inplace` (python/run_gpu_tests.sh does both).

Covers:
- the providers ("lfru", "row") driven with the same random calls as the library's reference
  planners (_C.ReferencePlanner: the host Lfru / Lru) and, for "lfru", an independent Python
  transcription of docs/reference_providers.md "LFRU, exactly": hits, misses, fills, victims,
  slot contents of all six tensors, the forward-scoped expert_map and the remapped topk_ids at
  every step (CPU and CUDA ids, int32 and int64, explicit unique_ids, invalidate);
- the documented examples (frequency beats recency, a stale frequent expert loses, capacity 1,
  eviction reuses the slot, scales follow their expert, invalidate frees the slot);
- sources: pinned aliased, pageable pinned once, GPU copied once; slot buffers' dtypes, shapes,
  stable addresses;
- bad input: ValueError / RuntimeError naming the tensor and the expected value, nothing changed;
- run_with_expert_cache (token and expert split) equal to an uncached MoE;
- "device": captured in a CUDA graph and replayed, with each fill engine; host semantics refuse a
  capture;
- prefetch (host and device ids; scored hints, the compatibility views following the fills in
  the selection's order), the model-level cache (per_layer equal to per-layer caches,
  global), policies by name (unknown names refused with the valid ones listed).
"""
import os
import sys
import unittest

from cuda_or_skip import torch, ect, ev
from expert_cache_torch import _C

E, C = 12, 4
SLOT_NAMES = {"w13_weight": "w13", "w2_weight": "w2", "w13_scale": "w13_scale", "w2_scale": "w2_scale",
              "w13_scale_2": "w13_scale_2", "w2_scale_2": "w2_scale_2"}
BUFS = {"w13_weight": "buf_w13", "w2_weight": "buf_w2", "w13_scale": "buf_w13_scale", "w2_scale": "buf_w2_scale",
        "w13_scale_2": "buf_w13_scale_2", "w2_scale_2": "buf_w2_scale_2"}


def nvfp4_sources(seed=0, experts=E, pin=True):
    """Six vLLM-shaped NVFP4-Marlin-like tensors (int32 weights, uint8 block scales, fp32 global scales)."""
    g = torch.Generator().manual_seed(seed)
    src = {
        "w13_weight": torch.randint(-2**31, 2**31 - 1, (experts, 8, 32), generator=g, dtype=torch.int32),
        "w2_weight": torch.randint(-2**31, 2**31 - 1, (experts, 16, 8), generator=g, dtype=torch.int32),
        "w13_scale": torch.randint(0, 256, (experts, 8, 16), generator=g, dtype=torch.uint8),
        "w2_scale": torch.randint(0, 256, (experts, 4, 16), generator=g, dtype=torch.uint8),
        "w13_scale_2": torch.rand(experts, generator=g),
        "w2_scale_2": torch.rand(experts, 1, generator=g),
    }
    return {k: (v.pin_memory() if pin else v) for k, v in src.items()}


class PyLfru:
    """docs/reference_providers.md "LFRU, exactly", transcribed independently of the library."""

    def __init__(self, capacity):
        self.clock = 0
        self.resident = {}  # expert -> [slot, freq, last]; dict order = insertion order
        self.free = list(range(capacity))

    def prepare(self, unique):
        hits = misses = 0
        fills, evictions = [], []
        need = set(unique)
        for e in unique:
            if e in self.resident:
                self.clock += 1
                self.resident[e][1] += 1
                self.resident[e][2] = self.clock
                hits += 1
                continue
            if self.free:
                slot = self.free.pop()
            else:
                victim, best = None, None
                for k, (s, f, last) in self.resident.items():
                    if k in need:
                        continue
                    score = f / (self.clock - last + 1)
                    if best is None or score < best:
                        victim, best = k, score
                slot = self.resident.pop(victim)[0]
                evictions.append((victim, slot))
            self.clock += 1
            self.resident[e] = [slot, 1, self.clock]
            fills.append((e, slot))
            misses += 1
        return hits, misses, fills, evictions

    def invalidate(self, e):
        if e in self.resident:
            self.free.append(self.resident.pop(e)[0])


def random_topk(g, tokens, top_k, experts=E, unique_at_most=C, pad=True):
    pool = torch.randperm(experts, generator=g)[:unique_at_most]
    ids = pool[torch.randint(0, len(pool), (tokens, top_k), generator=g)]
    if pad:
        ids[torch.rand(tokens, top_k, generator=g) < 0.1] = -1
    return ids


class VllmProviderTest(unittest.TestCase):
    def check_result(self, provider, result, ids, src, expected_map):
        """Maps, remapped ids and slot contents of one prepare against the expected forward map."""
        torch.cuda.synchronize()
        emap = result.expert_map.cpu()
        self.assertEqual(result.expert_map.dtype, torch.int32)
        self.assertTrue(result.expert_map.is_cuda)
        self.assertEqual(emap.tolist(), list(expected_map))
        self.assertEqual(result.topk_ids.dtype, ids.dtype)
        self.assertEqual(result.topk_ids.shape, ids.shape)
        self.assertEqual(result.topk_ids.device, ids.device)
        flat = ids.cpu().reshape(-1).tolist()
        want = [expected_map[e] if e >= 0 else -1 for e in flat]
        self.assertEqual(result.topk_ids.cpu().reshape(-1).tolist(), want)
        for e, slot in enumerate(expected_map):
            if slot < 0:
                continue
            for name, t in src.items():
                buf = getattr(provider, BUFS[name])
                self.assertTrue(torch.equal(buf[slot].cpu(), t[e]), f"{name} of expert {e} in slot {slot}")
        self.assertIs(result.w1, provider.buf_w13)
        self.assertIs(result.w2, provider.buf_w2)
        self.assertIs(result.w1_scale, provider.buf_w13_scale)
        self.assertIs(result.w2_scale, provider.buf_w2_scale)

    def check_views(self, p, ref, py, where):
        """vLLM's private state views against the reference planner's residents and, for "lfru",
        the LFRU transcription's dict (order, slot, freq, last), free list and clock."""
        live = {e: s for e, s in enumerate(ref.resident_map()) if s >= 0}
        lru = p._lru
        if py is not None:
            self.assertEqual(list(lru.items()), list(py.resident.items()), where)
            self.assertEqual(p._free_slots, py.free, where)
            self.assertEqual(p._clock, py.clock, where)
        else:
            self.assertEqual(dict(lru), live, where)
            self.assertEqual(sorted(p._free), sorted(set(range(C)) - set(live.values())), where)
        self.assertTrue(p._ledger.exact, where)

    def test_equal_to_reference(self):
        for semantics, cls, policy in (("lfru", ev.CachedWeightProvider, "lfru"), ("row", ev.RowCacheWeightProvider, "lru")):
            with self.subTest(semantics=semantics):
                src = nvfp4_sources(1)
                p = cls(C, src["w13_weight"], src["w2_weight"], src["w13_scale"], src["w2_scale"],
                        w13_scale_2=src["w13_scale_2"], w2_scale_2=src["w2_scale_2"], label=f"eq_{semantics}")
                self.assertEqual(p.semantics, semantics)
                self.assertEqual(p.policy, policy)
                ref = _C.ReferencePlanner(policy, E, C, 1)
                py = PyLfru(C) if semantics == "lfru" else None
                g = torch.Generator().manual_seed(2)
                hits = misses = 0
                for step in range(120):
                    if step % 11 == 10:
                        # vLLM's invalidate: ids not held, out of range included, are no-ops.
                        e = int(torch.randint(-2, E + 2, (1,), generator=g))
                        p.invalidate(e)
                        if 0 <= e < E:
                            ref.invalidate(e)
                        if py:
                            py.invalidate(e)
                        self.check_views(p, ref, py, f"step {step}")
                        continue
                    ids = random_topk(g, 3, 2)
                    ids = ids.to(torch.int32 if step % 2 else torch.int64)
                    if step % 3 == 0:
                        ids = ids.cuda()
                    unique = None
                    if step % 4 == 3:  # an explicit list, in a random order
                        u = sorted({int(x) for x in ids.reshape(-1).tolist() if x >= 0})
                        unique = [u[i] for i in torch.randperm(len(u), generator=g).tolist()]
                    r = p.prepare(ids, unique)
                    if unique is None:
                        rh, rm, rf, rv = ref.plan([int(x) for x in ids.reshape(-1).tolist()], False)
                        order = sorted({int(x) for x in ids.reshape(-1).tolist() if x >= 0})
                    else:
                        rh, rm, rf, rv = ref.plan(unique, True)
                        order = unique
                    self.assertEqual((r.hits, r.misses), (rh, rm), f"step {step}")
                    plan = p.cache.last_plan()
                    self.assertEqual(plan["fills"], [tuple(x) for x in rf], f"step {step}")
                    self.assertEqual(plan["evictions"], [tuple(x) for x in rv], f"step {step}")
                    if py:
                        self.assertEqual(py.prepare(order), (rh, rm, [tuple(x) for x in rf], [tuple(x) for x in rv]),
                                         f"step {step}: library Lfru != the LFRU rules")
                    self.check_result(p, r, ids, src, ref.forward_map())
                    torch.cuda.synchronize()
                    self.assertEqual(p.resident_map.cpu().tolist(), list(ref.resident_map()))
                    self.check_views(p, ref, py, f"step {step}")
                    hits += rh
                    misses += rm
                self.assertEqual((p.hits, p.misses), (hits, misses))
                s = p.stats()
                self.assertEqual((s["hits"], s["misses"]), (hits, misses))
                self.assertGreater(s["slot_bytes"], 0)
                self.assertGreater(s["host_bytes"], 0)

    def test_documented_examples(self):
        src = nvfp4_sources(3)

        def provider(capacity, semantics="lfru"):
            return ev.ExpertCacheProvider(capacity, src["w13_weight"], src["w2_weight"], src["w13_scale"],
                                          src["w2_scale"], w13_scale_2=src["w13_scale_2"],
                                          w2_scale_2=src["w2_scale_2"], semantics=semantics)

        def ids(*e):
            return torch.tensor([list(e)], dtype=torch.int64, device="cuda")

        def resident(p):
            torch.cuda.synchronize()
            return p.resident_map.cpu().tolist()

        # Frequency beats recency: 0 (freq 3) stays, 1 (freq 1, newer) goes.
        p = provider(2)
        for _ in range(3):
            p.prepare(ids(0))
        p.prepare(ids(1))
        p.prepare(ids(2))
        self.assertEqual(p.cache.last_plan()["evictions"], [(1, 0)])
        self.assertGreaterEqual(resident(p)[0], 0)
        # A stale frequent expert loses: scores at clock 14 are 3/12 (expert 0), 10/1, 1/1.
        p = provider(3)
        for _ in range(3):
            p.prepare(ids(0))
        for _ in range(10):
            p.prepare(ids(1))
        p.prepare(ids(2))
        p.prepare(ids(5))
        self.assertEqual(p.cache.last_plan()["evictions"], [(0, 2)])
        # Capacity 1, both semantics: each new expert evicts the only one; the slot is reused, and the
        # scales follow their expert into it.
        for semantics in ("lfru", "row"):
            p = provider(1, semantics)
            r = p.prepare(ids(4))
            self.check_result(p, r, ids(4), src, [0 if e == 4 else -1 for e in range(E)])
            r = p.prepare(ids(7))
            self.assertEqual(p.cache.last_plan()["evictions"], [(4, 0)])
            self.assertEqual(p.cache.last_plan()["fills"], [(7, 0)])
            self.check_result(p, r, ids(7), src, [0 if e == 7 else -1 for e in range(E)])
            for name in ("w13_scale", "w2_scale", "w13_scale_2", "w2_scale_2"):
                self.assertTrue(torch.equal(getattr(p, BUFS[name])[0].cpu(), src[name][7]))
            with self.assertRaises(RuntimeError) as cm:
                p.prepare(ids(1, 2))
            self.assertIn("2 unique experts in one forward, capacity 1 slots", str(cm.exception))
            self.assertIn("experts [1, 2]", str(cm.exception))
        # Invalidate frees the slot (the next miss takes it); an absent expert is a no-op.
        p = provider(3)
        p.prepare(ids(0, 1, 2))  # lfru: slots 2, 1, 0
        calls = p.stats()["invalidations"]
        p.invalidate(1)
        p.invalidate(1)
        p.invalidate(9)
        self.assertEqual(p.stats()["invalidations"], calls + 1)
        self.assertEqual(resident(p)[1], -1)
        p.prepare(ids(8))
        self.assertEqual(p.cache.last_plan()["evictions"], [])
        self.assertEqual(p.cache.last_plan()["fills"], [(8, 1)])
        # The forward map is forward-scoped: resident experts this call did not ask for are -1.
        r = p.prepare(ids(0))
        torch.cuda.synchronize()
        self.assertEqual(sum(1 for s in r.expert_map.cpu().tolist() if s >= 0), 1)
        self.assertEqual(sum(1 for s in resident(p) if s >= 0), 3)

    def test_sources_and_buffers(self):
        pinned = nvfp4_sources(4)
        pageable = nvfp4_sources(4, pin=False)
        on_gpu = {k: v.cuda() for k, v in nvfp4_sources(4, pin=False).items()}
        for kind, src in (("pinned", pinned), ("pageable", pageable), ("gpu", on_gpu)):
            with self.subTest(kind=kind):
                p = ev.RowCacheWeightProvider(C, src["w13_weight"], src["w2_weight"], src["w13_scale"], src["w2_scale"],
                                              w13_scale_2=src["w13_scale_2"], w2_scale_2=src["w2_scale_2"])
                for name, t in src.items():
                    host = p.host_tensors[SLOT_NAMES[name]]
                    self.assertTrue(host.is_pinned())
                    self.assertEqual(host.device.type, "cpu")
                    self.assertEqual((host.dtype, host.shape), (t.dtype, t.shape))
                    if kind == "pinned":
                        self.assertEqual(host.data_ptr(), t.data_ptr(), f"{name}: a pinned source is aliased")
                    else:
                        self.assertNotEqual(host.data_ptr(), t.data_ptr())
                        self.assertTrue(torch.equal(host, t.cpu()))
                    # The cache reads the pinned source itself (zero copy after the one pinning).
                    self.assertEqual(p.cache.host_pointer(SLOT_NAMES[name], 3), host.data_ptr() + 3 * host[0].nbytes)
                    buf = getattr(p, BUFS[name])
                    self.assertEqual(buf.dtype, t.dtype)
                    self.assertEqual(tuple(buf.shape), (C,) + tuple(t.shape[1:]))
                    self.assertTrue(buf.is_cuda)
                if kind == "gpu":
                    self.assertEqual(p.device, on_gpu["w13_weight"].device)
                ptrs = {n: getattr(p, b).data_ptr() for n, b in BUFS.items()}
                g = torch.Generator().manual_seed(5)
                for _ in range(10):
                    p.prepare(random_topk(g, 4, 2).cuda())
                self.assertEqual(ptrs, {n: getattr(p, b).data_ptr() for n, b in BUFS.items()}, "slot buffers moved")
        # Weights only (no scales): the scale buffers are None.
        p = ev.CachedWeightProvider(2, pinned["w13_weight"], pinned["w2_weight"])
        self.assertIsNone(p.buf_w13_scale)
        self.assertIsNone(p.buf_w2_scale_2)
        r = p.prepare(torch.tensor([[3, 5]]))
        self.assertIsNone(r.w1_scale)
        self.assertEqual(r.topk_ids.device.type, "cpu")
        # Capacity above E is clamped to E (vLLM's effective capacity).
        self.assertEqual(ev.CachedWeightProvider(100, pinned["w13_weight"], pinned["w2_weight"]).capacity, E)

    def test_bad_input(self):
        src = nvfp4_sources(6)
        full = dict(w13_scale=src["w13_scale"], w2_scale=src["w2_scale"], w13_scale_2=src["w13_scale_2"],
                    w2_scale_2=src["w2_scale_2"])

        def build(capacity=C, w13=src["w13_weight"], w2=src["w2_weight"], **kw):
            args = dict(full)
            args.update(kw)
            return ev.CachedWeightProvider(capacity, w13, w2, **args)

        builds = [
            (lambda: build(0), ValueError, "capacity must be positive, got 0"),
            (lambda: build(w2=src["w2_weight"].float()), ValueError,
             "w2_weight has dtype torch.float32, expected torch.int32 (w13_weight's)"),
            (lambda: build(w2=src["w2_weight"][:-1]), ValueError, "w2_weight has shape [11, 16, 8], expected [12, ...]"),
            (lambda: build(w13_scale=None), ValueError, "w2_scale given without w13_scale"),
            (lambda: build(w2_scale_2=None), ValueError, "w13_scale_2 given without w2_scale_2"),
            (lambda: build(w13_scale_2=src["w13_scale_2"][:5]), ValueError, "w13_scale_2 has shape [5], expected [12"),
            (lambda: build(w2_scale_2=torch.tensor(1.0)), ValueError, "w2_scale_2 has shape [], expected [12"),
            (lambda: build(w2_scale=src["w2_scale"].to(torch.int16)), ValueError,
             "w2_scale has dtype torch.int16, expected torch.uint8 (w13_scale's)"),
            (lambda: ev.ExpertCacheProvider(C, src["w13_weight"], src["w2_weight"], semantics="lru"), ValueError,
             "unknown semantics 'lru'"),
            (lambda: ev.ExpertCacheProvider(C, src["w13_weight"], src["w2_weight"], semantics="row", policy="fifo"),
             ValueError, "unknown eviction policy 'fifo' (valid: lru, lfru"),
            (lambda: ev.DeviceWeightProvider(C, src["w13_weight"], src["w2_weight"], max_ids=16, policy="s3fifo"),
             ValueError, "provider 'device' plans on the device with policy lru, lfru or crf"),
            (lambda: ev.DeviceWeightProvider(C, src["w13_weight"], src["w2_weight"]), ValueError, "needs max_ids"),
            (lambda: ev.DeviceWeightProvider(C, src["w13_weight"], src["w2_weight"], max_ids=16, fill_engine="dma"),
             ValueError, "unknown fill engine 'dma' (available: automatic, copy_engine, sm_loads)"),
            (lambda: ev.DeviceWeightProvider(C, src["w13_weight"], src["w2_weight"], max_ids=16,
                                             link_profile="device=0"),
             ValueError, "link_profile: link profile line 1: expected 'expert_cache link profile v1'"),
            (lambda: ev.DeviceWeightProvider(C, src["w13_weight"], src["w2_weight"], max_ids=16, link_profile=7),
             TypeError, "a link profile is its stored text"),
            (lambda: build(fill_engine="sm_loads"), ValueError,
             "the fill engine is chosen for provider 'device' only (provider 'cached'"),
            (lambda: build(w13="weights"), TypeError, "w13_weight must be a torch.Tensor"),
        ]
        for fn, exc, text in builds:
            with self.assertRaises(exc) as cm:
                fn()
            self.assertIn(text, str(cm.exception))

        p = build()
        d = ev.DeviceWeightProvider(C, src["w13_weight"], src["w2_weight"], max_ids=16, **full)
        p.prepare(torch.tensor([[1, 2]], device="cuda"))
        torch.cuda.synchronize()
        before = (p.stats(), p.expert_map.cpu(), p.resident_map.cpu(), p.buf_w13.cpu(), p.buf_w2_scale_2.cpu())
        calls = [
            (lambda: p.prepare(torch.tensor([[0, E]])), ValueError, "out of range (num_experts 12)"),
            (lambda: p.prepare(torch.tensor([[0, E]], device="cuda")), ValueError, "out of range (num_experts 12)"),
            (lambda: p.prepare(torch.tensor([[0, 1]]), [0, E]), ValueError, "unique_ids[1] = 12 outside [0, 12)"),
            (lambda: p.prepare(torch.tensor([[0, 1]]), [1, 1]), ValueError, "unique_ids[1] = 1 appears twice"),
            (lambda: p.prepare(torch.tensor([[0, 1]]), [-1]), ValueError, "unique_ids[0] = -1 outside"),
            (lambda: p.prepare(torch.tensor([[0, E + 3]]), [0]), ValueError, "topk_ids holds 15, outside [0, 12)"),
            (lambda: p.prepare(torch.tensor([[0.0, 1.0]])), ValueError, "topk_ids must be int32 or int64"),
            (lambda: p.prepare(torch.arange(C + 1).view(1, -1)), RuntimeError,
             "5 unique experts in one forward, capacity 4 slots"),
            (lambda: p.prepare(torch.tensor([[0, 1]]), [0, 1, 2, 3, 4]), RuntimeError, "capacity 4"),
            (lambda: p.invalidate(1.0), TypeError, "invalidate takes an integer expert id, got float"),
            (lambda: p.prefetch([3, 3]), ValueError, "appears twice"),
            (lambda: p.prefetch([E]), ValueError, "outside [0, 12)"),
            (lambda: p.prefetch([1], max_bytes=-1), ValueError, "max_bytes = -1"),
            (lambda: p.prefetch([3, 4], scores=[0.5]), ValueError, "prefetch got 1 scores for 2 predicted ids"),
            (lambda: p.prefetch([3, 4], scores=[0.5, float("nan")]), ValueError, "prefetch score nan at index 1 (expert 4)"),
            (lambda: p.prefetch([3], min_score=2.0), ValueError, "prefetch min_score 2 is not in [0, 1]"),
            (lambda: d.prefetch(torch.tensor([3], device="cuda"), scores=[0.9]), ValueError, "takes no scores"),
            (lambda: d.prepare(torch.tensor([[0, 1]])), ValueError, "semantics 'device' takes CUDA topk_ids"),
            (lambda: d.prepare(torch.tensor([[0, 1]], device="cuda"), [0, 1]), ValueError, "takes no unique_ids"),
            (lambda: d.prepare(torch.zeros(17, dtype=torch.int32, device="cuda")), ValueError, "max_ids"),
        ]
        for fn, exc, text in calls:
            with self.assertRaises(exc) as cm:
                fn()
            self.assertIsInstance(cm.exception, ect.ExpertCacheError if exc is not TypeError else TypeError)
            self.assertIn(text, str(cm.exception))
            torch.cuda.synchronize()
            after = (p.stats(), p.expert_map.cpu(), p.resident_map.cpu(), p.buf_w13.cpu(), p.buf_w2_scale_2.cpu())
            self.assertEqual(after[0], before[0], f"stats changed by a refused call ({cm.exception})")
            for a, b in zip(after[1:], before[1:]):
                self.assertTrue(torch.equal(a, b), f"a map or slot changed by a refused call ({cm.exception})")
        # vLLM's invalidate of an expert not held is a no-op, whatever the id (the native
        # ExpertCache.invalidate keeps its error: test_extension.py).
        for e in (E, E + 5, -1, -E, 2**40, 2**70, -2**70, 0, torch.tensor(E), torch.tensor(3)):
            p.invalidate(e)
            d.invalidate(e)
            torch.cuda.synchronize()
            after = (p.stats(), p.expert_map.cpu(), p.resident_map.cpu(), p.buf_w13.cpu(), p.buf_w2_scale_2.cpu())
            self.assertEqual(after[0], before[0], f"invalidate({e}) changed the stats")
            for a, b in zip(after[1:], before[1:]):
                self.assertTrue(torch.equal(a, b), f"invalidate({e}) changed a map or slot")
        with self.assertRaises(ValueError) as cm:
            p.cache.invalidate(E)
        self.assertIn("invalidate(12): expert out of range [0, 12)", str(cm.exception))

    def test_run_with_expert_cache(self):
        """A small fused MoE (dense bf16 weights, silu-and-mul) through the returned expert_map,
        equal to the uncached computation; wide forwards through the token and the expert split."""
        hidden, inter, experts, top_k = 64, 32, 16, 2
        g = torch.Generator().manual_seed(7)
        w13 = (torch.randn(experts, 2 * inter, hidden, generator=g) / 8).to(torch.bfloat16)
        w2 = (torch.randn(experts, hidden, inter, generator=g) / 8).to(torch.bfloat16)
        tokens = 24
        x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16).cuda()
        topk_ids = torch.randint(0, experts, (tokens, top_k), generator=g).cuda()
        topk_w = torch.softmax(torch.randn(tokens, top_k, generator=g), dim=-1).cuda()

        def moe(x, w1, w2_, slots, weights):
            """out[t] = sum_k weights[t,k] * w2[s] @ silu_and_mul(w1[s] @ x[t]) for s = slots[t,k] >= 0."""
            out = torch.zeros(x.shape[0], hidden, dtype=torch.float32, device=x.device)
            for k in range(slots.shape[1]):
                s = slots[:, k]
                keep = s >= 0
                if not bool(keep.any()):
                    continue
                sl = s[keep].long()
                h = torch.bmm(w1[sl].float(), x[keep].float().unsqueeze(-1)).squeeze(-1)
                a = torch.nn.functional.silu(h[:, :inter]) * h[:, inter:]
                y = torch.bmm(w2_[sl].float(), a.unsqueeze(-1)).squeeze(-1)
                out[keep] += weights[keep, k:k + 1] * y
            return out

        reference = moe(x, w13.cuda(), w2.cuda(), topk_ids, topk_w)
        for semantics, split, stream_slots in (("lfru", "token", 0), ("row", "token", 0), ("lfru", "expert", 0),
                                               ("row", "expert", 0), ("row", "expert", 4), ("device", "token", 0),
                                               ("device", "expert", 0)):
            with self.subTest(semantics=semantics, split=split, stream_slots=stream_slots):
                kw = dict(max_ids=tokens * top_k) if semantics == "device" else dict(stream_slots=stream_slots)
                p = ev.ExpertCacheProvider(5, w13, w2, split=split, semantics=semantics, **kw)
                seen = []

                def run(result, rows, include_shared):
                    seen.append((rows.start, rows.stop, include_shared))
                    # The expert_map convention: global ids in, slots through the map.
                    slots = result.expert_map[topk_ids[rows].clamp(min=0).long()]
                    slots = torch.where(topk_ids[rows] >= 0, slots, torch.full_like(slots, -1))
                    # The remapped-ids convention gives the same slots.
                    self.assertTrue(torch.equal(slots.to(result.topk_ids.dtype), result.topk_ids))
                    return moe(x[rows], result.w1, result.w2, slots, topk_w[rows])

                out = ev.run_with_expert_cache(p, topk_ids, run)
                torch.cuda.synchronize()
                self.assertGreater(len(seen), 1, "the forward was wider than the cache: split into parts")
                torch.testing.assert_close(out, reference, rtol=1e-5, atol=1e-5)
                if semantics != "device":
                    # The compatibility views followed every plan of the split (rounds through
                    # the pool included) and agree with the live resident map.
                    torch.cuda.synchronize()
                    live = {e: s for e, s in enumerate(p.cache.resident_map_host().tolist()) if s >= 0}
                    self.assertEqual(dict(p._lru) if semantics == "row" else {e: v[0] for e, v in p._lru.items()},
                                     live)
                    self.assertTrue(p._ledger.exact)
                if split == "token":
                    self.assertEqual(seen[0][0], 0)
                    self.assertEqual(seen[-1][1], tokens)
                    self.assertTrue(all(s[2] for s in seen))
                else:
                    self.assertEqual([s[2] for s in seen], [True] + [False] * (len(seen) - 1))
                # A forward that fits is one call.
                seen.clear()
                narrow = topk_ids[:1]
                ev.run_with_expert_cache(p, narrow, lambda r, rows, sh: seen.append(rows) or torch.zeros(1, hidden))
                self.assertEqual(len(seen), 1)
                if semantics == "device":
                    # Either split served every expert: no error, the expert split's rounds (the device
                    # planner's overflow groups, served by prepare_wide) included.
                    p.check_device_errors()
                if semantics == "device" and split == "expert":
                    # A plain prepare of the same wide forward serves its first group only: still reported.
                    p.prepare(topk_ids)
                    with self.assertRaises(ect.ExpertCacheError) as cm:
                        p.check_device_errors()
                    self.assertIn("error word 0x2", str(cm.exception))

    def test_device_semantics_cuda_graph(self):
        for engine in ("automatic", "copy_engine", "sm_loads"):
            with self.subTest(fill_engine=engine):
                self.device_semantics_cuda_graph(engine)

    def device_semantics_cuda_graph(self, fill_engine):
        src = nvfp4_sources(8)
        tokens, top_k = 4, 2
        p = ev.DeviceWeightProvider(C, src["w13_weight"], src["w2_weight"], src["w13_scale"], src["w2_scale"],
                                    w13_scale_2=src["w13_scale_2"], w2_scale_2=src["w2_scale_2"],
                                    max_ids=tokens * top_k, fill_engine=fill_engine)
        self.assertIn(p.fill_engine, ("copy_engine", "sm_loads"))
        if fill_engine != "automatic":
            self.assertEqual(p.fill_engine, fill_engine)
        g = torch.Generator().manual_seed(9)
        static_ids = random_topk(g, tokens, top_k, pad=False).cuda()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            p.prepare(static_ids)  # warm-up on the capture stream
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            r = p.prepare(static_ids)
            rows13 = r.w1.index_select(0, r.topk_ids.reshape(-1).long())
            rows_s2 = r.w13_scale_2.index_select(0, r.topk_ids.reshape(-1).long())
        torch.cuda.synchronize()
        for step in range(10):
            ids = random_topk(g, tokens, top_k, pad=False)
            static_ids.copy_(ids.cuda())
            graph.replay()
            torch.cuda.synchronize()
            flat = ids.reshape(-1)
            self.assertTrue(torch.equal(rows13.cpu(), src["w13_weight"][flat]), f"replay {step}: w13 rows")
            self.assertTrue(torch.equal(rows_s2.cpu(), src["w13_scale_2"][flat]), f"replay {step}: global scales")
        p.check_device_errors()
        self.assertGreater(p.misses, 0)
        # Host-planned semantics refuse a capture, before touching anything.
        row = ev.RowCacheWeightProvider(C, src["w13_weight"], src["w2_weight"])
        self.assertIsNone(row.fill_engine)
        with self.assertRaises(RuntimeError) as cm:
            with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=side):
                row.prepare(static_ids)
        self.assertIn("cannot be captured", str(cm.exception))
        torch.cuda.synchronize()


class PrefetchModelPolicyTest(unittest.TestCase):
    def test_prefetch(self):
        src = nvfp4_sources(10)
        for semantics in ("lfru", "row", "device"):
            with self.subTest(semantics=semantics):
                kw = dict(max_ids=16) if semantics == "device" else {}
                p = ev.ExpertCacheProvider(C, src["w13_weight"], src["w2_weight"], semantics=semantics, **kw)
                p.prepare(torch.tensor([[1, 2]], device="cuda"))
                per_expert = p.cache.bytes_per_expert
                # Host ids, budget for one expert: 1 is resident (skipped), 6 issued, 8 over the budget.
                v = p.prefetch([1, 6, 8], max_bytes=per_expert)
                if semantics != "device":
                    self.assertEqual(v["issued"], 1)
                    self.assertEqual(v["skipped_resident"], 1)
                r = p.prepare(torch.tensor([[6]], device="cuda"))
                if semantics != "device":
                    self.assertEqual((r.hits, r.misses), (1, 0))
                s = p.stats()
                self.assertEqual(s["speculative_issued"], 1)
                self.assertEqual(s["speculative_used"], 1)
                torch.cuda.synchronize()
                slot = int(p.resident_map[6])
                self.assertTrue(torch.equal(p.buf_w13[slot].cpu(), src["w13_weight"][6]))
                if semantics == "device":
                    # CUDA ids, planned on the device (no read-back).
                    p.prefetch(torch.tensor([9], device="cuda", dtype=torch.int32))
                    p.prepare(torch.tensor([[9]], device="cuda"))
                    self.assertEqual(p.stats()["speculative_used"], 2)
                    p.check_device_errors()
                else:
                    with self.assertRaises(ValueError):
                        p.prefetch([E + 1])

    def test_prefetch_scores(self):
        """Scored hints through the providers: below min_score skipped, the rest highest score first; for
        "lfru" and "row" the compatibility views follow the fills in that order (given order 8 before 6,
        filled 6 first)."""
        src = nvfp4_sources(12)
        # After a forward of 1 and 2: lfru's free list [0, 1] (the next miss takes 1), row's [3, 2].
        expected = {"lfru": [(1, [3, 1, 1]), (2, [2, 1, 2]), (6, [1, 1, 3]), (8, [0, 1, 4])],
                    "row": [(1, 0), (2, 1), (6, 2), (8, 3)]}
        for semantics in ("lfru", "row", "device"):
            with self.subTest(semantics=semantics):
                kw = dict(max_ids=16) if semantics == "device" else {}
                p = ev.ExpertCacheProvider(C, src["w13_weight"], src["w2_weight"], semantics=semantics, **kw)
                p.prepare(torch.tensor([[1, 2]], device="cuda"))
                per = p.cache.bytes_per_expert
                v = p.prefetch([8, 6, 7, 5], max_bytes=2 * per, scores=[0.7, 0.9, 0.3, 0.6])
                self.assertEqual(v["skipped_unlikely"], 1)
                self.assertEqual(p.stats()["speculative_issued"], 2)
                if semantics != "device":
                    self.assertEqual(v["issued"], 2)
                    self.assertEqual(list(p._lru.items()), expected[semantics])
                    self.assertEqual(p._free_slots if semantics == "lfru" else p._free, [])
                    if semantics == "lfru":
                        self.assertEqual(p._clock, 4)
                    with self.assertRaises(ValueError) as cm:
                        p.prefetch(torch.tensor([3, 4], device="cuda"), scores=[0.9])
                    self.assertIn("prefetch got 1 scores for 2 predicted ids", str(cm.exception))
                else:
                    # CUDA ids are planned on the GPU as given: no scores there.
                    with self.assertRaises(ValueError) as cm:
                        p.prefetch(torch.tensor([3, 4], device="cuda"), scores=[0.9, 0.8])
                    self.assertIn("prefetch with CUDA ids takes no scores (2 given)", str(cm.exception))
                    p.check_device_errors()
                self.assertEqual(p.stats()["speculative_issued"], 2)
                r = p.prepare(torch.tensor([[6, 8]], device="cuda"))
                if semantics != "device":
                    self.assertEqual((r.hits, r.misses), (2, 0))
                self.assertEqual(p.stats()["speculative_used"], 2)
                torch.cuda.synchronize()
                for e in (6, 8):
                    slot = int(p.resident_map[e])
                    self.assertTrue(torch.equal(p.buf_w13[slot].cpu(), src["w13_weight"][e]))
                    self.assertTrue(torch.equal(p.buf_w2[slot].cpu(), src["w2_weight"][e]))
                self.assertEqual(int(p.resident_map[7]), -1)
                self.assertEqual(int(p.resident_map[5]), -1)

    def test_model_cache(self):
        L, experts, hidden, inter = 3, 8, 32, 16
        g = torch.Generator().manual_seed(11)
        w13 = ect.to_host((torch.randn(L, experts, 2 * inter, hidden, generator=g)).to(torch.bfloat16))
        w2 = ect.to_host((torch.randn(L, experts, hidden, inter, generator=g)).to(torch.bfloat16))
        layout = ect.DenseBf16(hidden=hidden, intermediate=inter)
        model = ect.ModelExpertCache(layout, {"w13": w13, "w2": w2}, num_layers=L, num_experts=experts, capacity=3,
                                     top_k=2, pool="per_layer", policy="lru", label="model")
        # The per-layer reference: one separate cache per layer over the same weights (copies).
        singles = [ect.ExpertCache(layout, {"w13": ect.to_host(w13[l]), "w2": ect.to_host(w2[l])}, num_experts=experts,
                                   capacity=3, top_k=2, provider="row", policy="lru") for l in range(L)]
        for step in range(45):
            layer = step % L
            ids = random_topk(g, 3, 2, experts=experts, unique_at_most=3)
            if step % 2:
                ids = ids.cuda()
            v = model.prepare(layer, ids)
            s = singles[layer].prepare(ids)
            self.assertEqual((v.hits, v.misses), (s.hits, s.misses), f"step {step}")
            torch.cuda.synchronize()
            self.assertTrue(torch.equal(v.expert_map.cpu(), s.expert_map.cpu()))
            self.assertTrue(torch.equal(v.expert_map_host, s.expert_map_host))
            for e, slot in enumerate(v.expert_map.cpu().tolist()):
                if slot >= 0:
                    self.assertTrue(torch.equal(v.tensors["w13"][slot].cpu(), w13[layer, e]))
                    self.assertTrue(torch.equal(v.tensors["w2"][slot].cpu(), w2[layer, e]))
        st = model.stats()
        self.assertEqual(len(st["per_layer"]), L)
        self.assertEqual(st["total"]["hits"], sum(c.stats()["hits"] for c in singles))
        self.assertEqual(model.host_pointer(1, "w2", 2), w2[1, 2].data_ptr())  # the caller's memory, in place
        model.invalidate(0, 1)
        for fn, text in ((lambda: model.prepare(L, torch.tensor([1])), "layer 3 out of range"),
                         (lambda: model.prepare(0, torch.tensor([experts])), "out of range"),
                         (lambda: model.prepare_unique(0, [1, 1]), "appears twice")):
            with self.assertRaises(ValueError) as cm:
                fn()
            self.assertIn(text, str(cm.exception))
        del model, singles, v, s  # the views hold the caches: their registrations of w13/w2 end here
        # Global pool, policy by name: one set of slots for all layers.
        glob = ect.ModelExpertCache(layout, {"w13": w13, "w2": w2}, num_layers=L, num_experts=experts, capacity=5,
                                    top_k=2, pool="global", policy="layershare")
        self.assertEqual(glob.policy, "layershare")
        for step in range(30):
            layer = int(torch.randint(0, L, (1,), generator=g))
            v = glob.prepare(layer, random_topk(g, 2, 2, experts=experts, unique_at_most=3).cuda())
            torch.cuda.synchronize()
            self.assertEqual(v.tensors["w13"].data_ptr(), glob.layer_tensors[0]["w13"].data_ptr())
            for e, slot in enumerate(v.expert_map.cpu().tolist()):
                if slot >= 0:
                    self.assertTrue(torch.equal(v.tensors["w13"][slot].cpu(), w13[layer, e]), f"step {step}")
        del glob
        for kw, text in ((dict(pool="shared"), "unknown pool 'shared'"), (dict(policy="fifo"), "unknown eviction policy")):
            with self.assertRaises(ValueError) as cm:
                ect.ModelExpertCache(layout, {"w13": w13, "w2": w2}, num_layers=L, num_experts=experts, capacity=3,
                                     **kw)
            self.assertIn(text, str(cm.exception))

    def test_model_cache_prefetch(self):
        # Lookahead through the model-level cache: layer l+1's hints while layer l computes, per layer
        # and in a global pool; the same fills and hits as separate caches' prefetch (per_layer).
        L, experts, hidden, inter = 3, 8, 32, 16
        g = torch.Generator().manual_seed(12)
        w13 = ect.to_host((torch.randn(L, experts, 2 * inter, hidden, generator=g)).to(torch.bfloat16))
        w2 = ect.to_host((torch.randn(L, experts, hidden, inter, generator=g)).to(torch.bfloat16))
        layout = ect.DenseBf16(hidden=hidden, intermediate=inter)
        model = ect.ModelExpertCache(layout, {"w13": w13, "w2": w2}, num_layers=L, num_experts=experts, capacity=4,
                                     top_k=2, pool="per_layer", policy="lru", label="model")
        singles = [ect.ExpertCache(layout, {"w13": ect.to_host(w13[l]), "w2": ect.to_host(w2[l])}, num_experts=experts,
                                   capacity=4, top_k=2, provider="row", policy="lru") for l in range(L)]
        expert_bytes = singles[0].bytes_per_expert
        for step in range(30):
            forwards = [random_topk(g, 2, 2, experts=experts, unique_at_most=3) for _ in range(L)]
            for layer in range(L):
                v = model.prepare(layer, forwards[layer])
                s = singles[layer].prepare(forwards[layer])
                self.assertEqual((v.hits, v.misses), (s.hits, s.misses), f"step {step} layer {layer}")
                if layer + 1 < L:
                    hints = list(dict.fromkeys(int(e) for e in forwards[layer + 1].flatten().tolist() if e >= 0))[:2]
                    hints += [e for e in (int(torch.randint(0, experts, (1,), generator=g)),) if e not in hints]
                    ids = torch.tensor(hints, dtype=torch.int64, device="cuda" if step % 2 else "cpu")
                    a = model.prefetch(layer + 1, ids, max_bytes=2 * expert_bytes)
                    b = singles[layer + 1].prefetch(ids, max_bytes=2 * expert_bytes)
                    self.assertEqual(a, b, f"step {step} layer {layer}")
                torch.cuda.synchronize()
                for e, slot in enumerate(v.expert_map.cpu().tolist()):
                    if slot >= 0:
                        self.assertTrue(torch.equal(v.tensors["w13"][slot].cpu(), w13[layer, e]))
        st = model.stats()
        for key in ("speculative_issued", "speculative_used", "speculative_wasted", "speculative_bytes"):
            self.assertEqual(st["total"][key], sum(c.stats()[key] for c in singles), key)
        self.assertGreater(st["total"]["speculative_used"], 0)
        scored = model.prefetch(1, [5, 6], max_bytes=2 * expert_bytes, scores=[0.1, 0.9])
        self.assertEqual(scored["skipped_unlikely"], 1)
        for fn, text in ((lambda: model.prefetch(L, [1]), "layer 3 out of range"),
                         (lambda: model.prefetch(0, [experts]), "outside [0, 8)"),
                         (lambda: model.prefetch(0, [1, 1]), "appears twice"),
                         (lambda: model.prefetch(0, [1, 2], scores=[0.5]), "1 scores for 2")):
            with self.assertRaises(ValueError) as cm:
                fn()
            self.assertIn(text, str(cm.exception))
        del model, singles, v, s
        glob = ect.ModelExpertCache(layout, {"w13": w13, "w2": w2}, num_layers=L, num_experts=experts, capacity=6,
                                    top_k=2, pool="global", policy="lru")
        glob.prepare(0, torch.tensor([[0, 1]]))
        p = glob.prefetch(1, [4, 5], max_bytes=2 * expert_bytes)
        self.assertEqual(p["issued"], 2)
        v = glob.prepare(1, torch.tensor([[4, 5]]))
        self.assertEqual((v.hits, v.misses), (2, 0))
        torch.cuda.synchronize()
        for e in (4, 5):
            slot = int(v.expert_map[e])
            self.assertTrue(torch.equal(v.tensors["w13"][slot].cpu(), w13[1, e]))
        self.assertEqual(glob.stats()["total"]["speculative_used"], 2)
        del glob, v

    def test_policy_by_name(self):
        src = nvfp4_sources(12)
        host = {"w13": src["w13_weight"].view(torch.uint8).reshape(E, -1),
                "w2": src["w2_weight"].view(torch.uint8).reshape(E, -1)}
        layout = ect.ExplicitBytes({"w13": host["w13"].shape[1], "w2": host["w2"].shape[1]})
        for provider, policy in (("row", "sieve"), ("cached", "s3fifo"), ("row", "arc"), ("cached", "lru")):
            with self.subTest(provider=provider, policy=policy):
                c = ect.ExpertCache(layout, host, num_experts=E, capacity=C, provider=provider, policy=policy)
                self.assertEqual(c.policy, policy)
                c.prepare(torch.tensor([1, 2, 3]))
                del c
        c = ect.ExpertCache(layout, host, num_experts=E, capacity=C, provider="device", policy="lru", max_ids=8)
        self.assertEqual(c.policy, "lru")
        del c
        for provider, policy, text in (("device", "s3fifo", "provider 'device' plans on the device with policy lru, lfru or crf"),
                                       ("row", "nope", "unknown eviction policy 'nope' (valid: lru, lfru"),
                                       ("row", "belady", "offline-only")):
            with self.assertRaises(ValueError) as cm:
                ect.ExpertCache(layout, host, num_experts=E, capacity=C, provider=provider, policy=policy, max_ids=8)
            self.assertIn(text, str(cm.exception))

    def test_documented_vllm_example(self):
        """docs/python.md "Coming from vLLM": the complete example runs as pasted."""
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        text = open(os.path.join(root, "docs", "python.md"), encoding="utf-8").read()
        text = text[text.index("## Coming from vLLM"):]
        start = text.index("```python\n", text.index("### A complete example")) + len("```python\n")
        code = text[start:text.index("```", start)]
        exec(compile(code, "docs/python.md", "exec"), {"__name__": "snippet"})
        torch.cuda.synchronize()


if __name__ == "__main__":
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, device {torch.cuda.get_device_name()}, "
          f"expert_cache_torch from {os.path.dirname(ect.__file__)}")
    result = unittest.main(exit=False, verbosity=2).result
    ok = result.wasSuccessful() and result.testsRun > 0
    print(f"SUMMARY: {result.testsRun} tests, {len(result.failures)} failures, {len(result.errors)} errors, "
          f"{len(result.skipped)} skipped -> {'PASS' if ok else 'FAIL'}")
    sys.exit(0 if ok else 1)
