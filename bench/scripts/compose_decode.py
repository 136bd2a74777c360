#!/usr/bin/env python3
"""Composes a batch-1 decode layer from its measured parts (docs/benchmarks.md, "The one-pass layer
composed from its parts").

A layer whose forward misses m experts costs router + plan(m) + consumer(m); how the misses spread
over forwards comes from the routing (expert-cache-replay --miss-histogram S --json). Weighted by
that spread, the composition predicts the decode benchmark's one-pass row, and with the consumer's
fixed time taken out it shows how close the layer could come to the PCIe bound without lookahead.

usage: compose_decode.py --replay FILE --consumer FILE --plan FILE --router-us US
                         [--policy P] [--capacity N] [--batch B]
                         [--consumer-row one_pass] [--plan-row plan_pdl/lru]

  --replay FILE     expert-cache-replay --miss-histogram S --json output; the result of --policy
                    and --capacity (default: the first result)
  --consumer FILE   bench_consumer_host output (console text or --benchmark_out JSON): rows
                    CONSUMER_ROW/batch:B/missing:m with counter us_per_layer, and link_us_per_layer
                    (the link time of the missing experts at the same run's pinned ceiling)
  --plan FILE       bench_device_plan output (console or JSON): rows PLAN_ROW/misses:k, medians
                    when the run has repetitions
  --router-us US    the router's us per layer (expert-cache-bench --budget: "router" in its notes)

Plan and consumer at a miss count the benchmarks did not run are interpolated linearly between the
nearest measured counts, and extrapolated past the largest with the slope of its last two.
Exit status: 0 ok, 2 bad arguments or unreadable input.
"""
import argparse
import json
import re
import sys

COUNTER = re.compile(r"(?<![\w-])([A-Za-z_]+)=([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)(?![\w.])")


class InputError(Exception):
    pass


def read_rows(path):
    """{benchmark name without /iterations:... and aggregate suffixes: {counter: value}} from
    Google Benchmark console text or JSON. Medians win over plain rows of the same name."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as e:
        raise InputError(f"{path}: {e.strerror}") from None
    rows, medians = {}, {}
    try:
        doc = json.loads(text)
    except ValueError:
        doc = None
    if isinstance(doc, dict) and "benchmarks" in doc:
        for b in doc["benchmarks"]:
            name = b.get("run_name") or b.get("name", "")
            name = name.split("/iterations:")[0].split("/manual_time")[0]
            counters = {k: float(v) for k, v in b.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            agg = b.get("aggregate_name")
            if agg == "median":
                medians[name] = counters
            elif not agg:
                rows[name] = counters
    else:
        for line in text.splitlines():
            fields = line.split()
            if not fields or fields[0].startswith("#") or "=" not in line:
                continue
            full = fields[0]
            name = full.split("/iterations:")[0].split("/manual_time")[0]
            counters = {k: float(v) for k, v in COUNTER.findall(line)}
            if full.endswith("_median"):
                medians[name] = counters
            elif not re.search(r"_(mean|stddev|cv)$", full):
                rows[name] = counters
    rows.update(medians)
    if not rows:
        raise InputError(f"{path}: no benchmark rows with counters")
    return rows


def series(rows, prefix, key, path):
    """{k: counter} of rows named PREFIX<k> (k an integer)."""
    out = {}
    for name, counters in rows.items():
        if name.startswith(prefix) and name[len(prefix):].isdigit() and key in counters:
            out[int(name[len(prefix):])] = counters[key]
    if not out:
        raise InputError(f"{path}: no rows {prefix}<k> with {key}")
    return out


def at(points, m):
    """points (k -> value) at m: measured, interpolated, or extrapolated with the last slope."""
    if m in points:
        return points[m]
    ks = sorted(points)
    if len(ks) == 1:
        return points[ks[0]]
    if m < ks[0]:
        a, b = ks[0], ks[1]
    elif m > ks[-1]:
        a, b = ks[-2], ks[-1]
    else:
        a = max(k for k in ks if k < m)
        b = min(k for k in ks if k > m)
    return points[a] + (points[b] - points[a]) * (m - a) / (b - a)


def pick_result(doc, policy, capacity, path):
    results = doc.get("results") or []
    for r in results:
        if (policy is None or r.get("policy") == policy) and (capacity is None or r.get("capacity") == capacity):
            if "forwards_by_misses" not in r:
                raise InputError(f"{path}: no forwards_by_misses (run expert-cache-replay with --miss-histogram)")
            return r
    raise InputError(f"{path}: no result for policy {policy or 'any'}, capacity {capacity or 'any'}")


def main(argv):
    ap = argparse.ArgumentParser(add_help=True, description=__doc__.split("\n\n")[0])
    ap.add_argument("--replay", required=True)
    ap.add_argument("--consumer", required=True)
    ap.add_argument("--plan", required=True)
    ap.add_argument("--router-us", required=True, type=float)
    ap.add_argument("--policy")
    ap.add_argument("--capacity", type=int)
    ap.add_argument("--batch", type=int, default=1)
    ap.add_argument("--consumer-row", default="one_pass")
    ap.add_argument("--plan-row", default="plan_pdl/lru")
    try:
        a = ap.parse_args(argv)
    except SystemExit as e:
        return 2 if e.code else 0
    try:
        if a.router_us < 0:
            raise InputError("--router-us: below 0")
        try:
            with open(a.replay, encoding="utf-8") as f:
                replay = json.load(f)
        except (OSError, ValueError) as e:
            raise InputError(f"{a.replay}: not an expert-cache-replay JSON report ({e})") from None
        result = pick_result(replay, a.policy, a.capacity, a.replay)
        spread = [int(x) for x in result["forwards_by_misses"]]
        forwards = sum(spread)
        if forwards == 0:
            raise InputError(f"{a.replay}: the histogram counts no forward")
        crow = read_rows(a.consumer)
        consumer = series(crow, f"{a.consumer_row}/batch:{a.batch}/missing:", "us_per_layer", a.consumer)
        link = series(crow, f"{a.consumer_row}/batch:{a.batch}/missing:", "link_us_per_layer", a.consumer)
        plan = series(read_rows(a.plan), f"{a.plan_row}/misses:", "us_per_layer", a.plan)
    except InputError as e:
        print(f"compose_decode.py: {e}", file=sys.stderr)
        return 2
    smallest = min(k for k in link if k > 0) if any(k > 0 for k in link) else None
    if smallest is None:
        print(f"compose_decode.py: {a.consumer}: no row with a missing expert", file=sys.stderr)
        return 2
    link_per_expert = link[smallest] / smallest
    ks = sorted(consumer)
    if len(ks) >= 2:
        marginal = (consumer[ks[-1]] - consumer[ks[-2]]) / (ks[-1] - ks[-2])
    else:
        marginal = link_per_expert
    misses = sum(m * n for m, n in enumerate(spread)) / forwards
    link_us = misses * link_per_expert
    composed = sum(n * (a.router_us + at(plan, m) + at(consumer, m)) for m, n in enumerate(spread)) / forwards
    free = sum(n * (a.router_us + at(plan, 0) + m * marginal) for m, n in enumerate(spread)) / forwards
    print(f"routing: {result.get('policy')} at {result.get('capacity')} slots, {forwards} forwards, "
          f"{misses:.3f} misses per forward")
    print(f"{'misses':>6} {'share':>7} {'router':>7} {'plan':>7} {'consumer':>9} {'layer us':>9}")
    for m, n in enumerate(spread):
        if n == 0:
            continue
        layer = a.router_us + at(plan, m) + at(consumer, m)
        note = "" if (m in plan and m in consumer) else "  (interpolated)"
        print(f"{m:>6} {100.0 * n / forwards:>6.1f}% {a.router_us:>7.2f} {at(plan, m):>7.2f} {at(consumer, m):>9.2f} "
              f"{layer:>9.2f}{note}")
    print(f"link: {link_per_expert:.2f} us per expert at the consumer run's ceiling, {link_us:.1f} us per layer")
    print(f"composed: {composed:.1f} us per layer = {link_us / composed:.3f} of the PCIe bound")
    print(f"marginal read: {marginal:.2f} us per extra missing expert = {link_per_expert / marginal:.3f} of the ceiling")
    print(f"with a consumer that costs nothing beyond its reads: {free:.1f} us per layer = {link_us / free:.3f} of the bound")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
