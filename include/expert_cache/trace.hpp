#pragma once
// Routing traces, format v1 (docs/trace_format.md): parse, write and generate. Host-only.
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

#include "expert_cache/status.hpp"

namespace expert_cache {

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

inline Status trace_error(std::uint64_t line, const std::string& what) {
  return Status(ErrorCode::parse_error, "line " + std::to_string(line) + ": " + what);
}

inline std::uint64_t forward_key(std::int32_t step, std::int32_t layer) noexcept {
  return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(step)) << 32) |
         static_cast<std::uint32_t>(layer);
}

}  // namespace detail

// Parse trace text held in memory. Never throws except std::bad_alloc for a genuinely
// huge (well-formed) input, which is converted to an error too.
[[nodiscard]] inline Result<Trace> parse_trace_text(std::string_view text, const ParseOptions& options = {}) noexcept {
  try {
    std::int64_t id_limit = trace_max_experts - 1;
    if (options.num_experts) {
      if (*options.num_experts < 1 || *options.num_experts > trace_max_experts) {
        return Status(ErrorCode::invalid_argument,
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
    return Status(ErrorCode::invalid_argument, "trace too large: out of memory while parsing");
  } catch (...) {
    return Status(ErrorCode::internal, "unexpected exception while parsing a trace");
  }
}

// Read the whole stream, then parse it. A stream failure is io_error.
[[nodiscard]] inline Result<Trace> parse_trace(std::istream& in, const ParseOptions& options = {}) noexcept {
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
    if (in.bad()) return Status(ErrorCode::io_error, "error while reading the trace stream");
  } catch (const std::bad_alloc&) {
    return Status(ErrorCode::io_error, "trace too large: out of memory while reading");
  } catch (...) {
    return Status(ErrorCode::io_error, "error while reading the trace stream");
  }
  return parse_trace_text(text, options);
}

[[nodiscard]] inline Result<Trace> load_trace(const std::string& path, const ParseOptions& options = {}) noexcept {
  try {
    std::ifstream in(path, std::ios::binary);
    if (!in) return Status(ErrorCode::io_error, "cannot open trace file '" + path + "'");
    Result<Trace> r = parse_trace(in, options);
    if (!r.ok() && r.status().code() == ErrorCode::parse_error) {
      return Status(ErrorCode::parse_error, path + ": " + r.status().message());
    }
    return r;
  } catch (...) {
    return Status(ErrorCode::io_error, "cannot read trace file '" + path + "'");
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

// ---------------------------------------------------------------------------------------
// Deterministic synthetic traces with temporal locality (docs/trace_format.md).
// Every step routes each layer to top_k distinct experts. Each of the top_k picks either
// reuses one of that layer's previous picks (probability `sticky`) or draws from a
// per-layer Zipf(zipf_s) popularity over a per-layer random permutation of the experts.
// Bit-for-bit reproducible across platforms: own PRNG, no <random> distributions.
struct GeneratorSpec {
  std::int32_t layers = 8;
  std::int32_t experts = 64;
  std::int32_t top_k = 6;
  std::int32_t steps = 2000;
  double zipf_s = 1.0;
  double sticky = 0.4;
  std::uint64_t seed = 1;
};

namespace detail {

struct SplitMix64 {
  std::uint64_t state;
  std::uint64_t next() noexcept {
    std::uint64_t z = (state += 0x9e3779b97f4a7c15ULL);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  }
  double uniform() noexcept { return static_cast<double>(next() >> 11) * 0x1.0p-53; }  // [0, 1)
  std::uint32_t below(std::uint32_t n) noexcept {  // [0, n); bias negligible for small n
    return static_cast<std::uint32_t>((next() >> 32) * n >> 32);
  }
};

inline double zipf_weight(std::int32_t rank, double s) noexcept {
  // s == 1 (the default) avoids pow, so the default trace does not depend on libm.
  const double r = static_cast<double>(rank + 1);
  if (s == 1.0) return 1.0 / r;
  return 1.0 / std::pow(r, s);
}

}  // namespace detail

// Parse "key=value,key=value" (keys: layers experts topk steps zipf sticky seed); an empty
// string or "default" keeps the defaults.
[[nodiscard]] inline Result<GeneratorSpec> parse_generator_spec(std::string_view text) {
  GeneratorSpec spec;
  if (text.empty() || text == "default") return spec;
  std::size_t pos = 0;
  while (pos <= text.size()) {
    const std::size_t comma = std::min(text.find(',', pos), text.size());
    const std::string_view item = text.substr(pos, comma - pos);
    pos = comma + 1;
    const std::size_t eq = item.find('=');
    if (eq == std::string_view::npos) {
      return Status(ErrorCode::invalid_argument, "generator spec item '" + std::string(item) + "' is not key=value");
    }
    const std::string_view key = item.substr(0, eq);
    const std::string_view val = item.substr(eq + 1);
    auto int_in = [&](std::int64_t lo, std::int64_t hi, std::int64_t& out) -> bool {
      const auto r = std::from_chars(val.data(), val.data() + val.size(), out);
      return r.ec == std::errc() && r.ptr == val.data() + val.size() && out >= lo && out <= hi;
    };
    auto real_in = [&](double lo, double hi, double& out) -> bool {
      const auto r = std::from_chars(val.data(), val.data() + val.size(), out);
      return r.ec == std::errc() && r.ptr == val.data() + val.size() && out >= lo && out <= hi;
    };
    auto bad = [&](const char* range) {
      return Status(ErrorCode::invalid_argument, "generator spec: " + std::string(key) + "='" + std::string(val) +
                                                     "' must be " + range);
    };
    std::int64_t v = 0;
    if (key == "layers") {
      if (!int_in(1, 4096, v)) return bad("an integer in [1, 4096]");
      spec.layers = static_cast<std::int32_t>(v);
    } else if (key == "experts") {
      if (!int_in(1, 1 << 20, v)) return bad("an integer in [1, 1048576]");
      spec.experts = static_cast<std::int32_t>(v);
    } else if (key == "topk") {
      if (!int_in(1, 1 << 20, v)) return bad("an integer in [1, experts]");
      spec.top_k = static_cast<std::int32_t>(v);
    } else if (key == "steps") {
      if (!int_in(1, trace_max_step, v)) return bad("an integer in [1, 2147483647]");
      spec.steps = static_cast<std::int32_t>(v);
    } else if (key == "seed") {
      if (!int_in(0, INT64_MAX, v)) return bad("a non-negative integer");
      spec.seed = static_cast<std::uint64_t>(v);
    } else if (key == "zipf") {
      if (!real_in(0.0, 10.0, spec.zipf_s)) return bad("a number in [0, 10]");
    } else if (key == "sticky") {
      if (!real_in(0.0, 1.0, spec.sticky)) return bad("a number in [0, 1]");
    } else {
      return Status(ErrorCode::invalid_argument,
                    "generator spec: unknown key '" + std::string(key) +
                        "' (known: layers, experts, topk, steps, zipf, sticky, seed)");
    }
  }
  if (spec.top_k > spec.experts) {
    return Status(ErrorCode::invalid_argument, "generator spec: topk " + std::to_string(spec.top_k) +
                                                   " exceeds experts " + std::to_string(spec.experts));
  }
  if (static_cast<std::int64_t>(spec.layers) * spec.steps * spec.top_k > (std::int64_t{1} << 31)) {
    return Status(ErrorCode::invalid_argument, "generator spec: layers*steps*topk exceeds 2^31 ids");
  }
  return spec;
}

// Generate a trace (layers numbered 0..layers-1, steps 0..steps-1, step-major).
[[nodiscard]] inline Trace generate_trace(const GeneratorSpec& spec) {
  Trace trace;
  trace.num_experts = spec.experts;
  const auto E = static_cast<std::size_t>(spec.experts);
  const auto K = static_cast<std::size_t>(spec.top_k);
  detail::SplitMix64 rng{spec.seed};

  // Zipf CDF over ranks, shared; each layer maps ranks to experts through its own permutation.
  std::vector<double> cdf(E);
  double total = 0.0;
  for (std::size_t r = 0; r < E; ++r) {
    total += detail::zipf_weight(static_cast<std::int32_t>(r), spec.zipf_s);
    cdf[r] = total;
  }
  std::vector<std::vector<std::int32_t>> perm(static_cast<std::size_t>(spec.layers));
  for (auto& p : perm) {
    p.resize(E);
    for (std::size_t i = 0; i < E; ++i) p[i] = static_cast<std::int32_t>(i);
    for (std::size_t i = E; i > 1; --i) std::swap(p[i - 1], p[rng.below(static_cast<std::uint32_t>(i))]);
  }
  std::vector<std::vector<std::int32_t>> previous(static_cast<std::size_t>(spec.layers));
  std::vector<std::uint32_t> taken(E, 0);  // epoch stamps: experts already picked this forward
  std::uint32_t epoch = 0;
  std::vector<std::int32_t> picks;
  picks.reserve(K);

  trace.forwards.reserve(static_cast<std::size_t>(spec.layers) * static_cast<std::size_t>(spec.steps));
  trace.ids.reserve(trace.forwards.capacity() * K);
  for (std::int32_t step = 0; step < spec.steps; ++step) {
    for (std::int32_t layer = 0; layer < spec.layers; ++layer) {
      ++epoch;
      picks.clear();
      auto& prev = previous[static_cast<std::size_t>(layer)];
      std::uint32_t rejected = 0;
      while (picks.size() < K) {
        std::int32_t e;
        if (rejected > 64) {
          // A steep Zipf rarely draws its tail: take the most popular untaken expert so
          // the loop is bounded (deterministic, so still reproducible).
          std::size_t rank = 0;
          while (taken[static_cast<std::size_t>(perm[static_cast<std::size_t>(layer)][rank])] == epoch) ++rank;
          e = perm[static_cast<std::size_t>(layer)][rank];
        } else if (!prev.empty() && rng.uniform() < spec.sticky) {
          e = prev[rng.below(static_cast<std::uint32_t>(prev.size()))];
        } else {
          const double u = rng.uniform() * total;
          auto rank = static_cast<std::size_t>(std::upper_bound(cdf.begin(), cdf.end(), u) - cdf.begin());
          rank = std::min(rank, E - 1);
          e = perm[static_cast<std::size_t>(layer)][rank];
        }
        if (taken[static_cast<std::size_t>(e)] == epoch) {
          ++rejected;
          continue;
        }
        taken[static_cast<std::size_t>(e)] = epoch;
        picks.push_back(e);
      }
      prev = picks;
      std::sort(picks.begin(), picks.end());
      TraceForward f;
      f.step = step;
      f.layer = layer;
      f.line = 0;  // not from a file
      f.records = 1;
      f.begin = trace.ids.size();
      trace.ids.insert(trace.ids.end(), picks.begin(), picks.end());
      f.end = trace.ids.size();
      trace.forwards.push_back(f);
      ++trace.records;
    }
  }
  return trace;
}

}  // namespace expert_cache
