#!/usr/bin/env python3
"""End-to-end tests of bench/scripts/compose_decode.py (a decode layer composed from router, plan and
consumer, weighted by the routing's spread of misses over forwards).

usage: test_compose_decode.py PATH_TO_SCRIPT CASE
Cases: console (Google Benchmark console text; medians chosen over means, numbers by hand),
json (the same rows as --benchmark_out JSON give the same output), extrapolate (a miss count past
the measured ones), bad_input (exit 2 with a clear message). 'all' runs every case.
"""
import json
import os
import sys

# tests/support is shared with the C++ suites; this file sits one folder below tests/.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from support import cli_harness as h  # noqa: E402
from support.cli_harness import expect, expect_usage_error, run, write

# Consumer: 10 / 40 / 70 us at 0 / 1 / 2 missing, 30 us of link per expert; plan medians 2 / 3 / 4
# us at 0 / 1 / 2 misses (the means, 9 us, must not be taken).
CONSUMER_TEXT = """\
Benchmark                                   Time   CPU  Iterations UserCounters...
ceiling/iterations:1/manual_time             1 us   1 us  1 GBps=55.0
one_pass/batch:1/missing:0/iterations:30/manual_time  1 us 1 us 30 check_failures=0 us_per_layer=10
one_pass/batch:1/missing:1/iterations:30/manual_time  1 us 1 us 30 check_failures=0 link_us_per_layer=30 us_per_layer=40
one_pass/batch:1/missing:2/iterations:30/manual_time  1 us 1 us 30 check_failures=0 link_us_per_layer=60 us_per_layer=70
one_pass/batch:4/missing:1/iterations:30/manual_time  1 us 1 us 30 link_us_per_layer=30 us_per_layer=99
"""
PLAN_TEXT = """\
# bench_device_plan --benchmark_repetitions=3 --benchmark_filter=plan
plan_pdl/lru/misses:0/iterations:50/manual_time_mean     1 us 1 us 3 misses_per_layer=0 us_per_layer=9
plan_pdl/lru/misses:0/iterations:50/manual_time_median   1 us 1 us 3 misses_per_layer=0 us_per_layer=2
plan_pdl/lru/misses:1/iterations:50/manual_time_median   1 us 1 us 3 misses_per_layer=1 us_per_layer=3
plan_pdl/lru/misses:2/iterations:50/manual_time_median   1 us 1 us 3 misses_per_layer=2 us_per_layer=4
plan_pdl/lru/misses:2/iterations:50/manual_time_stddev   1 us 1 us 3 misses_per_layer=0 us_per_layer=0.1
plan/lru/misses:0/iterations:50/manual_time_median       1 us 1 us 3 misses_per_layer=0 us_per_layer=7
"""


def replay(spread, policy="lru", capacity=8):
    return write("replay.json", json.dumps({"results": [
        {"policy": "opt", "capacity": capacity, "forwards_by_misses": [9]},
        {"policy": policy, "capacity": capacity, "forwards_by_misses": spread}]}))


def compose(replay_path, consumer, plan, *extra):
    return run("--replay", replay_path, "--consumer", consumer, "--plan", plan, "--router-us", "1",
               "--policy", "lru", *extra)


def case_console():
    # Forwards with 0 / 1 / 2 misses: 1 / 2 / 1. Misses per forward 1.0, link 30 us per layer.
    # Layers (router 1 + plan + consumer): 13, 44, 75 -> (13 + 2 * 44 + 75) / 4 = 44.0 us, 30 / 44 = 0.682.
    # Marginal read 70 - 40 = 30 us (1.000 of the ceiling); without consumer time: 3, 33, 63 -> 33.0 us, 0.909.
    rc, out, err = compose(replay([1, 2, 1]), write("c.txt", CONSUMER_TEXT), write("p.txt", PLAN_TEXT))
    expect(rc == 0, "exit 0", out, err)
    for line in ("lru at 8 slots, 4 forwards, 1.000 misses per forward",
                 "link: 30.00 us per expert at the consumer run's ceiling, 30.0 us per layer",
                 "composed: 44.0 us per layer = 0.682 of the PCIe bound",
                 "marginal read: 30.00 us per extra missing expert = 1.000 of the ceiling",
                 "with a consumer that costs nothing beyond its reads: 33.0 us per layer = 0.909 of the bound"):
        expect(line in out, f"line {line!r}", out)
    expect("interpolated" not in out, "every count measured", out)
    # --batch 4 picks the batch-4 rows (only missing:1 there: one point, used flat).
    rc, out, err = compose(replay([0, 4]), write("c.txt", CONSUMER_TEXT), write("p.txt", PLAN_TEXT), "--batch", "4")
    expect(rc == 0 and "composed: 103.0 us per layer = 0.291 of the PCIe bound" in out, "batch 4 rows", out, err)


def case_json():
    def bench_json(text):
        rows = []
        for line in text.splitlines():
            f = line.split()
            if not f or f[0].startswith("#") or "=" not in line:
                continue
            name = f[0]
            row = {"name": name, "run_name": name.split("/iterations:")[0] + ("/manual_time" if "manual_time" in name else "")}
            for agg in ("mean", "median", "stddev"):
                if name.endswith("_" + agg):
                    row["aggregate_name"] = agg
                    row["run_name"] = name.split("/iterations:")[0]
            for kv in f:
                if "=" in kv:
                    k, v = kv.split("=")
                    row[k] = float(v)
            rows.append(row)
        return json.dumps({"context": {}, "benchmarks": rows})
    rc, out, err = compose(replay([1, 2, 1]), write("c.json", bench_json(CONSUMER_TEXT)), write("p.json", bench_json(PLAN_TEXT)))
    expect(rc == 0 and "composed: 44.0 us per layer = 0.682 of the PCIe bound" in out, "JSON rows", out, err)


def case_extrapolate():
    # 4 misses: consumer 70 + 2 * 30 = 130, plan 4 + 2 * 1 = 6; layer 137; link 120 -> 0.876.
    rc, out, err = compose(replay([0, 0, 0, 0, 1]), write("c.txt", CONSUMER_TEXT), write("p.txt", PLAN_TEXT))
    expect(rc == 0 and "composed: 137.0 us per layer = 0.876 of the PCIe bound" in out, "extrapolated", out, err)
    expect("(interpolated)" in out, "marked", out)


def case_bad_input():
    c, p = write("c.txt", CONSUMER_TEXT), write("p.txt", PLAN_TEXT)
    no_hist = write("nohist.json", json.dumps({"results": [{"policy": "lru", "capacity": 8}]}))
    expect_usage_error(["--replay", no_hist, "--consumer", c, "--plan", p, "--router-us", "1"], "--miss-histogram")
    expect_usage_error(["--replay", write("bad.json", "{"), "--consumer", c, "--plan", p, "--router-us", "1"],
                       "not an expert-cache-replay JSON report")
    r = replay([1, 1])
    expect_usage_error(["--replay", r, "--consumer", c, "--plan", p, "--router-us", "1", "--capacity", "9"],
                       "no result for policy")
    expect_usage_error(["--replay", r, "--consumer", c, "--plan", p, "--router-us", "-1"], "below 0")
    expect_usage_error(["--replay", r, "--consumer", write("none.txt", "nothing here\n"), "--plan", p,
                        "--router-us", "1"], "no benchmark rows")
    expect_usage_error(["--replay", r, "--consumer", c, "--plan", p, "--router-us", "1", "--plan-row", "plan/crf"],
                       "no rows plan/crf/misses:<k>")
    expect_usage_error(["--replay", r, "--consumer", c + ".missing", "--plan", p, "--router-us", "1"], "No such file")
    expect_usage_error(["--replay", write("zero.json", json.dumps({"results": [{"policy": "lru", "capacity": 8,
                       "forwards_by_misses": [0, 0]}]})), "--consumer", c, "--plan", p, "--router-us", "1"],
                       "counts no forward")


CASES = {"console": case_console, "json": case_json, "extrapolate": case_extrapolate, "bad_input": case_bad_input}

if __name__ == "__main__":
    sys.exit(h.main(CASES, __doc__ + "cases: " + " ".join(CASES), timeout=60))
