// Half-precision storage: keys, values, queries and W_o stored as Eigen::half or Eigen::bfloat16 (what engines
// keep their KV cache in) are read through the same views and converted to the arithmetic type S (float by
// default) inside the library. The selection must be exactly the one of float storage holding the same values.
#include <catch2/catch.hpp>

#include <kvevict/kvevict.hpp>

#include <Eigen/Core>

#include <string>
#include <vector>

#include "support/random_inputs.hpp"
#include "support/selector_inputs.hpp"

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
  for (int c = 0; c < 60; ++c) {
    const Shape s = kvevict_test::random_shape(rng, 160);
    const VLayer l = kvevict_test::rounded_to<T>(kvevict_test::random_vlayer(s, 24, rng));
    const std::int64_t n_kept = std::uniform_int_distribution<std::int64_t>(1, s.L)(rng);
    const Layout layout = c % 2 ? Layout::heads_major : Layout::tokens_major;
    same_as_float_storage<kvevict::SnapKV, T>("snapkv", l, n_kept, layout);
    same_as_float_storage<kvevict::AdaKV, T>("adakv", l, n_kept, layout);
    same_as_float_storage<kvevict::CriticalKV, T>("criticalkv", l, n_kept, layout);
    same_as_float_storage<kvevict::DefensiveKV, T>("defensivekv", l, n_kept, layout);
  }
}
