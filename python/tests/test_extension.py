"""GPU tests of expert_cache_torch (the PyTorch extension). Plain unittest; exits 77 (skip) when
torch or a CUDA device is missing. Run from python/ after `python setup.py build_ext --inplace`
(python/run_gpu_tests.sh does both).

Covers: host tensors adopted without copy (the cache's host addresses are the tensors' own),
prepare with CPU and CUDA ids (int32/int64) for the row / cached / device providers, slot tensor
contents equal to the mapped experts' host weights, expert_map / resident_map / expert_map_host
semantics, errors as ExpertCacheError with the library's message and stats unchanged, invalidate,
the stats dict, a torch.cuda.graph capture of a device-provider prepare plus a gather of slot
rows, replayed with new ids (equal to eager), the device provider's fill engines with the link
profile (link_profile, set_link_profile, stored profiles that decide "automatic"), and scored
prefetch hints (skipped below min_score, the rest highest score first; bad scores refused, nothing
changed).
"""
import os
import sys
import unittest

from cuda_or_skip import torch, ect

PAGE = 4096
K, N = 256, 128        # hidden, intermediate
E, C, TOP_K = 16, 6, 2
EXPECTED_STATS = {"hits", "misses", "promotions", "evictions", "invalidations", "resident", "capacity",
                  "prepare_calls", "generation", "last_copies", "total_copies", "owner_changes", "map_uploads",
                  "staging_stalls", "faults", "speculative_issued", "speculative_used", "speculative_wasted",
                  "speculative_bytes", "slot_bytes", "host_bytes", "hit_rate", "wide_forwards", "wide_rounds",
                  "wide_hits", "wide_streamed", "wide_bytes"}


def page_aligned(shape, dtype):
    """A CPU tensor alone on its own pages (ect.host_empty): cudaHostRegister pins whole pages, so two
    registered tensors must not share one."""
    t = ect.host_empty(shape, dtype)
    assert t.data_ptr() % PAGE == 0 and t.is_contiguous() and tuple(t.shape) == tuple(shape) and t.dtype == dtype
    return t


def dense_weights(seed=0, experts=E):
    g = torch.Generator().manual_seed(seed)
    w13 = page_aligned((experts, 2 * N, K), torch.bfloat16)
    w2 = page_aligned((experts, K, N), torch.bfloat16)
    w13.copy_(torch.randn(w13.shape, generator=g).to(torch.bfloat16))
    w2.copy_(torch.randn(w2.shape, generator=g).to(torch.bfloat16))
    return w13, w2


def make_cache(w13, w2, provider, **kw):
    kw.setdefault("max_ids", 32 if provider == "device" else 0)
    return ect.ExpertCache(ect.DenseBf16(hidden=K, intermediate=N), host_tensors={"w13": w13, "w2": w2},
                           num_experts=w13.shape[0], capacity=kw.pop("capacity", C), top_k=TOP_K, provider=provider,
                           label=f"test_{provider}", **kw)


def random_ids(g, tokens, experts=E, unique_at_most=C):
    """[tokens, TOP_K] int64 ids with at most `unique_at_most` distinct experts."""
    pool = torch.randperm(experts, generator=g)[:unique_at_most]
    return pool[torch.randint(0, unique_at_most, (tokens, TOP_K), generator=g)]


class ExtensionTest(unittest.TestCase):
    def check_view(self, cache, view, ids_cpu, w13, w2):
        """Slots of the ids hold their host weights; expert_map holds exactly this forward's experts."""
        torch.cuda.synchronize()
        emap = view.expert_map.cpu()
        rmap = view.resident_map.cpu()
        wanted = sorted(set(int(x) for x in ids_cpu.flatten().tolist() if x >= 0))
        self.assertEqual(view.expert_map.dtype, torch.int32)
        self.assertEqual(view.expert_map.device.type, "cuda")
        self.assertEqual(tuple(view.expert_map.shape), (cache.num_experts,))
        for e in range(cache.num_experts):
            if e in wanted:
                self.assertGreaterEqual(int(emap[e]), 0, f"expert {e} routed but not mapped")
                self.assertEqual(int(rmap[e]), int(emap[e]), f"expert {e}: resident map disagrees")
            else:
                self.assertEqual(int(emap[e]), -1, f"expert {e} not routed but mapped")
        slots = [int(emap[e]) for e in wanted]
        self.assertEqual(len(set(slots)), len(slots), "two experts share a slot")
        self.assertTrue(all(0 <= s < cache.capacity for s in slots))
        self.assertLessEqual(int((rmap >= 0).sum()), cache.capacity)
        for e, s in zip(wanted, slots):
            self.assertTrue(torch.equal(view.tensors["w13"][s].cpu(), w13[e]), f"w13 slot {s} != expert {e}")
            self.assertTrue(torch.equal(view.tensors["w2"][s].cpu(), w2[e]), f"w2 slot {s} != expert {e}")
        # The device gather a consumer does: slot = expert_map[ids].
        flat = torch.tensor(wanted, dtype=torch.long, device="cuda")
        gathered = view.tensors["w13"].index_select(0, view.expert_map.index_select(0, flat).long())
        self.assertTrue(torch.equal(gathered.cpu(), w13[torch.tensor(wanted)]))
        if cache.provider == "device":
            self.assertIsNone(view.expert_map_host)
            self.assertIsNone(view.hits)
        else:
            self.assertTrue(torch.equal(view.expert_map_host, emap))
            self.assertEqual(view.hits + view.misses, len(wanted))

    def test_zero_copy_adoption(self):
        for provider in ("row", "cached", "device"):
            with self.subTest(provider=provider):
                w13, w2 = dense_weights(1)
                cache = make_cache(w13, w2, provider)
                for e in (0, 7, E - 1):
                    self.assertEqual(cache.host_pointer("w13", e), w13.data_ptr() + e * w13[0].nbytes)
                    self.assertEqual(cache.host_pointer("w2", e), w2.data_ptr() + e * w2[0].nbytes)
                del cache
        # Pinned tensors are used as they are (not registered again).
        w13, w2 = dense_weights(2)
        w13p, w2p = w13.pin_memory(), w2.pin_memory()
        cache = make_cache(w13p, w2p, "row")
        self.assertEqual(cache.host_pointer("w13", 3), w13p.data_ptr() + 3 * w13p[0].nbytes)
        view = cache.prepare(torch.tensor([[3, 4]]))
        self.check_view(cache, view, torch.tensor([[3, 4]]), w13p, w2p)

    def test_slot_tensors(self):
        src = torch.randn(3, 5).to(torch.bfloat16)
        copy = ect.to_host(src)
        self.assertTrue(torch.equal(copy, src))
        self.assertEqual(copy.data_ptr() % PAGE, 0)
        w13, w2 = dense_weights(3)
        cache = make_cache(w13, w2, "row")
        st = cache.slot_tensors
        self.assertEqual(set(st), {"w13", "w2"})
        self.assertEqual(tuple(st["w13"].shape), (C, 2 * N, K))
        self.assertEqual(tuple(st["w2"].shape), (C, K, N))
        for t in st.values():
            self.assertEqual(t.dtype, torch.bfloat16)
            self.assertEqual(t.device.type, "cuda")
            self.assertTrue(t.is_contiguous())
        view = cache.prepare(torch.tensor([1, 2]))
        self.assertEqual(view.tensors["w13"].data_ptr(), st["w13"].data_ptr())  # the same alias, no copy
        self.assertEqual(view.expert_map.data_ptr(), cache.prepare(torch.tensor([2])).expert_map.data_ptr())

    def test_prepare_host_providers(self):
        for provider in ("row", "cached"):
            for where in ("cpu", "cuda"):
                for dtype in (torch.int32, torch.int64):
                    with self.subTest(provider=provider, ids=where, dtype=dtype):
                        w13, w2 = dense_weights(4)
                        cache = make_cache(w13, w2, provider)
                        g = torch.Generator().manual_seed(5)
                        first = random_ids(g, 3)
                        v = cache.prepare(first.to(dtype).to(where))
                        self.check_view(cache, v, first, w13, w2)
                        self.assertEqual(v.hits, 0)
                        self.assertEqual(v.misses, len(set(first.flatten().tolist())))
                        again = cache.prepare(first.to(dtype).to(where))
                        self.assertEqual(again.misses, 0)
                        self.assertEqual(again.generation, v.generation + 1)
                        for step in range(30):  # more experts than slots overall: evictions
                            ids = random_ids(g, 1 + step % 4)
                            self.check_view(cache, cache.prepare(ids.to(dtype).to(where)), ids, w13, w2)
                        s = cache.stats()
                        self.assertGreater(s["evictions"], 0)
                        self.assertEqual(s["prepare_calls"], 32)

    def test_prepare_wide(self):
        """A prompt wider than the cache in rounds: every round's map names disjoint experts whose
        slots (pool or stream slots) hold their weights; together they are the prompt's experts;
        stream admission leaves the pool as it was (the device provider's too, with stream slots);
        a consumer's exception propagates."""
        for provider, stream_slots in (("row", 4), ("row", 0), ("cached", 4), ("device", 0), ("device", 4)):
            with self.subTest(provider=provider, stream_slots=stream_slots):
                w13, w2 = dense_weights(9)
                cache = make_cache(w13, w2, provider, stream_slots=stream_slots)
                cache.prepare(torch.tensor([[0, 1]]).cuda() if provider == "device" else torch.tensor([[0, 1]]))
                torch.cuda.synchronize()
                resident_before = cache.resident_map.cpu().clone()
                ids = torch.arange(E).reshape(-1, TOP_K)
                seen = []

                def consume(r):
                    self.assertEqual(r.include_shared, r.index == 0)
                    torch.cuda.synchronize()  # test only: read the round's map and slots now
                    emap = r.expert_map.cpu()
                    mapped = [e for e in range(E) if int(emap[e]) >= 0]
                    if provider != "device" or stream_slots:  # the device planner's groups name no experts on the host
                        self.assertEqual(mapped, r.experts)
                    for e in mapped:
                        s = int(emap[e])
                        self.assertTrue(torch.equal(r.tensors["w13"][s].cpu(), w13[e]), f"round {r.index}: expert {e}")
                        self.assertTrue(torch.equal(r.tensors["w2"][s].cpu(), w2[e]))
                    seen.extend(mapped)

                summary = cache.prepare_wide(ids.cuda() if provider == "device" else ids, consume)
                self.assertEqual(sorted(seen), list(range(E)))
                self.assertEqual(summary["rounds"], max(1, summary["rounds"]))
                self.assertGreater(summary["rounds"], 1)
                if stream_slots:
                    self.assertEqual(summary["admission"], "stream")
                    self.assertTrue(torch.equal(cache.resident_map.cpu(), resident_before))
                else:
                    self.assertEqual(summary["admission"], "admit")

                def boom(r):
                    raise KeyError("consumer failed")

                with self.assertRaises(KeyError):
                    cache.prepare_wide(ids.cuda() if provider == "device" else ids, boom)

    def test_prepare_device_provider(self):
        for dtype in (torch.int32, torch.int64):
            with self.subTest(dtype=dtype):
                w13, w2 = dense_weights(6)
                cache = make_cache(w13, w2, "device")
                g = torch.Generator().manual_seed(7)
                for step in range(30):
                    ids = random_ids(g, 1 + step % 4)
                    v = cache.prepare(ids.to(dtype).cuda())
                    self.check_view(cache, v, ids, w13, w2)
                self.assertEqual(cache.device_errors(), 0)
                s = cache.stats()
                self.assertGreater(s["misses"], 0)
                self.assertEqual(s["prepare_calls"], 30)
                with self.assertRaises(ect.ExpertCacheError) as cm:
                    cache.prepare(torch.tensor([1, 2]))  # CPU ids: the device provider reads the router's output
                self.assertIn("takes CUDA topk_ids", str(cm.exception))

    def test_errors(self):
        w13, w2 = dense_weights(8)
        cache = make_cache(w13, w2, "row")
        cache.prepare(torch.tensor([1, 2]))
        before = cache.stats()
        emap = cache.expert_map.clone()
        cases = [
            (lambda: cache.prepare(torch.tensor([0, E])), "out of range"),
            (lambda: cache.prepare(torch.tensor([0, E], device="cuda")), "out of range"),
            (lambda: cache.prepare(torch.tensor([0.0, 1.0])), "int32 or int64"),
            (lambda: cache.prepare(torch.arange(2 * C).view(2, C)[:, ::2]), "contiguous"),
            (lambda: cache.prepare(torch.arange(C + 1)), ""),  # more unique experts than slots
            (lambda: cache.invalidate(E), "out of range"),
            (lambda: cache.host_pointer("w3", 0), "unknown tensor 'w3'"),
        ]
        for fn, text in cases:
            with self.assertRaises(ect.ExpertCacheError) as cm:
                fn()
            self.assertIsInstance(cm.exception, RuntimeError)
            self.assertIn(text, str(cm.exception))
            torch.cuda.synchronize()
            self.assertEqual(cache.stats(), before, f"stats changed by a refused call ({cm.exception})")
            self.assertTrue(torch.equal(cache.expert_map, emap))
        bad_builds = [
            (dict(provider="rows"), "unknown provider 'rows'"),
            (dict(provider="device", max_ids=0), "max_ids"),
            (dict(policy="fifo"), "unknown eviction policy"),
            (dict(capacity=E + 1), "capacity"),
        ]
        for kw, text in bad_builds:
            with self.assertRaises(ect.ExpertCacheError) as cm:
                make_cache(w13, w2, kw.pop("provider", "row"), **kw)
            self.assertIn(text, str(cm.exception))
        misaligned = page_aligned((w2.numel() + 8,), torch.bfloat16)[1:1 + w2.numel()].view(w2.shape)  # 2 bytes off
        tensors = [
            ({"w13": w13, "w2": w2[:-1]}, "expected exactly"),
            ({"w13": w13}, "host tensor 'w2' missing"),
            ({"w13": w13, "w2": w2, "bias": w2}, "unknown host tensor 'bias'"),
            ({"w13": w13, "w2": w2.view(torch.int32)}, "has dtype int32, expected bfloat16"),
            ({"w13": w13, "w2": w2.transpose(1, 2).contiguous()}, "has shape"),
            ({"w13": w13, "w2": w2.transpose(1, 2)}, "contiguous"),
            ({"w13": w13, "w2": w2.cuda()}, "must be a CPU tensor"),
            ({"w13": w13, "w2": misaligned}, "16-byte aligned"),
            # w13 is registered by `cache` above, a clone of w2 is not: refused, after the checks above.
            ({"w13": w13, "w2": w2.clone()}, "got a mix"),
        ]
        for host, text in tensors:
            with self.assertRaises(ect.ExpertCacheError) as cm:
                ect.ExpertCache(ect.DenseBf16(hidden=K, intermediate=N), host_tensors=host, num_experts=E,
                                capacity=C, top_k=TOP_K)
            self.assertIn(text, str(cm.exception))
        # A refused build registered nothing: once the first cache is gone (its registration
        # undone), the same tensors build a cache again.
        del cache
        make_cache(w13, w2, "row")

    def test_prefetch_scores(self):
        """Scored hints (docs/prefetch.md "Scored hints"): below min_score skipped and counted, the rest
        highest score first within max_bytes, every provider; the fills are the experts' bytes."""
        keys = {"issued", "evictions", "skipped_resident", "skipped_no_victim", "skipped_unlikely", "skipped_imprecise",
                "bytes"}
        for provider in ("row", "cached", "device"):
            with self.subTest(provider=provider):
                w13, w2 = dense_weights(21)
                cache = make_cache(w13, w2, provider)
                per = cache.bytes_per_expert
                cache.prepare(torch.tensor([[0, 1]], device="cuda"))
                # 7 (0.3) is below 0.5; then 6 (0.9), 8 (0.7), 5 (0.6): a budget of two takes 6 and 8.
                v = cache.prefetch([8, 6, 7, 5], max_bytes=2 * per, scores=[0.7, 0.9, 0.3, 0.6])
                self.assertEqual(set(v), keys)
                self.assertEqual(v["skipped_unlikely"], 1)
                if provider == "device":
                    self.assertEqual(v["issued"], 0)  # decided on the GPU: stats() counts the fills
                else:
                    self.assertEqual((v["issued"], v["bytes"], v["skipped_resident"]), (2, 2 * per, 0))
                    held = cache.resident_map_host()
                    self.assertGreaterEqual(int(held[6]), 0)
                    self.assertGreaterEqual(int(held[8]), 0)
                    self.assertEqual(int(held[5]), -1)
                    self.assertEqual(int(held[7]), -1)
                self.assertEqual(cache.stats()["speculative_issued"], 2)
                # The next forward finds 6 and 8: both fills used, their slots hold their weights.
                ids = torch.tensor([[6, 8]])
                view = cache.prepare(ids.cuda())
                self.check_view(cache, view, ids, w13, w2)
                if provider != "device":
                    self.assertEqual((view.hits, view.misses), (2, 0))
                s = cache.stats()
                self.assertEqual((s["speculative_issued"], s["speculative_used"]), (2, 2))
                # Scores as tensors of any floating dtype, on the CPU or the GPU, shaped like the ids;
                # equal scores keep the given order (one expert's budget: 9, then 3 resident by then).
                for scores in (torch.tensor([[0.8, 0.8]], dtype=torch.float64), torch.full((1, 2), 0.8).cuda(),
                               torch.tensor([[0.8, 0.8]], dtype=torch.bfloat16)):
                    v = cache.prefetch(torch.tensor([[9, 3]]), max_bytes=per, scores=scores)
                    self.assertEqual(v["skipped_unlikely"], 0)
                self.assertEqual(cache.stats()["speculative_issued"], 4)  # 9, then 3 (9 resident), then none
                view = cache.prepare(torch.tensor([[9, 3]], device="cuda"))
                if provider != "device":
                    self.assertEqual((view.hits, view.misses), (2, 0))
                self.assertEqual(cache.stats()["speculative_used"], 4)
                # min_score is inclusive: 0 keeps a score of 0, 1 keeps only a score of 1.
                self.assertEqual(cache.prefetch([10, 11], max_bytes=0, scores=[0.0, 1.0], min_score=0)
                                 ["skipped_unlikely"], 0)
                self.assertEqual(cache.prefetch([10, 11], max_bytes=0, scores=[0.0, 1.0], min_score=1)
                                 ["skipped_unlikely"], 1)
                self.assertEqual(cache.prefetch([], scores=[])["issued"], 0)
                if provider != "device":
                    # CUDA ids with scores: read back, selected on the host.
                    v = cache.prefetch(torch.tensor([12, 13], device="cuda"), max_bytes=per, scores=[0.2, 0.9])
                    self.assertEqual((v["issued"], v["skipped_unlikely"]), (1, 1))
                    self.assertGreaterEqual(int(cache.resident_map_host()[13]), 0)
                    self.assertEqual(int(cache.resident_map_host()[12]), -1)
                else:
                    self.assertEqual(cache.device_errors(), 0)

    def test_prefetch_scores_refused(self):
        """Bad scores and min_scores raise ExpertCacheValueError (a ValueError) with the library's message;
        nothing changes."""
        for provider in ("row", "device"):
            with self.subTest(provider=provider):
                w13, w2 = dense_weights(22)
                cache = make_cache(w13, w2, provider)
                cache.prepare(torch.tensor([[0, 1]], device="cuda"))
                torch.cuda.synchronize()
                before = (cache.stats(), cache.resident_map.clone(), cache.expert_map.clone())
                nan = float("nan")
                cases = [
                    (lambda: cache.prefetch([3, 7], scores=[0.9]), ValueError,
                     f"test_{provider}: prefetch got 1 scores for 2 predicted ids (scores[i] belongs to ids[i]; "
                     f"no scores: None)"),
                    (lambda: cache.prefetch([3, 7], scores=[]), ValueError, "prefetch got 0 scores for 2 predicted ids"),
                    (lambda: cache.prefetch([3, 7], scores=[0.9, nan]), ValueError,
                     "prefetch score nan at index 1 (expert 7) is not a probability in [0, 1]"),
                    (lambda: cache.prefetch([3, 7], scores=torch.tensor([1.5, 0.2])), ValueError,
                     "prefetch score 1.5 at index 0 (expert 3)"),
                    (lambda: cache.prefetch([3, 7], scores=[0.2, -0.25]), ValueError, "prefetch score -0.25 at index 1"),
                    (lambda: cache.prefetch([3, 7], scores=[float("inf"), 0.2]), ValueError, "prefetch score inf"),
                    (lambda: cache.prefetch([3, 7], scores=torch.tensor([1, 0])), ValueError,
                     "prefetch scores must be a floating-point tensor (got Long)"),
                    (lambda: cache.prefetch([3, 7], scores="high"), ValueError,
                     "scores must be a tensor or a sequence of numbers (got str)"),
                    (lambda: cache.prefetch([3, 7], scores=[0.9, "x"]), ValueError, "scores[1] is not a number (got str)"),
                    (lambda: cache.prefetch([3, 7], scores=0.9), ValueError,
                     "scores must be a tensor or a sequence of numbers (got float)"),
                    (lambda: cache.prefetch([3, 7], scores=[0.9, 0.8], min_score=nan), ValueError,
                     "prefetch min_score nan is not in [0, 1]"),
                    (lambda: cache.prefetch([3, 7], min_score=1.5), ValueError, "prefetch min_score 1.5 is not in [0, 1]"),
                    (lambda: cache.prefetch([3], min_score=-0.5), ValueError, "prefetch min_score -0.5"),
                    (lambda: cache.prefetch([3], min_score="0.5"), TypeError, "min_score must be a number, got str"),
                    (lambda: cache.prefetch([3, 3], scores=[0.9, nan]), ValueError, "predicted ids[1] = 3 appears twice"),
                    (lambda: cache.prefetch([3, E], scores=[0.9, 0.1]), ValueError, f"predicted ids[1] = {E} outside"),
                ]
                if provider == "device":
                    cases.append((lambda: cache.prefetch(torch.tensor([3, 7], device="cuda"), scores=[0.9, 0.8]),
                                  ValueError, "prefetch with CUDA ids takes no scores (2 given): provider 'device' "
                                  "plans CUDA ids on the GPU in the given order"))
                    cases.append((lambda: cache.prefetch(torch.tensor([3, 7], device="cuda"), min_score=2), ValueError,
                                  "prefetch min_score 2 is not in [0, 1]"))
                for fn, exc, text in cases:
                    with self.assertRaises(exc) as cm:
                        fn()
                    if exc is ValueError:
                        self.assertIsInstance(cm.exception, ect.ExpertCacheValueError)
                    self.assertIn(text, str(cm.exception))
                    torch.cuda.synchronize()
                    self.assertEqual(cache.stats(), before[0], f"stats changed by a refused call ({cm.exception})")
                    self.assertTrue(torch.equal(cache.resident_map, before[1]), f"resident map changed ({cm.exception})")
                    self.assertTrue(torch.equal(cache.expert_map, before[2]), f"expert map changed ({cm.exception})")
                # Usable after every refusal: the same hints with good scores are taken.
                v = cache.prefetch([3, 7], max_bytes=2 * cache.bytes_per_expert, scores=[0.9, 0.1])
                self.assertEqual(v["skipped_unlikely"], 1)
                self.assertEqual(cache.stats()["speculative_issued"], 1)
                if provider == "device":
                    # GPU scores are read back on the host: not inside a CUDA graph (refused before any work).
                    side = torch.cuda.Stream()
                    side.wait_stream(torch.cuda.current_stream())
                    gpu_scores = torch.tensor([0.9], device="cuda")
                    with self.assertRaises(ect.ExpertCacheError) as cm:
                        with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=side):
                            cache.prefetch([4], scores=gpu_scores)
                    self.assertIn("prefetch scores on the GPU are read back", str(cm.exception))
                    torch.cuda.synchronize()
                    self.assertEqual(cache.stats()["speculative_issued"], 1)

    def test_invalidate(self):
        for provider in ("row", "device"):
            with self.subTest(provider=provider):
                w13, w2 = dense_weights(9)
                cache = make_cache(w13, w2, provider)
                cache.prepare(torch.tensor([0, 1], device="cuda"))
                torch.cuda.synchronize()
                self.assertGreaterEqual(int(cache.resident_map[0]), 0)
                cache.invalidate(0)
                torch.cuda.synchronize()
                self.assertEqual(int(cache.resident_map[0]), -1)
                self.assertEqual(cache.stats()["invalidations"], 1)
                v = cache.prepare(torch.tensor([0], device="cuda"))
                self.check_view(cache, v, torch.tensor([0]), w13, w2)
                if provider == "row":
                    self.assertEqual(v.misses, 1)

    def test_stats_dict(self):
        for provider in ("row", "cached", "device"):
            with self.subTest(provider=provider):
                w13, w2 = dense_weights(10)
                cache = make_cache(w13, w2, provider)
                cache.prepare(torch.tensor([[1, 2], [2, 3]], device="cuda"))
                cache.prepare(torch.tensor([[1, 2]], device="cuda"))
                s = cache.stats()
                self.assertEqual(set(s), EXPECTED_STATS)
                self.assertTrue(all(isinstance(v, int) for k, v in s.items() if k != "hit_rate"))
                self.assertIsInstance(s["hit_rate"], float)
                self.assertEqual(s["capacity"], C)
                self.assertEqual(s["prepare_calls"], 2)
                self.assertEqual(s["misses"], 3)
                self.assertEqual(s["hits"], 2)
                self.assertAlmostEqual(s["hit_rate"], 0.4)
                self.assertEqual(s["resident"], 3)

    def test_graph_capture_device_provider(self):
        tokens = 4
        g = torch.Generator().manual_seed(12)
        for dtype in (torch.int32, torch.int64):
            with self.subTest(dtype=dtype):
                w13, w2 = dense_weights(11)
                cache = make_cache(w13, w2, "device", max_ids=tokens * TOP_K)
                # The eager reference: a second cache over equal weights, on the default stream.
                e13, e2 = dense_weights(11)
                eager_cache = make_cache(e13, e2, "device", max_ids=tokens * TOP_K)
                static_ids = random_ids(g, tokens).to(dtype).cuda()
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):  # warm up outside the capture, on the capture stream
                    cache.prepare(static_ids)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, stream=side):
                    view = cache.prepare(static_ids)
                    slots = view.expert_map.index_select(0, static_ids.view(-1).long()).long()
                    out13 = view.tensors["w13"].index_select(0, slots)
                    out2 = view.tensors["w2"].index_select(0, slots)
                torch.cuda.synchronize()
                calls = cache.stats()["prepare_calls"]
                for step in range(12):
                    ids = random_ids(g, tokens)
                    static_ids.copy_(ids.to(dtype).view_as(static_ids))
                    graph.replay()
                    torch.cuda.synchronize()
                    flat = ids.view(-1)
                    self.assertTrue(torch.equal(out13.cpu(), w13[flat]), f"replay {step}: w13 rows differ")
                    self.assertTrue(torch.equal(out2.cpu(), w2[flat]), f"replay {step}: w2 rows differ")
                    v = eager_cache.prepare(ids.to(dtype).cuda())
                    eager = v.tensors["w13"].index_select(0, v.expert_map.index_select(0, flat.cuda()).long())
                    self.assertTrue(torch.equal(eager, out13), f"replay {step}: graph != eager")
                # The host saw no prepare during the replays (captured once); the device counted them.
                s = cache.stats()
                self.assertEqual(s["prepare_calls"], calls)
                self.assertGreater(s["misses"], 0)
                self.assertEqual(cache.device_errors(), 0)
                # A host-planned cache refuses to be captured, before touching the stream.
                row = make_cache(*dense_weights(14), "row")
                with self.assertRaises(ect.ExpertCacheError) as cm:
                    with torch.cuda.graph(torch.cuda.CUDAGraph(), stream=side):
                        row.prepare(static_ids)
                self.assertIn("cannot be captured", str(cm.exception))
                torch.cuda.synchronize()
                del graph, view, out13, out2

    def test_fill_engine_and_link_profile(self):
        """Provider "device" with each fill engine (slots hold the experts' bytes; the cache reports the
        engine it runs), link_profile() / set_link_profile(), stored profiles that force the automatic
        choice either way, and every bad engine, profile or argument refused with ValueError."""
        device = torch.cuda.current_device()
        profile_keys = {"device", "device_name", "pci_bus_id", "expert_bytes", "copy_engine_gbps_one",
                       "copy_engine_gbps_batch", "copy_latency_us", "sm_load_gbps", "graph_fill_latency_us",
                       "measure_ms", "sm_load_share", "engine", "reason", "text", "describe"}
        dense_bytes = (2 * N * K + K * N) * 2  # bf16 w13 + w2 of one expert

        def with_field(text, key, value):
            lines = [f"{key}={value}" if line.startswith(key + "=") else line for line in text.splitlines()]
            self.assertIn(f"{key}={value}", lines, f"no line {key}= in the profile")
            return "\n".join(lines) + "\n"

        def run_cache(cache, w13, w2, seed):
            g = torch.Generator().manual_seed(seed)
            for step in range(12):
                ids = random_ids(g, 1 + step % 4)
                self.check_view(cache, cache.prepare(ids.cuda()), ids, w13, w2)
            self.assertEqual(cache.device_errors(), 0)
            self.assertGreater(cache.stats()["misses"], 0)

        # Each engine by name moves the right bytes; host providers report no engine.
        for engine in ("copy_engine", "sm_loads"):
            with self.subTest(engine=engine):
                w13, w2 = dense_weights(20)
                cache = make_cache(w13, w2, "device", fill_engine=engine)
                self.assertEqual(cache.fill_engine, engine)
                self.assertIn(f"fill_engine={engine!r}", repr(cache))
                run_cache(cache, w13, w2, 21)
                del cache
        self.assertIsNone(make_cache(*dense_weights(22), "row").fill_engine)

        # The profile of this device at the dense expert size: measured once, then the same.
        profile = ect.link_profile(expert_bytes=dense_bytes)
        self.assertEqual(set(profile), profile_keys)
        self.assertEqual(profile["device"], device)
        self.assertEqual(profile["expert_bytes"], dense_bytes)
        for key in ("copy_engine_gbps_one", "copy_engine_gbps_batch", "copy_latency_us", "sm_load_gbps",
                    "graph_fill_latency_us"):
            self.assertGreater(profile[key], 0, key)
        self.assertIn(profile["engine"], ("copy_engine", "sm_loads"))
        self.assertTrue(profile["reason"].startswith(profile["engine"] + ": SM loads"), profile["reason"])
        self.assertTrue(profile["describe"].startswith(f"link profile: device {device}, "), profile["describe"])
        self.assertTrue(profile["text"].startswith("expert_cache link profile v1\n"))
        self.assertEqual(ect.link_profile(f"cuda:{device}", expert_bytes=dense_bytes), profile)
        self.assertEqual(ect.link_profile(torch.device("cuda", device), expert_bytes=dense_bytes), profile)
        print(f"  {profile['describe']}\n  automatic: {profile['reason']}")

        # automatic: the engine the profile picks; the cache's bytes per expert are the profile's size.
        w13, w2 = dense_weights(23)
        cache = make_cache(w13, w2, "device")
        self.assertEqual(cache.bytes_per_expert, dense_bytes)
        self.assertEqual(cache.fill_engine, profile["engine"])
        run_cache(cache, w13, w2, 24)
        del cache
        for stored in (profile["text"], profile):  # the text, or the dict that carries it
            self.assertEqual(make_cache(*dense_weights(25), "device", link_profile=stored).fill_engine,
                             profile["engine"])

        # A stored profile decides automatic whatever this machine measures: SM loads at twice the
        # copy engine's batch bandwidth pick sm_loads, at a tenth copy_engine.
        batch = profile["copy_engine_gbps_batch"]
        sm_gbps = {"sm_loads": 2 * batch, "copy_engine": batch / 10}
        forced = {engine: with_field(profile["text"], "sm_load_gbps", repr(gbps)) for engine, gbps in sm_gbps.items()}
        for engine, text in forced.items():
            with self.subTest(stored=engine):
                w13, w2 = dense_weights(26)
                cache = make_cache(w13, w2, "device", link_profile=text)
                self.assertEqual(cache.fill_engine, engine)
                run_cache(cache, w13, w2, 27)
                del cache
        # set_link_profile installs one for later caches of its size (one this process has not
        # measured: an explicit layout of 3 pages per expert), without measuring.
        for engine, page_count in (("sm_loads", 3), ("copy_engine", 5)):
            with self.subTest(installed=engine):
                nbytes = page_count * PAGE
                text = with_field(with_field(forced[engine], "expert_bytes", nbytes), "measure_ms", "1.25")
                ect.set_link_profile(text)
                installed = ect.link_profile(expert_bytes=nbytes)
                # The installed profile, not a measurement: its numbers come back as written.
                self.assertEqual(installed["measure_ms"], 1.25)
                self.assertEqual(installed["expert_bytes"], nbytes)
                self.assertEqual(installed["sm_load_gbps"], sm_gbps[engine])
                self.assertEqual(installed["copy_engine_gbps_batch"], batch)
                self.assertEqual(installed["engine"], engine)
                host = {"blob": page_aligned((E, nbytes), torch.uint8)}
                host["blob"].copy_(torch.randint(0, 256, host["blob"].shape, dtype=torch.uint8))
                cache = ect.ExpertCache(ect.ExplicitBytes({"blob": nbytes}), host_tensors=host, num_experts=E,
                                        capacity=C, top_k=1, provider="device", max_ids=8)
                self.assertEqual(cache.fill_engine, engine)
                cache.prepare(torch.tensor([2, 7], device="cuda"))
                torch.cuda.synchronize()
                self.assertEqual(cache.device_errors(), 0)
                emap = cache.expert_map.cpu()
                for e in (2, 7):
                    self.assertTrue(torch.equal(cache.slot_tensors["blob"][int(emap[e])].cpu(), host["blob"][e]))
                del cache

        # Bad engines and profiles: ValueError with the library's message, nothing registered (the
        # same tensors build a cache afterwards).
        w13, w2 = dense_weights(28)
        other_size = with_field(profile["text"], "expert_bytes", dense_bytes + 16)
        other_device = with_field(profile["text"], "pci_bus_id", "0000:ff:1f.7")
        bad_builds = [
            (dict(provider="device", fill_engine="dma"), "unknown fill engine 'dma' (available: automatic, "
                                                        "copy_engine, sm_loads)"),
            (dict(provider="device", fill_engine="Sm_Loads"), "unknown fill engine 'Sm_Loads'"),
            (dict(provider="device", link_profile="device=0"), "link profile line 1: expected 'expert_cache link "
                                                               "profile v1'"),
            (dict(provider="device", link_profile=profile["text"].replace("measure_ms=", "measure_seconds=")),
             "unknown key 'measure_seconds'"),
            (dict(provider="device", link_profile=other_size),
             f"link profile is for experts of {dense_bytes + 16} bytes, not {dense_bytes}"),
            (dict(provider="device", link_profile=other_device), "link profile is for device"),
            (dict(provider="device", fill_engine="sm_loads", link_profile=profile["text"]),
             "a link_profile is read by fill_engine 'automatic' only"),
            (dict(provider="row", fill_engine="copy_engine"), "the fill engine is chosen for provider 'device' only"),
            (dict(provider="cached", link_profile=profile["text"]), "for provider 'device' only"),
        ]
        for kw, text in bad_builds:
            with self.subTest(bad=text):
                with self.assertRaises(ect.ExpertCacheValueError) as cm:
                    make_cache(w13, w2, kw.pop("provider"), **kw)
                self.assertIsInstance(cm.exception, ValueError)
                self.assertIn(text, str(cm.exception))
        with self.assertRaises(TypeError):
            make_cache(w13, w2, "device", link_profile=42)
        make_cache(w13, w2, "device", fill_engine="sm_loads")

        # Bad link_profile() / set_link_profile() arguments; a refused profile changes nothing.
        calls = [
            (lambda: ect.link_profile(expert_bytes=0), ValueError, "expert_bytes 0"),
            (lambda: ect.link_profile(expert_bytes=-4096), ValueError, "expert_bytes -4096"),
            (lambda: ect.link_profile(-1, expert_bytes=4096), ValueError, "device -1 is not a CUDA device ordinal"),
            (lambda: ect.link_profile(torch.cuda.device_count(), expert_bytes=4096), ValueError,
             f"device {torch.cuda.device_count()} is outside [0, {torch.cuda.device_count()})"),
            (lambda: ect.link_profile("cpu", expert_bytes=4096), ValueError, "must be a CUDA device"),
            (lambda: ect.link_profile(expert_bytes=1.5), TypeError, "expert_bytes must be an int"),
            (lambda: ect.set_link_profile("expert_cache link profile v2\n"), ValueError,
             "set_link_profile: link profile line 1"),
            (lambda: ect.set_link_profile(with_field(profile["text"], "sm_load_gbps", "0")), ValueError,
             "sm_load_gbps: 0 is not a finite number > 0"),
            (lambda: ect.set_link_profile(other_device), ValueError, "link profile is for device"),
            (lambda: ect.set_link_profile(3), TypeError, "a link profile is its stored text"),
        ]
        for fn, exc, text in calls:
            with self.subTest(call=text):
                with self.assertRaises(exc) as cm:
                    fn()
                self.assertIn(text, str(cm.exception))
                if exc is ValueError:
                    self.assertIsInstance(cm.exception, ect.ExpertCacheValueError)
        self.assertEqual(ect.link_profile(expert_bytes=dense_bytes), profile)

    def test_nvfp4_marlin_layout(self):
        hidden, inter = 128, 96  # Np = 128
        np_ = 128
        sizes = {"w13": (hidden // 16) * 4 * np_ * 4, "w2": (np_ // 16) * 2 * hidden * 4,
                 "w13_scale": (hidden // 16) * 2 * np_, "w2_scale": (np_ // 16) * hidden,
                 "w13_scale_2": 4, "w2_scale_2": 4}
        g = torch.Generator().manual_seed(13)
        host = {}
        for name, b in sizes.items():
            t = page_aligned((E, b), torch.uint8)
            t.copy_(torch.randint(0, 256, (E, b), generator=g, dtype=torch.uint8))
            host[name] = t
        cache = ect.ExpertCache(ect.Nvfp4Marlin(hidden=hidden, intermediate=inter), host_tensors=host, num_experts=E,
                                capacity=C, top_k=TOP_K, provider="cached")
        st = cache.slot_tensors
        self.assertEqual((tuple(st["w13"].shape), st["w13"].dtype), ((C, hidden // 16, 4 * np_), torch.int32))
        self.assertEqual((tuple(st["w2"].shape), st["w2"].dtype), ((C, np_ // 16, 2 * hidden), torch.int32))
        self.assertEqual((tuple(st["w13_scale"].shape), st["w13_scale"].dtype), ((C, hidden // 16, 2 * np_), torch.uint8))
        self.assertEqual((tuple(st["w2_scale"].shape), st["w2_scale"].dtype), ((C, np_ // 16, hidden), torch.uint8))
        self.assertEqual((tuple(st["w13_scale_2"].shape), st["w13_scale_2"].dtype), ((C, 1), torch.float32))
        v = cache.prepare(torch.tensor([[5, 9]]))
        torch.cuda.synchronize()
        for e in (5, 9):
            s = int(v.expert_map_host[e])
            for name in sizes:
                got = v.tensors[name][s].contiguous().view(torch.uint8).view(-1).cpu()
                self.assertTrue(torch.equal(got, host[name][e]), f"{name} of expert {e}")

    def test_explicit_layout(self):
        host = {"qweight": page_aligned((E, 96), torch.uint8), "bias": page_aligned((E, 32), torch.uint8)}
        for t in host.values():
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8))
        cache = ect.ExpertCache(ect.ExplicitBytes({"qweight": 96, "bias": 32}), host_tensors=host, num_experts=E,
                                capacity=C, top_k=1)
        self.assertEqual(tuple(cache.slot_tensors["qweight"].shape), (C, 96))
        v = cache.prepare(torch.tensor([3]))
        torch.cuda.synchronize()
        s = int(v.expert_map_host[3])
        self.assertTrue(torch.equal(v.tensors["bias"][s].cpu(), host["bias"][3]))

    def test_documented_snippets(self):
        """The README's "Use it from Python" block and docs/python.md's first example run as pasted."""
        root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
        for path, after in (("README.md", "## Use it from Python"), (os.path.join("docs", "python.md"), "")):
            with self.subTest(doc=path):
                text = open(os.path.join(root, path), encoding="utf-8").read()
                text = text[text.index(after):]
                start = text.index("```python\n") + len("```python\n")
                code = text[start:text.index("```", start)]
                exec(compile(code, path, "exec"), {"__name__": "snippet"})
                torch.cuda.synchronize()


if __name__ == "__main__":
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, device {torch.cuda.get_device_name()}, "
          f"expert_cache_torch from {os.path.dirname(ect.__file__)}")
    result = unittest.main(exit=False, verbosity=2).result
    ok = result.wasSuccessful() and result.testsRun > 0
    print(f"SUMMARY: {result.testsRun} tests, {len(result.failures)} failures, {len(result.errors)} errors, "
          f"{len(result.skipped)} skipped -> {'PASS' if ok else 'FAIL'}")
    sys.exit(0 if ok else 1)
