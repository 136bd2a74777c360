#pragma once
// The caches' log lines (one line at construction, one on a wide forward's fallback), joined by
// one non-template function: a chain of std::string temporaries at every log site costs each
// translation unit that instantiates a cache compile time for a cold, once-per-cache path.
#include "expert_cache/version.hpp"

#include <cstddef>
#include <cstdint>
#include <initializer_list>
#include <string>
#include <string_view>

namespace expert_cache::inline v0::detail {

// An integer in decimal, as std::to_string writes it (a leading '-' for negatives).
class DecimalText {
 public:
  explicit DecimalText(std::int64_t v) noexcept {
    const bool negative = v < 0;
    // Magnitude in unsigned arithmetic (INT64_MIN has no positive int64).
    write(negative ? ~static_cast<std::uint64_t>(v) + 1 : static_cast<std::uint64_t>(v));
    if (negative) text_[--begin_] = '-';
  }
  explicit DecimalText(std::uint64_t v) noexcept { write(v); }
  explicit DecimalText(std::int32_t v) noexcept : DecimalText(static_cast<std::int64_t>(v)) {}
  explicit DecimalText(std::uint32_t v) noexcept : DecimalText(static_cast<std::uint64_t>(v)) {}
  // NOLINTNEXTLINE(google-explicit-constructor): read as a part of a log line
  operator std::string_view() const noexcept { return std::string_view(text_ + begin_, sizeof text_ - begin_); }

 private:
  void write(std::uint64_t v) noexcept {
    do {
      text_[--begin_] = static_cast<char>('0' + v % 10);
      v /= 10;
    } while (v != 0);
  }
  char text_[24];
  std::size_t begin_ = sizeof text_;
};

// The parts, concatenated (one allocation).
inline std::string joined_text(std::initializer_list<std::string_view> parts) {
  std::size_t n = 0;
  for (const std::string_view p : parts) n += p.size();
  std::string out;
  out.reserve(n);
  for (const std::string_view p : parts) out.append(p);
  return out;
}

}  // namespace expert_cache::inline v0::detail
