// Expected Attention (docs/algorithms.md#expected-attention): worked numbers, random ragged and dense layers against
// the float64 reference of tests/support/reference_expected.hpp (explicit RoPE matrices), compositions, and errors.
#include <catch2/catch.hpp>

#include <kvevict/kvevict.hpp>

#include <cmath>
#include <cstdint>
#include <string>
#include <vector>

#include "support/ragged_inputs.hpp"
#include "support/random_inputs.hpp"
#include "support/reference_expected.hpp"

namespace test_expected_attention {  // this file's scope in unity builds (tests/CMakeLists.txt)

using Catch::Matchers::Contains;
using kvevict::Budget;
using kvevict::Index;
using kvevict::Selection;
using kvevict_test::Ragged;
using kvevict_test::Rng;
using kvevict_test::rows_of;
namespace ref = kvevict_ref::ragged;
namespace eref = kvevict_ref::expected;

namespace {

kvevict::ExpectedAttention::Params params_of(const eref::Params& p, int w) {
  kvevict::ExpectedAttention::Params q;
  q.window = w;
  q.rope_theta = p.theta;
  q.rotary_dim = p.rotary_dim;
  q.rope_layout = p.interleaved ? kvevict::RopeLayout::interleaved : kvevict::RopeLayout::half;
  q.future_positions = p.future;
  q.sinks = p.sinks;
  q.covariance = p.covariance;
  q.value_term = p.value_term;
  return q;
}

}  // namespace

TEST_CASE("expected attention: worked numbers on a 2-dimensional head", "[expected]") {
  // One head, d = 2 (one rotary pair, angle = position), keys at positions 0..4 whose pre-RoPE key is (1, 0), one
  // window query at position 4 whose pre-RoPE query is (1, 0); future_positions 1 (only position 5), no sinks,
  // one query: no covariance. mu' = R(5) (1, 0), so z_j = cos(j - 5) / sqrt(2):
  //   j = 0: cos 5 = 0.2837, j = 1: cos 4 = -0.6536, j = 2: cos 3 = -0.9900, j = 3: cos 2 = -0.4161.
  // Ranking of the prefix: 0, 3, 1, 2; the window (entry 4) is kept first.
  std::vector<double> k, q = {std::cos(4.0), std::sin(4.0)}, v(10, 1.0);
  for (int j = 0; j < 5; ++j) {
    k.push_back(std::cos(static_cast<double>(j)));
    k.push_back(std::sin(static_cast<double>(j)));
  }
  kvevict::LayerInputs<double> in;
  in.queries = kvevict::HeadsView<const double>::heads_major(q.data(), 1, 1, 2);
  in.keys = kvevict::kv_heads_major<const double>(k.data(), 1, 5, 2);
  in.values = kvevict::kv_heads_major<const double>(v.data(), 1, 5, 2);
  kvevict::ExpectedAttention::Params p;
  p.window = 1;
  p.future_positions = 1;
  p.sinks = 0;
  const auto kept = [&](const kvevict::ExpectedAttention::Params& params, std::int64_t n) {
    return rows_of(kvevict::ExpectedAttention(params).select<double>(in, Budget::tokens(n)));
  };
  CHECK(kept(p, 2) == ref::KeptRows{{0, 4}});
  CHECK(kept(p, 3) == ref::KeptRows{{0, 3, 4}});
  CHECK(kept(p, 4) == ref::KeptRows{{0, 1, 3, 4}});
  // ||v_0|| = 0.1 moves entry 0 below entry 2: 0.1 exp(0.2006) < exp(-0.7000) (the softmax normaliser is common).
  v[0] = 0.1;
  v[1] = 0.0;
  CHECK(kept(p, 2) == ref::KeptRows{{3, 4}});
  CHECK(kept(p, 4) == ref::KeptRows{{1, 2, 3, 4}});
  p.value_term = false;
  CHECK(kept(p, 2) == ref::KeptRows{{0, 4}});
  // Two sinks are kept first whatever their scores (at most n_kept - w of them).
  p.sinks = 2;
  CHECK(kept(p, 3) == ref::KeptRows{{0, 1, 4}});
  CHECK(kept(p, 2) == ref::KeptRows{{0, 4}});
}

TEST_CASE("expected attention: random ragged and dense layers against the float64 reference", "[expected][reference]") {
  Rng rng(2609);
  const double nan = std::numeric_limits<double>::quiet_NaN();
  for (int trial = 0; trial < 40; ++trial) {
    const int Hkv = 1 + trial % 3, G = 1 + (trial / 3) % 3, w = 1 + trial % 6, d = 2 * (1 + trial % 5);
    const bool dense = trial % 4 == 0;
    Ragged r = kvevict_test::random_ragged(rng, Hkv * G, Hkv, w, d, 20 + 3 * trial, dense ? 1.0 : 0.4);
    const std::int64_t shift = dense ? 0 : 37 * trial;
    for (auto& head : r.heads)
      for (auto& p : head.pos) p += shift;
    eref::Params p;
    p.theta = trial % 3 == 0 ? 10000.0 : (trial % 3 == 1 ? 500000.0 : 17.0);
    p.rotary_dim = trial % 5 == 3 ? d / 2 - (d / 2) % 2 : 0;
    p.interleaved = trial % 2 == 1;
    p.future = trial % 7 == 0 ? 1 : 1 + 53 * (trial % 11);
    p.sinks = trial % 6;
    p.covariance = trial % 5 != 1;
    p.value_term = trial % 4 != 2;
    const auto stored =
        kvevict_test::store<double>(r, kvevict_test::longest(r) + (dense ? 0 : 2), trial % 3 == 1, nan, 0, !dense);
    const std::vector<std::int64_t> lengths = ref::lengths(r);
    Index entries = 0;
    for (std::int64_t l : lengths) entries += l;
    for (const std::int64_t n :
         {std::int64_t{1}, std::int64_t{w}, std::int64_t{w + 2}, entries / Hkv / 2, entries / Hkv}) {
      if (n < 1) continue;
      INFO("trial " << trial << " Hkv " << Hkv << " G " << G << " w " << w << " d " << d << " rd " << p.rotary_dim
                    << " sinks " << p.sinks << " future " << p.future << " n " << n);
      const kvevict::ExpectedAttention policy(params_of(p, w));
      CHECK(rows_of(policy.select<double>(stored.in, Budget::tokens(n))) == eref::select(r, n, p));
    }
  }
}

TEST_CASE("expected attention: float storage selects as double on separated scores, compositions run", "[expected]") {
  Rng rng(77);
  const Ragged r = kvevict_test::random_ragged(rng, 8, 2, 4, 16, 300, 1.0);
  const auto d64 = kvevict_test::store<double>(r, kvevict_test::longest(r), false, 0.0, 0, false);
  const auto f32 = kvevict_test::store<float>(r, kvevict_test::longest(r), false, 0.0f, 0, false);
  kvevict::ExpectedAttention::Params p;
  p.window = 4;
  const kvevict::ExpectedAttention policy(p);
  const Budget b = Budget::keep_ratio(0.3);
  const ref::KeptRows want = rows_of(policy.select<double>(d64.in, b));
  const ref::KeptRows got = rows_of(policy.select<float>(f32.in, b));
  std::size_t same = 0, total = 0;
  for (std::size_t h = 0; h < want.size(); ++h) {
    total += want[h].size();
    for (std::int64_t j : got[h]) same += static_cast<std::size_t>(std::count(want[h].begin(), want[h].end(), j));
  }
  CHECK(same >= total - 4);  // float rounding may swap near-ties only
  // The selector composes with every base: a head-adaptive and a layer-global budget keep their totals.
  kvevict::Policy<kvevict::AdaKV, kvevict::ExpectedAttentionSelector>::Params pa;
  pa.window = 4;
  const Selection a = kvevict::Policy<kvevict::AdaKV, kvevict::ExpectedAttentionSelector>(pa).select(f32.in, b);
  CHECK(a.total() == 2 * static_cast<Index>(std::int64_t(300 * 0.3)));
  kvevict::LayerGlobalPolicy<kvevict::ExpectedAttentionSelector>::Params pg;
  pg.window = 4;
  const auto model = kvevict::LayerGlobalPolicy<kvevict::ExpectedAttentionSelector>(pg).select(
      std::vector<kvevict::LayerInputs<float>>{f32.in, f32.in}, b);
  CHECK(model.size() == 2);
  CHECK(model[0].total() + model[1].total() == 4 * static_cast<Index>(std::int64_t(300 * 0.3)));
}

TEST_CASE("expected attention: errors name what is wrong", "[expected][errors]") {
  Rng rng(5);
  const Ragged r = kvevict_test::random_ragged(rng, 2, 1, 2, 4, 12, 1.0);
  const auto s = kvevict_test::store<float>(r, 12, false, 0.0f, 0, false);
  kvevict::ExpectedAttention::Params p;
  p.window = 2;
  const Budget b = Budget::tokens(6);
  {
    std::vector<float> attn(2 * 2 * 12, 1.0f / 12);
    auto in = s.in;
    in.queries = {};
    in.attention = kvevict::HeadsView<const float>::heads_major(attn.data(), 2, 2, 12);
    REQUIRE_THROWS_WITH(kvevict::ExpectedAttention(p).select(in, b),
                        Contains("kvevict::ExpectedAttention::select: Expected Attention needs the window queries"));
    // ... as the policies say (the C API's KVEVICT_READS_QUERIES, what harnesses skip attention rows by)
    STATIC_REQUIRE(kvevict::ExpectedAttention::reads_queries());
    STATIC_REQUIRE(kvevict::Policy<kvevict::SnapKV, kvevict::ExpectedAttentionSelector>::reads_queries());
    STATIC_REQUIRE_FALSE(kvevict::SnapKV::reads_queries());
    STATIC_REQUIRE_FALSE(kvevict::LayerDefensiveKV::reads_queries());
  }
  {
    auto in = s.in;
    in.values = {};
    REQUIRE_THROWS_WITH(kvevict::ExpectedAttention(p).select(in, b), Contains("needs values"));
    auto q = p;
    q.value_term = false;
    CHECK(kvevict::ExpectedAttention(q).select(in, b).total() == 6);
  }
  {
    auto q = p;
    q.rotary_dim = 6;
    REQUIRE_THROWS_WITH(kvevict::ExpectedAttention(q).select(s.in, b),
                        Contains("must be even and in [2, head_dim = 4]"));
  }
  const auto params_error = [&](auto change, const std::string& message) {
    auto q = p;
    change(q);
    REQUIRE_THROWS_WITH(kvevict::ExpectedAttention(q), Contains("kvevict::ExpectedAttention::Params: " + message));
  };
  params_error([](auto& q) { q.future_positions = 0; }, "future_positions must be >= 1, got 0");
  params_error([](auto& q) { q.sinks = -1; }, "sinks must be >= 0, got -1");
  params_error([](auto& q) { q.rotary_dim = 3; }, "rotary_dim must be even and >= 0");
  params_error([](auto& q) { q.rope_theta = 0.0; }, "rope_theta must be finite and > 0, got 0");
}

}  // namespace test_expected_attention
