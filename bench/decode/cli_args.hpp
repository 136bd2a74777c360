#pragma once
// Command-line scanning shared by the bench programs: `--flag value`, `--flag=value`, and a
// usage error type the mains turn into exit code 2.
#include <optional>
#include <string>
#include <string_view>
#include <vector>

namespace expert_cache::bench {

// "a,b,,c" -> {"a", "b", "", "c"}: list-valued flags.
inline std::vector<std::string_view> split_commas(std::string_view s) {
  std::vector<std::string_view> out;
  std::size_t pos = 0;
  while (true) {
    const std::size_t comma = s.find(',', pos);
    out.push_back(s.substr(pos, comma == std::string_view::npos ? std::string_view::npos : comma - pos));
    if (comma == std::string_view::npos) break;
    pos = comma + 1;
  }
  return out;
}

struct UsageError {
  std::string message;
};

// Walks argv one flag at a time; value() consumes the flag's value (inline or the next word).
class ArgCursor {
 public:
  ArgCursor(int argc, char** argv) noexcept : argc_(argc), argv_(argv) {}

  // Advances to the next flag; false at the end.
  bool next() noexcept {
    if (++i_ >= argc_) return false;
    name_ = argv_[i_];
    inline_value_.reset();
    if (name_.starts_with("--")) {
      if (const std::size_t eq = name_.find('='); eq != std::string_view::npos) {
        inline_value_ = name_.substr(eq + 1);
        name_ = name_.substr(0, eq);
      }
    }
    return true;
  }
  [[nodiscard]] std::string_view name() const noexcept { return name_; }
  std::string_view value() {
    if (inline_value_) return *inline_value_;
    if (i_ + 1 >= argc_) throw UsageError{std::string(name_) + " needs a value"};
    return argv_[++i_];
  }
  void no_value() const {
    if (inline_value_) throw UsageError{std::string(name_) + " takes no value"};
  }

 private:
  int argc_;
  char** argv_;
  int i_ = 0;
  std::string_view name_;
  std::optional<std::string_view> inline_value_;
};

}  // namespace expert_cache::bench
