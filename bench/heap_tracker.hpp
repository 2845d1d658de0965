#pragma once
/// Heap bytes in use and their peak, counted by malloc/free interposition (heap_tracker.cpp, linked into the
/// benchmark only). Counts every allocation of the process (Eigen's aligned buffers, std::vector, ...), in
/// malloc_usable_size units. Used for the "extra memory" counters: peak_since(mark) after resetting the peak.

#include <cstdint>

namespace kvevict_bench::heap {

/// Bytes currently allocated.
std::int64_t in_use();
/// Starts a new peak measurement at the current level; returns that level.
std::int64_t mark();
/// Highest level since the last mark(), minus `level`.
std::int64_t peak_since(std::int64_t level);

}  // namespace kvevict_bench::heap
