// LinkProfile (runtime/link_profile.hpp) on the host: the text format's round trip and every
// rejection (with the output untouched), the automatic fill-engine rule on both sides of its
// threshold, the device / expert-size check, and FillEngine's names.
#include <doctest/doctest.h>

#include <cmath>
#include <limits>
#include <cstdlib>
#include <string>
#include <string_view>

#include "expert_cache/device_cache/options.hpp"
#include "expert_cache/runtime/link_profile.hpp"

using namespace expert_cache;

namespace {

LinkProfile sample_profile() {
  LinkProfile p;
  p.device = 1;
  p.device_name = "NVIDIA H100 80GB HBM3";
  p.pci_bus_id = "0000:19:00.0";
  p.expert_bytes = 1769472;
  p.copy_engine_gbps_one = 50.5;
  p.copy_engine_gbps_batch = 51.0;
  p.copy_latency_us = 9.8;
  p.sm_load_gbps = 30.2;
  p.graph_fill_latency_us = 7.1;
  p.measure_ms = 85.25;
  return p;
}

// The sample's text with the line `key=...` replaced by `replacement` (or removed when empty).
std::string with_line(std::string_view key, std::string_view replacement) {
  const std::string text = sample_profile().serialize();
  const std::string prefix = std::string(key) + "=";
  const std::size_t at = text.find("\n" + prefix);
  REQUIRE(at != std::string::npos);
  const std::size_t end = text.find('\n', at + 1);
  std::string out = text.substr(0, at + 1);
  if (!replacement.empty()) out += std::string(replacement) + "\n";
  out += text.substr(end + 1);
  return out;
}

// Parses `text` into a profile holding a sentinel; the parse must fail with invalid_argument,
// mention every `needle`, and leave the sentinel as it was.
void check_rejected(const std::string& text, std::initializer_list<std::string_view> needles) {
  LinkProfile out = sample_profile();
  out.device_name = "untouched";
  const LinkProfile before = out;
  const Status s = LinkProfile::parse(text, out);
  INFO("text:\n" << text << "status: " << s.to_string());
  REQUIRE_FALSE(s.ok());
  CHECK(s.code() == ErrorCode::invalid_argument);
  for (std::string_view n : needles) CHECK(s.message().find(n) != std::string_view::npos);
  CHECK(out == before);
}

}  // namespace

TEST_CASE("LinkProfile: serialize then parse gives the same profile") {
  const LinkProfile p = sample_profile();
  const std::string text = p.serialize();
  CHECK(text.starts_with("expert_cache link profile v1\n"));
  CHECK(text.find("\ndevice=1\n") != std::string::npos);
  CHECK(text.find("\ndevice_name=NVIDIA H100 80GB HBM3\n") != std::string::npos);
  CHECK(text.find("\nexpert_bytes=1769472\n") != std::string::npos);
  CHECK(text.find("\ncopy_engine_gbps_batch=51\n") != std::string::npos);
  CHECK(text.find("\nmeasure_ms=85.25\n") != std::string::npos);
  LinkProfile back;
  REQUIRE(LinkProfile::parse(text, back).ok());
  CHECK(back == p);

  // Doubles that have no short decimal form read back bit for bit.
  LinkProfile q = p;
  q.copy_engine_gbps_one = 1.0 / 3.0;
  q.sm_load_gbps = 49.123456789012345;
  q.copy_latency_us = 1e-7;
  q.measure_ms = 0;  // allowed: a profile written by hand
  LinkProfile q_back;
  REQUIRE(LinkProfile::parse(q.serialize(), q_back).ok());
  CHECK(q_back == q);
  CHECK(q_back.copy_engine_gbps_one == 1.0 / 3.0);

  // '\r\n' line ends and no final newline are accepted.
  std::string crlf;
  for (char c : text) {
    if (c == '\n') crlf += '\r';
    crlf += c;
  }
  LinkProfile from_crlf;
  REQUIRE(LinkProfile::parse(crlf, from_crlf).ok());
  CHECK(from_crlf == p);
  LinkProfile no_final_newline;
  REQUIRE(LinkProfile::parse(std::string_view(text).substr(0, text.size() - 1), no_final_newline).ok());
  CHECK(no_final_newline == p);

  // Keys in another order are accepted (every key once).
  const std::string reordered = with_line("device", "") + "device=1\n";
  LinkProfile from_reordered;
  REQUIRE(LinkProfile::parse(reordered, from_reordered).ok());
  CHECK(from_reordered == p);
}

TEST_CASE("LinkProfile::parse rejects a wrong format line, naming it, output untouched") {
  const std::string text = sample_profile().serialize();
  check_rejected("", {"empty text"});
  check_rejected(std::string("expert_cache link profile v2") + text.substr(text.find('\n')), {"line 1", "v2", "version"});
  check_rejected(text.substr(text.find('\n') + 1), {"line 1", "device=1"});
}

TEST_CASE("LinkProfile::parse rejects malformed lines, unknown and repeated keys") {
  const std::string text = sample_profile().serialize();
  check_rejected(text + "\n", {"line 12", "not key=value"});  // an empty line at the end
  check_rejected(text + "colour=blue\n", {"line 12", "unknown key 'colour'"});
  check_rejected(text + "sm_load_gbps=30\n", {"line 12", "'sm_load_gbps' appears twice"});
  check_rejected(with_line("copy_latency_us", "copy_latency_us 9.8"), {"line", "not key=value"});
  check_rejected(with_line("copy_latency_us", "Copy_latency_us=9.8"), {"unknown key 'Copy_latency_us'"});
}

TEST_CASE("LinkProfile::parse rejects each missing key by name") {
  for (std::string_view key : {"device", "device_name", "pci_bus_id", "expert_bytes", "copy_engine_gbps_one",
                               "copy_engine_gbps_batch", "copy_latency_us", "sm_load_gbps", "graph_fill_latency_us",
                               "measure_ms"}) {
    CAPTURE(key);
    check_rejected(with_line(key, ""), {"missing key '" + std::string(key) + "'"});
  }
}

TEST_CASE("LinkProfile::parse rejects bad numbers and empty strings, naming key and line") {
  // device: line 2; expert_bytes: line 5; sm_load_gbps: line 9; measure_ms: line 11.
  check_rejected(with_line("device", "device=-1"), {"line 2", "device", "'-1'"});
  check_rejected(with_line("device", "device=one"), {"line 2", "device", "'one'"});
  check_rejected(with_line("device", "device=0x1"), {"line 2", "device"});
  check_rejected(with_line("device", "device="), {"line 2", "device"});
  check_rejected(with_line("device_name", "device_name="), {"line 3", "device_name: empty"});
  check_rejected(with_line("pci_bus_id", "pci_bus_id="), {"line 4", "pci_bus_id: empty"});
  check_rejected(with_line("expert_bytes", "expert_bytes=0"), {"line 5", "expert_bytes", "'0'"});
  check_rejected(with_line("expert_bytes", "expert_bytes=-5"), {"line 5", "expert_bytes"});
  check_rejected(with_line("expert_bytes", "expert_bytes=1.5"), {"line 5", "expert_bytes"});
  check_rejected(with_line("expert_bytes", "expert_bytes=99999999999999999999999"), {"line 5", "expert_bytes"});
  check_rejected(with_line("sm_load_gbps", "sm_load_gbps=-30.2"), {"line 9", "sm_load_gbps", "-30.2", "> 0"});
  check_rejected(with_line("sm_load_gbps", "sm_load_gbps=0"), {"line 9", "sm_load_gbps", "> 0"});
  check_rejected(with_line("sm_load_gbps", "sm_load_gbps=inf"), {"line 9", "sm_load_gbps", "inf", "finite"});
  check_rejected(with_line("sm_load_gbps", "sm_load_gbps=nan"), {"line 9", "sm_load_gbps", "nan", "finite"});
  check_rejected(with_line("sm_load_gbps", "sm_load_gbps=1e999"), {"line 9", "sm_load_gbps", "not a number"});
  check_rejected(with_line("sm_load_gbps", "sm_load_gbps=30.2GB"), {"line 9", "sm_load_gbps", "not a number"});
  check_rejected(with_line("sm_load_gbps", "sm_load_gbps= 30.2"), {"line 9", "sm_load_gbps", "not a number"});
  check_rejected(with_line("sm_load_gbps", "sm_load_gbps="), {"line 9", "sm_load_gbps", "not a number"});
  check_rejected(with_line("measure_ms", "measure_ms=-1"), {"line 11", "measure_ms", ">= 0"});
  for (std::string_view key : {"copy_engine_gbps_one", "copy_engine_gbps_batch", "copy_latency_us",
                               "graph_fill_latency_us"}) {
    CAPTURE(key);
    check_rejected(with_line(key, std::string(key) + "=-0.5"), {key, "> 0"});
    check_rejected(with_line(key, std::string(key) + "=inf"), {key, "finite"});
  }
}

TEST_CASE("LinkProfile::choose_engine: SM loads from 0.8 of the copy engine's batch bandwidth") {
  CHECK(sm_load_min_share == 0.8);
  LinkProfile p = sample_profile();
  p.copy_engine_gbps_one = 40.0;  // the rule reads the batch bandwidth, not this one
  p.copy_engine_gbps_batch = 100.0;

  p.sm_load_gbps = 79.0;  // 0.79: below the threshold
  std::string reason;
  CHECK(p.choose_engine(&reason) == FillEngine::copy_engine);
  CHECK(reason == "copy_engine: SM loads 79.0 GB/s are 0.790 of the copy engine's batch 100.0 GB/s (below 0.80)");
  CHECK(p.choose_engine() == FillEngine::copy_engine);

  p.sm_load_gbps = 80.0;  // exactly 0.8: at the threshold
  CHECK(p.choose_engine(&reason) == FillEngine::sm_loads);
  CHECK(reason == "sm_loads: SM loads 80.0 GB/s are 0.800 of the copy engine's batch 100.0 GB/s (at least 0.80)");

  p.sm_load_gbps = 120.0;  // faster than the copy engine
  CHECK(p.choose_engine(&reason) == FillEngine::sm_loads);
  CHECK(reason.starts_with("sm_loads: SM loads 120.0 GB/s are 1.200"));

  // The sample: 30.2 against 51 GB/s.
  const LinkProfile h100 = sample_profile();
  CHECK(h100.choose_engine(&reason) == FillEngine::copy_engine);
  CHECK(reason.find("0.592") != std::string::npos);

  // No measurement: the copy engine, and the reason says why.
  LinkProfile empty;
  CHECK(empty.choose_engine(&reason) == FillEngine::copy_engine);
  CHECK(reason.find("no copy-engine") != std::string::npos);
  empty.copy_engine_gbps_batch = 50;
  empty.sm_load_gbps = std::numeric_limits<double>::quiet_NaN();
  CHECK(empty.choose_engine(&reason) == FillEngine::copy_engine);
  CHECK(reason.find("no copy-engine") != std::string::npos);
}

TEST_CASE("LinkProfile::choose_engines for overlapped lookahead: split with fast SM loads, else the copy engine") {
  LinkProfile p = sample_profile();
  p.copy_engine_gbps_batch = 100.0;
  p.sm_load_gbps = 94.0;  // fast SM loads: forwards' fills take them
  std::string reason;
  LinkProfile::EngineChoice c = p.choose_engines(FillUse::demand, &reason);
  CHECK(c.forwards == FillEngine::sm_loads);
  CHECK_FALSE(c.speculate_on_copy_engine);
  CHECK(reason == "sm_loads: SM loads 94.0 GB/s are 0.940 of the copy engine's batch 100.0 GB/s (at least 0.80)");
  c = p.choose_engines(FillUse::overlapped_lookahead, &reason);
  CHECK(c.forwards == FillEngine::sm_loads);
  CHECK(c.speculate_on_copy_engine);
  CHECK(reason ==
        "split: SM loads 94.0 GB/s are 0.940 of the copy engine's batch 100.0 GB/s (at least 0.80); forwards' fills "
        "with SM loads, the overlapped lookahead's speculative copies on the copy engine, which takes no SMs from the "
        "consumer");
  CHECK(p.choose_engine(FillUse::overlapped_lookahead) == FillEngine::sm_loads);
  p.sm_load_gbps = 50.0;  // slow SM loads: the copy engine for every fill
  for (const FillUse use : {FillUse::demand, FillUse::overlapped_lookahead}) {
    c = p.choose_engines(use, &reason);
    CHECK(c.forwards == FillEngine::copy_engine);
    CHECK_FALSE(c.speculate_on_copy_engine);
    CHECK(reason == "copy_engine: SM loads 50.0 GB/s are 0.500 of the copy engine's batch 100.0 GB/s (below 0.80)");
  }
  LinkProfile empty;  // no measurement: the copy engine
  c = empty.choose_engines(FillUse::overlapped_lookahead, &reason);
  CHECK(c.forwards == FillEngine::copy_engine);
  CHECK_FALSE(c.speculate_on_copy_engine);
  CHECK(reason.find("no copy-engine") != std::string::npos);
}

TEST_CASE("LinkProfile::choose_engines with one hardware work queue: SM loads for every fill, whatever the profile") {
  LinkProfile slow = sample_profile();
  slow.copy_engine_gbps_batch = 100.0;
  slow.sm_load_gbps = 50.0;  // alone it would put every fill on the copy engine
  LinkProfile fast = slow;
  fast.sm_load_gbps = 94.0;  // alone it would split with lookahead
  const LinkProfile empty;   // alone: the copy engine
  for (const LinkProfile* p : std::initializer_list<const LinkProfile*>{&slow, &fast, &empty}) {
    for (const FillUse use : {FillUse::demand, FillUse::overlapped_lookahead}) {
      std::string reason;
      const LinkProfile::EngineChoice c = p->choose_engines(use, &reason, 1);
      CHECK(c.forwards == FillEngine::sm_loads);
      CHECK_FALSE(c.speculate_on_copy_engine);
      CHECK(reason.find("CUDA_DEVICE_MAX_CONNECTIONS=1") != std::string::npos);
      // More queues, or none named: the profile decides as before.
      for (const int queues : {0, 2, 8, 32}) {
        const LinkProfile::EngineChoice d = p->choose_engines(use, nullptr, queues);
        const LinkProfile::EngineChoice unlimited = p->choose_engines(use);
        CHECK(d.forwards == unlimited.forwards);
        CHECK(d.speculate_on_copy_engine == unlimited.speculate_on_copy_engine);
      }
    }
  }
  CHECK(slow.choose_engines(FillUse::demand).forwards == FillEngine::copy_engine);
  CHECK(fast.choose_engines(FillUse::overlapped_lookahead).speculate_on_copy_engine);
}

TEST_CASE("cuda_work_queues_from_env: CUDA_DEVICE_MAX_CONNECTIONS as a whole number from 1 to 1024, else 0") {
  const char* before = std::getenv("CUDA_DEVICE_MAX_CONNECTIONS");
  const std::string saved = before != nullptr ? before : "";
  const auto with = [](const char* v) {
    REQUIRE(setenv("CUDA_DEVICE_MAX_CONNECTIONS", v, 1) == 0);
    return cuda_work_queues_from_env();
  };
  CHECK(with("1") == 1);
  CHECK(with("8") == 8);
  CHECK(with("32") == 32);
  CHECK(with("1024") == 1024);
  CHECK(with("0") == 0);
  CHECK(with("1025") == 0);
  CHECK(with("-1") == 0);
  CHECK(with("1x") == 0);
  CHECK(with(" 1") == 0);
  CHECK(with("") == 0);
  REQUIRE(unsetenv("CUDA_DEVICE_MAX_CONNECTIONS") == 0);
  CHECK(cuda_work_queues_from_env() == 0);
  if (before != nullptr) REQUIRE(setenv("CUDA_DEVICE_MAX_CONNECTIONS", saved.c_str(), 1) == 0);
}

TEST_CASE("fill_use_of: overlapped lookahead only with lookahead, overlap and room for the next forward") {
  DeviceCacheOptions o;
  o.num_experts = 64;
  o.capacity = 16;
  o.max_ids = 8;  // room: 16 slots hold this forward's 8 experts and the next forward's 8
  CHECK(fill_use_of(o) == FillUse::demand);  // no lookahead
  o.lookahead = true;
  CHECK(fill_use_of(o) == FillUse::demand);  // lookahead without overlap: the bandwidths decide
  o.overlap = true;
  CHECK(fill_use_of(o) == FillUse::overlapped_lookahead);
  o.capacity = 15;  // one slot short of the next forward's experts
  CHECK(fill_use_of(o) == FillUse::demand);
  o.capacity = 8;  // every slot belongs to the current forward (8 slots, top-8): nothing to look ahead into
  CHECK(fill_use_of(o) == FillUse::demand);
  o.capacity = 64;
  o.max_ids = std::numeric_limits<std::int32_t>::max();  // no overflow in the room test
  CHECK(fill_use_of(o) == FillUse::demand);
  // With the profile: a fast-SM host takes SM loads for the forwards, and the copy engine for
  // the speculation only when the cache really looks ahead.
  LinkProfile p = sample_profile();
  p.copy_engine_gbps_batch = 100.0;
  p.sm_load_gbps = 94.0;
  o.max_ids = 10;
  CHECK(p.choose_engines(fill_use_of(o)).forwards == FillEngine::sm_loads);
  CHECK(p.choose_engines(fill_use_of(o)).speculate_on_copy_engine);
  o.capacity = 10;
  CHECK(p.choose_engines(fill_use_of(o)).forwards == FillEngine::sm_loads);
  CHECK_FALSE(p.choose_engines(fill_use_of(o)).speculate_on_copy_engine);
}

TEST_CASE("LinkProfile::sm_load_share and describe") {
  const LinkProfile p = sample_profile();
  CHECK(p.sm_load_share() == doctest::Approx(30.2 / 51.0));
  LinkProfile one_faster = p;
  one_faster.copy_engine_gbps_one = 60.4;  // the better copy-engine number is the denominator
  CHECK(one_faster.sm_load_share() == doctest::Approx(0.5));
  CHECK(LinkProfile{}.sm_load_share() == 0.0);
  CHECK(p.describe() ==
        "link profile: device 1, NVIDIA H100 80GB HBM3 [0000:19:00.0], expert 1.69 MiB: copy engine 50.5 GB/s one, "
        "51.0 batch, 9.8 us per copy; SM loads 30.2 GB/s (0.59 of the copy engine); graph fill 7.1 us; measured in 85 ms");
}

TEST_CASE("LinkProfile::check_matches rejects another device or another expert size") {
  const LinkProfile p = sample_profile();
  CHECK(p.check_matches(1, "0000:19:00.0", 1769472).ok());
  CHECK(p.check_matches(1, "0000:19:00.0", 1769472).message().empty());

  const Status other_bus = p.check_matches(1, "0000:1A:00.0", 1769472);
  REQUIRE_FALSE(other_bus.ok());
  CHECK(other_bus.code() == ErrorCode::invalid_argument);
  CHECK(other_bus.message() ==
        "link profile is for device 1 [0000:19:00.0], not device 1 [0000:1A:00.0]: measure it on this device");

  const Status other_ordinal = p.check_matches(0, "0000:19:00.0", 1769472);
  REQUIRE_FALSE(other_ordinal.ok());
  CHECK(other_ordinal.code() == ErrorCode::invalid_argument);
  CHECK(other_ordinal.message().find("not device 0 [0000:19:00.0]") != std::string_view::npos);

  const Status other_size = p.check_matches(1, "0000:19:00.0", 2097152);
  REQUIRE_FALSE(other_size.ok());
  CHECK(other_size.code() == ErrorCode::invalid_argument);
  CHECK(other_size.message() ==
        "link profile is for experts of 1769472 bytes, not 2097152: measure it at this expert size");

  // The bus id is hexadecimal: its case does not matter (cudaDeviceGetPCIBusId's may differ from a hand-written one).
  LinkProfile upper = p;
  upper.pci_bus_id = "0000:1A:00.0";
  CHECK(upper.check_matches(1, "0000:1a:00.0", 1769472).ok());
  CHECK_FALSE(upper.check_matches(1, "0000:1b:00.0", 1769472).ok());
  CHECK_FALSE(upper.check_matches(1, "0000:1a:00.00", 1769472).ok());
}

TEST_CASE("FillEngine names parse back; a bad name is a clear error") {
  for (FillEngine e : {FillEngine::automatic, FillEngine::copy_engine, FillEngine::sm_loads}) {
    const Result<FillEngine> back = parse_fill_engine(to_string(e));
    REQUIRE(back.ok());
    CHECK(back.value() == e);
  }
  CHECK(to_string(FillEngine::automatic) == "automatic");
  CHECK(to_string(FillEngine::copy_engine) == "copy_engine");
  CHECK(to_string(FillEngine::sm_loads) == "sm_loads");
  for (std::string_view bad : {"", "auto", "Copy_engine", "sm_loads ", "gather"}) {
    CAPTURE(bad);
    const Result<FillEngine> r = parse_fill_engine(bad);
    REQUIRE_FALSE(r.ok());
    CHECK(r.status().code() == ErrorCode::invalid_argument);
    CHECK(r.status().message() == "unknown fill engine '" + std::string(bad) +
                                      "' (available: automatic, copy_engine, sm_loads)");
  }
}
