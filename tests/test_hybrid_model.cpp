// docs/algorithms.md#hybrid-models: a model whose layers differ in KV heads and head dims, some kept whole by the
// engine (LayerInputs::evict = false; CacheBook's kept_whole). A layer kept whole keeps every entry; the evicted
// layers select exactly as a model of them alone, for every catalogue policy, layout and budget form, through
// select_layers, select(layers) and plans; while the cache grows, only the evicted layers are evicted and counted.
#include <catch2/catch.hpp>

#include <kvevict/kvevict.hpp>

#include <cstdint>
#include <string>
#include <vector>

#include "support/matchers.hpp"
#include "support/random_inputs.hpp"
#include "support/selector_inputs.hpp"

namespace test_hybrid_model {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Budget;
using kvevict::Index;
using kvevict::Selection;
using kvevict_test::Layout;
using kvevict_test::MessageContains;
using kvevict_test::Rng;
using kvevict_test::Shape;

namespace {

bool same(const Selection& a, const Selection& b) {
  return a.indices() == b.indices() && a.offsets() == b.offsets() && a.blocks() == b.blocks();
}

/// Whether `s` keeps every entry of a dense layer of Hkv heads and L entries.
bool keeps_all(const Selection& s, Index Hkv, Index L) {
  if (s.heads() != Hkv) return false;
  for (Index h = 0; h < Hkv; ++h)
    if (s.length(h) != L) return false;
  return true;
}

}  // namespace

TEST_CASE("hybrid models: layers kept whole keep every entry, the evicted layers select as a model of them alone",
          "[hybrid]") {
  Rng rng(3505);
  // Layers 0 and 2 evicted (Hkv 2, d 16; Hkv 4, d 32), 1 and 3 kept whole (Hkv 4, d 8; Hkv 1, d 16); L 64 each.
  const std::vector<Shape> shapes = {{8, 2, 4, 64, 16}, {8, 4, 4, 64, 8}, {8, 4, 4, 64, 32}, {4, 1, 4, 64, 16}};
  std::vector<kvevict_test::VStored<float>> stored;
  for (const Shape& s : shapes)
    stored.push_back(kvevict_test::store_v<float>(kvevict_test::random_vlayer(s, 24, rng), Layout::heads_major));
  std::vector<kvevict::LayerInputs<float>> model, evicted;
  for (std::size_t l = 0; l < stored.size(); ++l) {
    model.push_back(stored[l].in);
    if (l % 2 == 1) {
      model.back().evict = false;
      model.back().queries = {};  // a layer kept whole needs only its keys
      model.back().values = {};
    } else {
      evicted.push_back(stored[l].in);
    }
  }
  const std::vector<Budget> budgets = {Budget::keep_ratio(0.25), Budget::tokens(20),
                                       Budget::threshold(0.01).count_bounds(16, 48, Budget::Scope::model)};
  for (const kvevict_test::EngineLayout layout : kvevict_test::engine_layouts()) {
    kvevict::Knobs k;
    k.window = 4;
    k.share = layout.share;
    k.block = layout.block;
    kvevict::catalogue::for_each(kvevict::catalogue::entries(), [&](const auto& e) {
      const auto policy = e.make(k);
      for (std::size_t b = 0; b < budgets.size(); ++b) {
        if (b == 2 && e.name == std::string("pyramidkv")) continue;  // a threshold budget has no count to schedule
        INFO(e.name << " share " << kvevict::to_string(layout.share) << " block " << layout.block << " budget " << b);
        const std::vector<Selection> full = kvevict::select_layers(policy, model, budgets[b]);
        const std::vector<Selection> alone = kvevict::select_layers(policy, evicted, budgets[b]);
        REQUIRE(full.size() == 4);
        CHECK(same(full[0], alone[0]));
        CHECK(same(full[2], alone[1]));
        CHECK(keeps_all(full[1], 4, 64));
        CHECK(keeps_all(full[3], 1, 64));
        if (layout.block > 1) CHECK(full[1].blocks().size() == 4 * 4);  // 64 rows: 4 whole blocks per head
        if constexpr (!kvevict::detail::is_layer_global<std::decay_t<decltype(policy)>>::value) {
          if (layout.share != kvevict::Sharing::per_model) continue;
        }
        auto plan = policy.plan(budgets[b], 2);  // the model's evicted layers
        for (const auto& in : model) plan.add(in);
        const std::vector<Selection> planned = plan.apply();
        for (std::size_t l = 0; l < 4; ++l) CHECK(same(planned[l], full[l]));
        const std::vector<Selection> at_once = policy.select(model, budgets[b]);
        for (std::size_t l = 0; l < 4; ++l) CHECK(same(at_once[l], full[l]));
      }
    });
  }
}

TEST_CASE("hybrid models: a growing cache evicts and counts only its evicted layers", "[hybrid][stream]") {
  Rng rng(3506);
  const std::vector<Index> heads = {2, 1, 4};  // layer 1 is kept whole (a sliding-window layer the engine keeps)
  const Index capacity = 160, d = 8, H = 4, w = 4, step = 20, n = 24;
  struct Layer {
    std::vector<float> k, v, q;
  };
  std::vector<Layer> layers(3);
  for (std::size_t l = 0; l < 3; ++l) {
    layers[l].k.assign(static_cast<std::size_t>(heads[l] * capacity * d), 0.0f);
    layers[l].v = layers[l].k;
  }
  for (const bool model_wide : {false, true}) {
    INFO((model_wide ? "LayerGlobalPolicy<AttentionSelector>" : "snapkv"));
    kvevict::CacheBook book(heads, capacity, {false, true, false});
    CHECK(book.evicted_layers() == 2);
    CHECK_FALSE(book.evicts(1));
    const auto inputs_of = [&](Index l) {
      Layer& x = layers[static_cast<std::size_t>(l)];
      x.q = kvevict_test::cast_to<float>(kvevict_test::normal_vector(static_cast<std::size_t>(H * w * d), rng));
      kvevict::LayerInputs<float> in;
      in.queries = kvevict::HeadsView<const float>::heads_major(x.q.data(), H, w, d);
      in.keys = kvevict::kv_heads_major<const float>(x.k.data(), heads[static_cast<std::size_t>(l)], capacity, d);
      in.values = kvevict::kv_heads_major<const float>(x.v.data(), heads[static_cast<std::size_t>(l)], capacity, d);
      return in;
    };
    const auto apply = [&](Index l, const Selection& s) {
      REQUIRE(l != 1);
      Layer& x = layers[static_cast<std::size_t>(l)];
      const Index hk = heads[static_cast<std::size_t>(l)];
      book.layer(l).apply(s, kvevict::kv_heads_major<float>(x.k.data(), hk, capacity, d),
                          kvevict::kv_heads_major<float>(x.v.data(), hk, capacity, d));
    };
    kvevict::SnapKV::Params sp;
    sp.window = w;
    kvevict::LayerGlobalPolicy<kvevict::AttentionSelector>::Params gp;
    gp.window = w;
    for (int s = 0; s < 6; ++s) {
      book.append(step);
      for (std::size_t l = 0; l < 3; ++l)
        for (float& x : layers[l].k) x = static_cast<float>(std::uniform_real_distribution<double>(-1, 1)(rng));
      if (model_wide)
        kvevict::evict_over_budget(kvevict::LayerGlobalPolicy<kvevict::AttentionSelector>(gp), book, n, inputs_of,
                                   apply);
      else
        kvevict::evict_over_budget(kvevict::SnapKV(sp), book, n, inputs_of, apply);
      CHECK(book.layer(1).entries() == (s + 1) * step);  // never evicted
      if (model_wide)
        CHECK(book.layer(0).entries() + book.layer(2).entries() <= (2 + 4) * n);
      else
        CHECK((book.layer(0).entries() <= 2 * n && book.layer(2).entries() <= 4 * n));
      CHECK_FALSE(book.over_budget(n));  // the layer kept whole is no part of the model's budget
    }
  }
}

TEST_CASE("hybrid models: bad descriptions are refused by name", "[hybrid][errors]") {
  CHECK_THROWS_MATCHES(kvevict::CacheBook(std::vector<Index>{2, 2}, 16, {true}), kvevict::invalid_argument,
                       MessageContains("kept_whole has 1 entries, expected one per layer (2) or none"));
  CHECK_THROWS_MATCHES(kvevict::CacheBook(std::vector<Index>{}, 16), kvevict::invalid_argument,
                       MessageContains("needs layers >= 1"));
  Rng rng(3507);
  const Shape s{4, 2, 4, 32, 8};
  const auto a = kvevict_test::store_v<float>(kvevict_test::random_vlayer(s, 8, rng), Layout::heads_major);
  kvevict::LayerInputs<float> whole = a.in;
  whole.evict = false;
  kvevict::PyramidKV::Params pp;
  pp.window = 4;
  auto plan = kvevict::PyramidKV(pp).plan(Budget::tokens(8), 1);  // one evicted layer
  plan.add(whole);
  plan.add(a.in);
  CHECK_THROWS_MATCHES(plan.add(a.in), kvevict::invalid_argument,
                       MessageContains("add (layer 2): the plan was made for 1 evicted layers"));
  const std::vector<Selection> kept = plan.apply();
  CHECK(keeps_all(kept[0], 2, 32));
  CHECK(kept[1].total() == 2 * 8);
}

}  // namespace test_hybrid_model
