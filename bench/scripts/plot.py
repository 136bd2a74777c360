#!/usr/bin/env python3
"""Plots for docs/benchmarks.md from the benchmark programs' JSON.

  bench/scripts/plot.py --bench BENCH.json [--replay REPLAY.json ...] --out docs/results [--name PREFIX]

--bench   JSON of expert-cache-bench (--json FILE; Google-Benchmark schema): tokens/s per
          provider x staging policy, with the all-resident run and the PCIe bound marked.
          Writes PREFIX_tokens_per_s.png.
--replay  JSON of expert-cache-replay (--json, stdout): hit rate vs capacity per eviction policy,
          OPT (Belady) included. Writes <name of the JSON file>_hit_rate.png per file.

Needs matplotlib (Debian: apt-get install python3-matplotlib).
"""
import argparse
import json
import os
import sys


def need_matplotlib():
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        return plt
    except ImportError:
        sys.stderr.write("bench/scripts/plot.py: matplotlib is missing; install it with "
                         "'apt-get install python3-matplotlib' (Debian) or 'pip install matplotlib'\n")
        sys.exit(2)


def load(path):
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        sys.stderr.write(f"bench/scripts/plot.py: cannot read {path}: {e}\n")
        sys.exit(2)


def plot_bench(plt, doc, out_path):
    ctx = doc.get("context", {})
    runs = doc.get("benchmarks", [])
    if not runs:
        sys.stderr.write("bench/scripts/plot.py: the bench JSON has no benchmarks\n")
        sys.exit(2)
    resident = next((b for b in runs if b.get("provider") == "resident"), None)
    cached = [b for b in runs if b.get("provider") != "resident"]
    stagings = []
    for b in cached:
        if b["staging"] not in stagings:
            stagings.append(b["staging"])
    providers = []
    for b in cached:
        if b["provider"] not in providers:
            providers.append(b["provider"])
    fig, ax = plt.subplots(figsize=(10, 4.5))
    width = 0.8 / max(1, len(providers))
    for pi, prov in enumerate(providers):
        xs, ys, pcie = [], [], []
        for si, st in enumerate(stagings):
            b = next((r for r in cached if r["provider"] == prov and r["staging"] == st), None)
            if b is None:
                continue
            xs.append(si + (pi - (len(providers) - 1) / 2) * width)
            ys.append(b["tokens_per_second"])
            pcie.append(b.get("pcie_bound_tokens_per_second") or 0)
        bars = ax.bar(xs, ys, width, label=f"{prov}")
        for x, y, bar in zip(xs, ys, bars):
            ax.annotate(f"{y:.0f}", (x, y), ha="center", va="bottom", fontsize=8)
        ax.scatter(xs, pcie, marker="_", s=400, color=bars.patches[0].get_facecolor() if bars.patches else "k",
                   label=f"{prov}: PCIe bound (misses at the copy ceiling)")
    ax.set_xticks(range(len(stagings)))
    ax.set_xticklabels(stagings)
    ax.set_xlabel("staging policy")
    ax.set_ylabel("tokens/s")
    if resident:
        ax.axhline(resident["tokens_per_second"], color="gray", linestyle="--", linewidth=1)
        ax.text(len(stagings) - 0.5, resident["tokens_per_second"], f"all-resident {resident['tokens_per_second']:.0f}",
                ha="right", va="bottom", fontsize=8, color="gray")
    ax.set_yscale("log")
    model = ctx.get("model", {})
    label = ctx.get("expert_cache_label", "")
    ax.set_title(f"expert-cache-bench: {label}\n"
                 f"{model.get('layers')} layers, {model.get('experts')} experts, top-{model.get('top_k')}, "
                 f"{model.get('capacity')} slots, batch {model.get('batch')}", fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    print("wrote", out_path)


def plot_replay(plt, doc, out_path, title):
    rows = doc.get("results", [])
    if not rows:
        sys.stderr.write("bench/scripts/plot.py: the replay JSON has no results\n")
        sys.exit(2)
    policies = []
    for r in rows:
        if r["policy"] not in policies:
            policies.append(r["policy"])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in policies:
        pts = sorted((r["capacity"], r["hit_rate"]) for r in rows if r["policy"] == p)
        style = dict(linestyle="--", color="black", linewidth=2) if p in ("opt", "belady") else {}
        ax.plot([c for c, _ in pts], [100 * h for _, h in pts], marker="o", markersize=3,
                label="OPT (Belady)" if p in ("opt", "belady") else p, **style)
    ax.set_xlabel(f"capacity (slots per {'layer' if doc.get('scope') == 'layer' else 'cache'})")
    ax.set_ylabel("hit rate (%)")
    ax.set_ylim(0, 100)
    ax.grid(alpha=0.3)
    ax.set_title(f"{title}\n{doc.get('num_layers')} layers, {doc.get('num_experts')} experts, "
                 f"{doc.get('forwards')} forwards, scope {doc.get('scope')}", fontsize=9)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out_path, dpi=120)
    plt.close(fig)
    print("wrote", out_path)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", help="expert-cache-bench --json output")
    ap.add_argument("--replay", action="append", default=[], help="expert-cache-replay --json output (repeatable)")
    ap.add_argument("--out", default="docs/results", help="output directory (default docs/results)")
    ap.add_argument("--name", default="modelled", help="file name prefix of the bench plot (default modelled)")
    args = ap.parse_args()
    if not args.bench and not args.replay:
        ap.error("give --bench and/or --replay")
    plt = need_matplotlib()
    os.makedirs(args.out, exist_ok=True)
    if args.bench:
        plot_bench(plt, load(args.bench), os.path.join(args.out, f"{args.name}_tokens_per_s.png"))
    for path in args.replay:
        doc = load(path)
        stem = os.path.splitext(os.path.basename(path))[0]
        plot_replay(plt, doc, os.path.join(args.out, f"{stem}_hit_rate.png"), f"hit rate vs capacity: {os.path.basename(str(doc.get('trace')))}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
