// The StreamingLLM baseline (sinks + recent tokens: Policy<UniformAllocation, RecencySelector>), against the reference.
#include <catch2/catch.hpp>

#include <kvevict/kvevict.hpp>

#include <algorithm>
#include <cstdint>
#include <random>
#include <vector>

#include "support/matchers.hpp"
#include "support/random_inputs.hpp"

namespace test_streaming_llm {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Budget;
using kvevict::Index;
using kvevict::StreamingLLM;
using kvevict_test::Kept;
using kvevict_test::MessageContains;
using kvevict_test::Rng;

namespace {

StreamingLLM with_sinks(Index sinks) {
  StreamingLLM::Params p;
  p.sinks = sinks;
  return StreamingLLM(p);
}

/// The selection of a layer of kv_heads x tokens (keys [Hkv, L, 1] of zeros: StreamingLLM reads only their shape).
template <class P>
kvevict::Selection select_shape(const P& policy, Index kv_heads, Index tokens, const Budget& budget) {
  const std::vector<float> keys(static_cast<std::size_t>(std::max<Index>(1, kv_heads * tokens)), 0.0f);
  kvevict::LayerInputs<float> in;
  in.keys = kvevict::kv_heads_major<const float>(keys.data(), kv_heads, tokens, 1);
  return policy.select(in, budget);
}

}  // namespace

TEST_CASE("StreamingLLM matches the reference for every budget form, sink count and shape", "[streaming]") {
  Rng rng(91);
  for (int t = 0; t < 60; ++t) {
    const kvevict_test::Shape s = kvevict_test::random_shape(rng, t < 55 ? 200 : 5000);
    for (int sinks : {0, 1, 4, 7, 64}) {
      const StreamingLLM policy = with_sinks(sinks);
      for (std::int64_t n : kvevict_test::budget_sweep(s, rng)) {
        INFO(kvevict_test::describe(s) << " sinks=" << sinks << " n_kept=" << n);
        const Kept want = kvevict_ref::streamingllm(s.Hkv, s.L, n, sinks);
        const kvevict::Selection sel = select_shape(policy, s.Hkv, s.L, Budget::tokens(n));
        REQUIRE(kvevict_test::structure_errors(sel, s.Hkv, s.L) == "");
        REQUIRE(kvevict_test::first_difference(kvevict_test::kept_of(sel), want) == "");
        REQUIRE(sel.total() == s.Hkv * n);
        const double keep = static_cast<double>(n) / s.L;
        const std::int64_t nk = kvevict_ref::n_kept_from_keep_ratio(s.L, keep);
        if (nk >= 1)
          REQUIRE(kvevict_test::kept_of(select_shape(policy, s.Hkv, s.L, Budget::keep_ratio(keep))) ==
                  kvevict_ref::streamingllm(s.Hkv, s.L, nk, sinks));
        const std::int64_t nc = kvevict_ref::n_kept_from_compression_ratio(s.L, 1.0 - keep);
        if (nc >= 1 && keep > 0.0 && keep <= 1.0)
          REQUIRE(kvevict_test::kept_of(select_shape(policy, s.Hkv, s.L, Budget::compression_ratio(1.0 - keep))) ==
                  kvevict_ref::streamingllm(s.Hkv, s.L, nc, sinks));
      }
    }
  }
}

TEST_CASE("StreamingLLM: hand-worked cases", "[streaming]") {
  const StreamingLLM s4;
  CHECK(s4.params().sinks == 4);
  CHECK(kvevict_test::kept_of(select_shape(s4, 2, 12, Budget::tokens(6))) ==
        Kept{{0, 1, 2, 3, 10, 11}, {0, 1, 2, 3, 10, 11}});
  // n_kept <= sinks: only sinks.
  CHECK(kvevict_test::kept_of(select_shape(s4, 1, 12, Budget::tokens(3))) == Kept{{0, 1, 2}});
  CHECK(kvevict_test::kept_of(select_shape(s4, 1, 12, Budget::tokens(4))) == Kept{{0, 1, 2, 3}});
  // n_kept == L: everything.
  CHECK(kvevict_test::kept_of(select_shape(s4, 1, 5, Budget::tokens(5))) == Kept{{0, 1, 2, 3, 4}});
  // Zero sinks: recency only.
  CHECK(kvevict_test::kept_of(select_shape(with_sinks(0), 1, 12, Budget::tokens(3))) == Kept{{9, 10, 11}});
  // Spec budget: L = 1000, compression 0.8 -> 199 tokens per head.
  CHECK(select_shape(s4, 3, 1000, Budget::compression_ratio(0.8)).total() == 3 * 199);
}

TEST_CASE("StreamingLLM reads only the keys' shape of LayerInputs", "[streaming]") {
  Rng rng(92);
  const kvevict_test::Shape s{8, 2, 4, 40, 16};
  const kvevict_test::Layer l = kvevict_test::random_layer(s, rng);
  const StreamingLLM policy;
  for (auto layout : {kvevict_test::Layout::heads_major, kvevict_test::Layout::tokens_major}) {
    const auto st = kvevict_test::store<float>(l, layout);
    for (std::int64_t n : {1, 4, 5, 20, 40}) {
      CHECK(kvevict_test::kept_of(policy.select(st.in, Budget::tokens(n))) ==
            kvevict_test::kept_of(select_shape(policy, s.Hkv, s.L, Budget::tokens(n))));
      const kvevict::Selection a = policy.select(st.in, Budget::tokens(n));
      CHECK(kvevict_test::kept_of(a) == kvevict_test::kept_of(policy.select(st.in, Budget::tokens(n))));  // determinism
    }
  }
}

TEST_CASE("StreamingLLM errors", "[streaming][errors]") {
  StreamingLLM::Params p;
  p.sinks = -1;
  REQUIRE_THROWS_MATCHES(StreamingLLM(p), kvevict::invalid_argument,
                         MessageContains("kvevict::StreamingLLM::Params: sinks must be >= 0, got -1"));
  const StreamingLLM s;
  REQUIRE_THROWS_MATCHES(select_shape(s, 0, 10, Budget::tokens(1)), kvevict::invalid_argument,
                         MessageContains("kvevict::StreamingLLM::select: keys must be a non-empty"));
  REQUIRE_THROWS_MATCHES(select_shape(s, 2, 0, Budget::tokens(1)), kvevict::invalid_argument,
                         MessageContains("kvevict::StreamingLLM::select: keys must be a non-empty"));
  // No observation window: 0 by default, and nothing else is accepted.
  CHECK(s.params().window == 0);
  p = StreamingLLM::Params();
  p.window = -1;
  REQUIRE_THROWS_MATCHES(StreamingLLM(p), kvevict::invalid_argument,
                         MessageContains("kvevict::StreamingLLM::Params: window must be >= 0, got -1"));
  p.window = 4;
  REQUIRE_THROWS_MATCHES(
      StreamingLLM(p), kvevict::invalid_argument,
      MessageContains(
          "kvevict::StreamingLLM::Params: a positional policy observes no window: window must be 0, got 4"));
  // The same for any composition over RecencySelector, whose window defaults to 0 too.
  using Composed = kvevict::Policy<kvevict::AdaKV, kvevict::RecencySelector>;
  CHECK(Composed().params().window == 0);
  CHECK(kvevict_test::kept_of(select_shape(kvevict::Policy<kvevict::UniformAllocation, kvevict::RecencySelector>(), 2,
                                           12, Budget::tokens(6))) == Kept{{0, 1, 2, 3, 10, 11}, {0, 1, 2, 3, 10, 11}});
  Composed::Params cp;
  cp.window = 32;
  REQUIRE_THROWS_MATCHES(Composed(cp), kvevict::invalid_argument,
                         MessageContains("a positional policy observes no window: window must be 0, got 32"));
  REQUIRE_THROWS_MATCHES(
      select_shape(s, 2, 10, Budget::keep_ratio(0.05)), kvevict::invalid_argument,
      MessageContains("kvevict::StreamingLLM::select: n_kept must be in [1, 10] (the context length), got 0"));
  REQUIRE_THROWS_MATCHES(select_shape(s, 2, 10, Budget::tokens(11)), kvevict::invalid_argument,
                         MessageContains("n_kept must be in [1, 10] (the context length), got 11"));
  REQUIRE_THROWS_MATCHES(select_shape(s, 2, 10, Budget::keep_ratio(0.05)), kvevict::invalid_argument,
                         MessageContains("got 0 from keep ratio 0.05"));
  REQUIRE_THROWS_MATCHES(select_shape(s, 2, 10, Budget::compression_ratio(0.95)), kvevict::invalid_argument,
                         MessageContains("got 0 from compression ratio 0.95"));
  const kvevict::LayerInputs<float> empty;
  REQUIRE_THROWS_MATCHES(s.select(empty, Budget::tokens(1)), kvevict::invalid_argument,
                         MessageContains("kvevict::StreamingLLM::select: keys must be a non-empty"));
}

}  // namespace test_streaming_llm
