// The CUDA instantiation of CacheBridge, compiled by nvcc WITHOUT torch headers: the library's
// .cuh headers (gather staging, the device planner) and torch never meet in one translation
// unit. The extension (extension.cpp, g++ + torch) only sees the non-template CudaBridge.
#include "expert_cache/any/any_cache_cuda.cuh"  // first: the CUDA staging list before make_expert_cache
#include "expert_cache/staging/link_probe.cuh"

#include "bridge.hpp"
#include "model_bridge.hpp"

#include <optional>
#include <string>

namespace expert_cache::inline v0::python {

template class CacheBridge<CudaRuntime>;
template class ModelBridge<CudaRuntime>;

namespace {

class CudaBridgeImpl final : public CudaBridge {
 public:
  static Result<std::unique_ptr<CudaBridge>> create(const BridgeConfig& config, std::span<const HostTensorArg> host) {
    std::unique_ptr<CudaBridgeImpl> self(new CudaBridgeImpl());
    auto made = CacheBridge<CudaRuntime>::create(self->rt_, config, host);
    if (!made.ok()) return made.status();
    self->bridge_ = std::move(made.value());
    return Result<std::unique_ptr<CudaBridge>>(std::unique_ptr<CudaBridge>(std::move(self)));
  }
  ~CudaBridgeImpl() override { bridge_.reset(); }  // the cache before the runtime it uses

  Result<PrepareResult> prepare_host32(std::span<const std::int32_t> ids, void* stream,
                                       bool name_experts) noexcept override {
    return bridge_->prepare(ids, static_cast<cudaStream_t>(stream), name_experts);
  }
  Result<PrepareResult> prepare_host64(std::span<const std::int64_t> ids, void* stream,
                                       bool name_experts) noexcept override {
    return bridge_->prepare(ids, static_cast<cudaStream_t>(stream), name_experts);
  }
  Result<PrepareResult> prepare_device(const std::int32_t* ids, std::int64_t n, void* stream) noexcept override {
    return bridge_->prepare_device(ids, n, static_cast<cudaStream_t>(stream));
  }
  Result<PrepareResult> prepare_unique(std::span<const std::int64_t> unique_ids, void* stream) noexcept override {
    return bridge_->prepare_unique(unique_ids, static_cast<cudaStream_t>(stream));
  }
  Result<WideSummary> prepare_wide_host64(std::span<const std::int64_t> ids, void* stream, const WideConsumerFn& consumer,
                                          std::string_view admission, std::string_view copy) noexcept override {
    return bridge_->prepare_wide(ids, static_cast<cudaStream_t>(stream), consumer, admission, copy);
  }
  Result<WideSummary> prepare_wide_device(const std::int32_t* ids, std::int64_t n, void* stream,
                                          const WideConsumerFn& consumer, std::string_view admission,
                                          std::string_view copy) noexcept override {
    return bridge_->prepare_wide_device(ids, n, static_cast<cudaStream_t>(stream), consumer, admission, copy);
  }
  Result<PrefetchView> prefetch_host(std::span<const std::int64_t> ids, std::int64_t max_bytes,
                                     std::int64_t expires_after, void* stream, const HintScores& hints) noexcept override {
    return bridge_->prefetch(ids, max_bytes, expires_after, static_cast<cudaStream_t>(stream), hints);
  }
  Result<PrefetchView> prefetch_device(const std::int32_t* ids, std::int64_t n, std::int64_t max_bytes,
                                       std::int64_t expires_after, void* stream,
                                       const HintScores& hints) noexcept override {
    return bridge_->prefetch_device(ids, n, max_bytes, expires_after, static_cast<cudaStream_t>(stream), hints);
  }
  [[nodiscard]] std::vector<std::pair<std::int32_t, std::int32_t>> last_fills() const override {
    return bridge_->last_fills();
  }
  [[nodiscard]] std::vector<std::pair<std::int32_t, std::int32_t>> last_evictions() const override {
    return bridge_->last_evictions();
  }
  [[nodiscard]] std::span<const std::int32_t> resident_map_host() const noexcept override {
    return bridge_->resident_map_host();
  }
  Status invalidate(std::int64_t expert, void* stream) noexcept override {
    return bridge_->invalidate(expert, static_cast<cudaStream_t>(stream));
  }
  [[nodiscard]] std::vector<StatEntry> stats() const override { return bridge_->stats(); }
  [[nodiscard]] std::uint32_t device_errors() noexcept override { return bridge_->device_errors(); }
  [[nodiscard]] const std::vector<SlotDescriptor>& slots() const noexcept override { return bridge_->slots(); }
  [[nodiscard]] std::uintptr_t expert_map_device() const noexcept override { return bridge_->expert_map_device(); }
  [[nodiscard]] std::uintptr_t resident_map_device() const noexcept override { return bridge_->resident_map_device(); }
  [[nodiscard]] std::span<const std::int32_t> expert_map_host() const noexcept override {
    return bridge_->expert_map_host();
  }
  [[nodiscard]] Result<std::uintptr_t> host_pointer(std::string_view name, std::int64_t expert) const override {
    return bridge_->host_pointer(name, expert);
  }
  [[nodiscard]] bool device_provider() const noexcept override { return bridge_->device_provider(); }
  [[nodiscard]] std::string fill_engine() const override {
    const std::optional<FillEngine> e = bridge_->fill_engine();
    return e ? std::string(to_string(*e)) : std::string();
  }
  [[nodiscard]] std::string provider() const override { return std::string(bridge_->provider()); }
  [[nodiscard]] std::string policy() const override { return std::string(bridge_->policy()); }
  [[nodiscard]] std::string staging() const override { return std::string(bridge_->staging()); }
  [[nodiscard]] std::string storage() const override { return std::string(bridge_->storage()); }

 private:
  CudaBridgeImpl() = default;
  CudaRuntime rt_;  // the current device, as torch set it when the cache was built
  std::unique_ptr<CacheBridge<CudaRuntime>> bridge_;
};

class CudaModelBridgeImpl final : public CudaModelBridge {
 public:
  static Result<std::unique_ptr<CudaModelBridge>> create(const ModelBridgeConfig& config,
                                                         std::span<const HostTensorArg> host) {
    std::unique_ptr<CudaModelBridgeImpl> self(new CudaModelBridgeImpl());
    auto made = ModelBridge<CudaRuntime>::create(self->rt_, config, host);
    if (!made.ok()) return made.status();
    self->bridge_ = std::move(made.value());
    return Result<std::unique_ptr<CudaModelBridge>>(std::unique_ptr<CudaModelBridge>(std::move(self)));
  }
  ~CudaModelBridgeImpl() override { bridge_.reset(); }  // the cache before the runtime it uses

  Result<PrepareResult> prepare(std::int32_t layer, std::span<const std::int64_t> ids, void* stream) noexcept override {
    return bridge_->prepare(layer, ids, static_cast<cudaStream_t>(stream));
  }
  Result<PrepareResult> prepare_unique(std::int32_t layer, std::span<const std::int64_t> ids,
                                       void* stream) noexcept override {
    return bridge_->prepare_unique(layer, ids, static_cast<cudaStream_t>(stream));
  }
  Result<WideSummary> prepare_wide(std::int32_t layer, std::span<const std::int64_t> ids, void* stream,
                                   const WideConsumerFn& consumer, std::string_view admission,
                                   std::string_view copy) noexcept override {
    return bridge_->prepare_wide(layer, ids, static_cast<cudaStream_t>(stream), consumer, admission, copy);
  }
  Status invalidate(std::int32_t layer, std::int64_t expert, void* stream) noexcept override {
    return bridge_->invalidate(layer, expert, static_cast<cudaStream_t>(stream));
  }
  Result<PrefetchView> prefetch(std::int32_t layer, std::span<const std::int64_t> predicted, std::int64_t max_bytes,
                                std::int64_t expires_after, void* stream, const HintScores& hints) noexcept override {
    return bridge_->prefetch(layer, predicted, max_bytes, expires_after, static_cast<cudaStream_t>(stream), hints);
  }
  [[nodiscard]] std::vector<std::vector<StatEntry>> stats() const override { return bridge_->stats(); }
  [[nodiscard]] const std::vector<SlotDescriptor>& slots() const noexcept override { return bridge_->slots(); }
  [[nodiscard]] const std::vector<LayerDescriptor>& layers() const noexcept override { return bridge_->layers(); }
  [[nodiscard]] Result<std::vector<std::int32_t>> forward_map_host(std::int32_t layer) const override {
    return bridge_->forward_map_host(layer);
  }
  [[nodiscard]] Result<std::uintptr_t> host_pointer(std::int32_t layer, std::size_t tensor,
                                                    std::int64_t expert) const override {
    return bridge_->host_pointer(layer, tensor, expert);
  }
  [[nodiscard]] std::string policy() const override { return std::string(bridge_->policy()); }

 private:
  CudaModelBridgeImpl() = default;
  CudaRuntime rt_;
  std::unique_ptr<ModelBridge<CudaRuntime>> bridge_;
};

}  // namespace

Result<std::unique_ptr<CudaModelBridge>> make_cuda_model_bridge(const ModelBridgeConfig& config,
                                                                std::span<const HostTensorArg> host) {
  try {
    return CudaModelBridgeImpl::create(config, host);
  } catch (const std::exception& e) {
    return Status(ErrorCode::runtime_failure, e.what());
  }
}

Result<std::unique_ptr<CudaBridge>> make_cuda_bridge(const BridgeConfig& config, std::span<const HostTensorArg> host) {
  try {
    return CudaBridgeImpl::create(config, host);
  } catch (const std::exception& e) {
    return Status(ErrorCode::runtime_failure, e.what());
  }
}

Result<LinkProfile> cuda_link_profile(std::int64_t device, std::int64_t expert_bytes) {
  if (Status s = check_link_profile_request(device, expert_bytes); !s) return s;
  LinkProfile p;
  if (Status s = link_profile_for(static_cast<int>(device), static_cast<std::uint64_t>(expert_bytes), p); !s) return s;
  return p;
}

Status cuda_set_link_profile(std::string_view text) {
  LinkProfile p;
  if (Status s = LinkProfile::parse(text, p); !s) return s.with_context("set_link_profile");
  return set_link_profile(p);
}

}  // namespace expert_cache::inline v0::python
