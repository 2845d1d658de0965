// ODR test driver: links odr_a.cpp and odr_b.cpp (both include <kvevict/kvevict.hpp>) and checks that they agree.
#include <cstdio>
#include <exception>

#include "odr.hpp"

int main() {
  try {
    const kvevict_odr::Result a = kvevict_odr::run_a();
    const kvevict_odr::Result b = kvevict_odr::run_b();
    const char* names[] = {"SnapKV", "AdaKV", "StreamingLLM", "SnapKV select<double>", "SnapKV double storage"};
    constexpr std::size_t expected = sizeof(names) / sizeof(names[0]);
    if (a.indices.size() != expected || b.indices.size() != expected) {
      std::fprintf(stderr, "odr: expected %zu selections per unit\n", expected);
      return 1;
    }
    int failures = 0;
    for (std::size_t i = 0; i < expected; ++i) {
      const bool same = a.indices[i] == b.indices[i] && a.offsets[i] == b.offsets[i];
      // 2 KV heads, 48 tokens kept per head on average: the total is exact for every policy.
      const bool sized = a.offsets[i].size() == 3 && a.offsets[i].back() == 2 * 48 &&
                         a.indices[i].size() == static_cast<std::size_t>(2 * 48);
      if (!same || !sized) {
        std::fprintf(stderr, "odr: %s: %s\n", names[i], same ? "wrong budget accounting" : "units disagree");
        ++failures;
      }
    }
#if defined(KVEVICT_ODR_MIXED_MODES)
    // Unit A is built with KVEVICT_OPENMP, unit B without: each must run its own mode's code. Without the inline
    // namespace of core/config.hpp the linker would keep one definition of every shared template for both.
    if (a.threading_mode != "openmp" || b.threading_mode != "serial") {
      std::fprintf(stderr, "odr: threading modes merged: unit A runs '%s' (want openmp), unit B '%s' (want serial)\n",
                   a.threading_mode.c_str(), b.threading_mode.c_str());
      ++failures;
    }
#endif
    if (failures == 0)
      std::printf("odr: %zu selections agree across two translation units (modes: %s, %s)\n", expected,
                  a.threading_mode.c_str(), b.threading_mode.c_str());
    return failures == 0 ? 0 : 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "odr: unexpected exception: %s\n", e.what());
    return 1;
  }
}
