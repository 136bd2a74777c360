#!/usr/bin/env python3
"""GPU test: examples/torch/mixtral_offload.py in --check mode, once per provider (row, cached, device).

Each run builds a small random-weight transformers Mixtral, generates greedily with every expert
resident, then with the expert weights in host memory behind expert_cache_torch (capacity below
the number of experts). Every generation feeds the prompt as ONE forward (through prepare_wide for
the cached variants) and must reproduce the resident tokens, the prompt forward's logits and every
decode logit bit for bit; TTFT and decode tok/s must be reported. Each provider runs twice, without and
with lookahead (real hints: layer L+1's router on layer L's MoE input, prefetched into layer L+1's cache);
the lookahead run must stay bit-identical, measure a hint recall in [0, 1] and issue speculative fills.
This test also reads the run's JSON and checks it independently of the example's own verdict.

Exit codes: 0 all runs passed; 77 (skip) when the example skipped for every provider (no torch,
CUDA device, transformers or extension: the reason is printed); 1 otherwise.
Usage: python3 tests/gpu/test_torch_mixtral.py [path/to/mixtral_offload.py]
"""
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
DEFAULT_EXAMPLE = os.path.join(HERE, "..", "..", "examples", "torch", "mixtral_offload.py")
PROVIDERS = ("row", "cached", "device")
TIMEOUT_S = 900
REPEATS = 3  # the example's --check default; the JSON must list REPEATS + 1 runs per variant


def check_variant(provider, name, r, args, report, need):
    """The checks of one variant's results (`name`: the provider, or the provider + "+lookahead")."""
    runs = r.get("runs", [])
    need(len(runs) == REPEATS + 1, f"{name}: {len(runs)} runs, expected {REPEATS + 1}")
    need(all(x.get("tokens_equal") and x.get("logits_equal") and x.get("prompt_logits_equal") for x in runs),
         f"{name}: a run differs from the all-resident one: "
         f"{[(x.get('run'), x.get('tokens_equal'), x.get('max_abs_logit_diff'), x.get('max_abs_prompt_logit_diff')) for x in runs]}")
    need(all(x.get("max_abs_logit_diff") == 0.0 and x.get("max_abs_prompt_logit_diff") == 0.0 for x in runs),
         f"{name}: nonzero logit difference")
    # The prompt went through the wide path, in every layer, every run.
    for x in runs:
        pw = x.get("prompt_wide") or {}
        # The device provider plans on the GPU: its summary counts rounds only (the unique ids never
        # reach the host), so there the check is more rounds than layers.
        wide = (pw.get("rounds", 0) > args.get("layers", 1) if provider == "device"
                else pw.get("rounds", 0) >= args.get("layers", 1) and pw.get("unique", 0) > 0)
        need(pw.get("layers") == args.get("layers") and wide,
             f"{name}: run {x.get('run')}: prompt forward not wide: {pw}")
        if provider == "device":
            need(pw.get("admission") == ["admit"], f"{name}: run {x.get('run')}: admission {pw.get('admission')}")
        else:
            need(pw.get("admission") == ["stream"] and not pw.get("fell_back")
                 and pw.get("hits", 0) + pw.get("streamed", 0) == pw.get("unique"),
                 f"{name}: run {x.get('run')}: not served by stream admission: {pw}")
        need(x.get("ttft_ms", 0) > 0, f"{name}: run {x.get('run')}: TTFT {x.get('ttft_ms')}")
    # Cold: empty pools, a prompt routing more experts than the pool holds in some layer.
    cold = runs[0].get("prompt_wide") or {} if runs else {}
    if provider != "device":
        need(cold.get("streamed", 0) > 0, f"{name}: the cold prompt forward streamed nothing: {cold}")
    else:
        need(r.get("device_errors") is not None and not any(r["device_errors"]),
             f"{name}: error words {r.get('device_errors')} after wide forwards")
    for key in ("ttft_ms", "cold_ttft_ms"):
        need(r.get(key, 0) > 0, f"{name}: {key} {r.get(key)}")
    need(r.get("misses", 0) > 0 or r.get("cold_misses", 0) > 0, f"{name}: the cache never missed")
    hr = r.get("hit_rate")
    need(hr is not None and 0.0 <= hr <= 1.0, f"{name}: hit rate {hr} not in [0, 1]")
    need(r.get("cold_misses", 0) >= report["args"]["capacity"],
         f"{name}: {r.get('cold_misses')} cold misses, at least capacity ({report['args']['capacity']}) "
         "expected from empty caches")
    need(r.get("tokens_per_s", 0) > 0, f"{name}: decode tokens/s {r.get('tokens_per_s')}")
    need(0.0 < r.get("prepare_share", 0) < 1.0, f"{name}: cache share {r.get('prepare_share')} not in (0, 1)")

    if name.endswith("+lookahead"):
        rec = r.get("hint_recall")
        need(rec is not None and 0.0 <= rec <= 1.0, f"{name}: hint recall {rec} not in [0, 1]")
        issued = sum((x.get("speculative") or {}).get("speculative_issued", 0) for x in runs)
        used = sum((x.get("speculative") or {}).get("speculative_used", 0) for x in runs)
        need(issued > 0, f"{name}: lookahead issued no speculative fill")
        need(0 <= used <= issued, f"{name}: {used} speculative fills used of {issued} issued")


def check_report(provider, report):
    """Returns a list of problems with the run's JSON (empty when it is what a pass must look like)."""
    problems = []

    def need(cond, what):
        if not cond:
            problems.append(what)

    need(report.get("passed") is True, f"report says passed={report.get('passed')}, failures {report.get('failures')}")
    need(not report.get("failures"), f"failures listed: {report.get('failures')}")
    results = report.get("results", {})
    need("resident" in results and provider in results, f"results lack resident/{provider}: {sorted(results)}")
    sc = report.get("stock_check", {})
    layers = sc.get("layers") or []
    args = report.get("args", {})
    # One prompt (per-expert path) and one decode check per layer.
    need(len(layers) == 2 * args.get("layers", -1), f"stock check has {len(layers)} entries for {args.get('layers')} layers")
    need(sorted({c.get("kind") for c in layers if c}) == ["decode", "prompt"], "stock check lacks a prompt or decode entry")
    need(all(c and c.get("ok") and c["max_abs_diff"] <= c["bound"] for c in layers),
         f"stock check failed: {layers}")
    need(report.get("gpu_mib_released", 0) >= 0.95 * report.get("expert_host_mib", float("inf")),
         f"GPU expert copies not released: {report.get('gpu_mib_released')} of {report.get('expert_host_mib')} MiB")
    for name in (provider, provider + "+lookahead"):
        r = results.get(name)
        need(r is not None, f"results lack {name}: {sorted(results)}")
        if r:
            check_variant(provider, name, r, args, report, need)
    return problems


def main():
    example = os.path.abspath(sys.argv[1] if len(sys.argv) > 1 else DEFAULT_EXAMPLE)
    if not os.path.isfile(example):
        print(f"FAILED: example not found: {example}")
        return 1
    codes = {}
    problems = {}
    with tempfile.TemporaryDirectory() as tmp:
        for provider in PROVIDERS:
            path = os.path.join(tmp, f"{provider}.json")
            cmd = [sys.executable, example, "--check", "--provider", provider, "--json", path]
            print("$ " + " ".join(cmd), flush=True)
            try:
                p = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
                rc, out, err = p.returncode, p.stdout, p.stderr
            except subprocess.TimeoutExpired as e:
                rc, out, err = 1, e.stdout or "", f"timed out after {TIMEOUT_S} s"
                out = out.decode() if isinstance(out, bytes) else out
            print(out, end="" if out.endswith("\n") else "\n")
            if err:
                print("---- stderr\n" + err, end="" if err.endswith("\n") else "\n")
            codes[provider] = rc
            if rc == 0:
                try:
                    with open(path, encoding="utf-8") as f:
                        problems[provider] = check_report(provider, json.load(f))
                except (OSError, ValueError) as e:
                    problems[provider] = [f"cannot read {path}: {e}"]
            elif rc != 77:
                problems[provider] = [f"example exited {rc}"]
            print(f"-- {provider}: exit {rc}, " + ("; ".join(problems.get(provider, [])) or "ok"), flush=True)
    if all(rc == 77 for rc in codes.values()):
        print(f"SKIP: the example skipped for every provider ({', '.join(PROVIDERS)})")
        print(f"0 passed, 0 failed, {len(PROVIDERS)} skipped")
        return 77
    failed = [p for p in PROVIDERS if codes[p] != 0 or problems.get(p)]
    for p in failed:
        if codes[p] == 77:
            print(f"FAILED: {p} skipped while another provider ran (inconsistent environment)")
        for what in problems.get(p, []):
            print(f"FAILED: {p}: {what}")
    print(f"{len(PROVIDERS) - len(failed)} passed, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
