#pragma once
/// Routing traces, format v1 (docs/trace_format.md): parse and write.
// Host-only.
// The parser never throws on malformed input: every problem comes back as a parse_error
// naming the 1-based line. Untrusted sizes are bounded so one bad number cannot make
// anything allocate a huge array.
#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <fstream>
#include <istream>
#include <new>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

#include "expert_cache/base/status.hpp"
#include "expert_cache/tools/tool_status.hpp"

namespace expert_cache::inline v0 {

// Largest step or layer number a trace may use.
inline constexpr std::int64_t trace_max_step = 2147483647;
inline constexpr std::int64_t trace_max_layer = 2147483647;
// Expert ids must be below this (and below num_experts when given): caches allocate
// arrays of num_experts entries, so an unchecked id would be an allocation request.
inline constexpr std::int32_t trace_max_experts = std::int32_t{1} << 24;

struct ParseOptions {
  // When given, ids must be in [0, num_experts); otherwise num_experts = max id + 1.
  std::optional<std::int32_t> num_experts;
};

// One forward: the union of all records of one (step, layer), unique ids ascending.
struct TraceForward {
  std::int32_t step = 0;
  std::int32_t layer = 0;
  std::uint64_t line = 0;     // 1-based line of the forward's first record; 0 if generated
  std::uint32_t records = 0;  // records merged into this forward
  std::uint64_t begin = 0;    // [begin, end) into Trace::ids
  std::uint64_t end = 0;
  [[nodiscard]] std::size_t size() const noexcept { return static_cast<std::size_t>(end - begin); }
};

struct Trace {
  std::vector<TraceForward> forwards;  // in order of first appearance
  std::vector<std::int32_t> ids;       // all forwards' unique ids, concatenated
  std::int32_t num_experts = 0;        // given, or max id + 1 (0 for an empty trace)
  std::uint64_t records = 0;           // non-blank, non-comment lines

  [[nodiscard]] std::span<const std::int32_t> experts(const TraceForward& f) const noexcept {
    return std::span<const std::int32_t>(ids).subspan(static_cast<std::size_t>(f.begin), f.size());
  }
  [[nodiscard]] std::span<const std::int32_t> experts(std::size_t forward) const noexcept {
    return experts(forwards[forward]);
  }
  // Distinct layer numbers, ascending.
  [[nodiscard]] std::vector<std::int32_t> layers() const {
    std::vector<std::int32_t> out;
    out.reserve(forwards.size());
    for (const TraceForward& f : forwards) out.push_back(f.layer);
    std::sort(out.begin(), out.end());
    out.erase(std::unique(out.begin(), out.end()), out.end());
    return out;
  }
};

namespace detail {

constexpr bool is_trace_space(char c) noexcept {
  return c == ' ' || c == '\t' || c == '\r' || c == '\v' || c == '\f';
}

// Quote a token for an error message, shortened so a megabyte of junk stays readable.
inline std::string quote_token(std::string_view token) {
  std::string out = "'";
  const std::size_t shown = std::min<std::size_t>(token.size(), 32);
  for (std::size_t i = 0; i < shown; ++i) {
    const auto c = static_cast<unsigned char>(token[i]);
    if (c >= 0x20 && c < 0x7f) {
      out.push_back(static_cast<char>(c));
    } else {
      static constexpr char hex[] = "0123456789abcdef";
      out += "\\x";
      out.push_back(hex[c >> 4]);
      out.push_back(hex[c & 15]);
    }
  }
  if (shown < token.size()) out += "...";
  out += "'";
  return out;
}

enum class IntParse : std::uint8_t { ok, not_integer, negative, too_large };

// Strict decimal: an optional '-', then digits only. `limit` bounds the magnitude; a
// negative value reports `negative` (after checking that it is a well-formed integer).
inline IntParse parse_trace_int(std::string_view token, std::int64_t limit, std::int64_t& out) noexcept {
  bool negative = false;
  std::size_t i = 0;
  if (!token.empty() && token[0] == '-') {
    negative = true;
    i = 1;
  }
  if (i == token.size()) return IntParse::not_integer;
  std::int64_t value = 0;
  bool overflow = false;
  for (; i < token.size(); ++i) {
    const char c = token[i];
    if (c < '0' || c > '9') return IntParse::not_integer;
    if (!overflow) {
      value = value * 10 + (c - '0');
      if (value > limit) overflow = true;  // keep scanning: "99999x" is not_integer
    }
  }
  if (negative && (value != 0 || overflow)) return IntParse::negative;
  if (overflow) return IntParse::too_large;
  out = value;
  return IntParse::ok;
}

inline ToolStatus trace_error(std::uint64_t line, const std::string& what) {
  return ToolStatus(ToolErrorCode::parse_error, "line " + std::to_string(line) + ": " + what);
}

inline std::uint64_t forward_key(std::int32_t step, std::int32_t layer) noexcept {
  return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(step)) << 32) |
         static_cast<std::uint32_t>(layer);
}

}  // namespace detail

// Parse trace text held in memory. Never throws except std::bad_alloc for a genuinely
// huge (well-formed) input, which is converted to an error too.
[[nodiscard]] inline ToolResult<Trace> parse_trace_text(std::string_view text, const ParseOptions& options = {}) noexcept {
  try {
    std::int64_t id_limit = trace_max_experts - 1;
    if (options.num_experts) {
      if (*options.num_experts < 1 || *options.num_experts > trace_max_experts) {
        return ToolStatus(ToolErrorCode::invalid_argument,
                      "num_experts must be in [1, " + std::to_string(trace_max_experts) + "], got " +
                          std::to_string(*options.num_experts));
      }
      id_limit = *options.num_experts - 1;
    }

    Trace trace;
    // Key (step, layer) -> index of its forward; detects a forward resumed after another.
    std::unordered_map<std::uint64_t, std::uint32_t> seen;
    std::int32_t max_id = -1;
    bool open = false;  // trace.forwards.back() is still accepting records

    auto close_forward = [&] {
      TraceForward& f = trace.forwards.back();
      auto first = trace.ids.begin() + static_cast<std::ptrdiff_t>(f.begin);
      std::sort(first, trace.ids.end());
      trace.ids.erase(std::unique(first, trace.ids.end()), trace.ids.end());
      f.end = trace.ids.size();
      open = false;
    };

    std::uint64_t line_no = 0;
    std::size_t pos = 0;
    while (pos < text.size()) {
      ++line_no;
      const void* nl = std::memchr(text.data() + pos, '\n', text.size() - pos);
      const std::size_t line_end =
          nl ? static_cast<std::size_t>(static_cast<const char*>(nl) - text.data()) : text.size();
      std::string_view line = text.substr(pos, line_end - pos);
      pos = line_end + 1;
      if (const std::size_t hash = line.find('#'); hash != std::string_view::npos) line = line.substr(0, hash);

      std::size_t i = 0;
      auto next_token = [&]() -> std::string_view {
        while (i < line.size() && detail::is_trace_space(line[i])) ++i;
        const std::size_t start = i;
        while (i < line.size() && !detail::is_trace_space(line[i])) ++i;
        return line.substr(start, i - start);
      };

      const std::string_view step_tok = next_token();
      if (step_tok.empty()) continue;  // blank or comment-only line
      std::int64_t step = 0;
      std::int64_t layer = 0;
      switch (detail::parse_trace_int(step_tok, trace_max_step, step)) {
        case detail::IntParse::ok: break;
        case detail::IntParse::not_integer:
          return detail::trace_error(line_no, "step " + detail::quote_token(step_tok) + " is not an integer");
        case detail::IntParse::negative:
          return detail::trace_error(line_no, "step " + detail::quote_token(step_tok) + " is negative");
        case detail::IntParse::too_large:
          return detail::trace_error(line_no, "step " + detail::quote_token(step_tok) + " exceeds " +
                                                  std::to_string(trace_max_step));
      }
      const std::string_view layer_tok = next_token();
      if (layer_tok.empty()) return detail::trace_error(line_no, "too few fields: need 'step layer expert...', got only a step");
      switch (detail::parse_trace_int(layer_tok, trace_max_layer, layer)) {
        case detail::IntParse::ok: break;
        case detail::IntParse::not_integer:
          return detail::trace_error(line_no, "layer " + detail::quote_token(layer_tok) + " is not an integer");
        case detail::IntParse::negative:
          return detail::trace_error(line_no, "layer " + detail::quote_token(layer_tok) + " is negative");
        case detail::IntParse::too_large:
          return detail::trace_error(line_no, "layer " + detail::quote_token(layer_tok) + " exceeds " +
                                                  std::to_string(trace_max_layer));
      }
      const auto s = static_cast<std::int32_t>(step);
      const auto l = static_cast<std::int32_t>(layer);

      // Continue the open forward, or start a new one (a key may not come back later).
      if (!open || trace.forwards.back().step != s || trace.forwards.back().layer != l) {
        const auto [it, inserted] =
            seen.try_emplace(detail::forward_key(s, l), static_cast<std::uint32_t>(trace.forwards.size()));
        if (!inserted) {
          const TraceForward& earlier = trace.forwards[it->second];
          return detail::trace_error(
              line_no, "records of step " + std::to_string(s) + " layer " + std::to_string(l) +
                           " must be contiguous: that forward began on line " + std::to_string(earlier.line) +
                           " and other records came in between");
        }
        if (open) close_forward();
        TraceForward f;
        f.step = s;
        f.layer = l;
        f.line = line_no;
        f.begin = trace.ids.size();
        trace.forwards.push_back(f);
        open = true;
      }

      std::size_t count = 0;
      for (std::string_view tok = next_token(); !tok.empty(); tok = next_token(), ++count) {
        std::int64_t id = 0;
        switch (detail::parse_trace_int(tok, id_limit, id)) {
          case detail::IntParse::ok: break;
          case detail::IntParse::not_integer:
            return detail::trace_error(line_no, "expert id " + detail::quote_token(tok) + " is not an integer");
          case detail::IntParse::negative:
            return detail::trace_error(line_no, "expert id " + detail::quote_token(tok) + " is negative");
          case detail::IntParse::too_large:
            return detail::trace_error(
                line_no, "expert id " + detail::quote_token(tok) +
                             (options.num_experts ? " is >= num_experts " + std::to_string(*options.num_experts)
                                                  : " exceeds the limit " + std::to_string(trace_max_experts - 1)));
        }
        trace.ids.push_back(static_cast<std::int32_t>(id));
        max_id = std::max(max_id, static_cast<std::int32_t>(id));
      }
      if (count == 0) return detail::trace_error(line_no, "too few fields: need 'step layer expert...', got no expert id");
      ++trace.forwards.back().records;
      ++trace.records;
    }
    if (open) close_forward();
    trace.num_experts = options.num_experts ? *options.num_experts : max_id + 1;
    return trace;
  } catch (const std::bad_alloc&) {
    return ToolStatus(ToolErrorCode::invalid_argument, "trace too large: out of memory while parsing");
  } catch (...) {
    return ToolStatus(Status(ErrorCode::internal, "unexpected exception while parsing a trace"));
  }
}

// Read the whole stream, then parse it. A stream failure is io_error.
[[nodiscard]] inline ToolResult<Trace> parse_trace(std::istream& in, const ParseOptions& options = {}) noexcept {
  std::string text;
  try {
    constexpr std::size_t chunk = std::size_t{1} << 20;
    std::size_t used = 0;
    while (in) {
      text.resize(used + chunk);
      in.read(text.data() + used, static_cast<std::streamsize>(chunk));
      used += static_cast<std::size_t>(in.gcount());
    }
    text.resize(used);
    if (in.bad()) return ToolStatus(ToolErrorCode::io_error, "error while reading the trace stream");
  } catch (const std::bad_alloc&) {
    return ToolStatus(ToolErrorCode::io_error, "trace too large: out of memory while reading");
  } catch (...) {
    return ToolStatus(ToolErrorCode::io_error, "error while reading the trace stream");
  }
  return parse_trace_text(text, options);
}

[[nodiscard]] inline ToolResult<Trace> load_trace(const std::string& path, const ParseOptions& options = {}) noexcept {
  try {
    std::ifstream in(path, std::ios::binary);
    if (!in) return ToolStatus(ToolErrorCode::io_error, "cannot open trace file '" + path + "'");
    ToolResult<Trace> r = parse_trace(in, options);
    if (!r.ok() && r.status().code() == ToolErrorCode::parse_error) {
      return ToolStatus(ToolErrorCode::parse_error, path + ": " + r.status().message());
    }
    return r;
  } catch (...) {
    return ToolStatus(ToolErrorCode::io_error, "cannot read trace file '" + path + "'");
  }
}

// Write `trace` in format v1: one record per forward (its union), in forward order.
inline void write_trace(std::ostream& out, const Trace& trace, std::string_view header_comment = {}) {
  out << "# expert-cache trace v1: step layer expert_ids...\n";
  if (!header_comment.empty()) out << "# " << header_comment << '\n';
  std::string line;
  char buf[16];
  for (const TraceForward& f : trace.forwards) {
    line.clear();
    auto append = [&](std::int32_t v) {
      const auto r = std::to_chars(buf, buf + sizeof buf, v);
      line.append(buf, r.ptr);
    };
    append(f.step);
    line.push_back(' ');
    append(f.layer);
    for (const std::int32_t e : trace.experts(f)) {
      line.push_back(' ');
      append(e);
    }
    line.push_back('\n');
    out.write(line.data(), static_cast<std::streamsize>(line.size()));
  }
}

}  // namespace expert_cache::inline v0
