#!/usr/bin/env python3
"""A transformers Mixtral model whose expert weights live in host memory, served through expert_cache.

Builds MixtralForCausalLM from a small MixtralConfig (random weights, no download), bf16 on CUDA, and
replaces every layer's `mlp.experts` by one of two modules that run the SAME torch ops:

  ResidentExperts  all expert weights on the GPU ([E, 2N, K] / [E, K, N]).
  CachedExperts    expert weights in host memory, one ect.ExpertCache per layer with capacity < E.

A generation feeds the whole prompt as ONE forward (TTFT: that forward to the first new token), then
decodes one token per forward. Prompt forward: per expert, the expert's GEMMs over the rows routed to
it; CachedExperts serves it with ONE prepare_wide() per layer (host providers: missing experts stream
through stream slots, the pool stays as it was; device provider: prepare + prepare_group rounds) and
its consumer runs each round's experts from the round's slots. Decode: prepare(top_k_index) and a
batched gather of each (token, k)'s expert (index_select over the full tensors or the slot tensors).
Both variants do the same GEMMs in the same shapes and dtype and combine the experts' outputs in the
same fixed order, so the generated tokens, the prompt's logits and every decode logit must be
bit-identical (torch.equal) to the all-resident run. ResidentExperts itself is checked against the
model's stock MixtralExperts (one prompt and one decode forward) with a stated bf16 tolerance (the
stock module runs different kernels).

Lookahead with real hints (--lookahead, default both: each provider without and with it): layer L's decode
forward applies layer L+1's router weight to layer L's MoE input and prefetches its --lookahead-ids best
experts into layer L+1's cache before layer L's GEMMs run. It reports the hints' measured recall on this
model, the speculative fills used and issued, and decode tokens/s against the same provider without
lookahead; the generated tokens and logits must stay bit-identical. Usage (docs/torch_example.md):

  python examples/torch/mixtral_offload.py --tokens 64 --capacity 4 --provider all --json out.json
  python examples/torch/mixtral_offload.py --check          # small, fast run; exit 0 pass, 77 skip, 1 fail

Exit codes: 0 every assertion passed; 1 an assertion or the run failed; 77 torch, CUDA, transformers or
the expert_cache_torch extension is missing (the reason is printed).
"""
import argparse
import gc
import json
import os
import platform
import statistics
import sys
import time
import traceback

EXIT_OK, EXIT_FAIL, EXIT_SKIP = 0, 1, 77

# ResidentExperts vs the stock MixtralExperts (different kernels, both bf16): per layer,
# max |ours - stock| <= STOCK_REL_TOL * max |stock| + STOCK_ABS_TOL. Both round the gate/up
# projection, the activation product and the down projection to bf16 (relative step 2^-8); they
# differ in the GEMM kernels' accumulation order and in where the routing weight is applied
# (stock: per expert in fp32 then rounded and summed in bf16; ours: summed in fp32, rounded once).
STOCK_REL_TOL = 2e-2
STOCK_ABS_TOL = 1e-6

# Providers this example runs through the cache ("all" = every one).
PROVIDERS = ("row", "cached", "device")

# Defaults of a normal run and of --check (a smaller model, same assertions).
FULL_DEFAULTS = dict(layers=8, hidden=1024, intermediate=2048, heads=16, kv_heads=4, tokens=64, repeats=3)
CHECK_DEFAULTS = dict(layers=4, hidden=512, intermediate=1024, heads=8, kv_heads=2, tokens=64, repeats=3)


class CheckFailed(Exception):
    """An assertion of the example failed (exit 1)."""


class Missing(Exception):
    """A prerequisite is missing (exit 77)."""


def log(*parts):
    print(*parts, flush=True)


def require(cond, what):
    if not cond:
        raise CheckFailed(what)


# --------------------------------------------------------------------------------------------
# Arguments
# --------------------------------------------------------------------------------------------

def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=None,
                   help="new tokens per greedy generation (>= 2: the prompt forward's, then decode; default 64)")
    p.add_argument("--prompt-len", type=int, default=16, help="prompt tokens (fixed, from the seed)")
    p.add_argument("--capacity", type=int, default=4, help="GPU slots per layer (top_k <= capacity <= experts)")
    p.add_argument("--provider", default="all",
                   help="row | cached | device | all (= row,cached,device); a comma list is accepted")
    p.add_argument("--stream-slots", type=int, default=None,
                   help="host providers: stream slots for the prompt's wide forward (default 2*max(top_k, capacity/16))")
    p.add_argument("--policy", default="", help="eviction policy name ('' = the provider's default)")
    p.add_argument("--staging", default="", help="staging policy name ('' = the provider's default)")
    p.add_argument("--layers", type=int, default=None, help="decoder layers (default 8; --check 4)")
    p.add_argument("--hidden", type=int, default=None, help="hidden size K (default 1024; --check 512)")
    p.add_argument("--intermediate", type=int, default=None, help="expert intermediate size N (default 2048)")
    p.add_argument("--heads", type=int, default=None, help="attention heads")
    p.add_argument("--kv-heads", type=int, default=None, help="key/value heads")
    p.add_argument("--experts", type=int, default=8, help="experts per layer E")
    p.add_argument("--top-k", type=int, default=2, help="experts per token")
    p.add_argument("--vocab", type=int, default=32000, help="vocabulary size")
    p.add_argument("--seed", type=int, default=0, help="torch.manual_seed for weights and prompt")
    p.add_argument("--repeats", type=int, default=None, help="timed generations per variant (median; default 3)")
    p.add_argument("--lookahead", default="both", choices=("off", "on", "both"),
                   help="decode lookahead with real hints (layer L+1's router applied to layer L's MoE input): "
                        "off, on, or both (each provider without and with it; the default)")
    p.add_argument("--lookahead-ids", type=int, default=None,
                   help="hinted experts per layer, best first (default top_k)")
    p.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    p.add_argument("--check", action="store_true",
                   help="test mode: small model, validates every expert map; exit 0/1/77")
    p.add_argument("--validate-maps", action="store_true",
                   help="check slot >= 0 for every (token, k) of every forward (one extra sync; on in --check)")
    a = p.parse_args(argv)
    defaults = CHECK_DEFAULTS if a.check else FULL_DEFAULTS
    for key, value in defaults.items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    if a.check:
        a.validate_maps = True
    names = [s.strip() for s in a.provider.split(",") if s.strip()]
    if names == ["all"]:
        names = list(PROVIDERS)
    bad = [n for n in names if n not in PROVIDERS]
    if not names or bad:
        p.error(f"--provider: unknown {bad or a.provider!r}; choose from {', '.join(PROVIDERS)} or all")
    a.providers = list(dict.fromkeys(names))
    if a.lookahead_ids is None:
        a.lookahead_ids = a.top_k
    a.lookahead_modes = {"off": [False], "on": [True], "both": [False, True]}[a.lookahead]
    if a.tokens < 2:
        p.error("--tokens must be >= 2 (the first comes from the prompt forward, the others are decode forwards)")
    if a.prompt_len < 2 or a.repeats < 1 or a.layers < 1:
        p.error("--prompt-len must be >= 2 (a prompt forward of several tokens), --repeats and --layers >= 1")
    if a.stream_slots is None:
        a.stream_slots = 2 * max(a.top_k, a.capacity // 16)   # the library's recommended_stream_slots
    if a.stream_slots < 2:
        p.error(f"--stream-slots {a.stream_slots} must be >= 2 (two halves: a round's copies overlap the previous one)")
    if not (1 <= a.top_k <= a.experts):
        p.error(f"--top-k {a.top_k} must be in [1, --experts {a.experts}]")
    if not (a.top_k <= a.capacity <= a.experts):
        p.error(f"--capacity {a.capacity} must be in [top_k {a.top_k}, experts {a.experts}] "
                "(a forward of one token needs top_k experts resident at once)")
    if not (1 <= a.lookahead_ids <= a.capacity):
        p.error(f"--lookahead-ids {a.lookahead_ids} must be in [1, --capacity {a.capacity}] (a prefetch fills at "
                "most the slots the cache may evict)")
    if a.hidden % a.heads != 0 or a.heads % a.kv_heads != 0:
        p.error(f"--hidden {a.hidden} must divide by --heads {a.heads}, and heads by --kv-heads {a.kv_heads}")
    return a


# --------------------------------------------------------------------------------------------
# Imports (exit 77 when a prerequisite is missing)
# --------------------------------------------------------------------------------------------

def import_stack():
    # Deterministic cuBLAS workspaces; harmless where already deterministic. Before torch loads.
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    try:
        import torch
    except ImportError as e:
        raise Missing(f"torch is not importable ({e})")
    if not torch.cuda.is_available():
        raise Missing(f"torch {torch.__version__} sees no CUDA device (torch.version.cuda={torch.version.cuda})")
    try:
        import transformers
        from transformers import MixtralConfig, MixtralForCausalLM
    except ImportError as e:
        raise Missing(f"transformers with Mixtral is not importable ({e})")
    try:
        import expert_cache_torch as ect
    except ModuleNotFoundError as e:
        if e.name and e.name.split(".")[0] == "expert_cache_torch":
            raise Missing(f"the expert_cache_torch extension is not installed ({e}); build it from python/ "
                          "(docs/python.md) and put it on PYTHONPATH")
        raise
    # Any other ImportError (an undefined symbol, a torch ABI mismatch) is a broken build: it fails
    # (exit 1) instead of passing as skipped.
    return torch, transformers, MixtralConfig, MixtralForCausalLM, ect


# --------------------------------------------------------------------------------------------
# The experts modules (same signature as MixtralExperts.forward)
# --------------------------------------------------------------------------------------------

def make_modules(torch):
    nn = torch.nn
    F = torch.nn.functional

    def expert_math(x, top_k_weights, w13, w2, act_fn):
        """Decode (one token). x [T, K]; w13 [T*k, 2N, K], w2 [T*k, K, N] (row t*k + j is token t's
        j-th expert); top_k_weights [T, k]. Returns [T, K] in x's dtype. The one code path of both
        variants for a single-token forward."""
        t, hidden = x.shape
        k = top_k_weights.shape[1]
        xk = x.unsqueeze(1).expand(t, k, hidden).reshape(t * k, 1, hidden)      # [T*k, 1, K]
        gate_up = torch.bmm(xk, w13.transpose(1, 2))                           # [T*k, 1, 2N]
        gate, up = gate_up.chunk(2, dim=-1)
        h = act_fn(gate) * up                                                    # [T*k, 1, N]
        y = torch.bmm(h, w2.transpose(1, 2)).view(t, k, hidden)                  # [T*k, 1, K]
        out = (y.float() * top_k_weights.float().unsqueeze(-1)).sum(dim=1)      # fp32 sum over k
        return out.to(x.dtype)

    # A forward of several tokens (the prompt) runs per expert, as the stock block's loop: each
    # expert's GEMMs over the rows routed to it. Bit-identity with the cache's rounds rests on three
    # things, none of them the order of the rounds: (1) an expert's rows are the same positions in
    # the same order in both variants (routed_positions, from the ids alone), so its GEMMs have the
    # same shapes and inputs; (2) its weights are copied into a fresh tensor first (clone), so
    # cuBLAS sees the same shapes, strides and allocator alignment whether they came from the
    # resident parameter or a cache slot; (3) an expert writes its weighted rows into their own
    # (token, k) rows of an fp32 buffer (index_copy_, no accumulation), and the k rows of a token
    # are summed once after every expert ran, in k order (as expert_math does). The rounds of a
    # wide forward are disjoint and cover the forward's experts, but are not globally ascending
    # (stream admission serves the pool's hits in round 0): with (3) any order gives the same bits.

    def routed_positions(top_k_index, num_experts):
        """{expert: LongTensor of the flat positions t*k + j routed to it, ascending}; one sync."""
        flat = top_k_index.reshape(-1)
        order = torch.argsort(flat, stable=True)
        counts = torch.bincount(flat, minlength=num_experts).tolist()
        require(len(counts) == num_experts, f"router ids outside [0, {num_experts}): counts {counts}")
        pos, start = {}, 0
        for e, c in enumerate(counts):
            if c:
                pos[e] = order[start:start + c]
            start += c
        return pos

    def expert_rows(x, pos, k, w13, w2, weights_flat, act_fn, acc):
        """One expert over its rows: acc[pos] = (down(act(gate) * up) of x[pos // k]) * weight, fp32."""
        xs = x.index_select(0, torch.div(pos, k, rounding_mode="floor"))         # [n, K]
        gate, up = F.linear(xs, w13.clone()).chunk(2, dim=-1)                    # [n, N] each
        y = F.linear(act_fn(gate) * up, w2.clone())                              # [n, K]
        acc.index_copy_(0, pos, y.float() * weights_flat.index_select(0, pos).float().unsqueeze(-1))

    def combine(acc, t, k, dtype):
        return acc.view(t, k, -1).sum(dim=1).to(dtype)                          # fp32 sum over k

    class ResidentExperts(nn.Module):
        """Every expert's weights on the GPU; optionally compares its first call of each kind
        (prompt, decode) with the stock module."""

        def __init__(self, layer, gate_up, down, act_fn, stock=None):
            super().__init__()
            self.layer = layer
            self.w13 = gate_up      # [E, 2N, K] (the model's parameter, not copied)
            self.w2 = down          # [E, K, N]
            self.act_fn = act_fn
            self._stock = [stock]   # a list: not registered as a submodule
            self.stock_check = {}   # kind ("prompt" / "decode") -> dict, after the first checked call

        def forward(self, hidden_states, top_k_index, top_k_weights):
            t = hidden_states.shape[0]
            if t == 1:
                flat = top_k_index.flatten()
                w13 = self.w13.index_select(0, flat)
                w2 = self.w2.index_select(0, flat)
                out = expert_math(hidden_states, top_k_weights, w13, w2, self.act_fn)
            else:
                k = top_k_index.shape[1]
                pos = routed_positions(top_k_index, self.w13.shape[0])
                acc = torch.zeros(t * k, hidden_states.shape[1], dtype=torch.float32, device=hidden_states.device)
                wflat = top_k_weights.reshape(-1)
                for e in sorted(pos):
                    expert_rows(hidden_states, pos[e], k, self.w13[e], self.w2[e], wflat, self.act_fn, acc)
                out = combine(acc, t, k, hidden_states.dtype)
            stock = self._stock[0]
            kind = "decode" if t == 1 else "prompt"
            if stock is not None and kind not in self.stock_check:
                ref = stock(hidden_states, top_k_index, top_k_weights)
                diff = (out.float() - ref.float()).abs()
                scale = ref.float().abs().max().item()
                err = diff.max().item()
                bound = STOCK_REL_TOL * scale + STOCK_ABS_TOL
                self.stock_check[kind] = dict(layer=self.layer, kind=kind, tokens=int(t),
                                              max_abs_diff=err, mean_abs_diff=diff.mean().item(),
                                              max_abs_stock=scale, bound=bound, ok=bool(err <= bound),
                                              out_dtype=str(ref.dtype))
            return out

    class CachedExperts(nn.Module):
        """Expert weights in host memory behind an ect.ExpertCache; the GEMMs read the slot tensors.
        One token: prepare() + the decode math. Several (the prompt): ONE prepare_wide() whose
        consumer runs the per-expert math of each round's experts from the round's slots."""

        def __init__(self, layer, cache, act_fn, validate_maps, admission):
            super().__init__()
            self.layer = layer
            self.cache = cache
            self.act_fn = act_fn
            self.validate_maps = validate_maps
            self.admission = admission   # prepare_wide admission: "stream" (host) or "admit" (device)
            self.prepare_s = 0.0         # time inside prepare() (and prefetch()) of single-token forwards
            self.forwards = 0
            self.wide = []               # prepare_wide summaries since the last reset
            # Lookahead: (the next layer's router weight [E, K], the next layer's CachedExperts, ids per
            # hint), set by enable_lookahead; None for the last layer or without lookahead.
            self.lookahead = None
            self.hint = None             # the ids the previous layer hinted for this one (CUDA int64), or None
            self.reset_recall()

        def reset_recall(self):
            # (hinted ids, routed ids) of each decode forward that had a hint, kept on the GPU and compared
            # once after a generation: the recall costs the timed loop no launch and no synchronisation.
            self.hint_pairs = []

        def hint_recall_counts(self):
            """(routed (token, k) entries the previous layer's hints named, routed entries), over the
            decode forwards since reset_recall."""
            if not self.hint_pairs:
                return 0, 0
            hints = torch.stack([h for h, _ in self.hint_pairs])                # [F, n_ids]
            routed = torch.stack([r for _, r in self.hint_pairs])               # [F, T*k]
            named = (routed.unsqueeze(-1) == hints.unsqueeze(1)).any(dim=-1)    # [F, T*k]
            return int(named.sum().item()), routed.numel()

        def enable_lookahead(self, next_router_weight, next_module, n_ids):
            require(next_router_weight.dim() == 2 and next_router_weight.shape[0] == next_module.cache.num_experts,
                    f"layer {self.layer}: the next layer's router weight is {tuple(next_router_weight.shape)}, "
                    f"expected [{next_module.cache.num_experts}, hidden]")
            self.lookahead = (next_router_weight, next_module, n_ids)

        def forward(self, hidden_states, top_k_index, top_k_weights):
            if hidden_states.shape[0] > 1:
                self.hint = None         # a prompt forward is served whole by prepare_wide: no hint
                return self.forward_wide(hidden_states, top_k_index, top_k_weights)
            if self.hint is not None:
                self.hint_pairs.append((self.hint, top_k_index.flatten()))   # the recall, after the generation
                self.hint = None
            t0 = time.perf_counter()
            view = self.cache.prepare(top_k_index)
            if self.lookahead is not None:
                # Real hints: the next layer's router applied to this layer's MoE input (the residual
                # stream changes little from one layer to the next). Its best ids, as a CUDA tensor: the
                # device provider plans them on the GPU without a synchronisation; a host-planned one
                # reads them back (one synchronisation). Issued before this layer's GEMMs so that the
                # copies overlap them; prepare(L+1) waits only for the slots it reads.
                weight, nxt, n_ids = self.lookahead
                logits = F.linear(hidden_states, weight)                          # [1, E]
                ids = logits.topk(n_ids, dim=-1).indices.flatten()                # best first
                nxt.cache.prefetch(ids)
                nxt.hint = ids
            self.prepare_s += time.perf_counter() - t0
            self.forwards += 1
            slot = view.expert_map[top_k_index]          # device gather, no host sync: [T, k] int32
            flat = slot.flatten()
            if self.validate_maps:
                lo = int(flat.min().item())
                if lo < 0:
                    raise CheckFailed(
                        f"layer {self.layer}: expert_map has -1 for a routed expert (ids "
                        f"{top_k_index.flatten().tolist()}, slots {flat.tolist()}, generation {view.generation})")
            w13 = view.tensors["w13"].index_select(0, flat)
            w2 = view.tensors["w2"].index_select(0, flat)
            return expert_math(hidden_states, top_k_weights, w13, w2, self.act_fn)

        def forward_wide(self, hidden_states, top_k_index, top_k_weights):
            t, hidden = hidden_states.shape
            k = top_k_index.shape[1]
            num_experts = self.cache.num_experts
            pos = routed_positions(top_k_index, num_experts)
            acc = torch.zeros(t * k, hidden, dtype=torch.float32, device=hidden_states.device)
            wflat = top_k_weights.reshape(-1)
            served = []
            check_pool = self.validate_maps and self.admission == "stream"
            # The planner's map, not the device copy: a cache that never prepared has uploaded nothing yet.
            pool_before = self.cache.resident_map_host() if check_pool else None
            stats_before = self.cache.stats() if check_pool else None

            def consumer(rnd):
                if rnd.experts:   # host-planned: the round's experts (ascending) and slots
                    pairs = list(zip(rnd.experts, rnd.slots))
                    if self.validate_maps:
                        m = rnd.expert_map.tolist()
                        named = [(e, s) for e, s in enumerate(m) if s >= 0]
                        if named != pairs:
                            raise CheckFailed(f"layer {self.layer}: round {rnd.index} map names {named}, "
                                              f"the round lists {pairs}")
                else:             # provider "device": the plan stays on the GPU; read this round's map
                    pairs = [(e, s) for e, s in enumerate(rnd.expert_map.tolist()) if s >= 0]
                w13, w2 = rnd.tensors["w13"], rnd.tensors["w2"]
                for e, s in pairs:
                    p = pos.get(e)
                    if p is None:
                        raise CheckFailed(f"layer {self.layer}: round {rnd.index} maps expert {e}, which this "
                                          f"forward does not route (routed: {sorted(pos)})")
                    expert_rows(hidden_states, p, k, w13[s], w2[s], wflat, self.act_fn, acc)
                    served.append(e)

            summary = self.cache.prepare_wide(top_k_index, consumer, admission=self.admission)
            self.wide.append(dict(summary))
            if sorted(served) != sorted(pos):
                raise CheckFailed(f"layer {self.layer}: the wide forward's rounds served experts {sorted(served)}, "
                                  f"the forward routes {sorted(pos)} (summary {dict(summary)})")
            if check_pool and summary.get("admission") == "stream":
                # Scan resistance: the pool, its policy's counters and the hit/miss counts as before.
                after = self.cache.resident_map_host()
                if not torch.equal(pool_before, after):
                    raise CheckFailed(f"layer {self.layer}: stream admission changed the pool: resident map "
                                      f"{pool_before.tolist()} -> {after.tolist()}")
                stats_after = self.cache.stats()
                moved = {key: (stats_before[key], stats_after[key]) for key in ("hits", "misses", "evictions")
                         if stats_before.get(key) != stats_after.get(key)}
                if moved:
                    raise CheckFailed(f"layer {self.layer}: stream admission changed the pool's counters {moved}")
            return combine(acc, t, k, hidden_states.dtype)

    return ResidentExperts, CachedExperts


# --------------------------------------------------------------------------------------------
# Model
# --------------------------------------------------------------------------------------------

def build_model(torch, MixtralConfig, MixtralForCausalLM, a):
    config = MixtralConfig(
        vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
        num_hidden_layers=a.layers, num_attention_heads=a.heads, num_key_value_heads=a.kv_heads,
        num_local_experts=a.experts, num_experts_per_tok=a.top_k,
        max_position_embeddings=max(256, 2 * (a.prompt_len + a.tokens)),
        sliding_window=None, router_jitter_noise=0.0, tie_word_embeddings=False, use_cache=True)
    torch.manual_seed(a.seed)
    # Built on the CPU in fp32 with the model's own initialisation (post_init), then moved.
    model = MixtralForCausalLM(config)

    def insane(m):
        # Uninitialised memory shows as non-finite values or an absurd spread (the model's init is
        # normal(0, initializer_range) for the projections, ones for the norms).
        out = []
        for n, prm in m.named_parameters():
            x = prm.detach().float()
            if not torch.isfinite(x).all() or (x.numel() > 1 and x.std().item() > 10.0):
                out.append(n)
        return out

    bad = insane(model)
    if bad:
        log(f"init: {len(bad)} parameters look uninitialised after construction (e.g. {bad[:3]}); "
            "running model.init_weights()")
        torch.manual_seed(a.seed)
        model.init_weights()
        bad = insane(model)
        require(not bad, f"parameters still uninitialised after init_weights: {bad[:5]}")
    model = model.to(device="cuda", dtype=torch.bfloat16).eval()
    return config, model


def check_structure(model, a):
    layers = getattr(getattr(model, "model", None), "layers", None)
    require(layers is not None and len(layers) == a.layers,
            f"model.model.layers missing or of the wrong length (transformers' Mixtral structure changed?)")
    for i, layer in enumerate(layers):
        mlp = getattr(layer, "mlp", None) or getattr(layer, "block_sparse_moe", None)
        require(mlp is not None, f"layer {i}: no .mlp (MixtralSparseMoeBlock) found")
        require(hasattr(mlp, "gate") and hasattr(mlp, "experts"), f"layer {i}: mlp has no .gate/.experts")
        gw = getattr(mlp.gate, "weight", None)
        require(gw is not None and tuple(gw.shape) == (a.experts, a.hidden),
                f"layer {i}: mlp.gate has no weight [{a.experts}, {a.hidden}] (got "
                f"{None if gw is None else tuple(gw.shape)}): lookahead applies it to the previous layer's input")
        ex = mlp.experts
        for name in ("gate_up_proj", "down_proj", "act_fn"):
            require(hasattr(ex, name), f"layer {i}: mlp.experts ({type(ex).__name__}) has no .{name}: this example "
                    "needs transformers' fused MixtralExperts (gate_up_proj [E,2N,K], down_proj [E,K,N]; "
                    "transformers >= 5)")
        e, two_n, k = ex.gate_up_proj.shape
        require((e, two_n, k) == (a.experts, 2 * a.intermediate, a.hidden),
                f"layer {i}: gate_up_proj shape {tuple(ex.gate_up_proj.shape)} != "
                f"({a.experts}, {2 * a.intermediate}, {a.hidden})")
        require(tuple(ex.down_proj.shape) == (a.experts, a.hidden, a.intermediate),
                f"layer {i}: down_proj shape {tuple(ex.down_proj.shape)} != ({a.experts}, {a.hidden}, {a.intermediate})")
    return [layer.mlp if hasattr(layer, "mlp") else layer.block_sparse_moe for layer in layers]


def set_experts(mlps, modules):
    for mlp, m in zip(mlps, modules):
        mlp.experts = m


# --------------------------------------------------------------------------------------------
# Greedy generation with the model's KV cache
# --------------------------------------------------------------------------------------------

def greedy(torch, model, prompt, n_new, timers):
    """Feeds the whole prompt as ONE forward (every prompt token at once: the cache serves it
    through prepare_wide), takes the first new token from its last position, then generates the
    other n_new - 1 tokens one forward each. TTFT is the prompt forward up to the first token's
    argmax, between two torch.cuda.synchronize(); the decode window is the n_new - 1 forwards
    after it. Returns dict(tokens [n_new] cpu, logits [n_new, V] cuda, prompt_logits [P, V] cuda,
    ttft_s, decode_s, prepare_s (single-token prepares), wide [summaries of the prompt forward])."""
    with torch.no_grad():
        for m in timers:
            m.prepare_s = 0.0
            m.wide = []
            m.reset_recall()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        out = model(input_ids=prompt, use_cache=True)
        prompt_logits = out.logits[0]
        cur = prompt_logits[-1:].argmax(dim=-1, keepdim=True)           # [1, 1]
        torch.cuda.synchronize()
        ttft_s = time.perf_counter() - t0
        past = out.past_key_values
        wide = [w for m in timers for w in m.wide]
        tokens, logits = [cur], [prompt_logits[-1:]]
        t1 = time.perf_counter()
        for _ in range(n_new - 1):
            out = model(input_ids=cur, past_key_values=past, use_cache=True)
            past = out.past_key_values
            last = out.logits[:, -1, :]
            cur = last.argmax(dim=-1, keepdim=True)
            logits.append(last)
            tokens.append(cur)
        torch.cuda.synchronize()
        decode_s = time.perf_counter() - t1
    prepare_s = sum(m.prepare_s for m in timers)
    counts = [m.hint_recall_counts() for m in timers]
    routed = sum(n for _, n in counts)
    recall = sum(h for h, _ in counts) / routed if routed else None
    return dict(tokens=torch.cat(tokens, dim=1).flatten().cpu(), logits=torch.cat(logits, dim=0),
                prompt_logits=prompt_logits, ttft_s=ttft_s, decode_s=decode_s, prepare_s=prepare_s, wide=wide,
                hint_recall=recall)


SPECULATIVE_KEYS = ("speculative_issued", "speculative_used", "speculative_wasted")
WIDE_KEYS = ("rounds", "unique", "hits", "streamed", "admitted", "copies", "bytes")


def wide_total(summaries):
    """The prompt forward's prepare_wide summaries summed over layers (None without a cache)."""
    if not summaries:
        return None
    total = {key: sum(int(w.get(key, 0)) for w in summaries) for key in WIDE_KEYS}
    total["layers"] = len(summaries)
    total["admission"] = sorted({str(w.get("admission")) for w in summaries})
    total["fell_back"] = any(bool(w.get("fell_back")) for w in summaries)
    return total


def stats_sum(caches):
    per_layer = [c.stats() for c in caches]
    total = {}
    for s in per_layer:
        for key, value in s.items():
            if isinstance(value, (int, float)) and not isinstance(value, bool) and key != "hit_rate":
                total[key] = total.get(key, 0) + value
    # A rate does not add up over layers: recompute it from the summed counts.
    total["hit_rate"] = hit_rate(total.get("hits", 0), total.get("misses", 0))
    return total, per_layer


def hit_rate(hits, misses):
    n = hits + misses
    return None if n == 0 else hits / n


def run_variant(torch, model, prompt, a, timers, caches, ref):
    """Warm-up + a.repeats timed generations. Every generation is compared with `ref` (the first
    all-resident generation) when given. Returns (the variant's result dict, the first generation)."""
    runs = []
    decode_tokens = a.tokens - 1
    for r in range(a.repeats + 1):
        before = stats_sum(caches)[0] if caches else {}
        g = greedy(torch, model, prompt, a.tokens, timers)
        after = stats_sum(caches)[0] if caches else {}
        hits = after.get("hits", 0) - before.get("hits", 0)
        misses = after.get("misses", 0) - before.get("misses", 0)
        speculative = {key: after.get(key, 0) - before.get(key, 0) for key in SPECULATIVE_KEYS}
        entry = dict(run=r, warmup=(r == 0), ttft_ms=1e3 * g["ttft_s"], decode_s=g["decode_s"],
                     tokens_per_s=decode_tokens / g["decode_s"], prepare_s=g["prepare_s"],
                     prepare_share=g["prepare_s"] / g["decode_s"], hits=hits, misses=misses,
                     hit_rate=hit_rate(hits, misses), prompt_wide=wide_total(g["wide"]),
                     hint_recall=g["hint_recall"], speculative=speculative)
        if ref is None:
            ref = g
        entry["tokens_equal"] = bool(torch.equal(g["tokens"], ref["tokens"]))
        entry["logits_equal"] = bool(g["logits"].dtype == ref["logits"].dtype and torch.equal(g["logits"], ref["logits"]))
        entry["prompt_logits_equal"] = bool(g["prompt_logits"].dtype == ref["prompt_logits"].dtype
                                            and torch.equal(g["prompt_logits"], ref["prompt_logits"]))
        entry["max_abs_logit_diff"] = float((g["logits"].float() - ref["logits"].float()).abs().max().item())
        entry["max_abs_prompt_logit_diff"] = float(
            (g["prompt_logits"].float() - ref["prompt_logits"].float()).abs().max().item())
        if not entry["tokens_equal"]:
            entry["first_token_mismatch"] = int((g["tokens"] != ref["tokens"]).nonzero()[0].item())
        runs.append(entry)
        pw = entry["prompt_wide"]
        look_txt = "" if g["hint_recall"] is None else (
            f", hint recall {100 * g['hint_recall']:.1f}%, speculative issued {speculative['speculative_issued']} "
            f"used {speculative['speculative_used']} wasted {speculative['speculative_wasted']}")
        wide_txt = "" if pw is None else (f", prompt forward: {pw['rounds']} rounds over {pw['layers']} layers, "
                                          f"{pw['hits']} pool hits, {pw['streamed']} streamed, {pw['admitted']} admitted")
        log(f"    run {r}{' (warm-up)' if r == 0 else ''}: TTFT {entry['ttft_ms']:.2f} ms{wide_txt}; decode "
            f"{entry['tokens_per_s']:.1f} tok/s, prepare {1e3 * g['prepare_s'] / decode_tokens:.3f} ms/token "
            f"({100 * entry['prepare_share']:.1f}%), hits {hits} misses {misses}, tokens equal {entry['tokens_equal']}, "
            f"logits bit-identical {entry['logits_equal']} (max |diff| {entry['max_abs_logit_diff']:.3g}), prompt "
            f"logits bit-identical {entry['prompt_logits_equal']} (max |diff| {entry['max_abs_prompt_logit_diff']:.3g})"
            f"{look_txt}")
    timed = runs[1:]
    hits = sum(x["hits"] for x in timed)
    misses = sum(x["misses"] for x in timed)
    result = dict(
        ttft_ms=statistics.median(x["ttft_ms"] for x in timed),
        cold_ttft_ms=runs[0]["ttft_ms"],
        tokens_per_s=statistics.median(x["tokens_per_s"] for x in timed),
        ms_per_token=1e3 * statistics.median(x["decode_s"] for x in timed) / decode_tokens,
        prepare_ms_per_token=1e3 * statistics.median(x["prepare_s"] for x in timed) / decode_tokens,
        prepare_share=statistics.median(x["prepare_share"] for x in timed),
        hits=hits, misses=misses, hit_rate=hit_rate(hits, misses),
        cold_hits=runs[0]["hits"], cold_misses=runs[0]["misses"],
        cold_hit_rate=hit_rate(runs[0]["hits"], runs[0]["misses"]),
        hint_recall=None if timed[0]["hint_recall"] is None else statistics.median(x["hint_recall"] for x in timed),
        speculative={key: sum(x["speculative"][key] for x in timed) for key in SPECULATIVE_KEYS},
        prompt_wide=timed[-1]["prompt_wide"], cold_prompt_wide=runs[0]["prompt_wide"],
        tokens_equal=all(x["tokens_equal"] for x in runs),
        logits_equal=all(x["logits_equal"] for x in runs),
        prompt_logits_equal=all(x["prompt_logits_equal"] for x in runs),
        max_abs_logit_diff=max(x["max_abs_logit_diff"] for x in runs),
        max_abs_prompt_logit_diff=max(x["max_abs_prompt_logit_diff"] for x in runs),
        runs=runs)
    return result, ref


# --------------------------------------------------------------------------------------------
# Main flow
# --------------------------------------------------------------------------------------------

def fmt_rate(x):
    return "-" if x is None else f"{100 * x:.1f}%"


def print_table(a, results):
    log("")
    log(f"Mixtral {a.layers} layers, hidden {a.hidden}, intermediate {a.intermediate}, {a.experts} experts, "
        f"top-{a.top_k}, capacity {a.capacity}/layer (+{a.stream_slots} stream slots, host providers), prompt "
        f"{a.prompt_len} tokens as one forward, {a.tokens} new tokens, median of {a.repeats} timed runs after a warm-up")
    head = ("variant", "TTFT ms", "cold TTFT ms", "decode tok/s", "ms/token", "prepare ms/token", "cache share",
            "hit rate", "cold hit rate", "prompt rounds", "hint recall", "spec. used/issued", "vs no lookahead",
            "tokens", "logits")
    rows = []
    for name, r in results.items():
        pw = r.get("prompt_wide")
        spec = r.get("speculative") or {}
        base = results.get(name[:-len("+lookahead")]) if name.endswith("+lookahead") else None
        rows.append((name, f"{r['ttft_ms']:.2f}", f"{r['cold_ttft_ms']:.2f}", f"{r['tokens_per_s']:.1f}",
                     f"{r['ms_per_token']:.3f}", f"{r['prepare_ms_per_token']:.3f}", f"{100 * r['prepare_share']:.1f}%",
                     fmt_rate(r.get("hit_rate")), fmt_rate(r.get("cold_hit_rate")),
                     "-" if pw is None else str(pw["rounds"]),
                     fmt_rate(r.get("hint_recall")),
                     f"{spec['speculative_used']}/{spec['speculative_issued']}" if spec.get("speculative_issued") else "-",
                     f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "-",
                     "same" if r["tokens_equal"] else "DIFFERENT",
                     "bit-identical" if r["logits_equal"] and r["prompt_logits_equal"]
                     else f"max|diff| {max(r['max_abs_logit_diff'], r['max_abs_prompt_logit_diff']):.3g}"))
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(head)]
    line = lambda cells: "| " + " | ".join(c.ljust(w) for c, w in zip(cells, widths)) + " |"
    log(line(head))
    log("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        log(line(row))
    log("TTFT: the prompt forward (all prompt tokens at once; through prepare_wide for the cached variants) up to "
        "the first new token, between two torch.cuda.synchronize() (perf_counter); cold: the warm-up run from "
        "empty caches. decode tok/s: the other new tokens, one forward each.")
    log("hit rate: hits / (hits + misses) from cache.stats() summed over layers, timed runs (the cache stays warm "
        "between runs); host providers count decode prepares only (stream admission reads the pool without "
        "counting), the device provider also the prompt forward's rounds. prompt rounds: prepare_wide rounds of "
        "one prompt forward, summed over layers.")
    log("hint recall: of the experts a decode forward routes, the share its previous layer's hint named (layer "
        "L+1's router applied to layer L's MoE input, the lookahead-ids best); spec. used/issued: speculative fills "
        "the next prepare read / fills issued (stats(), timed runs); vs no lookahead: decode tok/s over the same "
        "provider's row without lookahead, in the same process.")
    log("cache share: time inside prepare() and the lookahead's prefetch() (perf_counter) / wall time of the decode forwards. The host-planned "
        "providers (row, cached) include their one id read-back synchronisation per prepare(), which also "
        "waits for the GPU work queued before it.")


def versions(torch, transformers, ect):
    props = torch.cuda.get_device_properties(0)
    return dict(python=platform.python_version(), torch=torch.__version__, torch_cuda=torch.version.cuda,
                transformers=transformers.__version__,
                expert_cache_torch=getattr(ect, "__version__", "?"), expert_cache_torch_file=getattr(ect, "__file__", "?"),
                device=props.name, capability=f"{props.major}.{props.minor}",
                device_memory_gib=round(props.total_memory / 2**30, 1))


def main(argv=None):
    a = parse_args(sys.argv[1:] if argv is None else argv)
    report = dict(args={k: v for k, v in vars(a).items()}, passed=False, failures=[])
    try:
        code = run(a, report)
    except Missing as e:
        log(f"SKIP: {e}")
        report["skipped"] = str(e)
        code = EXIT_SKIP
    except CheckFailed as e:
        log(f"FAILED: {e}")
        report["failures"].append(str(e))
        code = EXIT_FAIL
    except Exception as e:  # the log must show what broke
        traceback.print_exc()
        msg = f"{type(e).__name__}: {e}"
        log(f"FAILED: {msg}")
        report["failures"].append(msg)
        code = EXIT_FAIL
    if a.json:
        with open(a.json, "w", encoding="utf-8") as f:
            json.dump(report, f, indent=2, default=str)
        log(f"wrote {a.json}")
    return code


def run(a, report):
    torch, transformers, MixtralConfig, MixtralForCausalLM, ect = import_stack()
    ResidentExperts, CachedExperts = make_modules(torch)
    v = versions(torch, transformers, ect)
    report["versions"] = v
    log("versions: " + ", ".join(f"{k}={val}" for k, val in v.items()))

    t0 = time.perf_counter()
    config, model = build_model(torch, MixtralConfig, MixtralForCausalLM, a)
    mlps = check_structure(model, a)
    stock = [m.experts for m in mlps]
    stds = [s.gate_up_proj.detach().float().std().item() for s in stock]
    log(f"init: gate_up_proj std per layer {', '.join(f'{x:.4g}' for x in stds)} "
        f"(initializer_range {getattr(config, 'initializer_range', '?')})")
    require(all(x > 0.0 for x in stds), "a layer's gate_up_proj is constant: the experts were not initialised")
    log(f"model: {type(model).__name__} built in {time.perf_counter() - t0:.1f} s, "
        f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f} M parameters, attn "
        f"{getattr(config, '_attn_implementation', '?')}, experts implementation "
        f"{getattr(config, '_experts_implementation', '?')}, stock experts {type(stock[0]).__name__}, "
        f"gate_up_proj {tuple(stock[0].gate_up_proj.shape)} {stock[0].gate_up_proj.dtype}, "
        f"down_proj {tuple(stock[0].down_proj.shape)}")
    g = torch.Generator().manual_seed(a.seed + 1)
    prompt = torch.randint(0, a.vocab, (1, a.prompt_len), generator=g).to("cuda")
    log(f"prompt ({a.prompt_len} tokens): {prompt.flatten().tolist()}")
    failures = report["failures"]

    # 1. ResidentExperts against the stock MixtralExperts: one forward over the whole prompt (the
    #    per-expert path) and one of its first token alone (the decode path).
    with torch.no_grad():
        ref_logits = model(input_ids=prompt, use_cache=False).logits
        checkers = [ResidentExperts(i, s.gate_up_proj, s.down_proj, s.act_fn, stock=s) for i, s in enumerate(stock)]
        set_experts(mlps, checkers)
        our_logits = model(input_ids=prompt, use_cache=False).logits
        model(input_ids=prompt[:, :1], use_cache=False)
    checks = [c.stock_check.get(kind) for c in checkers for kind in ("prompt", "decode")]
    report["stock_check"] = dict(rel_tol=STOCK_REL_TOL, abs_tol=STOCK_ABS_TOL, layers=checks,
                                 logits_max_abs_diff=float((our_logits.float() - ref_logits.float()).abs().max()),
                                 logits_max_abs=float(ref_logits.float().abs().max()),
                                 argmax_agree=float((our_logits.argmax(-1) == ref_logits.argmax(-1)).float().mean()))
    log(f"stock check (tolerance max|diff| <= {STOCK_REL_TOL} * max|stock| + {STOCK_ABS_TOL}):")
    for c in checks:
        if c is None:
            failures.append("stock check: a layer's experts were never called for a prompt or a decode forward")
            continue
        log(f"  layer {c['layer']} {c['kind']}: {c['tokens']} tokens, max|diff| {c['max_abs_diff']:.4g} "
            f"(mean {c['mean_abs_diff']:.3g}) vs max|stock| {c['max_abs_stock']:.4g}, bound {c['bound']:.4g}: "
            f"{'ok' if c['ok'] else 'FAIL'}")
        if not c["ok"]:
            failures.append(f"stock check layer {c['layer']} {c['kind']}: max|diff| {c['max_abs_diff']:.4g} > "
                            f"{c['bound']:.4g}")
    sc = report["stock_check"]
    log(f"  model logits over the prompt (informational): max|diff| {sc['logits_max_abs_diff']:.4g} of "
        f"max|logit| {sc['logits_max_abs']:.4g}, argmax agreement {100 * sc['argmax_agree']:.1f}%")
    del checkers, ref_logits, our_logits

    # 2. All resident: the reference generation.
    results = {}
    resident = [ResidentExperts(i, s.gate_up_proj, s.down_proj, s.act_fn) for i, s in enumerate(stock)]
    set_experts(mlps, resident)
    log("variant resident (every expert on the GPU):")
    results["resident"], ref = run_variant(torch, model, prompt, a, [], [], None)
    results["resident"].update(hit_rate=None, cold_hit_rate=None)
    require(results["resident"]["tokens_equal"] and results["resident"]["logits_equal"],
            "the all-resident model is not deterministic across runs: bit-identity cannot be tested")
    log(f"  tokens: {ref['tokens'].tolist()}")

    # 3. Expert weights to host memory; drop the GPU copies.
    host = [(s.gate_up_proj.detach().to("cpu").contiguous(), s.down_proj.detach().to("cpu").contiguous())
            for s in stock]
    act_fn = stock[0].act_fn
    expert_bytes = sum(t.numel() * t.element_size() for pair in host for t in pair)
    for gu, dn in host:
        require(gu.data_ptr() % 16 == 0 and dn.data_ptr() % 16 == 0, "host tensors are not 16-byte aligned")
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    set_experts(mlps, [torch.nn.Identity() for _ in mlps])   # placeholders until a cache is built
    del resident, stock
    gc.collect()
    torch.cuda.empty_cache()
    after = torch.cuda.memory_allocated()
    log(f"experts moved to host: {expert_bytes / 2**20:.1f} MiB of bf16 weights ({len(host)} layers, "
        f"w13 {tuple(host[0][0].shape)}, w2 {tuple(host[0][1].shape)}); GPU allocated {before / 2**20:.1f} -> "
        f"{after / 2**20:.1f} MiB")
    require(before - after >= 0.95 * expert_bytes,
            f"the GPU expert copies were not freed ({(before - after) / 2**20:.1f} MiB released, "
            f"{expert_bytes / 2**20:.1f} MiB expected): some reference keeps them alive")
    report["expert_host_mib"] = expert_bytes / 2**20
    report["gpu_mib_released"] = (before - after) / 2**20

    # 4. Through the cache, per provider.
    layout = ect.DenseBf16(hidden=a.hidden, intermediate=a.intermediate)
    for provider, look in [(p, look) for p in a.providers for look in a.lookahead_modes]:
        name = provider + ("+lookahead" if look else "")
        caches = []
        for i, (gu, dn) in enumerate(host):
            try:
                caches.append(ect.ExpertCache(
                    layout, host_tensors={"w13": gu, "w2": dn}, num_experts=a.experts, capacity=a.capacity,
                    top_k=a.top_k, provider=provider, policy=a.policy, staging=a.staging,
                    storage="tensor_major" if provider == "cached" else "",
                    # device: one prepare_wide takes the whole prompt's ids; host: the prompt's
                    # missing experts stream through stream_slots, the pool stays as it was.
                    max_ids=a.prompt_len * a.top_k if provider == "device" else 0,
                    stream_slots=0 if provider == "device" else a.stream_slots, label=f"layer{i}"))
            except Exception as e:
                # Every provider registers the same host tensors in turn: the previous provider's
                # caches must be gone (unregistered) by now.
                raise CheckFailed(f"{provider}: building the cache of layer {i} failed: {type(e).__name__}: {e} "
                                  f"(host tensors w13 {tuple(gu.shape)} @0x{gu.data_ptr():x}, w2 {tuple(dn.shape)} "
                                  f"@0x{dn.data_ptr():x}; providers before it: {a.providers[:a.providers.index(provider)]})")
        st = caches[0].slot_tensors
        log(f"variant {name}: {len(caches)} caches, capacity {caches[0].capacity}/{caches[0].num_experts}, "
            f"provider {caches[0].provider}, slot tensors "
            + ", ".join(f"{k} {tuple(t.shape)} {t.dtype} {t.device}" for k, t in st.items()))
        slots = a.capacity + (0 if provider == "device" else a.stream_slots)
        require(tuple(st["w13"].shape) == (slots, 2 * a.intermediate, a.hidden)
                and tuple(st["w2"].shape) == (slots, a.hidden, a.intermediate)
                and st["w13"].dtype == torch.bfloat16,
                f"{provider}: slot tensors have unexpected shapes/dtype (expected {slots} slots)")
        admission = "admit" if provider == "device" else "stream"
        modules = [CachedExperts(i, c, act_fn, a.validate_maps, admission) for i, c in enumerate(caches)]
        if look:
            for i in range(len(modules) - 1):
                modules[i].enable_lookahead(mlps[i + 1].gate.weight, modules[i + 1], a.lookahead_ids)
            log(f"  lookahead: layer L's decode forward prefetches the {a.lookahead_ids} best experts of layer L+1's "
                "router applied to layer L's MoE input (real hints, not emulated)")
        set_experts(mlps, modules)
        res, _ = run_variant(torch, model, prompt, a, modules, caches, ref)
        if provider == "device":
            # A wide forward served in rounds is no error; bad ids or a timeout would be.
            errors = [c.device_errors() for c in caches]
            res["device_errors"] = errors
            if any(errors):
                failures.append(f"device: error words after the runs {errors} (0x2 overflow, 0x1 bad id)")
        total, per_layer = stats_sum(caches)
        res["stats_total"] = total
        res["per_layer_hit_rate"] = [hit_rate(s.get("hits", 0), s.get("misses", 0)) for s in per_layer]
        log("  per-layer hit rate (all runs): " + ", ".join(fmt_rate(x) for x in res["per_layer_hit_rate"]))
        log("  stats (sum over layers): " + ", ".join(f"{k}={val}" for k, val in total.items()))
        results[name] = res
        if not res["tokens_equal"]:
            bad = [x for x in res["runs"] if not x["tokens_equal"]]
            failures.append(f"{name}: tokens differ from the all-resident run (run {bad[0]['run']}, first "
                            f"mismatch at new token {bad[0].get('first_token_mismatch')})")
        if not res["logits_equal"]:
            failures.append(f"{name}: logits not bit-identical to the all-resident run "
                            f"(max |diff| {res['max_abs_logit_diff']:.4g})")
        if not res["prompt_logits_equal"]:
            failures.append(f"{name}: the prompt forward's logits not bit-identical to the all-resident one "
                            f"(max |diff| {res['max_abs_prompt_logit_diff']:.4g})")
        pw = res["cold_prompt_wide"]
        if pw is None or pw["layers"] != a.layers or pw["rounds"] < a.layers:
            failures.append(f"{name}: the prompt forward did not go through prepare_wide in every layer ({pw})")
        elif provider != "device" and (pw["fell_back"] or pw["admission"] != ["stream"]
                                       or pw["streamed"] + pw["hits"] != pw["unique"]):
            failures.append(f"{name}: the prompt was not served by stream admission ({pw})")
        # Capacity < experts and empty caches at the start: a host-planned cache must miss. (The
        # device provider's stats may not count hits/misses; its bit-identity is the check.)
        if provider != "device" and total.get("misses", 0) == 0:
            failures.append(f"{name}: no misses recorded: the cache was not exercised")
        if total.get("faults", 0):
            failures.append(f"{name}: cache reported {total['faults']} faults")
        if look:
            spec = res["speculative"]
            rec = res["hint_recall"]
            log(f"  lookahead (timed runs): hint recall {fmt_rate(rec)}, speculative issued "
                f"{spec['speculative_issued']}, used {spec['speculative_used']}, wasted {spec['speculative_wasted']}")
            if a.layers > 1 and (rec is None or not 0.0 <= rec <= 1.0):
                failures.append(f"{name}: no hint recall measured ({rec}): the hints never reached the next layer")
            # The warm-up run starts from empty caches: its first hints name experts that are not resident.
            if a.layers > 1 and sum(x["speculative"]["speculative_issued"] for x in res["runs"]) == 0:
                failures.append(f"{name}: lookahead issued no speculative fill in any run")
        # Unregister the host tensors before the next provider registers them again.
        set_experts(mlps, [torch.nn.Identity() for _ in mlps])
        del modules, caches, st
        gc.collect()
        torch.cuda.synchronize()

    report["results"] = results
    print_table(a, results)
    if failures:
        log("FAILURES:")
        for f in failures:
            log("  - " + f)
        return EXIT_FAIL
    report["passed"] = True
    log("PASS: every provider generated the all-resident tokens with bit-identical logits (prompt forward and decode)")
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
