// Half-precision storage: keys, values, queries and W_o stored as Eigen::half or Eigen::bfloat16 (what engines
// keep their KV cache in) are read through the same views and converted to the arithmetic type S (float by
// default) inside the library. The selection must be exactly the one of float storage holding the same values.
#include <catch2/catch.hpp>

#include <kvevict/kvevict.hpp>

#include <Eigen/Core>

#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "support/cases.hpp"
#include "support/random_inputs.hpp"
#include "support/selector_inputs.hpp"

namespace test_half_storage {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Budget;
using kvevict::Selection;
using kvevict_test::Layout;
using kvevict_test::Rng;
using kvevict_test::Shape;
using kvevict_test::VLayer;

namespace {

template <class Policy, class T>
void same_as_float_storage(const char* name, const VLayer& l, std::int64_t n_kept, Layout layout) {
  typename Policy::Params p;
  p.window = l.s.w;
  const Policy policy(p);
  const auto narrow = kvevict_test::store_v<T>(l, layout);
  const auto wide = kvevict_test::store_v<float>(l, layout);
  const Selection a = policy.select(narrow.in, Budget::tokens(n_kept));
  const Selection b = policy.select(wide.in, Budget::tokens(n_kept));
  INFO(name << " " << kvevict_test::describe(l.s) << " n_kept=" << n_kept);
  CHECK(a.indices() == b.indices());
  CHECK(a.offsets() == b.offsets());
}

}  // namespace

TEMPLATE_TEST_CASE(
    "half storage: Eigen::half and Eigen::bfloat16 inputs select exactly as float storage of the same "
    "values",
    "[views][half]", Eigen::half, Eigen::bfloat16) {
  using T = TestType;
  Rng rng(31);
  for (int c = 0; c < kvevict_test::cases(60); ++c) {
    const Shape s = kvevict_test::random_shape(rng, 160);
    const VLayer l = kvevict_test::rounded_to<T>(kvevict_test::random_vlayer(s, 24, rng));
    const std::int64_t n_kept = std::uniform_int_distribution<std::int64_t>(1, s.L)(rng);
    const Layout layout = c % 2 ? Layout::heads_major : Layout::tokens_major;
    same_as_float_storage<kvevict::SnapKV, T>("snapkv", l, n_kept, layout);
    same_as_float_storage<kvevict::AdaKV, T>("adakv", l, n_kept, layout);
    same_as_float_storage<kvevict::CriticalKV, T>("criticalkv", l, n_kept, layout);
    same_as_float_storage<kvevict::DefensiveKV, T>("defensivekv", l, n_kept, layout);
    same_as_float_storage<kvevict::KNorm, T>("knorm", l, n_kept, layout);
    same_as_float_storage<kvevict::KeyDiff, T>("keydiff", l, n_kept, layout);
  }
}

TEMPLATE_TEST_CASE(
    "half storage: window attention rows and value norms equal float storage bit for bit across the key blocks "
    "they are converted in",
    "[views][half]", Eigen::half, Eigen::bfloat16) {
  using T = TestType;
  namespace ext = kvevict::extend;
  Rng rng(57);
  // Keys and values are converted 256 rows at a time (the last block up to 511): contexts around those edges.
  for (int L : {40, 255, 256, 257, 511, 512, 513, 767, 768, 1100}) {
    Shape s;
    s.H = 4, s.Hkv = 2, s.w = 8, s.L = L, s.d = 24;
    const VLayer l = kvevict_test::rounded_to<T>(kvevict_test::random_vlayer(s, 20, rng));
    const Layout layout = L % 2 ? Layout::heads_major : Layout::tokens_major;
    const auto narrow = kvevict_test::store_v<T>(l, layout);
    const auto wide = kvevict_test::store_v<float>(l, layout);
    INFO(kvevict_test::describe(s));
    const auto shape = kvevict::detail::validate_inputs(wide.in, s.w, "test");
    std::vector<kvevict::RowMatrix<float>> rows_wide;
    ext::observe<float>(wide.in, shape).for_each_head([&](kvevict::Index, const kvevict::RowMatrix<float>& rows) {
      rows_wide.push_back(rows);
    });
    std::size_t q = 0;
    ext::observe<float>(narrow.in, shape).for_each_head([&](kvevict::Index, const kvevict::RowMatrix<float>& rows) {
      CHECK((rows.array() == rows_wide[q++].array()).all());
    });
    for (auto norm : {kvevict::ValueNorm::l1, kvevict::ValueNorm::l2}) {
      const auto gram = kvevict::OutputGram<float>::compute(wide.in.w_o);
      const auto a = ext::value_norms<float>(narrow.in.values, narrow.in.w_o, shape, norm, &gram);
      const auto b = ext::value_norms<float>(wide.in.values, wide.in.w_o, shape, norm, &gram);
      CHECK((a.array() == b.array()).all());
    }
  }
}

TEMPLATE_TEST_CASE("half storage: NaN and Inf keys and values are refused by name, found on their bits",
                   "[views][errors]", Eigen::half, Eigen::bfloat16) {
  using T = TestType;
  // Every bit pattern: the bit test agrees with the float value's finiteness.
  int wrong = 0, non_finite = 0;
  for (int b = 0; b < 65536; ++b) {
    const T x = Eigen::numext::bit_cast<T>(static_cast<std::uint16_t>(b));
    const Eigen::Matrix<T, 1, 1> one(x);
    const bool finite = std::isfinite(static_cast<float>(x));
    non_finite += finite ? 0 : 1;
    wrong += kvevict::detail::all_finite(one) == finite ? 0 : 1;
  }
  CHECK(wrong == 0);
  CHECK(non_finite == (std::is_same_v<T, Eigen::half> ? 2 * 1024 : 2 * 128));
  // One bad entry anywhere in rows of 70 (two 32-wide chunks and a tail) is named with its position.
  Rng rng(3);
  const VLayer l = kvevict_test::random_vlayer(Shape{4, 2, 4, 40, 70}, 8, rng);
  const kvevict::SnapKV snap([&] {
    kvevict::SnapKV::Params p;
    p.window = l.s.w;
    return p;
  }());
  for (int c : {0, 31, 32, 63, 64, 69}) {
    auto stored = kvevict_test::store_v<T>(l, Layout::heads_major);
    const float bad = c % 2 ? std::numeric_limits<float>::infinity() : std::numeric_limits<float>::quiet_NaN();
    stored.k[static_cast<std::size_t>((1 * l.s.L + 17) * l.s.d + c)] = T(bad);  // heads-major [Hkv, L, d]
    try {
      snap.select(stored.in, Budget::tokens(10));
      FAIL("accepted a non-finite key at column " << c);
    } catch (const kvevict::invalid_argument& e) {
      CHECK_THAT(e.what(), Catch::Contains("keys[1, 17, " + std::to_string(c) + "] is not finite"));
    }
  }
}

}  // namespace test_half_storage
