#!/usr/bin/env python3
"""End-to-end tests of expert-cache-bench (the decode-loop provider benchmark).

usage: test_bench_cli.py PATH_TO_BENCH CASE
Cases: smoke (a short modelled run of every provider, the device provider alone too, table +
Google-Benchmark JSON, host synchronisations per token, a modelled --prompt run), bad_args (every rejection
exits 2 with a clear message and prints no table), prompt_trace (--prompt-trace: a prompt from a trace
file written here, the modelled table's rows and bounds, the trace's decode steps in the warm-up and the mixed
run), prompt_trace_bad_args (each bad trace or combination exits 2 naming the file and line or step, runs
nothing and writes no --json file), prefetch (--prefetch rows: columns, JSON
fields, budget 0 = no prefetch, emulated-hint labels; the output without --prefetch keeps its
table), prefetch_bad_args (its rejections). 'all' runs every case. Always forces --runtime sim
so the tests behave the same with or without a GPU.
"""
import json
import os
import sys

# tests/support is shared with the C++ suites; this file sits one folder below tests/.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from support import cli_harness as h  # noqa: E402
from support.cli_harness import expect, run, write


def case_smoke():
    out_json = os.path.join(h.TMP, "bench.json")
    rc, out, err = run("--runtime", "sim", "--steps", "2", "--warmup", "2", "--layers", "4", "--json", out_json)
    expect(rc == 0, "smoke run exits 0", out, err)
    expect("MODELLED (SimRuntime cost model), not measured" in out, "modelled label on stdout", out)
    for name in ("resident", "row", "cached", "device", "graph", "inline", "copy_stream", "batched", "syncs"):
        expect(name in out, f"table mentions {name}", out)
    with open(out_json, encoding="utf-8") as f:
        doc = json.load(f)
    expect(doc["context"]["expert_cache_mode"] == "modelled", "json mode", doc["context"])
    names = [b["name"] for b in doc["benchmarks"]]
    expect(names[0] == "decode/resident" and "decode/row/copy_stream" in names and "decode/cached/batched" in names
           and names.count("decode/device/graph") == 1, "benchmark names", names)
    for b in doc["benchmarks"]:
        for key in ("real_time", "cpu_time", "time_unit", "iterations", "tokens_per_second", "hit_rate",
                    "misses_per_token", "pcie_bytes_per_token", "host_us_per_prepare", "vs_resident",
                    "vs_pcie_bound", "cold_start_ms", "host_syncs_per_token"):
            expect(key in b, f"{b['name']} has {key}", b)
        expect(b["iterations"] == 2 and b["tokens_per_second"] > 0, "tokens measured", b)
        expect(b["check_failures"] == 0, "consumer checks pass", b)
        if b["provider"] != "resident":
            expect(0.0 <= b["hit_rate"] <= 1.0 and b["vs_resident"] <= 1.0 + 1e-9, "ratios in range", b)
        # Host-planned loops wait once per layer (4 layers) and once per step; the device-planned
        # step is one graph replay with no host wait.
        want_syncs = 0 if b["provider"] == "device" else 5
        expect(b["host_syncs_per_token"] == want_syncs, f"{b['name']} host syncs per token", b)
    by_name = {b["name"]: b for b in doc["benchmarks"]}
    dev, row = by_name["decode/device/graph"], by_name["decode/row/inline"]
    expect(dev["hit_rate"] == row["hit_rate"] and dev["misses_per_token"] == row["misses_per_token"],
           "device LRU decides like the row provider's Lru", dev, row)
    # --provider device alone, batch 2, on a trace (the staging list does not apply to it).
    trace2 = write("d.trace", "".join(f"{s} {l} {(s + l) % 7} {(s * 5 + l) % 7 + 7}\n" for s in range(16) for l in range(3)))
    rc, out, err = run("--runtime", "sim", "--trace", trace2, "--capacity", "8", "--batch", "2", "--steps", "4",
                       "--warmup", "2", "--provider", "device", "--staging", "copy_stream", "--json", out_json)
    expect(rc == 0, "device run exits 0", out, err)
    table = out.split("provider")[1]
    expect("device" in table and "graph" in table and "copy_stream" not in table and "cached" not in table,
           "only the device provider", out)
    with open(out_json, encoding="utf-8") as f:
        doc = json.load(f)
    expect([b["name"] for b in doc["benchmarks"]] == ["decode/device/graph"], "device benchmark name", doc)
    b = doc["benchmarks"][0]
    expect(b["check_failures"] == 0 and b["host_syncs_per_token"] == 0 and b["iterations"] == 8
           and b["misses_per_token"] > 0, "device run counters", b)
    # --device-policy all: one device row per policy in one run, on the same routing. Each plans
    # with its own policy: LRU decides like the row provider (Lru), LFRU like the cached provider
    # (Lfru); CRF has no host-planned twin here, but must differ from LRU on this routing.
    rc, out, err = run("--runtime", "sim", "--steps", "24", "--warmup", "24", "--layers", "4", "--capacity", "40",
                       "--provider", "row,cached,device", "--staging", "inline", "--device-policy", "all",
                       "--json", out_json)
    expect(rc == 0, "--device-policy all exits 0", out, err)
    table = out.split("provider")[1]
    for label in ("device:lru", "device:lfru", "device:crf"):
        expect(table.count(label + " ") == 1, f"one {label} row", out)
    expect("LRU planner's measured cost for every policy" in out, "the modelled plan cost is named", out)
    with open(out_json, encoding="utf-8") as f:
        doc = json.load(f)
    by_name = {b["name"]: b for b in doc["benchmarks"]}
    expect(sorted(by_name) == ["decode/cached/inline", "decode/device:crf/graph", "decode/device:lfru/graph",
                               "decode/device:lru/graph", "decode/row/inline"], "one benchmark per policy", sorted(by_name))
    lru, lfru, crf = (by_name[f"decode/device:{p}/graph"] for p in ("lru", "lfru", "crf"))
    row, cached = by_name["decode/row/inline"], by_name["decode/cached/inline"]
    expect(lru["device_policy"] == "lru" and crf["device_policy"] == "crf", "device_policy field", lru, crf)
    expect(lru["misses_per_token"] == row["misses_per_token"], "device:lru decides like the row provider's Lru", lru, row)
    expect(lfru["misses_per_token"] == cached["misses_per_token"], "device:lfru decides like the cached provider's Lfru",
           lfru, cached)
    expect(lru["misses_per_token"] != lfru["misses_per_token"] and crf["misses_per_token"] != lru["misses_per_token"],
           "the policies decide differently on this routing", lru, lfru, crf)
    for b in (lru, lfru, crf):
        expect(b["check_failures"] == 0 and b["host_syncs_per_token"] == 0, f"{b['name']} checks", b)
    # A comma list: those policies, in that order.
    rc, out, err = run("--runtime", "sim", "--steps", "2", "--warmup", "2", "--layers", "2", "--provider", "device",
                       "--device-policy", "crf,lfru,crf", "--json", out_json)
    expect(rc == 0, "--device-policy crf,lfru exits 0", out, err)
    with open(out_json, encoding="utf-8") as f:
        doc = json.load(f)
    expect([b["name"] for b in doc["benchmarks"]] == ["decode/device:crf/graph", "decode/device:lfru/graph"],
           "a comma list, duplicates dropped", doc)
    # --prompt with the device provider: the modelled run gives the host-planned table and the
    # device-planned one (stream rows, its mixed run without the groups row), and says that the
    # groups rows are measured on a GPU only (not asked: no device table).
    rc, out, err = run("--runtime", "sim", "--prompt", "16", "--layers", "2", "--warmup", "1",
                       "--provider", "device,cached", "--prompt-every", "2", "--steps", "4")
    expect(rc == 0, "--prompt --provider device,cached exits 0 when modelled", out, err)
    expect("device-planned cache" in out and "host-planned whole-expert cache" in out and "bound_ms" in out
           and "groups rows (prepare in rounds + prepare_group) measured on a GPU only" in out,
           "modelled prompt tables for both caches with the device note", out)
    expect(out.count("stream (scan resistant)") == 2 and out.count("admit (reference)") == 1,
           "mixed runs: both caches stream, the host-planned one admits", out)
    rc, out, err = run("--runtime", "sim", "--prompt", "16", "--layers", "2", "--warmup", "1")
    expect(rc == 0 and "TTFT" in out and "device-planned" not in out, "no device table unless asked", out, err)
    # A trace file, batch 2, one provider and staging.
    trace = write("t.trace", "".join(f"{s} {l} {(s + l) % 6} {(s * 3 + l) % 6 + 6}\n" for s in range(12) for l in range(3)))
    rc, out, err = run("--runtime", "sim", "--trace", trace, "--capacity", "6", "--batch", "2", "--steps", "3",
                       "--warmup", "1", "--provider", "cached", "--staging", "copy_stream", "--progress")
    expect(rc == 0, "trace run exits 0", out, err)
    expect("cached" in out and "copy_stream" in out and "row" not in out.split("provider")[1], "only cached", out)
    expect("expert-cache-bench: [1/1]" in err, "--progress reports on stderr", err)
    # Each row's result on stderr as soon as it is known, the same tok/s as the table's.
    done = [line for line in err.split("\n") if "[1/1] cached/copy_stream done: " in line]
    row = [line for line in out.split("\n") if line.startswith("cached ")]
    expect(len(done) == 1 and len(row) == 1 and f"done: {row[0].split()[2]} tok/s" in done[0],
           "--progress prints the row's tok/s when it is done", err, out)


def expect_usage_error(args, needle):
    _, out, _ = h.expect_usage_error(["--runtime", "sim", *args], needle)
    expect("tok/s" not in out, f"no table for {args}", out)


def case_bad_args():
    expect_usage_error(["--capacity", "5"], "is below top-k 10")
    expect_usage_error(["--capacity", "600"], "exceeds the 512 experts")
    expect_usage_error(["--provider", "bogus"], "unknown provider 'bogus'")
    expect_usage_error(["--staging", "fast"], "unknown staging 'fast'")
    expect_usage_error(["--staging", "gather"], "needs the CUDA runtime")
    expect_usage_error(["--device-policy", "opt"], "is not lru, lfru, crf or all")
    expect_usage_error(["--device-policy", "lru,bogus"], "'bogus' is not lru, lfru, crf or all")
    expect_usage_error(["--device-policy", "lru,"], "an empty name in 'lru,'")
    expect_usage_error(["--budget", "--runtime", "sim"], "--budget needs the CUDA runtime")
    expect_usage_error(["--budget", "--provider", "row"], "--budget needs the device provider")
    expect_usage_error(["--one-pass", "--runtime", "sim"], "--one-pass needs the CUDA runtime")
    expect_usage_error(["--one-pass", "--provider", "row"], "--one-pass needs the device provider")
    expect_usage_error(["--runtime", "gpu"], "--runtime")
    expect_usage_error(["--trace", os.path.join(h.TMP, "missing.trace")], "cannot open trace file")
    expect_usage_error(["--trace", write("bad.trace", "0 0 1 2\n1 0 x\n")], "line 2")
    expect_usage_error(["--trace", write("neg.trace", "0 0 1\n1 0 -3\n")], "negative")
    expect_usage_error(["--trace", write("empty.trace", "# nothing\n")], "no records")
    expect_usage_error(["--trace", write("short.trace", "0 0 1 2\n1 0 2 3\n"), "--capacity", "4"], "steps but")
    expect_usage_error(["--batch", "0"], "--batch")
    expect_usage_error(["--batch", "17"], "--batch")
    expect_usage_error(["--steps", "x"], "not an integer")
    expect_usage_error(["--topk", "20", "--capacity", "16"], "is below top-k 20")
    expect_usage_error(["--json"], "needs a value")
    expect_usage_error(["--frobnicate"], "unknown argument")
    expect_usage_error(["--prompt", "128", "--stream-slots", "1"], "--stream-slots")
    expect_usage_error(["--prompt", "128", "--prompt-lists", "pinned"], "--prompt-lists")
    expect_usage_error(["--prompt", "128", "--prompt-precision", "fp8"], "--prompt-precision")
    expect_usage_error(["--crf-half-life", "0"], "--crf-half-life")
    expect_usage_error(["--crf-half-life", "8x"], "--crf-half-life")
    expect_usage_error(["--consumer-order", "tokens"], "--consumer-order")
    expect_usage_error(["--overlap-parts", "w2-first"], "--overlap-parts")
    expect_usage_error(["--overlap-parts", "auto"], "is not whole or w13-first")
    expect_usage_error(["--device-storage", "blob"], "--device-storage: 'blob' is not tensor_major or expert_major")
    expect_usage_error(["--device-storage", "expert_major", "--runtime", "sim"], "--device-storage needs the CUDA runtime")
    expect_usage_error(["--device-storage", "expert_major", "--overlap-parts", "w13-first"],
                       "--device-storage expert_major cannot take --overlap-parts w13-first")
    expect_usage_error(["--device-storage", "expert_major", "--prompt", "128"],
                       "--device-storage sets the decode run's device rows")
    expect_usage_error(["--host-wait", "sleep"], "is not auto, spin, yield or blocking")
    expect_usage_error(["--host-wait", "blocking", "--runtime", "sim"], "--host-wait needs the CUDA runtime")
    expect_usage_error(["--prefetch-at", "layer"], "is not router, prepare or auto")
    expect_usage_error(["--prefetch-at", "router", "--runtime", "sim"], "--prefetch-at needs --prefetch")
    expect_usage_error(["--timeline", "--runtime", "sim"], "--timeline needs the CUDA runtime")
    expect_usage_error(["--step-sync", "--runtime", "sim"], "--step-sync needs the CUDA runtime")
    expect_usage_error(["--timeline-csv", "tl"], "--timeline-csv needs --timeline")
    expect_usage_error(["--fill-engine", "dma"], "'dma' in 'dma' (sm_loads, copy_engine, automatic, split or all)")
    expect_usage_error(["--fill-engine", "copy_engine", "--runtime", "sim"], "--fill-engine needs the CUDA runtime")
    expect_usage_error(["--fill-engine", "all", "--provider", "row"], "--fill-engine needs the device provider")
    rc, out, err = run("--help")
    expect(rc == 0 and "--provider" in out and "--staging" in out and "--trace" in out, "--help", out, err)
    expect("row, cached, device, resident" in out, "--help names the device provider", out)
    expect("--one-pass" in out, "--help names --one-pass", out)
    expect("--fill-engine" in out, "--help names --fill-engine", out)


PREFETCH_FIELDS = ("prefetch", "prefetch_label", "prefetch_emulated", "prefetch_budget", "speculative_issued_per_token",
                   "speculative_used_per_token", "speculative_wasted_per_token", "bytes_moved_per_token",
                   "bytes_needed_per_token", "vs_pcie_bound_moved", "vs_pcie_bound_needed")


def mask_real_cpu(text):
    # prep_us(realCPU) (columns 91-100 of the main table) is this CPU's wall clock; everything
    # else of a modelled run is deterministic.
    return "\n".join(line[:90] + "#" * 10 + line[100:] if len(line) > 100 else line for line in text.split("\n"))


def load(path):
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def case_prefetch():
    # A small model where the slots are short (64 experts, 24 slots, top-4), so the predictors
    # have non-resident experts to fetch.
    base = ["--runtime", "sim", "--experts", "64", "--capacity", "24", "--topk", "4", "--layers", "4", "--steps", "8",
            "--warmup", "8"]
    out_json = os.path.join(h.TMP, "prefetch.json")
    rc, out, err = run(*base, "--provider", "row,cached", "--prefetch", "none,coact,prev,hint:0.8,hint:1", "--json",
                       out_json)
    expect(rc == 0, "prefetch run exits 0", out, err)
    expect("lookahead" in out and "budget 4 experts per layer" in out, "lookahead table, default budget top-k", out)
    look = out.split("\nlookahead")[1]
    for col in ("spec_iss", "spec_use", "spec_wst", "(moved)", "(needed)", "vs_pcie", "tok/s", "hit%"):
        expect(col in look, f"lookahead table has {col}", out)
    rows = [line.split() for line in look.split("\n") if line.startswith(("row ", "cached "))]
    expect(len(rows) == 10, "5 lookahead rows per host-planned provider", out)
    for r in rows:
        expect(r[1] == "copy_stream", "lookahead rows use copy_stream", r)
        expect(("(emulated hint)" in " ".join(r)) == r[2].startswith("hint:"), "hint rows labelled emulated", r)
    main = out.split("\nlookahead")[0]
    expect("coact" not in main and "hint" not in main, "the main table keeps its rows", out)
    doc = load(out_json)
    by = {b["name"]: b for b in doc["benchmarks"]}
    for p in ("row", "cached"):
        none = by[f"decode/{p}/copy_stream"]
        expect(none["prefetch"] == "none" and none["speculative_issued_per_token"] == 0, f"{p} baseline row", none)
        expect(none["bytes_needed_per_token"] == none["pcie_bytes_per_token"] == none["bytes_moved_per_token"]
               and abs(none["vs_pcie_bound_needed"] - none["vs_pcie_bound_moved"]) < 1e-12, f"{p} baseline bytes", none)
        expect("prefetch" not in by[f"decode/{p}/inline"], "rows of other stagings carry no prefetch fields",
               by[f"decode/{p}/inline"])
        for spec in ("coact", "prev", "hint:0.8", "hint:1"):
            b = by.get(f"decode/{p}/copy_stream/prefetch:{spec}")
            expect(b is not None, f"{p} {spec} row in json", list(by))
            for key in PREFETCH_FIELDS:
                expect(key in b, f"{b['name']} has {key}", b)
            expect(b["check_failures"] == 0 and b["iterations"] == 8, f"{b['name']} consumer checks", b)
            expect(b["prefetch_emulated"] == spec.startswith("hint") and
                   ("emulated hint" in b["prefetch_label"]) == spec.startswith("hint"), f"{b['name']} label", b)
            iss, use, wst = (b["speculative_issued_per_token"], b["speculative_used_per_token"],
                             b["speculative_wasted_per_token"])
            expect(0 <= use <= iss and use + wst <= iss + 1e-9, f"{b['name']} used + wasted <= issued", b)
            expect(b["bytes_needed_per_token"] == none["pcie_bytes_per_token"], f"{b['name']} needed = baseline misses", b)
            # Bytes moved = the misses plus every speculative fill, each one fill's bytes.
            per_fill = none["pcie_bytes_per_token"] / none["misses_per_token"]
            want = (b["misses_per_token"] + iss) * per_fill
            expect(abs(b["bytes_moved_per_token"] - want) <= 1e-6 * want, f"{b['name']} bytes moved", b, want)
            expect(b["hit_rate"] >= 0 and b["prefetch_budget"] == 4, f"{b['name']} budget", b)
        hint1 = by[f"decode/{p}/copy_stream/prefetch:hint:1"]
        expect(hint1["speculative_wasted_per_token"] == 0 and hint1["hit_rate"] > none["hit_rate"],
               f"{p}: exact hints are all used and raise the hit rate", hint1, none)
        # prev names layer L+1's experts of the previous token: cache[L+1]'s last forward, which
        # is still resident, so a per-layer cache never needs its fills.
        prev = by[f"decode/{p}/copy_stream/prefetch:prev"]
        expect(prev["speculative_issued_per_token"] == 0 and prev["hit_rate"] == none["hit_rate"],
               f"{p}: previous-token predictions are resident already", prev, none)
    # Budget 0 = no prefetch: the same hits and misses, nothing issued.
    rc, out, err = run(*base, "--provider", "cached", "--staging", "copy_stream", "--prefetch", "coact,prev,hint:1",
                       "--prefetch-budget", "0", "--json", out_json)
    expect(rc == 0 and "budget 0 experts" in out, "budget 0 run", out, err)
    doc = load(out_json)
    none = doc["benchmarks"][0]
    expect(none["name"] == "decode/cached/copy_stream" and len(doc["benchmarks"]) == 4, "budget 0 rows", doc)
    for b in doc["benchmarks"][1:]:
        expect(b["hit_rate"] == none["hit_rate"] and b["misses_per_token"] == none["misses_per_token"]
               and b["speculative_issued_per_token"] == 0 and b["bytes_moved_per_token"] == none["bytes_moved_per_token"],
               f"{b['name']}: budget 0 equals no prefetch", b, none)
    # --two-ahead: each hint row once more, also prefetching layer L+2 from hints of recall R. Exact
    # two-ahead lists add what half-recall next-layer lists miss (layers 2 and up), all of it used.
    rc, out, err = run(*base, "--provider", "cached", "--staging", "copy_stream", "--prefetch", "none,coact,hint:0.5",
                       "--two-ahead", "1", "--json", out_json)
    expect(rc == 0 and "+ahead2:R rows also prefetch layer L+2" in out, "two-ahead run and legend", out, err)
    by = {b["name"]: b for b in load(out_json)["benchmarks"]}
    expect(sorted(by) == ["decode/cached/copy_stream", "decode/cached/copy_stream/prefetch:coact",
                          "decode/cached/copy_stream/prefetch:hint:0.5",
                          "decode/cached/copy_stream/prefetch:hint:0.5+ahead2:1"], "a twin for the hint row only", list(by))
    one, two = by["decode/cached/copy_stream/prefetch:hint:0.5"], by["decode/cached/copy_stream/prefetch:hint:0.5+ahead2:1"]
    expect(two["check_failures"] == 0 and two["prefetch_emulated"] and "+ahead2:1 (emulated hint)" in two["prefetch_label"],
           "two-ahead row checked and labelled", two)
    expect(two["hit_rate"] > one["hit_rate"] and two["speculative_issued_per_token"] > one["speculative_issued_per_token"],
           "exact two-ahead lists raise the hit rate", one, two)
    expect(two["speculative_used_per_token"] + two["speculative_wasted_per_token"] <= two["speculative_issued_per_token"] + 1e-9,
           "two-ahead used + wasted <= issued", two)
    # Without --prefetch: no lookahead output, no prefetch fields; the table is the one a
    # --prefetch run prints above its lookahead table.
    rc, plain, err = run(*base, "--json", out_json)
    expect(rc == 0 and "lookahead" not in plain and "prefetch" not in plain and "emulated" not in plain,
           "no lookahead output without --prefetch", plain, err)
    for b in load(out_json)["benchmarks"]:
        expect(not any(k in b for k in PREFETCH_FIELDS), f"{b['name']}: no prefetch fields without --prefetch", b)
    rc, with_prefetch, err = run(*base, "--prefetch", "coact")
    expect(rc == 0, "default providers with --prefetch", with_prefetch, err)
    # The --prefetch output is the plain one with the lookahead table inserted after the legend.
    start = with_prefetch.index("\nlookahead (")
    tail = "(the benchmark has no hidden states).\n"
    end = with_prefetch.index(tail) + len(tail)
    expect(mask_real_cpu(with_prefetch[:start] + with_prefetch[end:]) == mask_real_cpu(plain),
           "the output without --prefetch is the --prefetch output less its lookahead table", plain, with_prefetch)


def case_prefetch_bad_args():
    expect_usage_error(["--prefetch", "bogus"], "unknown prefetch 'bogus'")
    expect_usage_error(["--prefetch", "hint:0"], "outside (0, 1]")
    expect_usage_error(["--prefetch", "hint:1.5"], "outside (0, 1]")
    expect_usage_error(["--prefetch", "hint:x"], "decimal number")
    expect_usage_error(["--prefetch", "coact,"], "--prefetch")
    expect_usage_error(["--prefetch"], "needs a value")
    expect_usage_error(["--prefetch", "coact", "--prefetch-budget", "-1"], "--prefetch-budget")
    expect_usage_error(["--prefetch", "coact", "--prefetch-budget", "x"], "not an integer")
    expect_usage_error(["--prefetch-budget", "3"], "--prefetch-budget needs --prefetch")
    expect_usage_error(["--prefetch", "coact", "--provider", "device"], "host-planned provider")
    expect_usage_error(["--prefetch", "prev", "--provider", "resident"], "host-planned provider")
    expect_usage_error(["--prefetch", "coact", "--staging", "inline,batched"], "--staging copy_stream")
    expect_usage_error(["--prefetch", "hint:0.9", "--two-ahead", "0"], "'0' is not a recall in (0, 1]")
    expect_usage_error(["--prefetch", "hint:0.9", "--two-ahead", "0.7x"], "'0.7x' is not a recall in (0, 1]")
    expect_usage_error(["--prefetch", "coact,prev", "--two-ahead", "0.7"], "--two-ahead needs a hint predictor")
    expect_usage_error(["--two-ahead", "0.7"], "--two-ahead needs a hint predictor")
    rc, out, err = run("--help")
    expect(rc == 0 and "--prefetch P" in out and "--prefetch-budget N" in out and "EMULATED" in out,
           "--help documents --prefetch", out, err)


# A trace with sparse layer numbers (5 and 7: the model's layers 0 and 1) for a 2-layer model of 16
# experts, top-2. Step 3 and steps 11-14 are one-token (decode) steps routed to experts 0 and 1 in
# both layers; step 10 (lines 4-11) is a 4-token prompt, step 20 (lines 20-25) a 3-token one. A
# record may name fewer than top-k distinct experts ("5 5"; "11").
PROMPT_TRACE = """# expert-cache trace v1: a prompt between decode steps
3 5 0 1
3 7 0 1
10 5 0 2
10 5 3 4
10 5 5 5
10 5 6 0
10 7 1 8
10 7 9 10
10 7 11
10 7 12 1
""" + "".join(f"{s} 5 0 1\n{s} 7 1 0\n" for s in range(11, 15)) + """20 5 13 14
20 5 15
20 5 0 13
20 7 2 3
20 7 4
20 7 1 4
"""
PROMPT_MODEL = ["--runtime", "sim", "--layers", "2", "--experts", "16", "--topk", "2", "--capacity", "4"]


def prompt_rows(out):
    """{table title: [row dicts]} of a modelled prompt run's TTFT tables, and its mixed tables."""
    ttft, mixed, title, kind, header = {}, {}, None, None, None
    for line in out.split("\n"):
        if ": TTFT (" in line:
            title, kind = line.split(":")[0], "ttft"
            ttft[title] = []
        elif line.startswith("mixed: "):
            kind = "mixed"
            mixed[title] = {}
        elif kind == "ttft" and line.split()[:1] == ["tokens"]:
            header = line.split()
        elif kind == "ttft" and line.strip() and line.split()[0].isdigit():
            ttft[title].append(dict(zip(header, (float(v) for v in line.split()))))
        elif kind == "mixed" and line.strip() and not line.startswith(("admission", "(")):
            parts = line.rsplit(None, 2)
            if len(parts) == 3 and parts[2].replace(".", "").isdigit():
                mixed[title][parts[0].strip()] = (float(parts[1]), float(parts[2]))
    return ttft, mixed


def expected_bound_ms(out, experts):
    """The streaming bound of `experts` non-resident experts, from the run's printed expert size and link rate."""
    mib = float(out.split(" MiB")[0].rsplit("expert ", 1)[1])
    gbs = float(out.split(" GB/s)")[0].rsplit("/ ", 1)[1])
    return experts * mib * (1 << 20) / (gbs * 1e9) * 1e3


def case_prompt_trace():
    trace = write("prompt.trace", PROMPT_TRACE)
    host = "host-planned whole-expert cache (Lfru, copy stream)"
    # Default step: the first with a wide forward (10, not the one-token step 3). From an empty
    # cache (no warm-up) every expert of the prompt is missing: layer 5 (model layer 0) routes
    # {0, 2, 3, 4, 5, 6}, layer 7 {1, 8, 9, 10, 11, 12}: 12 experts.
    rc, out, err = run(*PROMPT_MODEL, "--prompt-trace", trace, "--warmup", "0")
    expect(rc == 0, "--prompt-trace exits 0", out, err)
    expect("MODELLED on SimRuntime" in out, "labelled MODELLED", out)
    expect(f"routing: prompt = {trace} step 10 (the first step with a wide forward), lines 4-11, 4 tokens per layer; "
           "decode steps = the trace's 5 one-token steps, in file order, cycled; 1 other step(s) not used" in out,
           "the routing line names the file, the step, its lines, its tokens and the decode steps", out)
    ttft, mixed = prompt_rows(out)
    expect(list(ttft) == [host] and len(ttft[host]) == 1 and not mixed, "one TTFT row of the host-planned cache", out)
    row = ttft[host][0]
    for col in ("tokens", "ttft_ms", "bound_ms", "bound/ttft", "GB/s", "compute_ms", "resident_ms", "rounds", "copies"):
        expect(col in row, f"the row has {col}", row)
    expect(row["tokens"] == 4, "the prompt's tokens: records per layer at the step", row)
    bound = expected_bound_ms(out, 12)
    expect(abs(row["bound_ms"] - bound) <= 0.01 * bound, "cold bound = the prompt's 12 experts", row, bound)
    expect(row["ttft_ms"] >= row["bound_ms"] and 0 < row["bound/ttft"] <= 1 and row["GB/s"] > 0, "TTFT >= bound", row)
    expect(row["rounds"] >= 2 and row["copies"] >= 2 and row["resident_ms"] > 0 and row["compute_ms"] > 0,
           "every layer ran rounds and copies", row)
    cold_ttft = row["ttft_ms"]

    # After warm-up on the trace's decode steps (experts 0 and 1 in both layers) those two are
    # resident in each layer: 10 experts missing. The device-planned cache serves the same prompt.
    rc, out, err = run(*PROMPT_MODEL, "--prompt-trace", trace, "--warmup", "2", "--provider", "device,cached")
    expect(rc == 0, "--prompt-trace with both caches exits 0", out, err)
    ttft, _ = prompt_rows(out)
    expect(len(ttft) == 2 and all(len(rows) == 1 for rows in ttft.values()), "one row per cache", out)
    bound = expected_bound_ms(out, 10)
    for title, rows in ttft.items():
        expect(rows[0]["tokens"] == 4 and abs(rows[0]["bound_ms"] - bound) <= 0.01 * bound,
               f"{title}: warm bound = 10 non-resident experts", rows, bound)
    expect(ttft[host][0]["ttft_ms"] < cold_ttft, "the warm cache serves the prompt faster", ttft, cold_ttft)

    # An explicit step: 20 (3 tokens; layer 5 routes {0, 13, 14, 15}, layer 7 {1, 2, 3, 4}: 8 cold).
    rc, out, err = run(*PROMPT_MODEL, "--prompt-trace", trace + ":20", "--warmup", "0")
    expect(rc == 0, "--prompt-trace FILE:20 exits 0", out, err)
    expect(f"prompt = {trace} step 20, lines 20-25, 3 tokens per layer" in out and "1 other step(s) not used" in out,
           "step 20 named, step 10 left out of the decode steps", out)
    row = prompt_rows(out)[0][host][0]
    bound = expected_bound_ms(out, 8)
    expect(row["tokens"] == 3 and abs(row["bound_ms"] - bound) <= 0.01 * bound, "step 20's row", row, bound)

    # The mixed run: the trace's prompt every 2 decode tokens, decode on the trace's steps. Those
    # route only experts 0 and 1, resident after the warm-up: every decode hit is certain, and
    # stream admission keeps it so (generated decode steps would miss).
    rc, out, err = run(*PROMPT_MODEL, "--prompt-trace", trace, "--warmup", "2", "--prompt-every", "2", "--steps", "4")
    expect(rc == 0, "--prompt-trace --prompt-every exits 0", out, err)
    expect("mixed: the trace's 4-token prompt every 2 decode tokens, 4 decode tokens measured" in out,
           "the mixed run names the trace's prompt", out)
    _, mixed = prompt_rows(out)
    rows = mixed[host]
    expect(set(rows) == {"decode only", "stream (scan resistant)", "admit (reference)"}, "three admission rows", out)
    expect(rows["decode only"][1] == 1.0 and rows["stream (scan resistant)"][1] == 1.0,
           "decode on the trace's steps hits every time; stream admission leaves it so", rows)
    # Admitted, the prompt's 6 experts per layer pass through the 4 slots and evict decode's.
    expect(rows["admit (reference)"][1] < 1.0, "admitting the trace's prompt costs decode hits", rows)

    # A trace that is one prompt only: the decode steps are generated, and the run says so.
    only = write("only.trace", "".join(f"0 {l} {t} {t + 4}\n" for l in (0, 1) for t in range(3)))
    rc, out, err = run(*PROMPT_MODEL, "--prompt-trace", only, "--warmup", "1")
    expect(rc == 0 and "decode steps = generated (" in out and "the trace has no step with one record in every layer"
           in out, "generated decode steps for a prompt-only trace, labelled", out, err)
    expect(prompt_rows(out)[0][host][0]["tokens"] == 3, "the prompt-only trace's row", out)

    rc, out, err = run("--help")
    expect(rc == 0 and "--prompt-trace FILE[:STEP]" in out and "first step with more than one record" in out,
           "--help documents --prompt-trace", out, err)


def case_prompt_trace_bad_args():
    trace = write("prompt.trace", PROMPT_TRACE)
    out_json = os.path.join(h.TMP, "never.json")

    def reject(args, needle, model=PROMPT_MODEL):
        _, out, _ = h.expect_usage_error([*model, *args, "--json", out_json], needle)
        expect(out == "", f"nothing run for {args}", out)
        expect(not os.path.exists(out_json), f"no --json file written for {args}", out_json)

    missing = os.path.join(h.TMP, "missing.trace")
    reject(["--prompt-trace", missing], f"--prompt-trace: cannot open trace file '{missing}'")
    reject(["--prompt-trace", write("syntax.trace", "0 0 1 2\n0 0 3 x\n")], "syntax.trace: line 2: expert id 'x'")
    reject(["--prompt-trace", write("split.trace", "0 0 1\n0 1 2\n0 0 3\n")], "split.trace: line 3: records of step 0 "
           "layer 0 must be contiguous")
    reject(["--prompt-trace", write("nothing.trace", "# no records\n")], "nothing.trace: the trace has no records")
    decode = write("decode.trace", "".join(f"{s} {l} 0 1\n" for s in range(4) for l in (0, 1)))
    reject(["--prompt-trace", decode], "decode.trace: no step has a wide forward")
    reject(["--prompt-trace", trace + ":3"], "prompt.trace: step 3 (line 2) has no wide forward")
    reject(["--prompt-trace", trace + ":99"], "prompt.trace: step 99 is not in the trace")
    reject(["--prompt-trace", trace + ":99999999999"], "--prompt-trace STEP: 99999999999 is outside")
    reject(["--prompt-trace", ":5"], "--prompt-trace needs a file name")
    # Layer count against the model's (--layers 2).
    three = write("three.trace", "0 5 0 1\n0 5 2 3\n0 7 0 1\n0 7 2 3\n0 9 0 1\n0 9 2 3\n")
    reject(["--prompt-trace", three], "three.trace: the trace has 3 layers (5 to 9) but the model has 2 (--layers); "
           "layer 9, the trace's 3rd, first appears on line 5")
    reject(["--prompt-trace", write("one.trace", "0 5 0 1\n0 5 2 3\n")],
           "one.trace: the trace has 1 layer (5) but the model has 2 (--layers)")
    # Experts and top-k against the model's (16 experts, top-2).
    reject(["--prompt-trace", write("wide_id.trace", PROMPT_TRACE.replace("10 7 11\n", "10 7 16\n"))],
           "wide_id.trace: line 10: expert id 16 is outside the model's 16 experts (--experts)")
    reject(["--prompt-trace", write("topk.trace", PROMPT_TRACE.replace("14 5 0 1\n", "14 5 0 1 2\n"))],
           "topk.trace: line 18: a record (one token) of 3 distinct experts, more than the model's top-k 2 (--topk)")
    # The prompt step's layers: every layer, the same number of tokens.
    reject(["--prompt-trace", write("gap.trace", "0 5 0 1\n0 7 0 1\n1 5 0 1\n1 5 2 3\n")],
           "gap.trace: step 1 (line 3) has no records for layer 7: a prompt's tokens pass every layer")
    reject(["--prompt-trace", write("uneven.trace", PROMPT_TRACE.replace("10 7 12 1\n", ""))],
           "uneven.trace: line 8: step 10 layer 7 has 3 record(s) but layer 5 has 4 (line 4)")
    # Combinations.
    reject(["--prompt-trace", trace, "--prompt", "16"], "--prompt-trace and --prompt: give one")
    reject(["--prompt-every", "4"], "--prompt-every needs --prompt or --prompt-trace")
    reject(["--prompt-trace", trace], "--prompt-trace " + trace + ": the trace has 2 layers (5 to 7) but the model has 48",
           model=["--runtime", "sim"])


def case_prefetch_scores():
    # Scored emulated hints in the modelled decode loop (the same small model as case_prefetch):
    # noise 0 scores true ids 1 and wrong ids 0, so only true ids are fetched, and each is used
    # by the next forward of its layer (a per-layer cache, one forward later): nothing wasted.
    base = ["--runtime", "sim", "--experts", "64", "--capacity", "24", "--topk", "4", "--layers", "4", "--steps", "8",
            "--warmup", "8", "--provider", "cached", "--staging", "copy_stream"]
    out_json = os.path.join(h.TMP, "scores.json")
    rc, out, err = run(*base, "--prefetch", "hint:0.5,hint:0.5:noise=0,hint:0.5:noise=1,hint:0.5:recent:noise=0.3",
                       "--json", out_json)
    expect(rc == 0, "scored prefetch run exits 0", out, err)
    by = {b["name"]: b for b in load(out_json)["benchmarks"]}
    key = "decode/cached/copy_stream/prefetch:"
    plain, exact, blind = by[key + "hint:0.5"], by[key + "hint:0.5:noise=0"], by[key + "hint:0.5:noise=1"]
    recent = by[key + "hint:0.5:recent:noise=0.3"]
    for b in (exact, blind, recent):
        expect(b["prefetch_emulated"] and "emulated hint" in b["prefetch_label"], f"{b['name']} labelled emulated", b)
        expect(b["check_failures"] == 0, f"{b['name']} consumer checks", b)
    expect(plain["speculative_wasted_per_token"] > 0, "unscored uniform wrong ids waste fills", plain)
    expect(exact["speculative_wasted_per_token"] == 0 and recent["speculative_wasted_per_token"] == 0,
           "noise 0 and 0.3 with min_score 0.5: true ids only, none wasted", exact, recent)
    expect(exact["speculative_issued_per_token"] < plain["speculative_issued_per_token"]
           and exact["bytes_moved_per_token"] < plain["bytes_moved_per_token"],
           "the scores drop the wrong ids' fills", exact, plain)
    expect(exact["hit_rate"] > by["decode/cached/copy_stream"]["hit_rate"], "the true ids still raise the hit rate",
           exact)
    # Both rows' wrong fills also meet the precision feedback, which throttles a rank after a few wasted
    # fills; what the scores add is that true hints are skipped with the wrong ones.
    expect(blind["speculative_issued_per_token"] <= plain["speculative_issued_per_token"]
           and blind["speculative_used_per_token"] < plain["speculative_used_per_token"],
           "noise 1: hints skipped, true and wrong alike (no more fills, fewer of them used)", blind, plain)
    expect("hint:0.5:recent:noise=0.3 (emulated hint)" in out, "the table names the scored row", out)


def case_prefetch_scores_bad_args():
    expect_usage_error(["--prefetch", "hint:0.5:noise=2"], "noise 2 is outside [0, 1]")
    expect_usage_error(["--prefetch", "hint:0.5:noise=x"], "decimal number in [0, 1]")
    expect_usage_error(["--prefetch", "hint:0.5:noise=0.1:recent"], "'recent' is out of place")
    rc, out, err = run("--help")
    expect(rc == 0 and "noise=N" in out, "--help documents the score noise", out, err)


CASES = {"smoke": case_smoke, "bad_args": case_bad_args, "prompt_trace": case_prompt_trace,
         "prompt_trace_bad_args": case_prompt_trace_bad_args, "prefetch": case_prefetch,
         "prefetch_bad_args": case_prefetch_bad_args, "prefetch_scores": case_prefetch_scores,
         "prefetch_scores_bad_args": case_prefetch_scores_bad_args}


if __name__ == "__main__":
    sys.exit(h.main(CASES, __doc__, timeout=300))
