#include <doctest/doctest.h>

#include <cstdint>
#include <limits>
#include <string>
#include <string_view>
#include <type_traits>

#include "expert_cache/base/status.hpp"
#include "expert_cache/base/types.hpp"

using namespace expert_cache;

TEST_CASE("Status carries a specific code and message") {
  Status ok;
  CHECK(ok.ok());
  CHECK(ok.to_string() == "ok");
  Status bad(ErrorCode::duplicate_expert, "expert 3 appears twice");
  CHECK_FALSE(bad.ok());
  CHECK(bad.code() == ErrorCode::duplicate_expert);
  CHECK(bad.to_string() == "duplicate_expert: expert 3 appears twice");
}

TEST_CASE("Result holds a value or an error; value() on error throws Error with the code") {
  Result<int> good(7);
  REQUIRE(good.ok());
  CHECK(good.value() == 7);
  Result<int> bad(Status(ErrorCode::expert_out_of_range, "id 600 >= 512"));
  CHECK_FALSE(bad.ok());
  CHECK(bad.status().code() == ErrorCode::expert_out_of_range);
  try {
    (void)bad.value();
    FAIL("value() on an error must throw");
  } catch (const Error& e) {
    CHECK(e.code() == ErrorCode::expert_out_of_range);
    CHECK(std::string(e.what()).find("id 600") != std::string::npos);
  }
  Result<int> from_ok_status{Status()};
  CHECK(from_ok_status.status().code() == ErrorCode::internal);
}

TEST_CASE("strong ids compare and report validity") {
  CHECK(ExpertId(3) < ExpertId(4));
  CHECK(ExpertId(3) == ExpertId(3));
  // The line above passes even if == always answers true; these fail then.
  CHECK_FALSE(ExpertId(3) == ExpertId(4));
  CHECK(ExpertId(3) != ExpertId(4));
  CHECK_FALSE(ExpertId(4) < ExpertId(3));
  CHECK_FALSE(SlotId().valid());
  CHECK(SlotId(0).valid());
  CHECK(ExpertId(5).index() == 5u);
}

TEST_CASE("Status::format builds the message in place; long messages are truncated, never lost") {
  const Status s = Status::format(ErrorCode::expert_out_of_range, "expert id %d is outside [0, %d)", 600, 512);
  CHECK(s.code() == ErrorCode::expert_out_of_range);
  CHECK(s.message() == "expert id 600 is outside [0, 512)");

  const std::string long_text(1000, 'x');
  const Status t(ErrorCode::internal, long_text);
  CHECK(t.message().size() == Status::message_capacity);
  CHECK(t.message().substr(t.message().size() - 3) == "...");
  CHECK(t.message().substr(0, 10) == "xxxxxxxxxx");
  const Status f = Status::format(ErrorCode::internal, "%s", long_text.c_str());
  CHECK(f.message() == t.message());

  const Status c = s.with_context("prepare(layer %d)", 7);
  CHECK(c.code() == ErrorCode::expert_out_of_range);
  CHECK(c.message() == "prepare(layer 7): expert id 600 is outside [0, 512)");
  const Status still_ok = Status().with_context("ignored %d", 1);
  CHECK(still_ok.ok());
  CHECK(still_ok.message().empty());
}

TEST_CASE("Status is a trivially copyable value: copies keep code and message") {
  static_assert(std::is_trivially_copyable_v<Status>);
  const Status a = Status::format(ErrorCode::duplicate_expert, "expert %d twice", 3);
  Status b;
  b = a;
  CHECK(b.code() == ErrorCode::duplicate_expert);
  CHECK(b.message() == "expert 3 twice");
  CHECK(Error(b).code() == ErrorCode::duplicate_expert);
  CHECK(std::string(Error(b).what()) == "duplicate_expert: expert 3 twice");
}

TEST_CASE("detail::join and DecimalText spell messages as std::to_string and concatenation do") {
  using detail::DecimalText;
  CHECK(std::string_view(DecimalText(0)) == "0");
  CHECK(std::string_view(DecimalText(-7)) == std::to_string(-7));
  CHECK(std::string_view(DecimalText(std::numeric_limits<std::int64_t>::min())) ==
        std::to_string(std::numeric_limits<std::int64_t>::min()));
  CHECK(std::string_view(DecimalText(std::numeric_limits<std::uint64_t>::max())) ==
        std::to_string(std::numeric_limits<std::uint64_t>::max()));
  CHECK(std::string_view(DecimalText(std::numeric_limits<std::int32_t>::min())) ==
        std::to_string(std::numeric_limits<std::int32_t>::min()));
  CHECK(std::string_view(DecimalText(std::size_t{4096})) == "4096");
  const std::string label = "layer 3";
  CHECK(detail::join({label, ": ", DecimalText(16), " of ", DecimalText(64), " experts"}) == "layer 3: 16 of 64 experts");
  CHECK(detail::join({}).empty());
  CHECK(detail::join({std::string_view("a\0b", 3)}) == std::string("a\0b", 3));
}
