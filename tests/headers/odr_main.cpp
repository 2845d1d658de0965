// ODR test driver: links odr_a.cpp and odr_b.cpp (both include <kvevict/kvevict.hpp>) and checks that they agree.
// With KVEVICT_ODR_MIXED_MODES, unit A is built with KVEVICT_OPENMP and unit B without: each must run its own mode.
#include <catch2/catch.hpp>

#include <string>

#include "odr.hpp"

TEST_CASE("two translation units of the umbrella header link into one program and select alike", "[headers][odr]") {
  const kvevict_odr::Result a = kvevict_odr::run_a();
  const kvevict_odr::Result b = kvevict_odr::run_b();
  const char* names[] = {"SnapKV", "AdaKV", "StreamingLLM", "SnapKV select<double>", "SnapKV double storage"};
  constexpr std::size_t expected = sizeof(names) / sizeof(names[0]);
  REQUIRE(a.indices.size() == expected);
  REQUIRE(b.indices.size() == expected);
  for (std::size_t i = 0; i < expected; ++i) {
    INFO(names[i]);
    CHECK(a.indices[i] == b.indices[i]);
    CHECK(a.offsets[i] == b.offsets[i]);
    // 2 KV heads, 48 tokens kept per head on average: the total is exact for every policy.
    CHECK(a.offsets[i].size() == 3);
    CHECK(a.offsets[i].back() == 2 * 48);
    CHECK(a.indices[i].size() == static_cast<std::size_t>(2 * 48));
  }
#if defined(KVEVICT_ODR_MIXED_MODES)
  // Without the inline namespace of core/config.hpp the linker would keep one definition of every shared template
  // (and of threading_mode()) for both units.
  CHECK(a.threading_mode == "openmp");
  CHECK(b.threading_mode == "serial");
#else
  CHECK(a.threading_mode == b.threading_mode);
#endif
}
