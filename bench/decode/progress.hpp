#pragma once
// expert-cache-bench: progress lines on stderr (--progress, or when stderr is a terminal).
// Host-only.
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <string>

#if defined(__unix__) || defined(__APPLE__)
#include <unistd.h>
#endif

namespace expert_cache::bench {

class Progress {
 public:
  Progress(bool enabled, bool tty) : enabled_(enabled), tty_(tty) {}
  void run_started(std::size_t index, std::size_t total, const std::string& what) {
    index_ = index;
    total_ = total;
    what_ = what;
    last_ = {};
    if (enabled_) line(0, 0, true);
  }
  void step(std::int32_t done, std::int32_t total) {
    if (!enabled_) return;
    const auto now = std::chrono::steady_clock::now();
    if (done != total && now - last_ < std::chrono::milliseconds(tty_ ? 200 : 2000)) return;
    last_ = now;
    line(done, total, false);
  }
  // The row's result as soon as it is known, so that a run cut short still shows the rows it finished.
  void run_done(double tokens_per_second, double hit_rate) {
    if (!enabled_) return;
    std::fprintf(stderr, "%sexpert-cache-bench: [%zu/%zu] %s done: %.2f tok/s, hit %.1f%%\n", tty_ ? "\r\033[K" : "",
                 index_ + 1, total_, what_.c_str(), tokens_per_second, 100.0 * hit_rate);
    std::fflush(stderr);
  }
  void note(const std::string& text) {
    if (!enabled_) return;
    std::fprintf(stderr, "%sexpert-cache-bench: %s%s", tty_ ? "\r\033[K" : "", text.c_str(), tty_ ? "" : "\n");
    std::fflush(stderr);
  }
  void finish() {
    if (enabled_ && tty_) std::fputs("\r\033[K", stderr);
  }

 private:
  void line(std::int32_t done, std::int32_t total, bool start) {
    if (start) {
      std::fprintf(stderr, "%sexpert-cache-bench: [%zu/%zu] %s%s", tty_ ? "\r\033[K" : "", index_ + 1, total_,
                   what_.c_str(), tty_ ? "" : "\n");
    } else {
      std::fprintf(stderr, "%sexpert-cache-bench: [%zu/%zu] %s step %d/%d%s", tty_ ? "\r\033[K" : "", index_ + 1,
                   total_, what_.c_str(), done, total, tty_ ? "" : "\n");
    }
    std::fflush(stderr);
  }
  bool enabled_;
  bool tty_;
  std::size_t index_ = 0, total_ = 0;
  std::string what_;
  std::chrono::steady_clock::time_point last_{};
};

inline bool stderr_is_tty() {
#if defined(__unix__) || defined(__APPLE__)
  return isatty(STDERR_FILENO) != 0;
#else
  return false;
#endif
}

}  // namespace expert_cache::bench
