"""GPU tests of expert_cache_torch (the PyTorch extension). Plain unittest; exits 77 (skip) when
torch or a CUDA device is missing. Run from python/ after `python setup.py build_ext --inplace`
(python/run_gpu_tests.sh does both).

Covers: host tensors adopted without copy (the cache's host addresses are the tensors' own),
prepare with CPU and CUDA ids (int32/int64) for the row / cached / device providers, slot tensor
contents equal to the mapped experts' host weights, expert_map / resident_map / expert_map_host
semantics, errors as ExpertCacheError with the library's message and stats unchanged, invalidate,
the stats dict, and a torch.cuda.graph capture of a device-provider prepare plus a gather of slot
rows, replayed with new ids (equal to eager).
"""
import os
import sys
import traceback
import unittest

try:
    import torch
except ImportError as e:
    print(f"SKIP: torch is not importable ({e})")
    sys.exit(77)
if not torch.cuda.is_available():
    print(f"SKIP: torch {torch.__version__} sees no CUDA device")
    sys.exit(77)

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # python/ (in-place build)
try:
    import expert_cache_torch as ect
except ImportError:
    print("FAIL: expert_cache_torch is not importable (build it: cd python && python setup.py build_ext --inplace)")
    traceback.print_exc()
    sys.exit(1)

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
