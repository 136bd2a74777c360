#!/usr/bin/env python3
"""End-to-end tests of the expert-cache-replay CLI.

usage: test_replay_cli.py PATH_TO_CLI CASE
Each CASE is registered as its own meson test; 'all' runs every case.
Traces are written into a fresh temporary directory; nothing outside it is needed.
"""
import json
import os
import sys

from support import cli_harness as h
from support.cli_harness import expect, expect_usage_error, run, write


def generated_file():
    path = os.path.join(h.TMP, "gen.trace")
    rc, out, err = run("--generate", "layers=3,experts=16,topk=3,steps=300,seed=4", "--write-trace", path)
    expect(rc == 0, "--write-trace succeeds", out, err)
    return path


def case_help():
    rc, out, err = run("--help")
    expect(rc == 0 and "--capacity" in out and "--scope" in out and "lru" in out, "--help", out, err)


def case_default_generated():
    rc, out, err = run("--capacity", "8,16", "--policy", "lru")
    expect(rc == 0, "default generated trace replays", out, err)
    expect("generated:default" in out and "lru" in out and "hit_rate" in out, "table header", out)


def case_file_table_and_json():
    path = generated_file()
    rc, out, err = run("--trace", path, "--capacity", "3,6,12", "--policy", "all", "--json")
    expect(rc == 0, "replay of generated file", out, err)
    doc = json.loads(out)
    expect(doc["num_layers"] == 3 and doc["num_experts"] == 16 and doc["forwards"] == 900, "json header", out)
    expect(doc["accesses"] == 900 * 3, "accesses = forwards * topk", out)
    caps = sorted({r["capacity"] for r in doc["results"]})
    expect(caps == [3, 6, 12], "all capacities present", out)
    for r in doc["results"]:
        expect(r["hits"] + r["misses"] == doc["accesses"], "hits + misses = accesses", r)
        if doc["has_opt"]:
            expect(r["hits_vs_opt"] is not None and r["hits_vs_opt"] <= 1.0 + 1e-9, "OPT bounds hits", r)
    # Generated-in-memory and written-then-parsed traces give the same numbers.
    rc2, out2, err2 = run("--generate", "layers=3,experts=16,topk=3,steps=300,seed=4",
                          "--capacity", "3,6,12", "--policy", "all", "--json")
    expect(rc2 == 0, "generated replay", out2, err2)
    expect(json.loads(out2)["results"] == doc["results"], "file and in-memory replays agree", out, out2)
    rc, out, err = run("--trace", path, "--capacity", "6", "--policy", "lru")
    expect(rc == 0 and "lru" in out and "gen.trace" in out, "table output", out, err)
    # stdin
    with open(path, encoding="utf-8") as f:
        rc, out, err = run("--trace", "-", "--capacity", "6", "--policy", "lru", "--json", stdin=f.read())
    expect(rc == 0 and json.loads(out)["forwards"] == 900, "trace from stdin", out, err)


def case_global_scope():
    path = write("g.trace", "0 0 1 2\n0 1 1\n1 0 2 3\n1 1 0 1\n")
    rc, out, err = run("--trace", path, "--scope", "global", "--capacity", "3", "--policy", "lru", "--json")
    expect(rc == 0, "global scope", out, err)
    doc = json.loads(out)
    expect(doc["cache_experts"] == 8 and doc["caches"] == 1, "global key space = layers * E", out)
    r = doc["results"][0]
    # keys (E=4): {1,2} {5} {2,3} {4,5}; LRU with 3 slots, ascending order within a forward:
    # f1 miss 1,2 | f2 miss 5 | f3 hit 2, miss 3 (evicts 1) | f4 miss 4 (evicts 2: 5 is needed), hit 5
    expect(r["hits"] + r["misses"] == 7, "accesses", r)
    expect(r["hits"] == 2, "hits by hand", r)


def case_per_layer():
    path = write("g.trace", "0 0 1 2\n0 1 1\n1 0 2 3\n1 1 0 1\n")
    rc, out, err = run("--trace", path, "--scope", "global", "--capacity", "3", "--policy", "lru,opt",
                       "--per-layer", "--json")
    expect(rc == 0, "--per-layer --json", out, err)
    doc = json.loads(out)
    lru = doc["results"][0]
    # By hand (see global_scope): layer 0 requests {1,2} {2,3} and hits 2; layer 1 requests
    # {5} {4,5} and hits 5. OPT hits the same two.
    expect([(x["layer"], x["hits"], x["misses"]) for x in lru["per_layer"]] == [(0, 1, 3), (1, 1, 2)],
           "per-layer counts by hand", lru)
    expect([x["opt_hits"] for x in lru["per_layer"]] == [1, 1], "OPT per layer", lru)
    # Without --per-layer the JSON stays as it was.
    rc, out, err = run("--trace", path, "--scope", "global", "--capacity", "3", "--policy", "lru", "--json")
    expect(rc == 0 and "per_layer" not in out, "no per_layer without the flag", out, err)
    # A generated pool: per-layer sums equal the totals, and the table names the layers that
    # lose the most against OPT.
    gen = generated_file()
    rc, out, err = run("--trace", gen, "--scope", "global", "--capacity", "6,12", "--policy", "all",
                       "--per-layer", "--json")
    expect(rc == 0, "global --per-layer on a generated trace", out, err)
    for r in json.loads(out)["results"]:
        expect(len(r["per_layer"]) == 3, "one entry per layer", r)
        expect(sum(x["hits"] for x in r["per_layer"]) == r["hits"], "per-layer hits sum to the total", r)
        expect(sum(x["misses"] for x in r["per_layer"]) == r["misses"], "per-layer misses sum to the total", r)
        expect(all(x["opt_hits"] >= 0 for x in r["per_layer"]), "OPT per layer present", r)
    rc, out, err = run("--trace", gen, "--scope", "global", "--capacity", "6", "--policy", "lru,lrfu,layershare",
                       "--per-layer")
    expect(rc == 0 and "per layer, capacity 6 (global scope)" in out, "per-layer table", out, err)
    expect("lru loses" in out and "most at layers" in out, "layers that lose the most", out)


def case_progress():
    path = generated_file()
    rc, out, err = run("--trace", path, "--capacity", "6", "--policy", "lru", "--progress")
    expect(rc == 0 and "replay:" in err and "forwards" in err, "--progress reports on stderr", out, err)
    rc, out, err = run("--trace", path, "--capacity", "6", "--policy", "lru")
    expect(rc == 0 and err == "", "no progress when stderr is not a terminal", err)


def case_bad_args():
    path = generated_file()
    expect_usage_error(["--trace", path, "--policy", "bogus"], "unknown policy 'bogus'")
    expect_usage_error(["--trace", path, "--capacity", "0"], "below 1")
    expect_usage_error(["--trace", path, "--capacity", "-4"], "below 1")
    expect_usage_error(["--trace", path, "--capacity", "abc"], "not an integer")
    expect_usage_error(["--trace", path, "--capacity", "8,"], "not an integer")
    expect_usage_error(["--trace", path, "--capacity", "17"], "capacity 17 must be in [1, 16]")
    expect_usage_error(["--trace", path, "--capacity", "2"], "needs 3 unique experts")
    expect_usage_error(["--trace", path, "--scope", "world"], "--scope")
    expect_usage_error(["--trace", path, "--experts", "0"], "--experts")
    expect_usage_error(["--trace", path, "--experts", "8"], "is >= num_experts 8")
    expect_usage_error(["--trace", os.path.join(h.TMP, "missing.trace")], "cannot open")
    expect_usage_error(["--trace"], "needs a value")
    expect_usage_error(["--frobnicate"], "unknown argument")
    expect_usage_error(["--json=1"], "takes no value")
    expect_usage_error(["--generate", "layers=0"], "generator spec")
    expect_usage_error(["--trace", path, "--generate", "default"], "mutually exclusive")
    expect_usage_error(["--trace", write("empty.trace", "# nothing\n")], "no records")


def case_malformed_traces():
    cases = [
        ("0 0 1 2\n1 0 x\n", "line 2:", "not an integer"),
        ("0 0 1 2\n\n# c\n1 0\n", "line 4:", "too few fields"),
        ("0 0 1\n-1 0 1\n", "line 2:", "negative"),
        ("0 0 1\n1 0 -5\n", "line 2:", "negative"),
        ("0 99999999999 1\n", "line 1:", "exceeds"),
        ("0 0 1\n0 1 1\n0 0 2\n", "line 3:", "contiguous"),
        ("0 0 " + "9" * 40 + "\n", "line 1:", "exceeds the limit"),
        ("0 0 1\n\x00\x01\xff\n", "line 2:", "not an integer"),
    ]
    for i, (text, line, what) in enumerate(cases):
        path = write(f"bad{i}.trace", text)
        rc, out, err = run("--trace", path, "--capacity", "1", "--policy", "lru")
        expect(rc == 2, f"malformed trace {i} exits 2", text, out, err)
        expect(path in err and line in err and what in err, f"malformed trace {i} message", text, err)
        expect(out == "", f"malformed trace {i} prints no table", out)
    # A forward too wide for the cache names its first line.
    path = write("wide.trace", "# header\n0 0 1 2\n1 0 1\n1 0 2 3\n")
    expect_usage_error(["--trace", path, "--capacity", "2", "--policy", "lru"], "line 3: forward (step 1, layer 0)")


CASES = {
    "help": case_help,
    "default_generated": case_default_generated,
    "file_table_and_json": case_file_table_and_json,
    "global_scope": case_global_scope,
    "per_layer": case_per_layer,
    "progress": case_progress,
    "bad_args": case_bad_args,
    "malformed_traces": case_malformed_traces,
}


if __name__ == "__main__":
    sys.exit(h.main(CASES, __doc__ + "cases: " + " ".join(CASES), timeout=120))
