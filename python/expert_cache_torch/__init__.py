"""expert_cache for PyTorch: a GPU expert cache over an MoE layer's host weight tensors.

    import torch, expert_cache_torch as ect
    cache = ect.ExpertCache(ect.DenseBf16(hidden=K, intermediate=N),
                            host_tensors={"w13": w13_cpu, "w2": w2_cpu},   # [E, 2N, K], [E, K, N] bf16
                            num_experts=E, capacity=C, top_k=k, provider="row")
    view = cache.prepare(topk_ids)          # on torch.cuda.current_stream()
    slots = view.expert_map[topk_ids]       # expert -> slot; view.tensors["w13"][slots] are its weights

Stream contract (docs/python.md): the tensors of a view alias the cache's slot arrays and maps. They
are valid for work enqueued on the current stream after prepare() (or on streams that wait on it)
until the next prepare()/invalidate() of this cache. The maps are persistent device buffers (stable
addresses: CUDA-graph safe). A host-planned provider ("row", "cached") given CUDA ids copies them to
the host and synchronises the current stream once per prepare(); provider "device" takes CUDA ids as
they are, never synchronises, and can be captured in torch.cuda.graph.
"""

import operator

import torch  # noqa: F401  (loads libtorch before the extension)

from . import _C

__all__ = ["DenseBf16", "Nvfp4Marlin", "ExplicitBytes", "ExpertCache", "ModelExpertCache", "ForwardView", "WideRound",
           "ExpertCacheError", "ExpertCacheValueError", "host_empty", "to_host", "link_profile", "set_link_profile"]

_PAGE = 4096

#: Raised for every error the library reports (a subclass of RuntimeError; the message is the
#: library's Status message).
ExpertCacheError = _C.ExpertCacheError
#: Raised for bad arguments (ids out of range, wrong sizes, dtypes or names): a subclass of both
#: ExpertCacheError and ValueError.
ExpertCacheValueError = _C.ExpertCacheValueError


def host_empty(shape, dtype):
    """An uninitialised CPU tensor on pages of its own. cudaHostRegister pins whole pages, and a range
    sharing a page with an already registered one can be refused; host tensors made here (or pinned
    with pin_memory()) never share one."""
    shape = torch.Size(shape)
    nbytes = shape.numel() * torch.empty((), dtype=dtype).element_size()
    padded = (nbytes + _PAGE - 1) // _PAGE * _PAGE
    raw = torch.empty(padded + _PAGE, dtype=torch.uint8)
    offset = (-raw.data_ptr()) % _PAGE
    return raw[offset:offset + nbytes].view(dtype).view(shape)


def link_profile(device=None, *, expert_bytes):
    """What the host -> GPU link of `device` (None: the current CUDA device; an index, "cuda:N" or a
    torch.device) delivers for experts of `expert_bytes` bytes (all tensors of one expert, e.g.
    cache.bytes_per_expert): measured on the first call of this process for that device and size
    (well under a second), then the same profile; provider "device" with fill_engine="automatic"
    picks its engine from it (docs/python.md "Fill engine and link profile").

    Returns a dict: device, device_name, pci_bus_id, expert_bytes, copy_engine_gbps_one,
    copy_engine_gbps_batch, copy_latency_us, sm_load_gbps, graph_fill_latency_us, measure_ms,
    sm_load_share, engine (what "automatic" picks: "copy_engine" | "sm_loads"), reason (the numbers
    that decided), text (the stored form: give it to set_link_profile or to a cache's link_profile in
    a later process) and describe (one line)."""
    return _C.link_profile(_device_index(device), _int_arg(expert_bytes, "expert_bytes"))


def set_link_profile(text):
    """Installs a stored profile (link_profile(...)["text"] of an earlier process on this machine, or
    that dict itself) for its device and expert size: later caches with fill_engine="automatic" and
    link_profile() calls use it without measuring. Raises ExpertCacheValueError, changing nothing,
    when the text does not parse or names another device (its PCI bus id differs)."""
    _C.set_link_profile(_profile_text(text, "set_link_profile"))


def _device_index(device):
    if device is None:
        return torch.cuda.current_device()
    if isinstance(device, (str, torch.device)):
        device = torch.device(device)
        if device.type != "cuda":
            raise ExpertCacheValueError(f"link_profile: device must be a CUDA device, got {device}")
        return torch.cuda.current_device() if device.index is None else device.index
    return _int_arg(device, "device")


def _int_arg(value, name):
    try:
        return operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None


def _profile_text(profile, where):
    """A stored link profile's text from a str or a link_profile() dict; "" for None."""
    if profile is None:
        return ""
    if isinstance(profile, dict) and isinstance(profile.get("text"), str):
        return profile["text"]
    if not isinstance(profile, str):
        raise TypeError(f"{where}: a link profile is its stored text (a str) or a link_profile() dict, "
                        f"got {type(profile).__name__}")
    return profile


def to_host(tensor):
    """A contiguous CPU copy of `tensor` on pages of its own (host_empty), for host_tensors."""
    out = host_empty(tensor.shape, tensor.dtype)
    out.copy_(tensor)
    return out


class DenseBf16:
    """Unquantized experts: w13 [2N, K] and w2 [K, N] bf16 per expert (K = hidden, N = intermediate)."""

    name = "dense_bf16"

    def __init__(self, hidden, intermediate):
        self.hidden = int(hidden)
        self.intermediate = int(intermediate)

    def _args(self):
        return (self.name, self.hidden, self.intermediate, 16, [])

    def __repr__(self):
        return f"DenseBf16(hidden={self.hidden}, intermediate={self.intermediate})"


class Nvfp4Marlin:
    """NVFP4 experts repacked for Marlin (docs/nvfp4_marlin.md): w13 int32 [K/16, 4Np], w2 int32
    [Np/16, 2K], w13_scale uint8 [K/16, 2Np], w2_scale uint8 [Np/16, K], w13_scale_2 / w2_scale_2
    float32 [1]; host tensors may also be uint8 byte views of the same sizes."""

    name = "nvfp4_marlin"

    def __init__(self, hidden, intermediate, group_size=16):
        self.hidden = int(hidden)
        self.intermediate = int(intermediate)
        self.group_size = int(group_size)

    def _args(self):
        return (self.name, self.hidden, self.intermediate, self.group_size, [])

    def __repr__(self):
        return f"Nvfp4Marlin(hidden={self.hidden}, intermediate={self.intermediate}, group_size={self.group_size})"


class ExplicitBytes:
    """Any per-expert tensors by byte size: {"name": bytes_per_expert, ...} (slot tensors are uint8 [C, bytes])."""

    name = "explicit"

    def __init__(self, tensors):
        if not isinstance(tensors, dict):
            raise TypeError("ExplicitBytes takes a dict {name: bytes_per_expert}")
        self.tensors = {str(k): int(v) for k, v in tensors.items()}

    def _args(self):
        return (self.name, 0, 0, 16, list(self.tensors.items()))

    def __repr__(self):
        return f"ExplicitBytes({self.tensors})"


class ForwardView:
    """One prepare()'s result. tensors / expert_map / resident_map alias cache memory (see the stream contract)."""

    __slots__ = ("tensors", "expert_map", "resident_map", "expert_map_host", "hits", "misses", "generation")

    def __init__(self, tensors, expert_map, resident_map, expert_map_host, hits, misses, generation):
        self.tensors = tensors
        self.expert_map = expert_map
        self.resident_map = resident_map
        self.expert_map_host = expert_map_host
        self.hits = hits
        self.misses = misses
        self.generation = generation

    def __repr__(self):
        return f"ForwardView(generation={self.generation}, hits={self.hits}, misses={self.misses})"


class WideRound:
    """One round of a wide forward (prepare_wide), handed to the consumer. tensors: {name: CUDA tensor
    [slot_count, ...]} over the slot arrays (the pool, then the stream slots); expert_map: int32 [E] on
    the GPU, this round's experts -> slot, -1 for every other expert. experts / slots: the round's
    experts (ascending) and their slots as Python lists (empty for provider "device", whose plan stays
    on the GPU). Valid for work the consumer enqueues on the current stream during its call."""

    __slots__ = ("index", "rounds", "streamed", "experts", "slots", "tensors", "expert_map")

    def __init__(self, index, rounds, streamed, experts, slots, tensors, expert_map):
        self.index = index
        self.rounds = rounds
        self.streamed = streamed
        self.experts = experts
        self.slots = slots
        self.tensors = tensors
        self.expert_map = expert_map

    @property
    def include_shared(self):
        """True for round 0 only: where work that is not per expert (shared experts) belongs."""
        return self.index == 0

    def __repr__(self):
        return f"WideRound({self.index + 1}/{self.rounds}, experts={len(self.experts)}, streamed={self.streamed})"


def _wide(run, consumer):
    if not callable(consumer):
        raise TypeError(f"consumer must be callable (called with one WideRound per round), got {type(consumer).__name__}")
    return run(lambda t: consumer(WideRound(*t)))


class ExpertCache:
    """A fixed pool of `capacity` GPU slots over `num_experts` experts whose weights stay in the
    caller's host tensors (registered in place at their exact size, never copied).

    host_tensors: {name: CPU tensor [E, ...]}, contiguous, 16-byte aligned, one per layout tensor;
    all pinned (tensor.pin_memory(), not registered again) or all pageable (registered). The cache
    keeps references to them. provider: "row" | "cached" | "device"; policy / staging / storage: ""
    for the provider's default (storage must be "tensor_major" with caller tensors, the default).
    max_ids: provider "device" only, the largest number of ids one prepare() takes (tokens * top_k).
    stream_slots: extra GPU slots after the pool for prepare_wide's scan-resistant streaming (0: wide
    forwards go through the pool; provider "device": through the device planner's groups); slot_tensors
    then have capacity + stream_slots rows.
    fill_engine: provider "device" only, who moves the misses' bytes: "copy_engine" (the GPU's copy
    engines, driven from the plan's fill list), "sm_loads" (the fill kernel reading mapped host
    memory) or "automatic" (default: chosen from the link profile, see link_profile()).
    link_profile: provider "device" with fill_engine "automatic" only, a stored profile (the "text"
    of link_profile(), or that dict) used instead of measuring; refused if it is for another device
    or expert size. After construction, `fill_engine` is the engine the cache runs (None for host
    providers).
    """

    def __init__(self, layout, host_tensors, num_experts, capacity, top_k=1, provider="row", policy="",
                 staging="", storage="", max_ids=0, label="expert_cache", stream_slots=0, fill_engine="automatic",
                 link_profile=None):
        if not hasattr(layout, "_args"):
            raise TypeError(f"layout must be ect.DenseBf16, ect.Nvfp4Marlin or ect.ExplicitBytes, got {type(layout).__name__}")
        if not isinstance(host_tensors, dict) or not all(isinstance(t, torch.Tensor) for t in host_tensors.values()):
            raise TypeError("host_tensors must be a dict {name: torch.Tensor}")
        name, hidden, intermediate, group_size, explicit = layout._args()
        self.layout = layout
        self._host_tensors = dict(host_tensors)  # kept alive with the cache
        self._impl = _C.Cache(name, hidden, intermediate, group_size, explicit, str(provider), str(policy),
                              str(staging), str(storage), int(num_experts), int(capacity), int(top_k), int(max_ids),
                              str(label), self._host_tensors, int(stream_slots), str(fill_engine),
                              _profile_text(link_profile, str(label)))
        self.num_experts = int(num_experts)
        self.capacity = int(capacity)
        self.top_k = int(top_k)
        self.stream_slots = int(stream_slots)
        self.label = str(label)
        self.provider = self._impl.provider
        self.policy = self._impl.policy
        self.staging = self._impl.staging
        self.storage = self._impl.storage
        #: Provider "device": the engine its fills run on ("copy_engine" | "sm_loads", "automatic"
        #: resolved); None for host providers.
        self.fill_engine = self._impl.fill_engine
        #: {name: CUDA tensor [capacity, ...]} aliasing the slot arrays, stable for the cache's life.
        self.slot_tensors = self._impl.slot_tensors()
        self._expert_map = self._impl.expert_map()
        self._resident_map = self._impl.resident_map()
        self._device = self._impl.device_provider

    def prepare(self, topk_ids, *, name_experts=False):
        """Makes the experts in topk_ids (int32/int64, CPU or CUDA, any shape; negative = padding)
        resident, on torch.cuda.current_stream(). Returns a ForwardView. name_experts: a forward with
        more unique experts than slots is refused with a message naming them (host-planned providers)."""
        if not isinstance(topk_ids, torch.Tensor):
            raise TypeError(f"topk_ids must be a torch.Tensor, got {type(topk_ids).__name__}")
        has_counts, hits, misses, generation = self._impl.prepare(topk_ids, bool(name_experts))
        host_map = None if self._device else self._impl.expert_map_host()
        return ForwardView(self.slot_tensors, self._expert_map, self._resident_map, host_map,
                           hits if has_counts else None, misses if has_counts else None, generation)

    def prepare_wide(self, topk_ids, consumer, *, admission="stream", copy="automatic"):
        """A forward of any width (a whole prompt) in rounds, on torch.cuda.current_stream():
        consumer(round) is called once per round with a WideRound and enqueues that round's work;
        the rounds' experts are disjoint and together the forward's, so accumulating every round's
        expert outputs computes the forward. Host providers: CPU or CUDA ids (CUDA ids are read back
        once); admission "stream" (default) copies missing experts into the stream slots and leaves
        the pool as it was (needs stream_slots >= 2, else it is served as "admit": through the pool);
        copy "automatic" | "runs" | "span". Provider "device": CUDA ids (at most max_ids), rounds of
        prepare + prepare_group through the pool, not overlapped. Returns the summary dict (rounds,
        unique, hits, streamed, admitted, copies, bytes, span_rounds, wasted, admission, fell_back).
        An exception in the consumer ends the forward and propagates."""
        if not isinstance(topk_ids, torch.Tensor):
            raise TypeError(f"topk_ids must be a torch.Tensor, got {type(topk_ids).__name__}")
        return _wide(lambda fn: self._impl.prepare_wide(topk_ids, fn, str(admission), str(copy)), consumer)

    def prepare_unique(self, unique_ids):
        """Host-planned providers: makes the experts of an explicit list resident, in its order
        (ids in [0, num_experts), distinct, at most capacity of them). Returns a ForwardView."""
        has_counts, hits, misses, generation = self._impl.prepare_unique(_id_list(unique_ids, "unique_ids"))
        return ForwardView(self.slot_tensors, self._expert_map, self._resident_map, self._impl.expert_map_host(),
                           hits, misses, generation)

    def prefetch(self, predicted_ids, max_bytes=None, expires_after=1, scores=None, min_score=0.5,
                 evict_last_forward=False):
        """Speculative fills of predicted experts (distinct ids in [0, num_experts), best first),
        on the current stream, within max_bytes (None: up to every slot). A prefetched expert is
        protected from eviction until `expires_after` further prepares have passed without using
        it. CPU ids: every provider. CUDA ids: provider "device" plans them on the GPU (no
        synchronisation, capturable); a host-planned provider reads them back (one synchronisation).
        `scores` (None: no scores): one probability in [0, 1] per id, the chance the next forward
        reads it (a float tensor or a sequence of numbers, read as float32); the ids scoring below
        `min_score` are skipped (counted in skipped_unlikely, not fetched), the others taken highest
        score first (docs/prefetch.md "Scored hints"). Scores need CPU ids with provider "device".
        The host-planned providers also skip ids at ranks where fewer than 8 of 10 earlier fills were used
        (counted in skipped_imprecise; docs/prefetch.md "Precision feedback").
        `evict_last_forward=True` is the caller's promise that every kernel reading the last
        prepare's experts is already enqueued (e.g. this layer's previous forward in a decode loop):
        that forward's experts may then be evicted, except the ones the list names, so a cache of
        top_k slots can look ahead.
        Returns {issued, evictions, skipped_resident, skipped_no_victim, skipped_unlikely,
        skipped_imprecise, bytes}."""
        if not isinstance(predicted_ids, torch.Tensor):
            predicted_ids = torch.tensor(_id_list(predicted_ids, "predicted_ids"), dtype=torch.int64)
        if max_bytes is None:
            max_bytes = self.capacity * self.bytes_per_expert
        return self._impl.prefetch(predicted_ids, int(max_bytes), int(expires_after), _score_tensor(scores),
                                   _real_arg(min_score, "min_score"), bool(evict_last_forward))

    def resident_map_host(self):
        """Host-planned providers: the planner's resident map (int32 [E] CPU tensor, expert -> pool
        slot, -1 absent), the state the next prepare() uploads; None for "device". Unlike
        `resident_map` (the device copy, uploaded by a prepare), it is defined before the first one."""
        return self._impl.resident_map_host()

    def last_plan(self):
        """Host-planned providers: the last prepare's misses and victims, as
        {"fills": [(expert, slot)], "evictions": [(expert, slot)]}; both empty for "device"."""
        return {"fills": self._impl.last_fills(), "evictions": self._impl.last_evictions()}

    @property
    def bytes_per_expert(self):
        """Bytes one expert occupies in its slot, all tensors together."""
        return sum(int(t[0].numel()) * t.element_size() for t in self.slot_tensors.values())

    def invalidate(self, expert_id):
        """Drops expert_id from the cache (its slot is refilled on next use), on the current stream."""
        self._impl.invalidate(int(expert_id))

    def stats(self):
        """Every CacheStats field by name (ints) plus hit_rate (float). Provider "device": synchronises
        the current stream first (its counters are written by the device)."""
        return self._impl.stats()

    def device_errors(self):
        """Provider "device": reads and clears the device error word (bad ids, overflow); synchronises."""
        return self._impl.device_errors()

    def host_pointer(self, name, expert):
        """Debug: the host address the cache reads expert `expert` of tensor `name` from."""
        return self._impl.host_pointer(str(name), int(expert))

    @property
    def expert_map(self):
        return self._expert_map

    @property
    def resident_map(self):
        return self._resident_map

    def __repr__(self):
        engine = "" if self.fill_engine is None else f", fill_engine={self.fill_engine!r}"
        return (f"ExpertCache({self.layout!r}, provider={self.provider!r}, policy={self.policy!r}, "
                f"staging={self.staging!r}{engine}, capacity={self.capacity}/{self.num_experts}, label={self.label!r})")



class ModelExpertCache:
    """One cache object for all MoE layers of a model (docs/python.md "Model-level cache"): one copy
    stream, one event set, one registration of the host tensors.

    host_tensors: {name: CPU tensor [L, E, ...]} per layout tensor (or [L*E, ...], or uint8 bytes),
    layer-major, used in place as in ExpertCache. pool: "per_layer" (every layer its own
    `capacity` slots, or layer_capacities[l], planned exactly as a separate cache of that layer)
    or "global" (one pool of `capacity` slots shared by all layers, one planner over layer*E +
    expert). policy: an eviction policy by name ("" = lru; docs/any_cache.md lists them; lrfu and
    layershare see the layer split of a global pool). Host-planned: CUDA ids are read back once
    per prepare, and prepare cannot be captured in a CUDA graph.

    Views: layer l's view is valid until the next prepare()/invalidate() of layer l (per_layer), or
    of ANY layer, prefetch() included (global: any layer's forward may evict any layer's slots).
    """

    def __init__(self, layout, host_tensors, num_layers, num_experts, capacity, top_k=1, pool="per_layer", policy="",
                 layer_capacities=None, label="model_expert_cache", stream_slots=0):
        if not hasattr(layout, "_args"):
            raise TypeError(f"layout must be ect.DenseBf16, ect.Nvfp4Marlin or ect.ExplicitBytes, got {type(layout).__name__}")
        if not isinstance(host_tensors, dict) or not all(isinstance(t, torch.Tensor) for t in host_tensors.values()):
            raise TypeError("host_tensors must be a dict {name: torch.Tensor}")
        name, hidden, intermediate, group_size, explicit = layout._args()
        self.layout = layout
        self._host_tensors = dict(host_tensors)
        caps = [int(c) for c in layer_capacities] if layer_capacities is not None else []
        self._impl = _C.ModelCache(name, hidden, intermediate, group_size, explicit, str(policy), str(pool),
                                   int(num_layers), int(num_experts), int(capacity), caps, int(top_k), str(label),
                                   self._host_tensors, int(stream_slots))
        self.stream_slots = int(stream_slots)
        self.num_layers = int(num_layers)
        self.num_experts = int(num_experts)
        self.capacity = int(capacity)
        self.top_k = int(top_k)
        self.pool = str(pool)
        self.label = str(label)
        self.policy = self._impl.policy
        #: Per layer: {name: CUDA tensor [slots of the layer's view, ...]} (global: the pool's slots).
        self.layer_tensors = [self._impl.layer_tensors(layer) for layer in range(self.num_layers)]
        self._expert_maps = [self._impl.expert_map(layer) for layer in range(self.num_layers)]
        self._resident_maps = [self._impl.resident_map(layer) for layer in range(self.num_layers)]

    def _layer(self, layer):
        layer = int(layer)
        if not 0 <= layer < self.num_layers:
            raise ExpertCacheValueError(f"{self.label}: layer {layer} out of range [0, {self.num_layers})")
        return layer

    def _view(self, layer, counts):
        hits, misses, generation = counts
        return ForwardView(self.layer_tensors[layer], self._expert_maps[layer], self._resident_maps[layer],
                           self._impl.expert_map_host(layer), hits, misses, generation)

    def prepare(self, layer, topk_ids):
        """Makes layer `layer`'s experts in topk_ids (int32/int64, CPU or CUDA, any shape; negative =
        padding) resident, on torch.cuda.current_stream(). Returns that layer's ForwardView."""
        layer = self._layer(layer)
        if not isinstance(topk_ids, torch.Tensor):
            raise TypeError(f"topk_ids must be a torch.Tensor, got {type(topk_ids).__name__}")
        return self._view(layer, self._impl.prepare(layer, topk_ids))

    def prepare_wide(self, layer, topk_ids, consumer, *, admission="stream", copy="automatic"):
        """A wide forward of layer `layer` in rounds (ExpertCache.prepare_wide; CUDA ids are read back
        once). stream_slots (constructor) are shared by all layers. Returns the summary dict."""
        layer = self._layer(layer)
        if not isinstance(topk_ids, torch.Tensor):
            raise TypeError(f"topk_ids must be a torch.Tensor, got {type(topk_ids).__name__}")
        return _wide(lambda fn: self._impl.prepare_wide(layer, topk_ids, fn, str(admission), str(copy)), consumer)

    def prepare_unique(self, layer, unique_ids):
        """An explicit unique list of layer `layer` (distinct, in [0, E)), in its order."""
        layer = self._layer(layer)
        return self._view(layer, self._impl.prepare_unique(layer, _id_list(unique_ids, "unique_ids")))

    def invalidate(self, layer, expert_id):
        """Drops layer `layer`'s expert (a no-op when absent), on the current stream."""
        self._impl.invalidate(self._layer(layer), int(expert_id))

    def prefetch(self, layer, predicted_ids, max_bytes=None, expires_after=1, scores=None, min_score=0.5,
                 evict_last_forward=False):
        """Speculative fills of layer `layer`'s predicted experts (distinct ids in [0, num_experts), best
        first), as ExpertCache.prefetch: the engine's lookahead, e.g. layer L+1's hints while layer L
        computes. On the current stream; max_bytes (None: up to the layer's slots, the pool's in
        global mode) bounds the bytes copied. Never evicts an expert of the layer's latest forward
        (global: of the pool's latest forward), an unused, unexpired speculative fill or an expert the
        list names; the next
        prepare of the layer that uses a fill waits for exactly that fill. CUDA ids are read back
        (one synchronisation); not capturable. scores / min_score select the hints as in
        ExpertCache.prefetch (docs/prefetch.md "Scored hints"). Global pool: like a prepare, a
        prefetch ends every layer's view. `evict_last_forward=True` (per-layer pools only) promises
        that every kernel reading the layer's latest forward is already enqueued: its experts may
        then be evicted, as ExpertCache.prefetch says. Returns {issued, evictions, skipped_resident,
        skipped_no_victim, skipped_unlikely, skipped_imprecise, bytes}."""
        layer = self._layer(layer)
        if not isinstance(predicted_ids, torch.Tensor):
            predicted_ids = torch.tensor(_id_list(predicted_ids, "predicted_ids"), dtype=torch.int64)
        if max_bytes is None:
            max_bytes = 1 << 62  # the cache caps the fills at the layer's (or the pool's) slots
        return self._impl.prefetch(layer, predicted_ids, int(max_bytes), int(expires_after), _score_tensor(scores),
                                   _real_arg(min_score, "min_score"), bool(evict_last_forward))

    def stats(self):
        """{"total": {...}, "per_layer": [{...} per layer]}: hits, misses, promotions, evictions,
        invalidations, resident, capacity, prepare_calls, generation, last_copies, total_copies,
        owner_changes, map_uploads, staging_stalls, faults, slot_bytes, host_bytes, hit_rate."""
        return self._impl.stats()

    def expert_map(self, layer):
        return self._expert_maps[self._layer(layer)]

    def resident_map(self, layer):
        return self._resident_maps[self._layer(layer)]

    def host_pointer(self, layer, name, expert):
        """Debug: the host address the cache reads layer `layer`'s expert `expert` of tensor `name` from."""
        return self._impl.host_pointer(self._layer(layer), str(name), int(expert))

    def __repr__(self):
        return (f"ModelExpertCache({self.layout!r}, pool={self.pool!r}, policy={self.policy!r}, "
                f"layers={self.num_layers}, capacity={self.capacity}, experts={self.num_experts}, label={self.label!r})")

def _score_tensor(scores):
    """Prefetch scores as the extension takes them: None, a tensor as given (its dtype and device are
    checked there) or a float32 tensor of a sequence of numbers."""
    if scores is None or isinstance(scores, torch.Tensor):
        return scores
    what = f"scores must be a tensor or a sequence of numbers (got {type(scores).__name__})"
    if isinstance(scores, (str, bytes)):
        raise ExpertCacheValueError(what)
    try:
        items = list(scores)
    except TypeError:
        raise ExpertCacheValueError(what) from None
    values = []
    for i, x in enumerate(items):
        try:
            if isinstance(x, (str, bytes)):
                raise TypeError
            values.append(float(x))
        except (TypeError, ValueError):
            raise ExpertCacheValueError(f"scores[{i}] is not a number (got {type(x).__name__})") from None
    return torch.tensor(values, dtype=torch.float32)


def _real_arg(value, name):
    """A float from a real number (an int, float or numpy/torch scalar); TypeError otherwise."""
    if isinstance(value, (str, bytes, bool)) or value is None:
        raise TypeError(f"{name} must be a number, got {type(value).__name__}")
    try:
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a number, got {type(value).__name__}") from None


def _id_list(ids, name):
    """A list of Python ints from a tensor (read back if on a GPU), a list or a tuple."""
    if isinstance(ids, torch.Tensor):
        if ids.dtype not in (torch.int32, torch.int64):
            raise ExpertCacheValueError(f"{name} must be int32 or int64 (got {ids.dtype})")
        return [int(x) for x in ids.reshape(-1).tolist()]
    try:
        return [int(x) for x in ids]
    except (TypeError, ValueError):
        raise ExpertCacheValueError(f"{name} must be a tensor or a sequence of ints (got {type(ids).__name__})") from None
