#pragma once
/// Errors of the tools (trace reader/writer, generator, replay CLI).
// Tools are not hot paths, so their messages are std::strings of any length (a file path plus
// a quoted token), and their codes (a malformed file, an unreadable file) are not the cache's.
// A library Status converts implicitly, keeping its code. Host-only.
#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

#include "expert_cache/base/status.hpp"

namespace expert_cache::inline v0 {

enum class ToolErrorCode : std::uint8_t {
  ok = 0,
  parse_error,       // trace text malformed
  io_error,          // a file or stream could not be read or written
  invalid_argument,  // a tool option or spec is malformed
  library,           // the library reported an error (library_code() says which)
};

[[nodiscard]] constexpr std::string_view to_string(ToolErrorCode code) noexcept {
  switch (code) {
    case ToolErrorCode::ok: return "ok";
    case ToolErrorCode::parse_error: return "parse_error";
    case ToolErrorCode::io_error: return "io_error";
    case ToolErrorCode::invalid_argument: return "invalid_argument";
    case ToolErrorCode::library: return "library";
  }
  return "unknown";
}

class [[nodiscard]] ToolStatus {
 public:
  ToolStatus() = default;
  ToolStatus(ToolErrorCode code, std::string message) : code_(code), message_(std::move(message)) {}
  ToolStatus(const Status& s)  // NOLINT: implicit, so library results flow through tools unchanged
      : code_(s.ok() ? ToolErrorCode::ok : ToolErrorCode::library), library_code_(s.code()), message_(s.message()) {}

  [[nodiscard]] static ToolStatus unexpected_ok() {
    return ToolStatus(Status(ErrorCode::internal, "Result constructed from an ok status without a value"));
  }

  [[nodiscard]] bool ok() const noexcept { return code_ == ToolErrorCode::ok; }
  explicit operator bool() const noexcept { return ok(); }
  [[nodiscard]] ToolErrorCode code() const noexcept { return code_; }
  // The library's code when code() == library, ErrorCode::ok otherwise.
  [[nodiscard]] ErrorCode library_code() const noexcept { return library_code_; }
  [[nodiscard]] const std::string& message() const noexcept { return message_; }
  [[nodiscard]] std::string to_string() const {
    if (ok()) return "ok";
    const std::string_view name =
        code_ == ToolErrorCode::library ? expert_cache::to_string(library_code_) : expert_cache::to_string(code_);
    return std::string(name) + ": " + message_;
  }
  // The same error with "<prefix>: " in front of the message.
  [[nodiscard]] ToolStatus with_prefix(std::string_view prefix) const {
    ToolStatus s = *this;
    s.message_ = std::string(prefix) + ": " + message_;
    return s;
  }

 private:
  ToolErrorCode code_ = ToolErrorCode::ok;
  ErrorCode library_code_ = ErrorCode::ok;
  std::string message_;
};

class ToolError : public std::runtime_error {
 public:
  explicit ToolError(const ToolStatus& s) : std::runtime_error(s.to_string()), code_(s.code()) {}
  [[nodiscard]] ToolErrorCode code() const noexcept { return code_; }

 private:
  ToolErrorCode code_;
};

[[noreturn]] inline void throw_error(const ToolStatus& s) { throw ToolError(s); }

template <class T>
using ToolResult = Result<T, ToolStatus>;

}  // namespace expert_cache::inline v0
