#!/usr/bin/env python3
"""End-to-end tests of expert-cache-bench (the decode-loop provider benchmark).

usage: test_bench_cli.py PATH_TO_BENCH CASE
Cases: smoke (a short modelled run of every provider, the device provider alone too, table +
Google-Benchmark JSON, host synchronisations per token, a modelled --prompt run), bad_args (every rejection
exits 2 with a clear message and prints no table), prefetch (--prefetch rows: columns, JSON
fields, budget 0 = no prefetch, emulated-hint labels; the output without --prefetch keeps its
table), prefetch_bad_args (its rejections). 'all' runs every case. Always forces --runtime sim
so the tests behave the same with or without a GPU.
"""
import json
import os
import sys

from support import cli_harness as h
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
    rc, out, err = run("--help")
    expect(rc == 0 and "--provider" in out and "--staging" in out and "--trace" in out, "--help", out, err)
    expect("row, cached, device, resident" in out, "--help names the device provider", out)
    expect("--one-pass" in out, "--help names --one-pass", out)


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
    rc, out, err = run("--help")
    expect(rc == 0 and "--prefetch P" in out and "--prefetch-budget N" in out and "EMULATED" in out,
           "--help documents --prefetch", out, err)


CASES = {"smoke": case_smoke, "bad_args": case_bad_args, "prefetch": case_prefetch,
         "prefetch_bad_args": case_prefetch_bad_args}


if __name__ == "__main__":
    sys.exit(h.main(CASES, __doc__, timeout=300))
