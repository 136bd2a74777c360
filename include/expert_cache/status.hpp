#pragma once
// Error model: hot paths return Status / Result<T>; constructors throw Error.
// Every failure carries a specific ErrorCode and a human-readable message.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <variant>

namespace expert_cache {

enum class ErrorCode : std::uint8_t {
  ok = 0,
  invalid_argument,        // generic malformed argument (null pointer, bad size...)
  invalid_capacity,        // capacity 0, > num_experts, or < top_k at construction
  expert_out_of_range,     // id outside [0, num_experts)
  duplicate_expert,        // the same id twice in an explicit unique list
  too_many_experts,        // a forward's unique set is larger than the capacity
  row_exceeds_capacity,    // token split: one row alone needs more slots than exist
  parse_error,             // trace text malformed
  io_error,                // file could not be read
  runtime_failure,         // the runtime (CUDA or simulated) reported a failed operation
  capture_unsupported,     // an operation that is silently dropped under stream capture was requested
  not_supported,           // the combination of policies cannot do this
  internal,                // broken invariant: a bug in the library
};

[[nodiscard]] constexpr std::string_view to_string(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::ok: return "ok";
    case ErrorCode::invalid_argument: return "invalid_argument";
    case ErrorCode::invalid_capacity: return "invalid_capacity";
    case ErrorCode::expert_out_of_range: return "expert_out_of_range";
    case ErrorCode::duplicate_expert: return "duplicate_expert";
    case ErrorCode::too_many_experts: return "too_many_experts";
    case ErrorCode::row_exceeds_capacity: return "row_exceeds_capacity";
    case ErrorCode::parse_error: return "parse_error";
    case ErrorCode::io_error: return "io_error";
    case ErrorCode::runtime_failure: return "runtime_failure";
    case ErrorCode::capture_unsupported: return "capture_unsupported";
    case ErrorCode::not_supported: return "not_supported";
    case ErrorCode::internal: return "internal";
  }
  return "unknown";
}

// A status is ok (no allocation) or an error code with a message.
class [[nodiscard]] Status {
 public:
  Status() noexcept = default;
  Status(ErrorCode code, std::string message) : code_(code), message_(std::move(message)) {}

  [[nodiscard]] bool ok() const noexcept { return code_ == ErrorCode::ok; }
  explicit operator bool() const noexcept { return ok(); }
  [[nodiscard]] ErrorCode code() const noexcept { return code_; }
  [[nodiscard]] const std::string& message() const noexcept { return message_; }
  [[nodiscard]] std::string to_string() const {
    return ok() ? std::string("ok")
                : std::string(expert_cache::to_string(code_)) + ": " + message_;
  }

 private:
  ErrorCode code_ = ErrorCode::ok;
  std::string message_;
};

// Exception thrown by constructors (and by Result::value() on error).
class Error : public std::runtime_error {
 public:
  explicit Error(const Status& status)
      : std::runtime_error(status.to_string()), code_(status.code()) {}
  Error(ErrorCode code, const std::string& message) : Error(Status(code, message)) {}
  [[nodiscard]] ErrorCode code() const noexcept { return code_; }

 private:
  ErrorCode code_;
};

inline void throw_if_error(const Status& status) {
  if (!status.ok()) throw Error(status);
}

// A value or a failed Status (a small stand-in for C++23 std::expected).
template <class T>
class [[nodiscard]] Result {
 public:
  Result(T value) : storage_(std::move(value)) {}  // NOLINT: implicit by design
  Result(Status error) : storage_(std::move(error)) {  // NOLINT
    if (std::get<Status>(storage_).ok())
      storage_ = Status(ErrorCode::internal, "Result constructed from an ok Status without a value");
  }

  [[nodiscard]] bool ok() const noexcept { return std::holds_alternative<T>(storage_); }
  explicit operator bool() const noexcept { return ok(); }
  [[nodiscard]] Status status() const { return ok() ? Status() : std::get<Status>(storage_); }
  [[nodiscard]] T& value() & {
    if (!ok()) throw Error(std::get<Status>(storage_));
    return std::get<T>(storage_);
  }
  [[nodiscard]] const T& value() const& {
    if (!ok()) throw Error(std::get<Status>(storage_));
    return std::get<T>(storage_);
  }
  [[nodiscard]] T&& value() && {
    if (!ok()) throw Error(std::get<Status>(storage_));
    return std::get<T>(std::move(storage_));
  }
  T* operator->() { return &value(); }
  T& operator*() { return value(); }

 private:
  std::variant<T, Status> storage_;
};

}  // namespace expert_cache
