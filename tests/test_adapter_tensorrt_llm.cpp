// adapters/tensorrt_llm.hpp (docs/engines.md#tensorrt-llm): the sparse KV prediction applied as TensorRT-LLM's
// updateSparseKvCacheAfterFmha does (per context request and KV head, token i of the request's cache takes the K and V
// of token sparse_kv_indices[h, offsets[r] + i], gathered in place in ascending i; the request keeps offsets[r + 1] -
// offsets[r] tokens per KV head, at their positions) equals Selection::compact on the same cache, for every catalogue
// policy whose KV heads keep equal counts, per head and shared, on a batch of three context requests of different
// lengths; the policies whose heads keep different counts are refused by name.
#include <catch2/catch.hpp>

#include <kvevict/adapters/tensorrt_llm.hpp>
#include <kvevict/kvevict.hpp>

#include <algorithm>
#include <cstdint>
#include <random>
#include <string>
#include <vector>

#include "support/engine_sim.hpp"
#include "support/matchers.hpp"

namespace test_adapter_tensorrt_llm {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Index;
using kvevict::Selection;
using kvevict::adapters::TensorRtLlmSparseKv;
using kvevict_test::MessageContains;
using namespace kvevict_test::engine_sim;

namespace {

/// One context request's cache: per layer, each KV head's token rows [Hkv][L][d] for K and V (the request's pages
/// of one head, in token order), and its tokens' positions.
struct RequestCache {
  Index L;
  std::vector<std::vector<float>> k, v;  // [layer][(h * L + token) * d]
  std::vector<std::int64_t> pos;
  RequestCache(Index tokens, Rng& rng) : L(tokens), k(sz(kLayers)), v(sz(kLayers)) {
    std::normal_distribution<float> normal(0.f, 1.f);
    for (Index l = 0; l < kLayers; ++l)
      for (Index i = 0; i < kHkv * L * kD; ++i) {
        k[sz(l)].push_back(normal(rng));
        v[sz(l)].push_back(normal(rng));
      }
    for (Index j = 0; j < L; ++j) pos.push_back(j);
  }
  float* krow(Index l, Index j, Index h) { return k[sz(l)].data() + (sz(h) * sz(L) + sz(j)) * sz(kD); }
  float* vrow(Index l, Index j, Index h) { return v[sz(l)].data() + (sz(h) * sz(L) + sz(j)) * sz(kD); }
  RowOf key() {
    return [this](Index l, Index j, Index h) -> const float* { return krow(l, j, h); };
  }
  RowOf value() {
    return [this](Index l, Index j, Index h) -> const float* { return vrow(l, j, h); };
  }
};

/// updateSparseKvCacheAfterFmha on layer l of the batch: each request's KV heads gather their listed tokens to the
/// front, in place.
void gather(std::vector<RequestCache>& batch, Index l, const TensorRtLlmSparseKv& kv) {
  for (std::size_t r = 0; r < batch.size(); ++r)
    for (Index h = 0; h < kv.kv_heads; ++h)
      for (std::int32_t i = 0; i < kv.offsets[r + 1] - kv.offsets[r]; ++i) {
        const std::int32_t src = kv.indices[sz(h * kv.total) + static_cast<std::size_t>(kv.offsets[r] + i)];
        REQUIRE(src >= i);  // sorted: safe in place
        std::copy(batch[r].krow(l, src, h), batch[r].krow(l, src, h) + kD, batch[r].krow(l, i, h));
        std::copy(batch[r].vrow(l, src, h), batch[r].vrow(l, src, h) + kD, batch[r].vrow(l, i, h));
      }
}

}  // namespace

TEST_CASE("TensorRT-LLM sparse KV: worked numbers", "[adapters][tensorrt-llm]") {
  // Two requests of 6 and 4 tokens, two KV heads each keeping 3 and 2 of their own.
  std::vector<char> a{1, 0, 1, 0, 0, 1, /**/ 0, 1, 1, 0, 1, 0};
  std::vector<char> b{0, 1, 0, 1, /**/ 1, 0, 0, 1};
  const TensorRtLlmSparseKv kv =
      kvevict::adapters::tensorrt_llm_sparse_kv({Selection::from_flags(a, 2, 6), Selection::from_flags(b, 2, 4)});
  CHECK(kv.offsets == std::vector<std::int32_t>{0, 3, 5});
  CHECK((kv.kv_heads == 2 && kv.total == 5));
  CHECK(kv.indices == std::vector<std::int32_t>{0, 2, 5, 1, 3, /**/ 1, 2, 4, 0, 3});
  // A request that keeps nothing: an empty range.
  const TensorRtLlmSparseKv none = kvevict::adapters::tensorrt_llm_sparse_kv({hand(4, {}, {}, 2), hand(3, {2}, {}, 2)});
  CHECK(none.offsets == std::vector<std::int32_t>{0, 0, 1});
  CHECK(none.indices == std::vector<std::int32_t>{2, 2});
}

TEST_CASE("TensorRT-LLM sparse KV: the gathered caches hold what compact gives, for every catalogue policy",
          "[adapters][tensorrt-llm][catalogue]") {
  int golden = 0, refused = 0;
  for (kvevict::Sharing share : {kvevict::Sharing::per_head, kvevict::Sharing::per_layer}) {
    kvevict::Knobs knobs;
    knobs.share = share;
    knobs.window = kW;
    kvevict::catalogue::for_each(kvevict::catalogue::entries(), [&](const auto& entry) {
      INFO(entry.name << " share " << kvevict::to_string(share));
      const auto policy = entry.make(knobs);
      Rng rng(31 + static_cast<unsigned>(golden + refused));
      std::vector<RequestCache> batch;
      std::vector<std::vector<Selection>> sels;  // [request][layer]
      std::vector<Expected> want;                // [request]
      for (Index L : {Index{37}, Index{29}, Index{44}}) batch.emplace_back(L, rng);
      std::vector<char> equal_counts(sz(kLayers), 1);  // [layer]: every request's KV heads keep as many
      for (RequestCache& r : batch) {
        SeqView view(r.pos, r.key(), r.value(), rng);
        sels.push_back(kvevict::select_layers(policy, view.layers, kvevict::Budget::tokens(12)));
        for (Index l = 0; l < kLayers; ++l) {
          const Selection& s = sels.back()[sz(l)];
          for (Index h = 1; h < s.heads(); ++h)
            if (s.length(h) != s.length(0)) equal_counts[sz(l)] = 0;
        }
        want.push_back(expected(view, sels.back(), false, kvevict::Rope{}));
      }
      std::vector<std::int32_t> kept_of_layer0;  // each request's kept tokens per KV head in layer 0, from offsets
      for (Index l = 0; l < kLayers; ++l) {
        std::vector<Selection> layer;
        for (const auto& per_request : sels) layer.push_back(per_request[sz(l)]);
        if (!equal_counts[sz(l)]) {
          REQUIRE_THROWS_MATCHES(kvevict::adapters::tensorrt_llm_sparse_kv(layer), kvevict::invalid_argument,
                                 MessageContains("TensorRT-LLM keeps as many tokens in every KV head of a request"));
          continue;
        }
        const TensorRtLlmSparseKv kv = kvevict::adapters::tensorrt_llm_sparse_kv(layer);
        REQUIRE(kv.offsets.size() == batch.size() + 1);
        REQUIRE(kv.indices.size() == sz(kv.kv_heads * kv.total));
        if (l == 0)
          for (std::size_t r = 0; r < batch.size(); ++r) kept_of_layer0.push_back(kv.offsets[r + 1] - kv.offsets[r]);
        gather(batch, l, kv);
      }
      if (std::count(equal_counts.begin(), equal_counts.end(), 0) > 0) {
        ++refused;  // (the layers that fit were gathered, but the request is only whole when every layer is)
        return;
      }
      for (std::size_t r = 0; r < batch.size(); ++r)
        CHECK(holds(kept_of_layer0[r], batch[r].key(), batch[r].value(), want[r]) == "");
      ++golden;
    });
  }
  CHECK(golden >= 2 * 10);  // the uniform allocations and every shared layout
  CHECK(refused >= 4);      // head-adaptive and layer-global per head
}

TEST_CASE("TensorRT-LLM sparse KV: refuses selections its rectangular indices cannot hold",
          "[adapters][tensorrt-llm][errors]") {
  std::vector<char> ragged{1, 1, 0, 1, /**/ 1, 0, 0, 0};
  REQUIRE_THROWS_MATCHES(kvevict::adapters::tensorrt_llm_sparse_kv({Selection::from_flags(ragged, 2, 4)}),
                         kvevict::invalid_argument,
                         MessageContains("request 0 KV head 1 keeps 1 and KV head 0 keeps 3 (select with a uniform "
                                         "allocation, or share = per_layer)"));
  REQUIRE_THROWS_MATCHES(kvevict::adapters::tensorrt_llm_sparse_kv({hand(4, {0, 3}), hand(4, {0, 3}, {}, 2)}),
                         kvevict::invalid_argument, MessageContains("request 1 has 2 KV heads, but request 0 has 1"));
  REQUIRE_THROWS_MATCHES(kvevict::adapters::tensorrt_llm_sparse_kv({}), kvevict::invalid_argument,
                         MessageContains("needs the selections of the batch's context requests, got none"));
}

}  // namespace test_adapter_tensorrt_llm
