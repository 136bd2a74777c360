// Host tier of expert_cache through dependency('expert_cache'): the umbrella header builds and a
// cache runs on the simulated runtime.
#include "expert_cache/expert_cache.hpp"

int main() {
  const expert_cache::Status s = expert_cache::Status::format(expert_cache::ErrorCode::invalid_argument, "%d", 1);
  return s.ok() ? 1 : 0;
}
