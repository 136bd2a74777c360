#pragma once
// JSON text pieces shared by the bench programs' writers (expert-cache-bench, expert-cache-replay).
#include <cstdio>
#include <string>
#include <string_view>

namespace expert_cache::bench {

// `s` as a JSON string literal: quotes and backslashes escaped, control characters as \uXXXX.
inline std::string json_string(std::string_view s) {
  std::string out = "\"";
  for (const char ch : s) {
    const auto c = static_cast<unsigned char>(ch);
    if (c == '"' || c == '\\') {
      out.push_back('\\');
      out.push_back(ch);
    } else if (c < 0x20) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\u%04x", c);
      out += buf;
    } else {
      out.push_back(ch);
    }
  }
  return out + "\"";
}

}  // namespace expert_cache::bench
