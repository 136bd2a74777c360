#include <doctest/doctest.h>

#include "expert_cache/status.hpp"
#include "expert_cache/types.hpp"

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
  CHECK_FALSE(SlotId().valid());
  CHECK(SlotId(0).valid());
  CHECK(ExpertId(5).index() == 5u);
}
