#!/usr/bin/env python3
"""End-to-end tests of the expert-cache-replay CLI.

usage: test_replay_cli.py PATH_TO_CLI CASE
Each CASE is registered as its own meson test; 'all' runs every case.
Traces are written into a fresh temporary directory; nothing outside it is needed.
"""
import json
import os
import sys

# tests/support is shared with the C++ suites; this file sits one folder below tests/.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from support import cli_harness as h  # noqa: E402
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


def plain_fields(r):
    return {k: r[k] for k in ("policy", "capacity", "hits", "misses", "evictions", "hit_rate")}


def case_prefetch():
    path = generated_file()
    rc, out, err = run("--trace", path, "--capacity", "6,12", "--policy", "all", "--json")
    expect(rc == 0, "plain replay", out, err)
    plain = json.loads(out)
    for pf in ("coact", "prev", "hint:0.8"):
        rc, out, err = run("--trace", path, "--capacity", "6,12", "--policy", "all", "--json", "--prefetch", pf,
                           "--expert-bytes", "1000")
        expect(rc == 0, f"--prefetch {pf}", out, err)
        doc = json.loads(out)
        p = doc["prefetch"]
        expect(p["predictor"] == pf and p["emulated"] == pf.startswith("hint"), "prefetch header", p)
        expect(p["budget"] == 3 and p["expires_after"] == 1 and p["expert_bytes"] == 1000, "budget = topk", p)
        expect(p["tokens"] == 300, "tokens = records / layers", p)
        expect([plain_fields(r) for r in doc["results"]] == [plain_fields(r) for r in plain["results"]],
               "the plain columns are the plain replay's", out)
        for r in doc["results"]:
            if r["policy"] == "opt":
                expect(r["prefetch_hits"] is None and r["issued"] is None and r["coverage"] is None,
                       "OPT is the reference, replayed without prefetch", r)
                continue
            expect(r["prefetch_hits"] + r["prefetch_misses"] == doc["accesses"], "prefetch accesses", r)
            expect(r["used"] <= r["issued"], "used <= issued", r)
            expect(r["issued"] == r["used"] + r["wasted"] + r["pending"], "issued = used + wasted + pending", r)
            expect(r["issued"] <= 3 * doc["forwards"], "budget bounds the fills", r)
            expect(abs(r["coverage"] - r["used"] / r["misses"]) < 1e-6, "coverage = used / plain misses", r)
            if r["issued"]:
                expect(abs(r["precision"] - r["used"] / r["issued"]) < 1e-6, "precision = used / issued", r)
            expect(abs(r["extra_bytes_per_token"] - (r["issued"] - r["used"]) * 1000 / 300) < 1e-3,
                   "extra bytes per token", r)
            expect(abs(r["opt_hit_rate"] - r["hit_rate"] / r["hits_vs_opt"]) < 1e-4 if r["hits_vs_opt"] else True,
                   "OPT's hit rate next to the policy's", r)
    # Budget 0: the prefetch run is the plain run.
    rc, out, err = run("--trace", path, "--capacity", "6", "--policy", "all", "--json", "--prefetch", "hint:0.7",
                       "--prefetch-budget", "0")
    expect(rc == 0, "budget 0", out, err)
    for r in json.loads(out)["results"]:
        if r["policy"] != "opt":
            expect(r["prefetch_hits"] == r["hits"] and r["issued"] == 0, "budget 0 changes nothing", r)
    # Perfect hints with enough budget never lower the hit rate.
    rc, out, err = run("--trace", path, "--capacity", "6,12", "--policy", "lru,lrfu", "--json", "--prefetch", "hint:1")
    expect(rc == 0, "hint:1", out, err)
    for r in json.loads(out)["results"]:
        expect(r["prefetch_hit_rate"] >= r["hit_rate"] and r["precision"] == 1.0, "hint:1 helps", r)
    # By hand (tests/host/test_predictors.cpp): global LRU, 3 slots, one fill per forward.
    tiny = write("tiny.trace", "0 0 0\n0 1 1\n1 0 2\n1 1 3\n2 0 0\n2 1 2\n")
    rc, out, err = run("--trace", tiny, "--scope", "global", "--capacity", "3", "--policy", "lru", "--json",
                       "--prefetch", "hint:1", "--prefetch-budget", "1")
    expect(rc == 0, "tiny global", out, err)
    doc = json.loads(out)
    r = doc["results"][0]
    expect(doc["prefetch"]["expires_after"] == 2, "global: expires after one token's forwards", doc)
    expect((r["hits"], r["prefetch_hits"], r["issued"], r["used"]) == (0, 3, 3, 3), "counts by hand", r)
    expect(abs(r["coverage"] - 0.5) < 1e-9, "coverage by hand", r)
    # Table: the added columns, and emulated hints labelled as such.
    rc, out, err = run("--trace", path, "--capacity", "6", "--policy", "lru,opt", "--prefetch", "hint:0.8")
    expect(rc == 0 and "coverage" in out and "precision" in out and "+prefetch" in out, "prefetch table", out, err)
    expect("emulated" in out and "EMULATED" in out, "emulated hints are labelled", out)
    rc, out, err = run("--trace", path, "--capacity", "6", "--policy", "lru", "--prefetch", "coact")
    expect(rc == 0 and "prefetch: coact:" in out and "emulated" not in out.lower(), "coact is not emulated", out)
    # --prefetch none is the plain output, byte for byte.
    rc, a, err = run("--trace", path, "--capacity", "6", "--policy", "lru", "--prefetch", "none")
    rc2, b, err2 = run("--trace", path, "--capacity", "6", "--policy", "lru")
    expect(rc == 0 and rc2 == 0 and a == b, "--prefetch none changes nothing", a, b)
    # --per-layer keeps its plain per-layer arrays next to the prefetch fields.
    rc, a, err = run("--trace", path, "--scope", "global", "--capacity", "12", "--policy", "lru,opt", "--per-layer",
                     "--json")
    rc2, b, err2 = run("--trace", path, "--scope", "global", "--capacity", "12", "--policy", "lru,opt", "--per-layer",
                       "--json", "--prefetch", "coact")
    expect(rc == 0 and rc2 == 0, "--per-layer with and without --prefetch", a, b, err, err2)
    expect([r["per_layer"] for r in json.loads(a)["results"]] == [r["per_layer"] for r in json.loads(b)["results"]],
           "per-layer arrays unchanged by --prefetch", a, b)
    expect(json.loads(b)["prefetch"]["expires_after"] == 3, "global: expires after the trace's 3 layers", b)
    rc, out, err = run("--help")
    expect(rc == 0 and "--prefetch" in out and "hint:R" in out and "--prefetch-budget" in out and "--expert-bytes" in out,
           "--help lists the prefetch options", out)
    # The hint model's wrong-id draws: each spelling runs, is labelled emulated, and keeps the recall.
    for model in ("uniform", "recent", "coact"):
        rc, out, err = run("--trace", path, "--capacity", "12", "--policy", "lru", "--json", "--prefetch",
                           "hint:0.5:" + model)
        expect(rc == 0, f"--prefetch hint:0.5:{model} runs", out, err)
        doc = json.loads(out)
        label = json.dumps(doc["prefetch"])
        expect("emulated" in label, f"hint:0.5:{model} is labelled emulated", label)
        expect(("hint:0.5" + ("" if model == "uniform" else ":" + model)) in label, f"hint:0.5:{model} named", label)


def case_prefetch_bad_args():
    path = generated_file()
    for bad, needle in [("hint:0", "outside (0, 1]"), ("hint:1.5", "outside (0, 1]"), ("hint:-1", "outside (0, 1]"),
                        ("hint:abc", "decimal number"), ("hint:", "decimal number"), ("hint:0.5x", "decimal number"),
                        ("hint:nan", "decimal number"), ("bogus", "unknown prefetch 'bogus'"), ("", "unknown prefetch"),
                        ("hint:0.8:nearby", "'uniform', 'recent' or 'coact', not 'nearby'"),
                        ("hint::recent", "decimal number")]:
        rc, out, err = expect_usage_error(["--trace", path, "--prefetch", bad], needle)
        expect("--prefetch" in err and out == "", f"--prefetch {bad!r} names the flag, prints nothing", err, out)
    expect_usage_error(["--trace", path, "--prefetch", "coact", "--prefetch-budget", "-1"], "is negative")
    expect_usage_error(["--trace", path, "--prefetch", "coact", "--prefetch-budget", "x"], "not an integer")
    expect_usage_error(["--trace", path, "--prefetch", "coact", "--expert-bytes", "0"], "below 1")
    expect_usage_error(["--trace", path, "--prefetch"], "needs a value")
    expect_usage_error(["--trace", path, "--prefetch", "coact", "--capacity", "2"], "needs 3 unique experts")


def case_prefetch_scores():
    # Two layers, six experts: layer 0 runs {0, 1} every step, layer 1 runs {0, 1}, {2, 3}, {4, 5}
    # (new every step). hint:0.5 lists one true and one wrong id per step; with noise 0 the true
    # one scores 1 and the wrong one 0. By hand, 6 slots per layer (no eviction), budget 2: the
    # true id is fetched and used each step (3 issued, 3 used), the wrong one skipped (3 unlikely);
    # layer 1 hits 3 of 6 instead of 0, layer 0 hits 4 of 6 either way.
    path = write("scored.trace", "0 0 0 1\n0 1 0 1\n1 0 0 1\n1 1 2 3\n2 0 0 1\n2 1 4 5\n")
    base = ["--trace", path, "--capacity", "6", "--policy", "lru", "--prefetch-budget", "2", "--json"]
    rc, out, err = run(*base, "--prefetch", "hint:0.5:noise=0")
    expect(rc == 0, "scored hints run", out, err)
    doc = json.loads(out)
    p = doc["prefetch"]
    expect(p["predictor"] == "hint:0.5:noise=0" and p["emulated"] and p["scored"] and p["min_score"] == 0.5,
           "prefetch header names the scores and the default min_score", p)
    r = doc["results"][0]
    expect((r["hits"], r["misses"]) == (4, 8), "plain counts by hand", r)
    expect((r["prefetch_hits"], r["prefetch_misses"]) == (7, 5), "scored counts by hand", r)
    expect((r["predicted"], r["issued"], r["used"], r["wasted"], r["skipped_unlikely"]) == (6, 3, 3, 0, 3),
           "fills and skips by hand", r)
    expect(r["precision"] == 1.0 and r["extra_bytes_per_token"] == 0.0, "noise 0: no wasted fill", r)
    # --min-score 0: every hint considered (nothing skipped as unlikely); 1 with noise 1: nothing fetched.
    rc, out, err = run(*base, "--prefetch", "hint:0.5:noise=0", "--min-score", "0")
    r0 = json.loads(out)["results"][0]
    expect(rc == 0 and r0["skipped_unlikely"] == 0 and json.loads(out)["prefetch"]["min_score"] == 0.0,
           "--min-score 0 keeps every hint", out, err)
    rc, out, err = run(*base, "--prefetch", "hint:0.5:noise=1", "--min-score", "1")
    r1 = json.loads(out)["results"][0]
    expect(rc == 0 and (r1["issued"], r1["skipped_unlikely"]) == (0, 6) and r1["prefetch_hits"] == r1["hits"],
           "--min-score 1 with noise 1 fetches nothing", out, err)
    # Unscored hints: no scores in the header, no skip.
    rc, out, err = run(*base, "--prefetch", "hint:0.5")
    doc = json.loads(out)
    expect(rc == 0 and not doc["prefetch"]["scored"] and doc["prefetch"]["min_score"] is None
           and doc["results"][0]["skipped_unlikely"] == 0, "unscored hints keep their output", out, err)
    # The table gains the 'unlikely' column with scores only.
    rc, out, err = run("--trace", path, "--capacity", "6", "--policy", "lru", "--prefetch-budget", "2",
                       "--prefetch", "hint:0.5:noise=0")
    expect(rc == 0 and "unlikely" in out and "min_score 0.5" in out and "EMULATED" in out and "noise" in out,
           "scored table", out, err)
    rc, out, err = run("--trace", path, "--capacity", "6", "--policy", "lru", "--prefetch", "hint:0.5")
    expect(rc == 0 and "unlikely" not in out, "unscored table has no 'unlikely' column", out, err)
    rc, out, err = run("--help")
    expect("--min-score" in out and "noise=N" in out, "--help lists the scored hints", out)
    # --two-ahead: layer L+2 from exact hints too. Three layers (layers 0 and 1 as above); layer 2 runs
    # {2s, 2s+1}: the next-layer hints give it one of two per step, the two-ahead ones both.
    path3 = write("two.trace", "0 0 0 1\n0 1 0 1\n0 2 0 1\n1 0 0 1\n1 1 0 1\n1 2 2 3\n2 0 0 1\n2 1 0 1\n2 2 4 5\n")
    base3 = ["--trace", path3, "--capacity", "6", "--policy", "lru", "--prefetch-budget", "2", "--json",
             "--prefetch", "hint:0.5:noise=0"]
    rc, out, err = run(*base3)
    one = json.loads(out)
    rc2, out2, err2 = run(*base3, "--two-ahead", "1")
    two = json.loads(out2)
    expect(rc == 0 and rc2 == 0 and one["prefetch"]["two_ahead"] is None and two["prefetch"]["two_ahead"] == 1.0,
           "two_ahead in the prefetch header", out, out2, err2)
    a, b = one["results"][0], two["results"][0]
    expect(a["hits"] == b["hits"] and b["prefetch_misses"] == a["prefetch_misses"] - 3 and b["wasted"] == 0,
           "two layers ahead: layer 2's three remaining misses become hits", a, b)
    rc, out, err = run(*base3[:-3], "--prefetch", "hint:0.5:noise=0", "--two-ahead", "0.7")
    expect(rc == 0 and "two layers ahead" in out and "recall 0.7" in out, "two-ahead table header", out, err)


def case_prefetch_scores_bad_args():
    path = generated_file()
    for args, needle in [(["--prefetch", "hint:0.9", "--two-ahead", "0"], "--two-ahead: 0 is not a recall in (0, 1]"),
                         (["--prefetch", "hint:0.9", "--two-ahead", "x"], "--two-ahead: 'x' is not a decimal number"),
                         (["--prefetch", "coact", "--two-ahead", "0.7"], "--two-ahead needs --prefetch hint"),
                         (["--prefetch", "hint:0.9:coact", "--two-ahead", "0.7"], "--two-ahead needs --prefetch hint"),
                         (["--two-ahead", "0.7"], "--two-ahead needs --prefetch hint")]:
        rc, out, err = expect_usage_error(["--trace", path, *args], needle)
        expect(out == "", f"{args} prints nothing", out)
    for bad, needle in [("hint:0.5:noise=1.5", "noise 1.5 is outside [0, 1]"),
                        ("hint:0.5:noise=x", "decimal number in [0, 1]"),
                        ("hint:0.5:noise=0.1:recent", "'recent' is out of place"),
                        ("hint:0.5:noise=0.1:noise=0.2", "given twice"),
                        ("hint:0.5:", "not ''")]:
        rc, out, err = expect_usage_error(["--trace", path, "--prefetch", bad], needle)
        expect("--prefetch" in err and out == "", f"--prefetch {bad!r} names the flag, prints nothing", err, out)
    for bad, needle in [("1.5", "--min-score: 1.5 is not in [0, 1]"), ("-0.1", "--min-score: -0.1 is not in [0, 1]"),
                        ("x", "--min-score: 'x' is not a decimal number"), ("nan", "not a decimal number")]:
        rc, out, err = expect_usage_error(["--trace", path, "--prefetch", "hint:0.5:noise=0.2", "--min-score", bad],
                                          needle)
        expect(out == "", f"--min-score {bad!r} prints nothing", out)
    for pf in ("hint:0.5", "coact", "prev"):
        expect_usage_error(["--trace", path, "--prefetch", pf, "--min-score", "0.5"], "applies to scored hints only")
    expect_usage_error(["--trace", path, "--min-score", "0.5"], "applies to scored hints only")


def case_prefetch_feedback():
    # --precision-feedback: the header, JSON and column say so; hint:1 is never throttled (its runs
    # equal the plain prefetch run); a long run of hint:0.2 (mostly wrong) fetches fewer ids with it.
    rc, out, err = run("--generate", "layers=4,experts=32,topk=4,steps=400,seed=3", "--capacity", "12",
                       "--policy", "lru", "--prefetch", "hint:1", "--json")
    plain = json.loads(out)["results"][0]
    rc2, out2, err2 = run("--generate", "layers=4,experts=32,topk=4,steps=400,seed=3", "--capacity", "12",
                          "--policy", "lru", "--prefetch", "hint:1", "--precision-feedback", "--json")
    doc = json.loads(out2)
    fb = doc["results"][0]
    expect(rc == 0 and rc2 == 0 and doc["prefetch"]["precision_feedback"] is True
           and json.loads(out)["prefetch"]["precision_feedback"] is False, "header flag", out2, err2)
    expect(fb["skipped_imprecise"] == 0 and plain["skipped_imprecise"] == 0
           and (fb["issued"], fb["used"]) == (plain["issued"], plain["used"]), "right hints are never held back", fb)
    args = ["--generate", "layers=4,experts=32,topk=4,steps=400,seed=3", "--capacity", "12", "--policy", "lru",
            "--prefetch", "hint:0.2", "--json"]
    rc, out, err = run(*args)
    rc2, out2, err2 = run(*args, "--precision-feedback")
    a, b = json.loads(out)["results"][0], json.loads(out2)["results"][0]
    expect(rc == 0 and rc2 == 0 and b["skipped_imprecise"] > 0 and 2 * b["wasted"] < a["wasted"],
           "wrong hints throttled", a, b)
    rc, out, err = run("--generate", "layers=2,experts=8,topk=2,steps=20,seed=1", "--capacity", "4",
                       "--prefetch", "hint:0.2", "--precision-feedback")
    expect(rc == 0 and "imprecise" in out and "precision feedback" in out, "table column and header line", out, err)
    rc, out, err = run("--generate", "layers=2,experts=8,topk=2,steps=20,seed=1", "--capacity", "4",
                       "--precision-feedback")
    expect(rc == 2 and "--precision-feedback needs --prefetch" in err, "needs --prefetch", out, err)


def case_calibrate():
    path = generated_file()
    rc, out, err = run("--trace", path, "--capacity", "6", "--policy", "crf,crf+prior,crf+pin,opt", "--json",
                       "--calibrate", "0.5")
    expect(rc == 0, "--calibrate replays", out, err)
    r = json.loads(out)
    expect(r["replay_from_step"] == 150 and r["calibration_forwards"] == 3 * 150 and r["forwards"] == 3 * 150,
           "the first half counted, the second replayed", r)
    rows = {x["policy"]: x for x in r["results"]}
    expect(set(rows) == {"crf", "crf+prior", "crf+pin", "opt"}, "one row per policy", r)
    expect(all(x["hits"] + x["misses"] == r["accesses"] for x in r["results"]), "every row replays the same rest", r)
    rc, out, err = run("--trace", path, "--capacity", "6", "--policy", "crf", "--calibrate", "0.5")
    expect(rc == 0 and "calibrated on the steps before 150" in out, "the table names the split", out, err)
    expect_usage_error(["--trace", path, "--calibrate", "1"], "not in (0, 1)")
    expect_usage_error(["--trace", path, "--calibrate", "x"], "not a number")
    expect_usage_error(["--trace", path, "--prior-pin", "2"], "not in [0, 1]")
    expect_usage_error(["--trace", path, "--prior-weight", "-1"], "is negative")
    expect_usage_error(["--trace", path, "--calibrate", "0.5", "--prefetch", "coact"], "cannot be combined")
    # --crf-half-life: the CRF rows change with it (8 is the default), the others do not.
    def misses(*extra):
        rc, out, err = run("--trace", path, "--capacity", "6", "--policy", "lru,crf,crf+prior", "--json",
                           "--calibrate", "0.5", *extra)
        expect(rc == 0, f"--crf-half-life run {extra}", out, err)
        return {x["policy"]: x["misses"] for x in json.loads(out)["results"]}
    default, eight, one = misses(), misses("--crf-half-life", "8"), misses("--crf-half-life", "1")
    expect(default == eight, "half-life 8 is the default", default, eight)
    expect(one["lru"] == default["lru"] and one["crf"] != default["crf"] and one["crf+prior"] != default["crf+prior"],
           "the half-life changes the CRF rows only", one, default)
    expect_usage_error(["--trace", path, "--crf-half-life", "0"], "is not above 0")
    expect_usage_error(["--trace", path, "--crf-half-life", "-2"], "is not above 0")
    expect_usage_error(["--trace", path, "--crf-half-life", "inf"], "not a number")


def case_miss_histogram():
    # One layer, 2 slots, LRU (by hand): misses per step 2, 0, 1, 1, 0, 2.
    path = write("h.trace", "0 0 1 2\n1 0 1 2\n2 0 3\n3 0 1 3\n4 0 1 3\n5 0 2 4\n")
    rc, out, err = run("--trace", path, "--capacity", "2", "--policy", "lru", "--miss-histogram", "2", "--json")
    expect(rc == 0, "--miss-histogram --json", out, err)
    lru = json.loads(out)["results"][0]
    expect(lru["forwards_by_misses"] == [1, 2, 1], "steps 2-5 by hand", lru)
    expect(lru["misses"] == 6, "totals count every step", lru)
    rc, out, err = run("--trace", path, "--capacity", "2", "--policy", "lru", "--miss-histogram", "0")
    expect(rc == 0 and "forwards by misses (steps >= 0" in out, "histogram table", out, err)
    expect("mean 1.000: 0: 33.3% 1: 33.3% 2: 33.3% (6 forwards)" in out, "shares and mean by hand", out)
    rc, out, err = run("--trace", path, "--capacity", "2", "--policy", "lru", "--json")
    expect(rc == 0 and "forwards_by_misses" not in out, "no histogram without the flag", out, err)
    expect_usage_error(["--trace", path, "--miss-histogram", "-1"], "is below 0")
    expect_usage_error(["--trace", path, "--miss-histogram", "x"], "is not an integer")
    expect_usage_error(["--trace", path, "--miss-histogram", "0", "--prefetch", "prev"], "cannot be combined")


CASES = {
    "help": case_help,
    "default_generated": case_default_generated,
    "file_table_and_json": case_file_table_and_json,
    "global_scope": case_global_scope,
    "per_layer": case_per_layer,
    "progress": case_progress,
    "bad_args": case_bad_args,
    "malformed_traces": case_malformed_traces,
    "prefetch": case_prefetch,
    "prefetch_bad_args": case_prefetch_bad_args,
    "prefetch_scores": case_prefetch_scores,
    "prefetch_scores_bad_args": case_prefetch_scores_bad_args,
    "prefetch_feedback": case_prefetch_feedback,
    "calibrate": case_calibrate,
    "miss_histogram": case_miss_histogram,
}


if __name__ == "__main__":
    sys.exit(h.main(CASES, __doc__ + "cases: " + " ".join(CASES), timeout=120))
