"""vLLM's expert-cache provider surface over expert_cache (docs/python.md "Coming from vLLM").

    from expert_cache_torch.vllm import CachedWeightProvider, run_with_expert_cache
    provider = CachedWeightProvider(capacity, w13_weight, w2_weight, w13_scale, w2_scale,
                                    w13_scale_2=w13_scale_2, w2_scale_2=w2_scale_2)
    result = provider.prepare(topk_ids)          # result.w1, .w2, .w1_scale, .w2_scale, .expert_map, .topk_ids
    out = run_with_expert_cache(provider, topk_ids, run)   # forwards wider than the cache

Three semantics, by name (ExpertCacheProvider(semantics=...), or the named classes):

    "lfru"    CachedWeightProvider: vLLM's LFRU, bit for bit (docs/reference_providers.md "LFRU,
              exactly"), planned on the host.
    "row"     RowCacheWeightProvider: the row provider's LRU with in-forward protection, slot 0
              first, copies on the cache's copy stream, planned on the host.
    "device"  DeviceWeightProvider: planned on the GPU from CUDA ids (LRU); no host
              synchronisation, so prepare() can be captured in a CUDA graph.

The host-planned semantics read CUDA ids back to the host (one synchronisation per prepare, as
vLLM's providers do) and cannot be captured in a CUDA graph: prepare() raises RuntimeError
inside a capture.
"""

import dataclasses
import operator
import types

import torch

from . import (ExpertCache, ExpertCacheError, ExpertCacheValueError, ExplicitBytes, _C, _id_list,
               _profile_text, _score_tensor)
from ._vllm_state import StateLedger

__all__ = ["ExpertCacheProvider", "CachedWeightProvider", "RowCacheWeightProvider", "DeviceWeightProvider",
           "ExpertWeightResult", "run_with_expert_cache", "SEMANTICS"]

SEMANTICS = ("lfru", "row", "device")

_SOURCES = ("w13_weight", "w2_weight", "w13_scale", "w2_scale", "w13_scale_2", "w2_scale_2")


@dataclasses.dataclass
class ExpertWeightResult:
    """One prepare(): the slot buffers to hand the fused-MoE kernel and the two id conventions.
    A dataclass with vLLM's fields first, in vLLM's order (w1, w2, expert_map, w1_scale,
    w2_scale), then the additions.

    w1, w2, w1_scale, w2_scale, w13_scale_2, w2_scale_2: the slot buffers (None when absent).
    expert_map: int32 [E] on the cache's GPU, this call's experts -> slot, -1 for every other
    expert (forward-scoped). topk_ids: the input ids remapped to slot ids, same dtype, shape and
    device as the input (-1 for padding and for experts this call did not prepare; None when
    prepare got topk_ids None with unique_ids). hits, misses: this call's unique experts found
    resident / copied in (None for "device" and for the rounds of an expert split).
    """

    w1: torch.Tensor
    w2: torch.Tensor
    expert_map: torch.Tensor
    w1_scale: "torch.Tensor | None" = None
    w2_scale: "torch.Tensor | None" = None
    topk_ids: "torch.Tensor | None" = None
    w13_scale_2: "torch.Tensor | None" = None
    w2_scale_2: "torch.Tensor | None" = None
    hits: "int | None" = None
    misses: "int | None" = None
    generation: "int | None" = None


def _record(name, t):
    if t is None:
        return (name, False, "", 0, [])
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor or None, got {type(t).__name__}")
    return (name, True, str(t.dtype), t.element_size(), [int(x) for x in t.shape])


def _pinned(t):
    """The source in pinned host memory: a pinned, contiguous, 16-byte aligned CPU tensor is used as
    it is (aliased: keep it unchanged while the provider lives); a pageable CPU tensor is pinned once
    (one copy); a GPU tensor is copied once into a fresh pinned allocation."""
    if t.device.type == "cpu" and t.is_pinned() and t.is_contiguous() and t.data_ptr() % 16 == 0:
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t)
    return out


def _compiler_disabled(fn):
    """vLLM marks its providers' host-side methods torch.compiler.disable (they read ids back and
    branch on them); the same here, where this torch has it."""
    compiler = getattr(torch, "compiler", None)
    disable = getattr(compiler, "disable", None)
    return disable(fn) if disable is not None else fn


def _expert_key(expert_id, label):
    """The integer an expert id stands for (operator.index: ints, NumPy integers, one-element
    integer tensors), or None for an integer no expert can have (outside int64)."""
    try:
        e = operator.index(expert_id)
    except TypeError:
        raise TypeError(f"{label}: invalidate takes an integer expert id, got {type(expert_id).__name__}") from None
    return e if -2**63 <= e < 2**63 else None


def _contiguous_strides(shape):
    strides, step = [], 1
    for n in reversed(shape):
        strides.append(step)
        step *= n
    return list(reversed(strides))


class ExpertCacheProvider:
    """vLLM's provider surface over one MoE layer's experts.

    capacity: GPU slots (clamped to E, vLLM's effective capacity). w13_weight, w2_weight: [E, ...]
    in the kernel's final layout; w13_scale/w2_scale and w13_scale_2/w2_scale_2: optional
    per-expert pairs ([E, ...] each, given together). Sources may be pinned CPU tensors (aliased),
    pageable CPU tensors (pinned once) or GPU tensors (copied once into pinned memory, then the
    GPU copy may be freed). The slots live on the sources' GPU, else on the current device.

    semantics: "lfru" | "row" | "device" (module docstring). policy: another eviction policy by
    name for "lfru"/"row" (docs/any_cache.md; then not the reference semantics); "device" takes
    a device policy: "lru" (its default), "lfru" or "crf". split: "token" | "expert", used by run_with_expert_cache. max_ids: "device"
    only, the largest topk_ids.numel() of one prepare (required there). stream_slots: host
    semantics, extra slots the expert split streams wide forwards through (the cache's
    prepare_wide, scan resistant; 0: its rounds go through the pool). fill_engine, link_profile:
    "device" only, who moves the misses' bytes ("automatic" (default) | "copy_engine" | "sm_loads")
    and a stored link profile for "automatic" (expert_cache_torch.ExpertCache; docs/python.md "Fill
    engine and link profile"); `fill_engine` then reads the engine the cache runs.
    """

    semantics = "lfru"

    def __init__(self, capacity, w13_weight, w2_weight, w13_scale=None, w2_scale=None, split="token", *,
                 w13_scale_2=None, w2_scale_2=None, semantics=None, policy=None, max_ids=None, device=None,
                 label="expert_cache", stream_slots=0, fill_engine="automatic", link_profile=None):
        semantics = self.semantics if semantics is None else str(semantics)
        given = dict(zip(_SOURCES, (w13_weight, w2_weight, w13_scale, w2_scale, w13_scale_2, w2_scale_2)))
        records = [_record(name, t) for name, t in given.items()]
        try:
            capacity = operator.index(capacity)
        except TypeError:
            raise TypeError(f"capacity must be an int, got {type(capacity).__name__}") from None
        num_experts, capacity, sources = _C.validate_provider_sources(capacity, records, str(label))
        provider, policy = _C.provider_semantics(semantics, "" if policy is None else str(policy))
        link_profile = _profile_text(link_profile, str(label))
        _C.check_fill_engine(provider, str(fill_engine), link_profile, str(label))
        if split not in ("token", "expert"):
            raise ExpertCacheValueError(f"{label}: unknown split {split!r} (valid: token, expert)")
        if provider == "device":
            if max_ids is None or int(max_ids) <= 0:
                raise ExpertCacheValueError(f"{label}: semantics 'device' needs max_ids > 0 (the largest "
                                            f"topk_ids.numel() of one prepare), got {max_ids}")
        elif max_ids is not None:
            raise ExpertCacheValueError(f"{label}: max_ids is for semantics 'device' only (got semantics {semantics!r})")

        gpus = {name: t.device for name, t in given.items() if t is not None and t.device.type == "cuda"}
        others = {name: t.device for name, t in given.items() if t is not None and t.device.type not in ("cpu", "cuda")}
        if others:
            name, dev = next(iter(others.items()))
            raise ExpertCacheValueError(f"{label}: {name} is on {dev}, expected a CPU or CUDA tensor")
        if len(set(gpus.values())) > 1:
            raise ExpertCacheValueError(f"{label}: sources on several GPUs ({gpus}); expected one device")
        if device is None:
            device = next(iter(gpus.values())) if gpus else torch.device("cuda", torch.cuda.current_device())
        device = torch.device(device)
        if device.type != "cuda":
            raise ExpertCacheValueError(f"{label}: device must be a CUDA device, got {device}")

        self._host = {}      # slot name -> pinned source, as the caller's dtype and shape
        host_bytes = {}      # slot name -> [E, bytes] uint8 view of it (what the cache reads)
        layout = {}
        for name, slot_name, _dtype, nbytes, _trailing in sources:
            src = _pinned(given[name])
            self._host[slot_name] = src
            host_bytes[slot_name] = src.reshape(num_experts, -1).view(torch.uint8)
            layout[slot_name] = int(nbytes)
        with torch.cuda.device(device):
            self._cache = ExpertCache(ExplicitBytes(layout), host_tensors=host_bytes, num_experts=num_experts,
                                      capacity=capacity, top_k=1, provider=provider, policy=policy,
                                      max_ids=int(max_ids) if provider == "device" else 0, label=str(label),
                                      stream_slots=int(stream_slots), fill_engine=fill_engine,
                                      link_profile=link_profile)
        self.device = device
        self.capacity = capacity
        self.num_experts = num_experts
        self.split = split
        self.label = str(label)
        self.policy = self._cache.policy
        self.semantics = semantics
        self._device_planned = provider == "device"
        # vLLM's private state (_lru, _free_slots / _free, _clock) for the two reference
        # semantics, rebuilt from the planner's decisions (_vllm_state.py); other policies and
        # "device" (state on the GPU) have none.
        self._ledger = None
        if (semantics, self.policy) in (("lfru", "lfru"), ("row", "lru")):
            self._ledger = StateLedger(capacity, recency=semantics == "row")

        # Slot buffers of the sources' dtypes and trailing shapes, over the cache's slot arrays
        # (allocated once with the cache; they never move).
        self._buf = {}
        for name, slot_name, _dtype, _nbytes, trailing in sources:
            raw = self._cache.slot_tensors[slot_name]             # uint8 [C, bytes], slot stride from the storage
            typed = raw.view(given[name].dtype)                   # [C, elements], same slot stride
            shape = [int(raw.shape[0])] + [int(x) for x in trailing]   # capacity (+ stream slots)
            self._buf[slot_name] = typed.as_strided(shape, [typed.stride(0)] + _contiguous_strides(trailing))

    # ---- slot buffers (read-only: the cache writes them) ----
    @property
    def buf_w13(self):
        return self._buf["w13"]

    @property
    def buf_w2(self):
        return self._buf["w2"]

    @property
    def buf_w13_scale(self):
        return self._buf.get("w13_scale")

    @property
    def buf_w2_scale(self):
        return self._buf.get("w2_scale")

    @property
    def buf_w13_scale_2(self):
        return self._buf.get("w13_scale_2")

    @property
    def buf_w2_scale_2(self):
        return self._buf.get("w2_scale_2")

    @property
    def host_tensors(self):
        """{slot name: the pinned host source} (aliases of pinned inputs, else the pinned copies)."""
        return dict(self._host)

    @property
    def cache(self):
        """The underlying expert_cache_torch.ExpertCache."""
        return self._cache

    @property
    def fill_engine(self):
        """Semantics "device": the engine the cache's fills run on ("copy_engine" | "sm_loads"); None
        for the host semantics."""
        return self._cache.fill_engine

    # ---- the forward ----
    @_compiler_disabled
    def prepare(self, topk_ids, unique_ids=None, *, _checked=False):
        """Makes this call's experts resident on torch.cuda.current_stream() and returns an
        ExpertWeightResult (valid until the next prepare/invalidate; docs/python.md stream contract).

        topk_ids: int32/int64 [tokens, top_k] (any shape), CPU or CUDA ("device": CUDA only);
        negative ids are padding. unique_ids (host semantics): the experts to prepare, in this
        order (distinct, in [0, E)); default: the sorted unique ids of topk_ids. With unique_ids,
        topk_ids may be None, as vLLM does not read it then (result.topk_ids is None). More unique
        experts than capacity raises RuntimeError (serve such forwards with run_with_expert_cache).
        """
        if topk_ids is None and unique_ids is not None and not self._device_planned:
            ids = _id_list(unique_ids, "unique_ids")
            view = self._cache.prepare_unique(ids)
            self._follow_forward(ids, view)
            return self._result(view, None)
        if not isinstance(topk_ids, torch.Tensor):
            raise TypeError(f"{self.label}: topk_ids must be a torch.Tensor, got {type(topk_ids).__name__}")
        if topk_ids.dtype not in (torch.int32, torch.int64):
            raise ExpertCacheValueError(f"{self.label}: topk_ids must be int32 or int64 (got {topk_ids.dtype})")
        topk_ids = topk_ids.contiguous()
        if self._device_planned:
            if not topk_ids.is_cuda:
                raise ExpertCacheValueError(f"{self.label}: semantics 'device' takes CUDA topk_ids (the router's "
                                            f"output), got a tensor on {topk_ids.device}")
            if unique_ids is not None:
                raise ExpertCacheValueError(f"{self.label}: semantics 'device' plans topk_ids on the GPU and takes no "
                                            f"unique_ids")
            view = self._cache.prepare(topk_ids)
            emap = view.expert_map
        else:
            if torch.cuda.is_current_stream_capturing():
                raise ExpertCacheError(f"{self.label}: semantics {self.semantics!r} plans on the host and cannot be "
                                       f"captured in a CUDA graph; capture with semantics 'device' (DeviceWeightProvider)")
            if unique_ids is None:
                view = self._cache.prepare(topk_ids, name_experts=True)
            else:
                if not _checked and topk_ids.numel() > 0:
                    # The remap below gathers expert_map[topk_ids]: ids >= E are refused here.
                    top = int(topk_ids.max())
                    if top >= self.num_experts:
                        raise ExpertCacheValueError(f"{self.label}: topk_ids holds {top}, outside [0, "
                                                    f"{self.num_experts})")
                unique_ids = _id_list(unique_ids, "unique_ids")
                view = self._cache.prepare_unique(unique_ids)
            self._follow_forward(unique_ids, view)
            emap = view.expert_map if topk_ids.is_cuda else view.expert_map_host
        valid = topk_ids >= 0
        slots = emap[topk_ids.clamp(0, self.num_experts - 1).long()]
        remapped = torch.where(valid, slots, torch.full_like(slots, -1)).to(topk_ids.dtype)
        return self._result(view, remapped)

    def _result(self, view, remapped):
        return ExpertWeightResult(w1=self._buf["w13"], w2=self._buf["w2"], expert_map=view.expert_map,
                                  w1_scale=self._buf.get("w13_scale"), w2_scale=self._buf.get("w2_scale"),
                                  topk_ids=remapped, w13_scale_2=self._buf.get("w13_scale_2"),
                                  w2_scale_2=self._buf.get("w2_scale_2"), hits=view.hits, misses=view.misses,
                                  generation=view.generation)

    def _follow_forward(self, unique_ids, view):
        """Tells the ledger one accepted host plan: the experts in processing order (the given
        list, else ascending) and their slots (the forward map)."""
        if self._ledger is None:
            return
        slots = view.expert_map_host.tolist()
        order = unique_ids if unique_ids is not None else [e for e, s in enumerate(slots) if s >= 0]
        self._ledger.forward(order, slots)

    def prefetch(self, predicted_ids, max_bytes=None, expires_after=1, scores=None, min_score=0.5,
                 evict_last_forward=False):
        """Speculative fills of predicted experts (ExpertCache.prefetch): CPU ids for every
        semantics, CUDA ids planned on the GPU for "device". `scores` (None: none): one probability
        in [0, 1] per id; the ids below `min_score` are skipped, the others taken highest score
        first (CPU ids for "device"). `evict_last_forward` as ExpertCache.prefetch takes it.
        Returns the counts dict (skipped_unlikely: the ids skipped)."""
        scores = _score_tensor(scores)
        counts = self._cache.prefetch(predicted_ids, max_bytes=max_bytes, expires_after=expires_after, scores=scores,
                                      min_score=min_score, evict_last_forward=evict_last_forward)
        if self._ledger is not None and counts["issued"]:
            predicted = _id_list(predicted_ids, "predicted_ids")
            if scores is not None:
                # The fills were taken in the selection's order (HintSelector), which the ledger follows.
                predicted = _C.prefetch_order(predicted, scores, float(min_score))
            self._ledger.prefetched(predicted, self._cache.resident_map_host().tolist())
        return counts

    def invalidate(self, expert_id):
        """vLLM's invalidate: drops expert_id when it is held (its slot is the next miss's); an id
        that is not held, in [0, E) or not (negative, >= E), is a no-op. Not an integer: TypeError."""
        e = _expert_key(expert_id, self.label)
        if e is None:
            return
        self._cache._impl.invalidate_if_held(e)
        if self._ledger is not None:
            self._ledger.invalidate(e)

    @_compiler_disabled
    def plan_chunks(self, topk_ids):
        """vLLM's token split of a [tokens, top_k] forward: [(rows, unique_ids)] with rows a slice of
        topk_ids' rows and unique_ids its ascending experts, each fitting the cache; one
        (slice(0, tokens), unique) when the forward fits, [(slice(0, 0), [])] for no tokens. A token
        needing more experts than slots raises RuntimeError ("one token routes to ...")."""
        parts = self._plan(topk_ids, "token")
        if not parts:
            return [(slice(0, 0), [])]
        return [(slice(b, e), u) for b, e, u, _ in parts]

    @_compiler_disabled
    def plan_expert_groups(self, topk_ids):
        """vLLM's expert split: [unique_ids] groups of at most capacity ascending ids ([[]] when
        there are none)."""
        return [u for _, _, u, _ in self._plan(topk_ids, "expert")]

    def _plan(self, topk_ids, split):
        ids = topk_ids if topk_ids.dim() == 2 else topk_ids.reshape(-1, 1)
        host = ids.to(device="cpu", dtype=torch.int64).reshape(-1).tolist()
        return _C.plan_split(host, int(ids.shape[1]), self.capacity, self.num_experts, split)

    # ---- counters ----
    @property
    def hits(self):
        """Unique experts found resident, over all prepares ("device": synchronises the current stream)."""
        return self._cache.stats()["hits"]

    @property
    def misses(self):
        return self._cache.stats()["misses"]

    def stats(self):
        """Counts and bytes: hits, misses, promotions, evictions, invalidations, resident, capacity,
        prepare_calls, generation, last_copies, total_copies, slot_bytes, host_bytes, ... (ExpertCache.stats)."""
        return self._cache.stats()

    def check_device_errors(self):
        """"device": raises RuntimeError when a prepare since the last check had more unique experts
        than slots or ids outside [0, E) (the GPU planner reports them in an error word; reading it
        synchronises). Host semantics raise at prepare() instead; this is a no-op for them."""
        if not self._device_planned:
            return
        word = self._cache.device_errors()
        if word:
            raise ExpertCacheError(f"{self.label}: the device planner reported error word {word:#x} (ids outside "
                                   f"[0, {self.num_experts}) or more unique experts than the {self.capacity} slots)")

    @property
    def expert_map(self):
        """The last prepare's forward-scoped map (int32 [E], persistent address)."""
        return self._cache.expert_map

    @property
    def resident_map(self):
        """Every resident expert -> slot (int32 [E], persistent address)."""
        return self._cache.resident_map

    # ---- compatibility views of vLLM's private state (docs/python.md: not API) ----
    def _synced_ledger(self, name, semantics):
        if self._ledger is None or self.semantics != semantics:
            raise AttributeError(f"{type(self).__name__}.{name}: vLLM's private state exists for semantics "
                                 f"{semantics!r} with its own policy only (this provider: semantics "
                                 f"{self.semantics!r}, policy {self.policy!r})")
        self._ledger.sync(self._cache.resident_map_host().tolist())
        return self._ledger

    @property
    def _lru(self):
        """vLLM's _lru, read-only, from the live cache: "lfru" (CachedWeightProvider)
        {expert: [slot, freq, last]} in insertion order; "row" (RowCacheWeightProvider)
        {expert: slot} in LRU order."""
        if self.semantics == "row":
            return types.MappingProxyType(self._synced_ledger("_lru", "row").lru_view())
        return types.MappingProxyType(self._synced_ledger("_lru", "lfru").lfru_view())

    @property
    def _free_slots(self):
        """CachedWeightProvider._free_slots: the free slots, next one last (a copy)."""
        return self._synced_ledger("_free_slots", "lfru").free_view()

    @property
    def _free(self):
        """RowCacheWeightProvider._free: the free slots, next one last (a copy)."""
        return self._synced_ledger("_free", "row").free_view()

    @property
    def _clock(self):
        """CachedWeightProvider._clock: one tick per expert a forward or a prefetch touched."""
        return self._synced_ledger("_clock", "lfru").clock

    @property
    def _num_experts(self):
        return self.num_experts

    @property
    def _cpu_w13(self):
        """The pinned host source of w13_weight the cache copies from (vLLM's _cpu_w13)."""
        return self._host["w13"]

    @property
    def _cpu_w2(self):
        return self._host["w2"]

    @property
    def _cpu_w13_scale(self):
        return self._host.get("w13_scale")

    @property
    def _cpu_w2_scale(self):
        return self._host.get("w2_scale")

    @property
    def _cpu_w13_scale_2(self):
        return self._host.get("w13_scale_2")

    @property
    def _cpu_w2_scale_2(self):
        return self._host.get("w2_scale_2")

    @property
    def _cpu(self):
        """RowCacheWeightProvider._cpu: {w13, w2, w13_scale, w2_scale, w13_scale_2, w2_scale_2} ->
        pinned host source or None (a copy of the dict)."""
        return {name: self._host.get(name) for name in ("w13", "w2", "w13_scale", "w2_scale", "w13_scale_2",
                                                         "w2_scale_2")}

    def __repr__(self):
        return (f"{type(self).__name__}(semantics={self.semantics!r}, policy={self.policy!r}, "
                f"capacity={self.capacity}/{self.num_experts}, label={self.label!r})")


class CachedWeightProvider(ExpertCacheProvider):
    """vLLM's CachedWeightProvider: LFRU exactly (semantics "lfru")."""

    semantics = "lfru"


class RowCacheWeightProvider(ExpertCacheProvider):
    """The row provider: LRU with in-forward protection (semantics "row")."""

    semantics = "row"


class DeviceWeightProvider(ExpertCacheProvider):
    """Planned on the GPU (semantics "device"): no synchronisation, CUDA-graph capturable."""

    semantics = "device"


def run_with_expert_cache(provider, topk_ids, run, split=None):
    """vLLM's run_with_expert_cache: serves a forward of any width.

    run(result, rows, include_shared) -> Tensor [len(rows), hidden] runs the fused-MoE kernel with
    result's buffers and expert_map over the rows `rows` (a slice of topk_ids' rows);
    include_shared: whether this call also adds the forward-wide work (shared experts). A forward
    whose unique experts fit is one call; a wider one is split (split: "token" (default: the
    provider's), exact, outputs concatenated; or "expert", every row per group, partial outputs
    summed in float32)."""
    return _serve_wide_forward(provider, topk_ids, run, provider.split if split is None else split)


def _serve_wide_forward(provider, topk_ids, run, split):
    # A forward that fits: one prepare. Wider ones: the token split (planned on the host, one
    # read-back of the ids, exact), or the expert split as the library's wide forward
    # (ExpertCache.prepare_wide: rounds of disjoint experts, the next round's copies overlapping
    # this round's run; "device": prepare + prepare_group rounds on the GPU), partial outputs
    # summed in float32.
    if topk_ids.dim() != 2:
        raise ExpertCacheValueError(f"{provider.label}: run_with_expert_cache takes topk_ids [tokens, top_k], got "
                                    f"shape {list(topk_ids.shape)}")
    rows = int(topk_ids.shape[0])
    if rows == 0:
        return run(provider.prepare(topk_ids), slice(0, 0), True)
    if split == "expert":
        if provider._device_planned:
            return _serve_expert_rounds(provider, topk_ids, run, rows, topk_ids)
        # Host semantics: one read-back of the ids plans the groups. A forward that fits is one
        # prepare and one run, whose output comes back untouched (vLLM's single group); a wider one
        # goes to the rounds with the ids already on the host (no second read-back).
        if topk_ids.dtype not in (torch.int32, torch.int64):
            raise ExpertCacheValueError(f"{provider.label}: topk_ids must be int32 or int64 (got {topk_ids.dtype})")
        if torch.cuda.is_current_stream_capturing():
            raise ExpertCacheError(f"{provider.label}: semantics {provider.semantics!r} plans on the host and cannot "
                                   f"be captured in a CUDA graph")
        host = topk_ids.to(device="cpu", dtype=torch.int64)
        parts = _C.plan_split(host.reshape(-1).tolist(), int(topk_ids.shape[1]), provider.capacity,
                              provider.num_experts, "expert")
        if len(parts) == 1:
            return run(provider.prepare(topk_ids, parts[0][2], _checked=True), slice(0, rows), True)
        return _serve_expert_rounds(provider, topk_ids, run, rows, host)
    parts = provider._plan(topk_ids, split)
    if len(parts) == 1:
        unique = None if provider._device_planned else parts[0][2]
        return run(provider.prepare(topk_ids, unique, _checked=True), slice(0, rows), True)
    outs = []
    for begin, end, unique, _ in parts:
        ids = topk_ids[begin:end]
        result = provider.prepare(ids) if provider._device_planned else provider.prepare(ids, unique, _checked=True)
        outs.append(run(result, slice(begin, end), True))
    return torch.cat(outs, dim=0)


def _serve_expert_rounds(provider, topk_ids, run, rows, wide_ids):
    if topk_ids.dtype not in (torch.int32, torch.int64):
        raise ExpertCacheValueError(f"{provider.label}: topk_ids must be int32 or int64 (got {topk_ids.dtype})")
    if not provider._device_planned and torch.cuda.is_current_stream_capturing():
        raise ExpertCacheError(f"{provider.label}: semantics {provider.semantics!r} plans on the host and cannot be "
                               f"captured in a CUDA graph")
    topk_ids = topk_ids.contiguous()
    valid = topk_ids >= 0
    clamped = topk_ids.clamp(0, provider.num_experts - 1).long()
    state = {"acc": None, "dtype": None, "part": None}
    # Rounds through the pool (no stream slots) are plans like prepare()'s: the ledger follows
    # them; streamed rounds leave the pool and its policy as they were.
    follow = provider._ledger if provider._cache.stream_slots < 2 else None

    def consume(wide_round):
        if follow is not None:
            follow.forward(wide_round.experts, dict(zip(wide_round.experts, wide_round.slots)))
        # The round's expert map names its experts only: the other (token, k) pairs map to -1,
        # which the fused-MoE kernel skips, so each round adds its experts' share.
        emap = wide_round.expert_map if topk_ids.is_cuda else wide_round.expert_map.cpu()
        slots = emap[clamped]
        remapped = torch.where(valid, slots, torch.full_like(slots, -1)).to(topk_ids.dtype)
        result = ExpertWeightResult(w1=provider._buf["w13"], w2=provider._buf["w2"],
                                    w1_scale=provider._buf.get("w13_scale"), w2_scale=provider._buf.get("w2_scale"),
                                    w13_scale_2=provider._buf.get("w13_scale_2"),
                                    w2_scale_2=provider._buf.get("w2_scale_2"), expert_map=wide_round.expert_map,
                                    topk_ids=remapped, hits=None, misses=None, generation=None)
        part = run(result, slice(0, rows), wide_round.include_shared)
        if wide_round.rounds == 1:
            state["part"] = part  # one round: its output as run returned it, as vLLM's single group
            return
        state["dtype"] = part.dtype
        state["acc"] = part.float() if state["acc"] is None else state["acc"] + part.float()

    ids = wide_ids.contiguous()
    if provider._device_planned and not ids.is_cuda:
        raise ExpertCacheValueError(f"{provider.label}: semantics 'device' takes CUDA topk_ids, got a tensor on "
                                    f"{ids.device}")
    provider._cache.prepare_wide(ids, consume)
    if state["part"] is not None:
        return state["part"]
    return state["acc"].to(state["dtype"])
