#!/usr/bin/env python3
"""End-to-end tests of expert-cache-bench (the decode-loop provider benchmark).

usage: test_bench_cli.py PATH_TO_BENCH CASE
Cases: smoke (a short modelled run of every provider, the device provider alone too, table +
Google-Benchmark JSON, host synchronisations per token), bad_args (every rejection
exits 2 with a clear message and prints no table). 'all' runs both. Always forces --runtime sim
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
    rc, out, err = run("--help")
    expect(rc == 0 and "--provider" in out and "--staging" in out and "--trace" in out, "--help", out, err)
    expect("row, cached, device, resident" in out, "--help names the device provider", out)


CASES = {"smoke": case_smoke, "bad_args": case_bad_args}


if __name__ == "__main__":
    sys.exit(h.main(CASES, __doc__, timeout=300))
