// value/value_norm.hpp OutputGram and LayerInputs::w_o_gram: the per-layer Gram matrices W_o^T W_o an engine
// computes once at model load. With them the L2 value term selects exactly as when the library computes them per
// select; a Gram of the wrong shape or with NaN/Inf is refused with a message.
#include <catch2/catch.hpp>

#include <kvevict/kvevict.hpp>

#include <limits>
#include <string>

#include "support/cases.hpp"
#include "support/random_inputs.hpp"
#include "support/selector_inputs.hpp"

namespace test_output_gram {  // this file's scope in unity builds (tests/CMakeLists.txt)

using Catch::Matchers::Contains;
using kvevict::Budget;
using kvevict::OutputGram;
using kvevict::Selection;
using kvevict::ValueNorm;
using kvevict_test::Layout;
using kvevict_test::Rng;
using kvevict_test::Shape;

namespace {

template <class Policy, class T>
void same_with_precomputed_gram(const char* name, kvevict_test::VStored<T>& stored, const Shape& s,
                                std::int64_t n_kept) {
  typename Policy::Params p;
  p.window = s.w;
  p.value_norm = ValueNorm::l2;
  const Policy policy(p);
  stored.in.w_o_gram = nullptr;
  const Selection computed = policy.select(stored.in, Budget::tokens(n_kept));
  const auto gram = OutputGram<kvevict::gram_scalar_t<T>>::compute(stored.in.w_o);
  stored.in.w_o_gram = &gram;
  const Selection given = policy.select(stored.in, Budget::tokens(n_kept));
  stored.in.w_o_gram = nullptr;
  INFO(name << " " << kvevict_test::describe(s) << " n_kept=" << n_kept);
  CHECK(given.indices() == computed.indices());
  CHECK(given.offsets() == computed.offsets());
}

}  // namespace

TEMPLATE_TEST_CASE("w_o_gram: a precomputed Gram selects exactly as the per-select one", "[value][gram]", float,
                   double) {
  Rng rng(41);
  for (int c = 0; c < kvevict_test::cases(40); ++c) {
    const Shape s = kvevict_test::random_shape(rng, 96);
    auto stored = kvevict_test::store_v<TestType>(kvevict_test::random_vlayer(s, 20, rng), Layout::tokens_major);
    const std::int64_t n_kept = std::uniform_int_distribution<std::int64_t>(1, s.L)(rng);
    same_with_precomputed_gram<kvevict::CriticalKV>("criticalkv", stored, s, n_kept);
    same_with_precomputed_gram<kvevict::DefensiveKV>("defensivekv", stored, s, n_kept);
  }
}

TEST_CASE("w_o_gram: the Gram matrices are W^T W of each head's W_o block", "[value][gram]") {
  Rng rng(42);
  const Shape s{4, 2, 2, 10, 6};
  const auto l = kvevict_test::random_vlayer(s, 9, rng);
  const auto stored = kvevict_test::store_v<double>(l, Layout::heads_major);
  const auto g = OutputGram<double>::compute(stored.in.w_o);
  REQUIRE(g.heads() == s.H);
  for (kvevict::Index q = 0; q < s.H; ++q) {
    const kvevict::RowMatrix<double> w = stored.in.w_o.head(q);
    const kvevict::RowMatrix<double> want = w.transpose() * w;
    CHECK((g.per_head[static_cast<std::size_t>(q)] - want).cwiseAbs().maxCoeff() <= 1e-12);
  }
  // Widened from float: the same matrices to float precision.
  const auto f = OutputGram<float>::compute(kvevict_test::store_v<float>(l, Layout::heads_major).in.w_o).cast<double>();
  for (kvevict::Index q = 0; q < s.H; ++q)
    CHECK((f.per_head[static_cast<std::size_t>(q)] - g.per_head[static_cast<std::size_t>(q)]).cwiseAbs().maxCoeff() <=
          1e-5);
}

TEST_CASE("w_o_gram: a Gram of the wrong shape or with NaN is refused", "[value][gram][errors]") {
  Rng rng(43);
  const Shape s{4, 2, 2, 12, 6};
  auto stored = kvevict_test::store_v<float>(kvevict_test::random_vlayer(s, 9, rng), Layout::heads_major);
  kvevict::CriticalKV::Params p;
  p.window = s.w;
  p.value_norm = ValueNorm::l2;
  const kvevict::CriticalKV policy(p);
  auto gram = OutputGram<float>::compute(stored.in.w_o);

  auto fewer = gram;
  fewer.per_head.pop_back();
  stored.in.w_o_gram = &fewer;
  CHECK_THROWS_WITH(policy.select(stored.in, Budget::tokens(6)), Contains("one Gram matrix per query head (4), got 3"));

  auto wrong = gram;
  wrong.per_head[1].resize(5, 5);
  stored.in.w_o_gram = &wrong;
  CHECK_THROWS_WITH(policy.select(stored.in, Budget::tokens(6)), Contains("w_o_gram head 1 must be [6, 6]"));

  auto nan = gram;
  nan.per_head[2](1, 3) = std::numeric_limits<float>::quiet_NaN();
  stored.in.w_o_gram = &nan;
  CHECK_THROWS_WITH(policy.select(stored.in, Budget::tokens(6)), Contains("w_o_gram head 2 is not finite"));

  stored.in.w_o_gram = &gram;
  CHECK_NOTHROW(policy.select(stored.in, Budget::tokens(6)));
}

}  // namespace test_output_gram
