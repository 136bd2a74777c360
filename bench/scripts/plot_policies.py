#!/usr/bin/env python3
"""Hit rate vs capacity per eviction policy, OPT included, for docs/policies.md.

  bench/scripts/plot_policies.py measure --tool expert-cache-replay --trace FILE --name NAME [--out docs/results]
  bench/scripts/plot_policies.py plot REPLAY.json [REPLAY.json ...] [--out docs/results] [--commit SHA]

measure  runs expert-cache-replay (--policy all --json) on FILE in both scopes and writes
         NAME_global.json (with --per-layer) and NAME_layer.json, the tool's output unchanged.
         Capacities are fixed fractions of the key space, so every trace gets the same sweep:
         global 2.5 ... 50 % of all layers x E experts, per layer 6.25 ... 75 % of E; a capacity
         below the widest forward (the tool rejects it) is left out.
plot     one PNG per JSON, <stem>.png: hit rate (%) vs capacity (% of the scope's experts) per
         policy with OPT dashed, and beside it hits / OPT with a dotted line at 0.9.

Needs matplotlib (Debian: apt-get install python3-matplotlib).
"""
import argparse
import json
import os
import subprocess
import sys

GLOBAL_PERCENT = [2.5, 5, 7.5, 10, 15, 20, 30, 40, 50]
LAYER_PERCENT = [6.25, 12.5, 18.75, 25, 31.25, 37.5, 50, 62.5, 75]
# The documented sizes (docs/policies.md tables), marked on the plots.
GLOBAL_MARKED = [7.5, 15, 30]
LAYER_MARKED = [12.5, 25, 50]


def fail(msg):
    sys.stderr.write(f"bench/scripts/plot_policies.py: {msg}\n")
    sys.exit(2)


def trace_shape(path):
    """(layers, experts per layer, widest forward) of a format-v1 trace."""
    layers, max_id, widest = set(), -1, 0
    key, union = None, set()
    try:
        with open(path, encoding="utf-8") as f:
            for line in f:
                fields = line.split("#", 1)[0].split()
                if not fields:
                    continue
                step, layer, ids = int(fields[0]), int(fields[1]), [int(x) for x in fields[2:]]
                if (step, layer) != key:
                    widest = max(widest, len(union))
                    key, union = (step, layer), set()
                union.update(ids)
                layers.add(layer)
                max_id = max([max_id] + ids)
    except (OSError, ValueError, IndexError) as e:
        fail(f"cannot read trace {path}: {e}")
    widest = max(widest, len(union))
    if not layers:
        fail(f"{path} has no records")
    return len(layers), max_id + 1, widest


def measure(args):
    layers, experts, widest = trace_shape(args.trace)
    os.makedirs(args.out, exist_ok=True)
    for scope, keys, percents in (("global", layers * experts, GLOBAL_PERCENT), ("layer", experts, LAYER_PERCENT)):
        caps = sorted({round(keys * p / 100) for p in percents})
        caps = [c for c in caps if widest <= c <= keys]
        cmd = [args.tool, "--trace", args.trace, "--scope", scope, "--capacity", ",".join(map(str, caps)),
               "--policy", "all", "--json"] + (["--per-layer"] if scope == "global" else [])
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            fail(f"{' '.join(cmd)} failed ({res.returncode}): {res.stderr.strip()}")
        out = os.path.join(args.out, f"{args.name}_{scope}.json")
        with open(out, "w", encoding="utf-8") as f:
            f.write(res.stdout)
        print("wrote", out)
    return 0


def need_matplotlib():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        fail("matplotlib is missing; install it with 'apt-get install python3-matplotlib' (Debian) "
             "or 'pip install matplotlib'")


def plot_one(plt, doc, out_path, commit):
    rows = doc.get("results", [])
    if not rows or not doc.get("has_opt"):
        fail(f"{out_path}: the replay JSON has no results or no OPT")
    keys = doc["cache_experts"]
    scope = doc.get("scope")
    policies = []
    for r in rows:
        if r["policy"] not in policies:
            policies.append(r["policy"])
    if "opt" not in policies:
        fail(f"{out_path}: the replay JSON has no opt rows (run with --policy all)")
    fig, (ax_h, ax_x) = plt.subplots(1, 2, figsize=(12, 4.8))
    cmap = plt.get_cmap("tab10")
    color = {p: cmap(i % 10) for i, p in enumerate(q for q in policies if q != "opt")}
    for p in policies:
        pts = sorted((100 * r["capacity"] / keys, r["hit_rate"], r.get("hits_vs_opt")) for r in rows if r["policy"] == p)
        xs = [c for c, _, _ in pts]
        if p == "opt":
            ax_h.plot(xs, [100 * h for _, h, _ in pts], linestyle="--", color="black", linewidth=2, label="OPT (Belady)")
            continue
        ax_h.plot(xs, [100 * h for _, h, _ in pts], marker="o", markersize=3, color=color[p], label=p)
        ax_x.plot(xs, [x if x is not None else float("nan") for _, _, x in pts], marker="o", markersize=3,
                  color=color[p], label=p)
    for c in GLOBAL_MARKED if scope == "global" else LAYER_MARKED:
        for ax in (ax_h, ax_x):
            ax.axvline(c, color="gray", linewidth=0.6, alpha=0.5)
    ax_x.axhline(0.9, color="red", linewidth=1, linestyle=":", label="0.9 x OPT")
    what = "all layers' experts (one global pool)" if scope == "global" else "a layer's experts (one cache per layer)"
    for ax in (ax_h, ax_x):
        ax.set_xlabel(f"capacity (% of {what})")
        ax.grid(alpha=0.3)
        ax.set_xlim(0, None)
    ax_h.set_ylabel("hit rate (%)")
    ax_h.set_ylim(0, 100)
    ax_x.set_ylabel("hits / OPT hits")
    ax_x.set_ylim(0, 1.05)
    ax_h.legend(fontsize=8, loc="lower right")
    ax_x.legend(fontsize=8, loc="lower right")
    title = (f"{os.path.basename(str(doc.get('trace')))}: scope {scope}, {doc.get('num_layers')} layers x "
             f"{doc.get('num_experts')} experts, {doc.get('forwards')} forwards")
    if commit:
        title += f"; measured at {commit}"
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(out_path, dpi=110)
    plt.close(fig)
    print("wrote", out_path)


def plot(args):
    plt = need_matplotlib()
    os.makedirs(args.out, exist_ok=True)
    for path in args.replay:
        try:
            with open(path, encoding="utf-8") as f:
                doc = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            fail(f"cannot read {path}: {e}")
        stem = os.path.splitext(os.path.basename(path))[0]
        plot_one(plt, doc, os.path.join(args.out, f"{stem}.png"), args.commit)
    return 0


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("measure", help="run expert-cache-replay in both scopes and keep its JSON")
    m.add_argument("--tool", required=True, help="path of expert-cache-replay")
    m.add_argument("--trace", required=True, help="trace file (format v1)")
    m.add_argument("--name", required=True, help="output file stem")
    m.add_argument("--out", default="docs/results")
    p = sub.add_parser("plot", help="plot replay JSON files")
    p.add_argument("replay", nargs="+", help="expert-cache-replay --json output")
    p.add_argument("--out", default="docs/results")
    p.add_argument("--commit", default="", help="commit the JSON was measured at (shown in the title)")
    args = ap.parse_args()
    return measure(args) if args.cmd == "measure" else plot(args)


if __name__ == "__main__":
    sys.exit(main())
