// glibc malloc interposition: the benchmark executable defines malloc & co., forwards to glibc's __libc_*
// entry points and counts malloc_usable_size of every block. Benchmark-only (never in the library).

#include "heap_tracker.hpp"

#include <malloc.h>

#include <atomic>
#include <cerrno>
#include <cstddef>

extern "C" {
void* __libc_malloc(std::size_t);
void __libc_free(void*);
void* __libc_calloc(std::size_t, std::size_t);
void* __libc_realloc(void*, std::size_t);
void* __libc_memalign(std::size_t, std::size_t);
}

namespace {

std::atomic<std::int64_t> g_in_use{0};
std::atomic<std::int64_t> g_peak{0};

void note_alloc(void* p) {
  if (p == nullptr) return;
  const auto now = g_in_use.fetch_add(static_cast<std::int64_t>(malloc_usable_size(p))) +
                   static_cast<std::int64_t>(malloc_usable_size(p));
  auto peak = g_peak.load(std::memory_order_relaxed);
  while (now > peak && !g_peak.compare_exchange_weak(peak, now, std::memory_order_relaxed)) {
  }
}

void note_free(void* p) {
  if (p != nullptr) g_in_use.fetch_sub(static_cast<std::int64_t>(malloc_usable_size(p)));
}

void* aligned(std::size_t alignment, std::size_t size) {
  void* p = __libc_memalign(alignment, size);
  note_alloc(p);
  return p;
}

}  // namespace

extern "C" {

void* malloc(std::size_t size) {
  void* p = __libc_malloc(size);
  note_alloc(p);
  return p;
}

void free(void* p) {
  note_free(p);
  __libc_free(p);
}

void* calloc(std::size_t n, std::size_t size) {
  void* p = __libc_calloc(n, size);
  note_alloc(p);
  return p;
}

void* realloc(void* old, std::size_t size) {
  const auto old_size = old != nullptr ? static_cast<std::int64_t>(malloc_usable_size(old)) : 0;
  void* p = __libc_realloc(old, size);
  if (p == nullptr && size != 0) return p;  // the old block is untouched
  g_in_use.fetch_sub(old_size);
  note_alloc(p);
  return p;
}

void* memalign(std::size_t alignment, std::size_t size) { return aligned(alignment, size); }
void* aligned_alloc(std::size_t alignment, std::size_t size) { return aligned(alignment, size); }

int posix_memalign(void** out, std::size_t alignment, std::size_t size) {
  if (alignment % sizeof(void*) != 0 || (alignment & (alignment - 1)) != 0) return EINVAL;
  void* p = aligned(alignment, size);
  if (p == nullptr) return ENOMEM;
  *out = p;
  return 0;
}

}  // extern "C"

namespace kvevict_bench::heap {

std::int64_t in_use() { return g_in_use.load(); }

std::int64_t mark() {
  const auto now = g_in_use.load();
  g_peak.store(now);
  return now;
}

std::int64_t peak_since(std::int64_t level) { return g_peak.load() - level; }

}  // namespace kvevict_bench::heap
