// core/budget.hpp: the three budget forms and their resolution against the context length (docs/algorithms.md section
// 1).
#include <catch2/catch.hpp>

#include <kvevict/kvevict.hpp>

#include <cmath>
#include <cstdint>
#include <limits>
#include <random>

#include "support/matchers.hpp"
#include "support/random_inputs.hpp"

namespace test_budget {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Budget;
using kvevict_test::MessageContains;

TEST_CASE("spec numbers: L = 1000 with compression ratio 0.8 keeps 199, keep ratio 0.2 keeps 200", "[budget]") {
  CHECK(Budget::compression_ratio(0.8).n_kept(1000) == 199);  // 1000 * 0.19999999999999996, truncated
  CHECK(Budget::keep_ratio(0.2).n_kept(1000) == 200);
  CHECK(Budget::tokens(200).n_kept(1000) == 200);
  CHECK(kvevict_ref::n_kept_from_compression_ratio(1000, 0.8) == 199);
  CHECK(kvevict_ref::n_kept_from_keep_ratio(1000, 0.2) == 200);
}

TEST_CASE("budget kinds and values are reported as given", "[budget]") {
  CHECK(Budget::tokens(17).kind() == Budget::Kind::tokens);
  CHECK(Budget::tokens(17).value() == 17.0);
  CHECK(Budget::keep_ratio(0.25).kind() == Budget::Kind::keep_ratio);
  CHECK(Budget::keep_ratio(0.25).value() == 0.25);
  CHECK(Budget::compression_ratio(0.5).kind() == Budget::Kind::compression_ratio);
  CHECK(Budget::compression_ratio(0.5).value() == 0.5);
}

TEST_CASE("budget edges: keep ratio 1 and compression ratio 0 keep everything, tokens resolve to themselves",
          "[budget]") {
  for (kvevict::Index L : {1, 2, 33, 1000, 4097}) {
    CHECK(Budget::keep_ratio(1.0).n_kept(L) == L);
    CHECK(Budget::compression_ratio(0.0).n_kept(L) == L);
    CHECK(Budget::tokens(1).n_kept(L) == 1);
    CHECK(Budget::tokens(L).n_kept(L) == L);
  }
}

TEST_CASE("ratio budgets truncate toward zero in double precision, like the reference", "[budget]") {
  kvevict_test::Rng rng(21);
  std::uniform_int_distribution<std::int64_t> len(1, 20000);
  std::uniform_real_distribution<double> ratio(0.0, 1.0);
  int compared = 0;
  for (int t = 0; t < 3000; ++t) {
    const std::int64_t L = len(rng);
    const double r =
        t % 3 == 0 ? static_cast<double>(std::uniform_int_distribution<int>(1, 99)(rng)) / 100.0 : ratio(rng);
    const std::int64_t from_cr = kvevict_ref::n_kept_from_compression_ratio(L, r);
    const std::int64_t from_keep = kvevict_ref::n_kept_from_keep_ratio(L, r);
    if (from_cr >= 1) {
      REQUIRE(Budget::compression_ratio(r).n_kept(L) == from_cr);
      ++compared;
    } else {
      REQUIRE_THROWS_AS(Budget::compression_ratio(r).n_kept(L), kvevict::invalid_argument);
    }
    if (r > 0.0 && from_keep >= 1) {
      REQUIRE(Budget::keep_ratio(r).n_kept(L) == from_keep);
      ++compared;
    } else if (r > 0.0) {
      REQUIRE_THROWS_AS(Budget::keep_ratio(r).n_kept(L), kvevict::invalid_argument);
    }
  }
  CHECK(compared > 4000);
}

TEST_CASE("well-known truncation cases of the ratio forms", "[budget]") {
  // 0.1 * 30 = 3.0000000000000004 -> 3; 0.7 * 10 = 7.000000000000001 -> 7; (1 - 0.7) * 10 = 3.0000000000000004.
  CHECK(Budget::keep_ratio(0.1).n_kept(30) == 3);
  CHECK(Budget::keep_ratio(0.7).n_kept(10) == 7);
  CHECK(Budget::compression_ratio(0.7).n_kept(10) == 3);
  // (1 - 0.9) * 100 = 9.999999999999998 -> 9, not 10.
  CHECK(Budget::compression_ratio(0.9).n_kept(100) == 9);
  CHECK(Budget::keep_ratio(0.5).n_kept(3) == 1);
  CHECK(Budget::keep_ratio(0.999).n_kept(3) == 2);
}

TEST_CASE("n_kept outside 1 .. L is an error for all three budget forms", "[budget][errors]") {
  // A token count below 1 is refused when the budget is made, as a ratio out of range is.
  REQUIRE_THROWS_MATCHES(Budget::tokens(0), kvevict::invalid_argument,
                         MessageContains("kvevict::Budget::tokens: tokens must be >= 1, got 0"));
  REQUIRE_THROWS_MATCHES(Budget::tokens(-3), kvevict::invalid_argument,
                         MessageContains("kvevict::Budget::tokens: tokens must be >= 1, got -3"));
  REQUIRE_THROWS_MATCHES(Budget::tokens(33).n_kept(32), kvevict::invalid_argument,
                         MessageContains("n_kept must be in [1, 32] (the context length), got 33"));
  // The ratio forms cannot exceed L; they can round down to 0.
  REQUIRE_THROWS_MATCHES(Budget::keep_ratio(0.01).n_kept(32), kvevict::invalid_argument,
                         MessageContains("n_kept must be in [1, 32] (the context length), got 0 from keep ratio 0.01"));
  REQUIRE_THROWS_MATCHES(
      Budget::compression_ratio(0.99).n_kept(32), kvevict::invalid_argument,
      MessageContains("n_kept must be in [1, 32] (the context length), got 0 from compression ratio 0.99"));
  // The caller's entry point names itself.
  REQUIRE_THROWS_MATCHES(Budget::tokens(33).n_kept(32, "select"), kvevict::invalid_argument,
                         MessageContains("kvevict::select: n_kept"));
}

TEST_CASE("keep ratio must be above 0 and at most 1", "[budget][errors]") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  const double inf = std::numeric_limits<double>::infinity();
  REQUIRE_THROWS_MATCHES(Budget::keep_ratio(0.0), kvevict::invalid_argument,
                         MessageContains("keep ratio must be in (0, 1], got 0"));
  REQUIRE_THROWS_MATCHES(Budget::keep_ratio(-0.5), kvevict::invalid_argument,
                         MessageContains("keep ratio must be in (0, 1], got -0.5"));
  REQUIRE_THROWS_MATCHES(Budget::keep_ratio(1.5), kvevict::invalid_argument,
                         MessageContains("keep ratio must be in (0, 1], got 1.5"));
  REQUIRE_THROWS_MATCHES(Budget::keep_ratio(nan), kvevict::invalid_argument,
                         MessageContains("keep ratio must be in (0, 1], got"));
  REQUIRE_THROWS_MATCHES(Budget::keep_ratio(inf), kvevict::invalid_argument,
                         MessageContains("keep ratio must be in (0, 1], got inf"));
  CHECK_NOTHROW(Budget::keep_ratio(1.0));
  CHECK_NOTHROW(Budget::keep_ratio(std::numeric_limits<double>::denorm_min()));
}

TEST_CASE("compression ratio must be at least 0 and below 1", "[budget][errors]") {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  REQUIRE_THROWS_MATCHES(Budget::compression_ratio(-0.1), kvevict::invalid_argument,
                         MessageContains("compression ratio must be in [0, 1), got -0.1"));
  REQUIRE_THROWS_MATCHES(Budget::compression_ratio(1.0), kvevict::invalid_argument,
                         MessageContains("compression ratio must be in [0, 1), got 1"));
  REQUIRE_THROWS_MATCHES(Budget::compression_ratio(2.0), kvevict::invalid_argument,
                         MessageContains("compression ratio must be in [0, 1), got 2"));
  REQUIRE_THROWS_MATCHES(Budget::compression_ratio(nan), kvevict::invalid_argument,
                         MessageContains("compression ratio must be in [0, 1), got"));
  REQUIRE_THROWS_MATCHES(Budget::compression_ratio(-std::numeric_limits<double>::infinity()), kvevict::invalid_argument,
                         MessageContains("compression ratio must be in [0, 1)"));
  CHECK_NOTHROW(Budget::compression_ratio(0.0));
  CHECK_NOTHROW(Budget::compression_ratio(std::nextafter(1.0, 0.0)));
}

}  // namespace test_budget
