#pragma once
/// Error model: hot paths return Status / Result<T>; constructors throw Error.
// Every failure carries a specific ErrorCode and a human-readable message. A Status never
// allocates: the message lives in a fixed buffer inside it (formatted with snprintf, truncated
// with "..." if longer), so rejecting a forward inside a noexcept planning path costs no heap.
#include "expert_cache/base/version.hpp"
#include <algorithm>
#include <cstdarg>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <initializer_list>
#include <memory>
#include <new>
#include <stdexcept>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>

namespace expert_cache::inline v0 {

/// What failed; every Status and Error carries one.
enum class ErrorCode : std::uint8_t {
  ok = 0,
  invalid_argument,        // generic malformed argument (null pointer, bad size...)
  invalid_capacity,        // capacity 0, > num_experts, or < top_k at construction
  expert_out_of_range,     // id outside [0, num_experts)
  duplicate_expert,        // the same id twice in an explicit unique list
  too_many_experts,        // a forward's unique set is larger than the capacity
  row_exceeds_capacity,    // token split: one row alone needs more slots than exist
  runtime_failure,         // the runtime (CUDA or simulated) reported a failed operation
  capture_unsupported,     // an operation that is silently dropped under stream capture was requested
  not_supported,           // the combination of policies cannot do this
  internal,                // broken invariant: a bug in the library
};

/// The enumerator's name, e.g. "invalid_argument".
[[nodiscard]] constexpr std::string_view to_string(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::ok: return "ok";
    case ErrorCode::invalid_argument: return "invalid_argument";
    case ErrorCode::invalid_capacity: return "invalid_capacity";
    case ErrorCode::expert_out_of_range: return "expert_out_of_range";
    case ErrorCode::duplicate_expert: return "duplicate_expert";
    case ErrorCode::too_many_experts: return "too_many_experts";
    case ErrorCode::row_exceeds_capacity: return "row_exceeds_capacity";
    case ErrorCode::runtime_failure: return "runtime_failure";
    case ErrorCode::capture_unsupported: return "capture_unsupported";
    case ErrorCode::not_supported: return "not_supported";
    case ErrorCode::internal: return "internal";
  }
  return "unknown";
}

#if defined(__GNUC__)
#define EXPERT_CACHE_PRINTF_FORMAT(fmt, args) __attribute__((format(printf, fmt, args)))
#else
#define EXPERT_CACHE_PRINTF_FORMAT(fmt, args)
#endif

/// A status is ok or an error code with a message. Trivially copyable; never allocates.
/// `if (!s) return s.with_context("what failed");` is the usual way to pass one up.
class [[nodiscard]] Status {
 public:
  /// Longest message kept; longer ones end in "...".
  static constexpr std::size_t message_capacity = 246;

  /// The ok status.
  Status() noexcept = default;
  /// An error (code != ok) with its message (copied, truncated to message_capacity).
  Status(ErrorCode code, std::string_view message) noexcept : code_(code) { assign(message); }

  /// printf-style construction into the inline buffer: the allocation-free way to build a
  /// message with numbers in it.
  [[nodiscard]] static Status format(ErrorCode code, const char* fmt, ...) noexcept EXPERT_CACHE_PRINTF_FORMAT(2, 3) {
    std::va_list args;
    va_start(args, fmt);
    Status s = vformatted(code, fmt, args);
    va_end(args);
    return s;
  }

  /// The same error with "<context>: " in front of its message (e.g. which call failed); an ok
  /// status stays ok.
  [[nodiscard]] Status with_context(const char* fmt, ...) const noexcept EXPERT_CACHE_PRINTF_FORMAT(2, 3) {
    if (ok()) return *this;
    std::va_list args;
    va_start(args, fmt);
    Status s = vformatted(code_, fmt, args);
    va_end(args);
    s.append(": ");
    s.append(message());
    return s;
  }

  /// The error that replaces an ok Status given to Result without a value.
  [[nodiscard]] static Status unexpected_ok() noexcept {
    return Status(ErrorCode::internal, "Result constructed from an ok Status without a value");
  }

  /// True for the ok status.
  [[nodiscard]] bool ok() const noexcept { return code_ == ErrorCode::ok; }
  /// Same as ok().
  explicit operator bool() const noexcept { return ok(); }
  /// ErrorCode::ok or the specific error.
  [[nodiscard]] ErrorCode code() const noexcept { return code_; }
  /// The message (empty when ok); a view into this Status, valid while it lives.
  [[nodiscard]] std::string_view message() const noexcept { return std::string_view(text_, length_); }
  /// "ok" or "<code>: <message>" (allocates: for logs, not hot paths).
  [[nodiscard]] std::string to_string() const {
    return ok() ? std::string("ok")
                : std::string(expert_cache::to_string(code_)) + ": " + std::string(message());
  }

 private:
  // The body of format() and with_context().
  static Status vformatted(ErrorCode code, const char* fmt, std::va_list args) noexcept {
    Status s;
    s.code_ = code;
    s.vformat_into(0, fmt, args);
    return s;
  }
  void assign(std::string_view m) noexcept {
    length_ = 0;
    append(m);
  }
  void append(std::string_view m) noexcept {
    const std::size_t room = message_capacity - length_;
    if (m.size() <= room) {
      std::memcpy(text_ + length_, m.data(), m.size());
      length_ = static_cast<std::uint8_t>(length_ + m.size());
      return;
    }
    std::memcpy(text_ + length_, m.data(), room);
    length_ = static_cast<std::uint8_t>(message_capacity);
    mark_truncated();
  }
  void vformat_into(std::size_t at, const char* fmt, std::va_list args) noexcept {
    char buf[message_capacity + 1];
    const int n = std::vsnprintf(buf, sizeof buf, fmt, args);
    length_ = static_cast<std::uint8_t>(at);
    if (n < 0) return append("(message formatting failed)");
    append(std::string_view(buf, std::min<std::size_t>(static_cast<std::size_t>(n), message_capacity)));
    if (static_cast<std::size_t>(n) > message_capacity) mark_truncated();
  }
  void mark_truncated() noexcept { std::memcpy(text_ + message_capacity - 3, "...", 3); }

  ErrorCode code_ = ErrorCode::ok;
  std::uint8_t length_ = 0;
  char text_[message_capacity];  // only the first length_ bytes are meaningful
};
static_assert(Status::message_capacity <= 255, "length_ is one byte");

namespace detail {

// Decimal text of an integer, held inline (trivially destructible, no allocation): a piece of
// join() where a message would append std::to_string(value).
class DecimalText {
 public:
  template <class T>
    requires(std::is_integral_v<T> && !std::is_same_v<T, bool>)
  DecimalText(T value) noexcept {  // NOLINT: implicit, a piece of a join() list
    bool negative = false;
    if constexpr (std::is_signed_v<T>) negative = value < 0;
    // The magnitude as unsigned (two's complement negation also holds the lowest value).
    const auto bits = static_cast<unsigned long long>(value);
    begin_ = spell(text_, negative ? 0ULL - bits : bits, negative);
  }
  operator std::string_view() const noexcept {  // NOLINT: implicit, a piece of a join() list
    return std::string_view(text_ + begin_, sizeof text_ - begin_);
  }

 private:
  // The digits (and sign) right-aligned in `text`; returns where they start. Out of line: one
  // copy for every message.
  [[gnu::cold, gnu::noinline]] static std::size_t spell(char (&text)[24], unsigned long long v,
                                                       bool negative) noexcept {
    std::size_t at = sizeof text;
    do {
      text[--at] = static_cast<char>('0' + v % 10);
      v /= 10;
    } while (v != 0);
    if (negative) text[--at] = '-';
    return at;
  }

  char text_[24];
  std::size_t begin_ = 0;
};

// The pieces as one string. Messages of cold paths (log lines, construction errors) are built
// with one call of it instead of a chain of std::string temporaries, whose inlined code (and
// its exception cleanups) every caller would otherwise compile.
[[nodiscard, gnu::cold, gnu::noinline]] inline std::string join(std::initializer_list<std::string_view> pieces) {
  std::size_t size = 0;
  for (const std::string_view p : pieces) size += p.size();
  std::string out;
  out.reserve(size);
  for (const std::string_view p : pieces) out.append(p);
  return out;
}

}  // namespace detail

/// Exception thrown by constructors (and by Result::value() on error).
class Error : public std::runtime_error {
 public:
  /// @param status  a failed status: its code and message
  explicit Error(const Status& status)
      : std::runtime_error(status.to_string()), code_(status.code()) {}
  /// @param code     what failed
  /// @param message  the message; what() is "<code>: <message>", never truncated
  Error(ErrorCode code, std::string_view message) : std::runtime_error(full_message(code, message)), code_(code) {}
  /// What failed.
  [[nodiscard]] ErrorCode code() const noexcept { return code_; }

 private:
  // Constructors are cold: their message is not truncated to a Status buffer.
  static std::string full_message(ErrorCode code, std::string_view message) {
    return std::string(expert_cache::to_string(code)) + ": " + std::string(message);
  }
  ErrorCode code_;
};

/// Throws Error(status) when `status` is not ok.
inline void throw_if_error(const Status& status) {
  if (!status.ok()) throw Error(status);
}

[[noreturn]] inline void throw_error(const Status& status) { throw Error(status); }

/// A value or a failed error status (a small stand-in for C++23 std::expected). `E` is Status
/// for the library; the tools use their own status type (tools/tool_status.hpp). E provides
/// ok(), a static `unexpected_ok()` (the error that replaces an ok E given without a value),
/// and a `throw_error(const E&)` found by argument-dependent lookup, and its move constructor
/// does not throw.
///
/// The value or the error lives in a union with a flag, not a std::variant: every Result type a
/// translation unit names would otherwise instantiate the variant's machinery (its converting
/// constructor's overload set, visitation, get), and a run-time-selected cache names a dozen.
/// The error is taken by reference, so an error return copies its Status once, inside the cold
/// constructor, not at every call site.
template <class T, class E = Status>
class [[nodiscard]] Result {
 public:
  /// A value (implicit, so `return value;` works).
  Result(T value) : ok_(true) { ::new (static_cast<void*>(std::addressof(value_))) T(std::move(value)); }  // NOLINT
  /// An error (implicit, so `return status;` works); an ok status becomes unexpected_ok().
  /// Cold: every error return builds one, so it stays out of the callers' hot code.
  [[gnu::cold]] Result(const E& error) : ok_(false) {  // NOLINT: implicit by design
    if (error.ok()) {
      ::new (static_cast<void*>(std::addressof(error_))) E(E::unexpected_ok());
    } else {
      ::new (static_cast<void*>(std::addressof(error_))) E(error);
    }
  }
  /// As above, moving an error that is not trivially copyable (a tool status's message).
  [[gnu::cold]] Result(E&& error)  // NOLINT: implicit by design
    requires(!std::is_trivially_copyable_v<E>)
      : ok_(false) {
    if (error.ok()) {
      ::new (static_cast<void*>(std::addressof(error_))) E(E::unexpected_ok());
    } else {
      ::new (static_cast<void*>(std::addressof(error_))) E(std::move(error));
    }
  }
  Result(const Result& o)
    requires std::is_copy_constructible_v<T>
      : ok_(o.ok_) {
    if (ok_) {
      ::new (static_cast<void*>(std::addressof(value_))) T(o.value_);
    } else {
      ::new (static_cast<void*>(std::addressof(error_))) E(o.error_);
    }
  }
  Result(Result&& o) noexcept(std::is_nothrow_move_constructible_v<T>) : ok_(o.ok_) {
    if (ok_) {
      ::new (static_cast<void*>(std::addressof(value_))) T(std::move(o.value_));
    } else {
      ::new (static_cast<void*>(std::addressof(error_))) E(std::move(o.error_));
    }
  }
  Result& operator=(const Result& o)
    requires(std::is_copy_constructible_v<T> && std::is_copy_assignable_v<T>)
  {
    if (this != &o) assign(o);
    return *this;
  }
  Result& operator=(Result&& o) noexcept(std::is_nothrow_move_constructible_v<T> &&
                                         std::is_nothrow_move_assignable_v<T>) {
    if (this != &o) assign(std::move(o));
    return *this;
  }
  ~Result() { destroy(); }

  /// True when a value is held.
  [[nodiscard]] bool ok() const noexcept { return ok_; }
  /// Same as ok().
  explicit operator bool() const noexcept { return ok(); }
  /// The error, or an ok E when a value is held. Out of line: callers read it on their error
  /// paths (and g++ would otherwise fold the copies of same-layout Results into one and warn
  /// about the folded copy, -Warray-bounds).
  [[nodiscard, gnu::cold, gnu::noinline]] E status() const { return ok() ? E() : error_; }
  /// The value; throws (Error for Status) when there is none.
  [[nodiscard]] T& value() & {
    if (!ok()) throw_error(error_);
    return value_;
  }
  [[nodiscard]] const T& value() const& {
    if (!ok()) throw_error(error_);
    return value_;
  }
  [[nodiscard]] T&& value() && {
    if (!ok()) throw_error(error_);
    return std::move(value_);
  }
  T* operator->() { return &value(); }
  T& operator*() { return value(); }

 private:
  void destroy() noexcept {
    if (ok_) {
      value_.~T();
    } else {
      error_.~E();
    }
  }
  // Assignment from another Result (`o`: const Result& or Result&&). Between a value and an
  // error the new alternative is built before the old one goes (strong guarantee; E's move
  // does not throw).
  template <class R>
  void assign(R&& o) {
    if (ok_ && o.ok_) {
      value_ = std::forward<R>(o).value_;
    } else if (!ok_ && !o.ok_) {
      error_ = std::forward<R>(o).error_;
    } else if (o.ok_) {
      E saved(std::move(error_));
      error_.~E();
      try {
        ::new (static_cast<void*>(std::addressof(value_))) T(std::forward<R>(o).value_);
      } catch (...) {
        ::new (static_cast<void*>(std::addressof(error_))) E(std::move(saved));
        throw;
      }
      ok_ = true;
    } else {
      E error(std::forward<R>(o).error_);
      value_.~T();
      ::new (static_cast<void*>(std::addressof(error_))) E(std::move(error));
      ok_ = false;
    }
  }

  union {
    T value_;
    E error_;
  };
  bool ok_;
};

}  // namespace expert_cache::inline v0
