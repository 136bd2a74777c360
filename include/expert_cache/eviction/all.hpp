#pragma once
/// Every eviction policy shipped with the library.
#include "expert_cache/eviction/arc.hpp"
#include "expert_cache/eviction/belady.hpp"
#include "expert_cache/eviction/crf.hpp"
#include "expert_cache/eviction/layer_share.hpp"
#include "expert_cache/eviction/lfru.hpp"
#include "expert_cache/eviction/lrfu.hpp"
#include "expert_cache/eviction/lru.hpp"
#include "expert_cache/eviction/s3fifo.hpp"
#include "expert_cache/eviction/sieve.hpp"
#include "expert_cache/eviction/wtinylfu.hpp"
