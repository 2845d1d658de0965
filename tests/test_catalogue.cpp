// The policy catalogue (policy/catalogue.hpp), presets as bases of Policy<Base, Selector>, the compile-time
// contracts, and inputs whose KV cache, queries and W_o have different storage types.
#include <catch2/catch.hpp>

#include <kvevict/extend.hpp>

#include <Eigen/Core>

#include <set>
#include <string>
#include <type_traits>
#include <vector>

#include "support/cases.hpp"
#include "support/matchers.hpp"
#include "support/random_inputs.hpp"
#include "support/same_selection.hpp"
#include "support/selector_inputs.hpp"

namespace test_catalogue {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Budget;
using kvevict::Index;
using kvevict::Selection;
using kvevict_test::Layout;
using kvevict_test::Rng;
using kvevict_test::Shape;
using kvevict_test::VLayer;

namespace {

/// Knobs that fit a small random shape (the window of the shape; everything else the preset's default).
kvevict::Knobs window_of(const Shape& s) {
  kvevict::Knobs k;
  k.window = s.w;
  return k;
}

using kvevict_test::same;

}  // namespace

// ---- the catalogue ---------------------------------------------------------------------------------------------

TEST_CASE("catalogue: every entry is named once and makes its preset with the preset's defaults", "[catalogue]") {
  std::set<std::string> names;
  int count = 0;
  kvevict::catalogue::for_each(kvevict::catalogue::entries(), [&](const auto& e) {
    using P = typename std::decay_t<decltype(e)>::policy_type;
    INFO(e.name);
    CHECK(names.insert(std::string(e.name)).second);
    CHECK(!e.summary.empty());
    ++count;
    // make() with no knobs is the preset as default-constructed.
    const P made = e.make();
    const P plain;
    CHECK(made.reads_values() == plain.reads_values());
    // visit() finds it by name.
    bool visited = false;
    CHECK(kvevict::catalogue::visit(
        e.name, [&](const auto& v) { visited = std::is_same_v<typename std::decay_t<decltype(v)>::policy_type, P>; }));
    CHECK(visited);
  });
  CHECK(count >= 8);  // the eight papers' presets, then whatever is added
  CHECK_FALSE(kvevict::catalogue::visit("nosuch", [](const auto&) {}));
  CHECK(kvevict::catalogue::names(kvevict::catalogue::entries())
            .rfind("streamingllm, snapkv, adakv, criticalkv, criticalkv-snapkv, defensivekv, layer-defensivekv, "
                   "adakv-defensive, tova, knorm, keydiff, pyramidkv, expected-attention, h2o, rkv, open-defensivekv",
                   0) == 0);
}

TEST_CASE("catalogue: budget scopes, knob lists and knobs applied", "[catalogue]") {
  using kvevict::BudgetScope;
  STATIC_REQUIRE(kvevict::budget_scope<kvevict::SnapKV>() == BudgetScope::head);
  STATIC_REQUIRE(kvevict::budget_scope<kvevict::CriticalSnapKV>() == BudgetScope::head);
  STATIC_REQUIRE(kvevict::budget_scope<kvevict::StreamingLLM>() == BudgetScope::head);
  STATIC_REQUIRE(kvevict::budget_scope<kvevict::AdaKV>() == BudgetScope::layer);
  STATIC_REQUIRE(kvevict::budget_scope<kvevict::DefensiveKV>() == BudgetScope::layer);
  STATIC_REQUIRE(kvevict::budget_scope<kvevict::LayerDefensiveKV>() == BudgetScope::model);

  using Names = std::vector<std::string>;
  CHECK(kvevict::knob_names<kvevict::SnapKV::Params>() ==
        Names{"share", "reduce", "block", "window", "pooling", "kernel", "reference_quirks", "redundancy"});
  CHECK(kvevict::knob_names<kvevict::StreamingLLM::Params>() == Names{"share", "reduce", "block", "sinks"});
  CHECK(kvevict::knob_names<kvevict::CriticalKV::Params>() ==
        Names{"share", "reduce", "block", "window", "pooling", "kernel", "reference_quirks", "redundancy", "alpha",
              "adakv_variant", "eps", "first_stage_ratio", "value_norm"});
  CHECK(kvevict::knob_names<kvevict::PyramidKV::Params>() ==
        Names{"share", "reduce", "block", "window", "pooling", "kernel", "reference_quirks", "redundancy", "beta"});
  CHECK(kvevict::knob_names<kvevict::ExpectedAttention::Params>() ==
        Names{"share", "reduce", "block", "window", "pooling", "kernel", "reference_quirks", "redundancy", "rope_theta",
              "rotary_dim", "rope_layout", "future_positions", "sinks", "covariance", "value_term"});
  STATIC_REQUIRE(kvevict::budget_scope<kvevict::ExpectedAttention>() == BudgetScope::head);
  CHECK(kvevict::knob_names<kvevict::H2O::Params>() == Names{"share", "reduce", "block", "window", "pooling", "kernel",
                                                             "reference_quirks", "redundancy", "recent_share"});
  STATIC_REQUIRE(kvevict::budget_scope<kvevict::H2O>() == BudgetScope::head);
  STATIC_REQUIRE(kvevict::budget_scope<kvevict::Policy<kvevict::PyramidKV, kvevict::DefensiveSelector>>() ==
                 BudgetScope::model);
  CHECK(kvevict::knob_names<kvevict::LayerDefensiveKV::Params>() ==
        Names{"share", "reduce", "block", "window", "pooling", "kernel", "reference_quirks", "redundancy",
              "mass_threshold", "value_norm", "floor", "value_term", "mass_forcing", "open_window"});
  CHECK(kvevict::knob_names<kvevict::OpenDefensiveKV::Params>() ==
        kvevict::knob_names<kvevict::LayerDefensiveKV::Params>());
  STATIC_REQUIRE(kvevict::budget_scope<kvevict::OpenDefensiveKV>() == BudgetScope::model);

  kvevict::Knobs k;
  k.window = 8;
  k.alpha = 0.3;
  k.value_norm = kvevict::ValueNorm::l2;
  k.eps = 0.5;  // not a DefensiveKV parameter: ignored there
  const kvevict::DefensiveKV d = kvevict::catalogue::Entry<kvevict::DefensiveKV>{"d", ""}.make(k);
  CHECK(d.params().window == 8);
  CHECK(d.params().alpha == 0.3);
  CHECK(d.params().value_norm == kvevict::ValueNorm::l2);
  CHECK(d.params().kernel == 5);  // unset: the preset's default
  CHECK(d.params().mass_threshold == 0.9);
  const kvevict::DefensiveKV plain;
  CHECK(plain.params().alpha == 0.0);  // DefensiveKV's own default (flat top-k)
  // Knobs out of range are refused by the preset, naming it.
  kvevict::Knobs bad;
  bad.first_stage_ratio = 2.0;
  REQUIRE_THROWS_MATCHES((kvevict::catalogue::Entry<kvevict::CriticalKV>{"c", ""}.make(bad)), kvevict::invalid_argument,
                         kvevict_test::MessageContains("kvevict::CriticalKV::Params: first_stage_ratio must be in"));
}

TEST_CASE("catalogue: select_layers runs every entry over a model, errors name the layer", "[catalogue]") {
  Rng rng(1201);
  const Shape s{8, 2, 6, 60, 16};
  std::vector<kvevict_test::VStored<float>> stored;
  std::vector<kvevict::LayerInputs<float>> layers;
  for (int l = 0; l < 3; ++l)
    stored.push_back(kvevict_test::store_v<float>(kvevict_test::random_vlayer(s, 24, rng), Layout::tokens_major));
  for (const auto& st : stored) layers.push_back(st.in);
  const Budget b = Budget::tokens(20);
  kvevict::catalogue::for_each(kvevict::catalogue::entries(), [&](const auto& e) {
    INFO(e.name);
    const auto policy = e.make(window_of(s));
    const std::vector<Selection> sels = kvevict::select_layers(policy, layers, b);
    REQUIRE(sels.size() == 3);
    Index model_total = 0;
    for (const Selection& x : sels) {
      REQUIRE(kvevict_test::structure_errors(x, s.Hkv, s.L) == "");
      Index layer_total = 0;
      for (Index h = 0; h < s.Hkv; ++h) {
        if (e.scope == kvevict::BudgetScope::head) CHECK(x.length(h) == 20);
        layer_total += x.length(h);
      }
      if (e.scope != kvevict::BudgetScope::model) CHECK(layer_total == s.Hkv * 20);
      model_total += layer_total;
    }
    CHECK(model_total == 3 * s.Hkv * 20);
    // The same as the preset's own entry point.
    if constexpr (std::decay_t<decltype(e)>::layer_global) {
      CHECK(same(sels, policy.select(layers, b)));
    } else {
      for (std::size_t l = 0; l < 3; ++l) CHECK(same(sels[l], policy.select(layers[l], b, static_cast<Index>(l), 3)));
    }
    // A bad layer is named, with the policy.
    std::vector<kvevict::LayerInputs<float>> broken = layers;
    broken[2].keys = kvevict::kv_heads_major<const float>(stored[2].k.data(), s.Hkv, 10, s.d);  // 10 tokens < n_kept
    broken[2].values = {};
    // (A model budget scheduled per layer, PyramidKV's, is not bounded by a layer: that one keeps all it holds.)
    if constexpr (std::decay_t<decltype(policy)>::reads_observation() &&
                  !kvevict::detail::is_scheduled<std::decay_t<decltype(policy)>>::value) {
      const std::string where = e.layer_global ? "::add (layer 2): " : "::select (layer 2): ";
      REQUIRE_THROWS_MATCHES(kvevict::select_layers(policy, broken, b), kvevict::invalid_argument,
                             kvevict_test::MessageContains(policy.name() + where));
    }
  });
}

// ---- presets as bases ------------------------------------------------------------------------------------------

TEST_CASE("every scored preset works as the base of Policy<Base, Selector>, with its allocation and defaults",
          "[catalogue][composition]") {
  Rng rng(1202);
  const Shape s{8, 4, 6, 90, 16};
  const auto st = kvevict_test::store_v<double>(kvevict_test::random_vlayer(s, 24, rng), Layout::heads_major);
  const auto others = kvevict_test::store_v<double>(kvevict_test::random_vlayer(s, 24, rng), Layout::heads_major);
  const std::vector<kvevict::LayerInputs<double>> model = {st.in, others.in};
  kvevict::catalogue::for_each(kvevict::catalogue::entries(), [&](const auto& base_entry) {
    using Base = typename std::decay_t<decltype(base_entry)>::policy_type;
    if constexpr (!std::is_same_v<Base, kvevict::StreamingLLM>) {
      kvevict::catalogue::for_each(kvevict::catalogue::selectors(), [&](const auto& selector_entry) {
        using Sel = typename std::decay_t<decltype(selector_entry)>::selector_type;
        using Composed = kvevict::Policy<Base, Sel>;
        INFO("Policy<" << base_entry.name << ", " << selector_entry.name << ">");
        typename Composed::Params p;
        p.window = s.w;
        const Composed composed(p);
        CHECK(composed.name() ==
              "Policy<" + kvevict::detail::name_of<Base>() + ", " + kvevict::detail::name_of<Sel>() + ">");
        for (std::int64_t n : {3, 6, 7, 40, 90}) {
          const Budget b = Budget::tokens(n);
          INFO("n_kept " << n);
          if constexpr (kvevict::detail::is_layer_global<Base>::value) {
            // A layer-global base: the layer-global policy of the selector (one budget across layers).
            STATIC_REQUIRE(std::is_same_v<typename Composed::Allocation, kvevict::LayerGlobalAllocation>);
            STATIC_REQUIRE(Composed::allocates_model());
            typename kvevict::LayerGlobalPolicy<Sel>::Params q;
            q.window = s.w;
            CHECK(same(composed.template select<double>(model, b),
                       kvevict::LayerGlobalPolicy<Sel>(q).template select<double>(model, b)));
          } else {
            // The base's allocation with the base's allocation defaults, the selector's scoring.
            using A = typename Base::Allocation;
            STATIC_REQUIRE(std::is_same_v<typename Composed::Allocation, A>);
            typename kvevict::Policy<A, Sel>::Params q;
            q.window = s.w;
            if constexpr (std::is_same_v<A, kvevict::HeadAdaptiveAllocation>) {
              CHECK(p.alpha == typename Base::Params{}.alpha);
              q.alpha = typename Base::Params{}.alpha;
            }
            // Layer 1 of 2: a scheduled allocation (PyramidKV) gives it its share; the others ignore the place.
            CHECK(same(composed.template select<double>(st.in, b, 1, 2),
                       kvevict::Policy<A, Sel>(q).template select<double>(st.in, b, 1, 2)));
          }
        }
      });
    }
  });
  // The cases the old allocation_of missed: a preset that is a class of its own, with its own defaults.
  STATIC_REQUIRE(std::is_same_v<kvevict::Policy<kvevict::DefensiveKV, kvevict::CriticalSelector>::Allocation,
                                kvevict::HeadAdaptiveAllocation>);
  CHECK(kvevict::Policy<kvevict::DefensiveKV, kvevict::CriticalSelector>{}.params().alpha == 0.0);
  CHECK(kvevict::Policy<kvevict::AdaKV, kvevict::CriticalSelector>{}.params().alpha == 0.2);
}

TEST_CASE("catalogue::base_of: each named policy's base, whose composition with its selector allocates as it does",
          "[catalogue][composition]") {
  namespace cat = kvevict::catalogue;
  CHECK(std::string(cat::base_of<kvevict::StreamingLLM>()) == "snapkv");  // its allocation: uniform, as SnapKV's
  CHECK(std::string(cat::base_of<kvevict::SnapKV>()) == "snapkv");
  CHECK(std::string(cat::base_of<kvevict::AdaKV>()) == "adakv");
  CHECK(std::string(cat::base_of<kvevict::CriticalKV>()) == "adakv");
  CHECK(std::string(cat::base_of<kvevict::CriticalSnapKV>()) == "snapkv");
  CHECK(std::string(cat::base_of<kvevict::DefensiveKV>()) == "defensivekv");  // flat top-k (alpha 0), not AdaKV's 0.2
  CHECK(std::string(cat::base_of<kvevict::LayerDefensiveKV>()) == "layer");
  CHECK(std::string(cat::base_of<kvevict::OpenDefensiveKV>()) == "layer");
  CHECK(std::string(cat::base_of<kvevict::AdaKVDefensive>()) == "adakv");
  CHECK(std::string(cat::base_of<kvevict::PyramidKV>()) ==
        "pyramidkv");  // its scheduled allocation, not a per-layer one
  CHECK(std::string(cat::base_of<kvevict::TOVA>()) == "snapkv");
  CHECK(std::string(cat::base_of<kvevict::KeyDiff>()) == "snapkv");
  CHECK(std::string(cat::base_of<kvevict::H2O>()) == "snapkv");
  CHECK(std::string(cat::base_of<kvevict::EngineScores>()) == "defensivekv");  // flat top-k of the layer
  CHECK(std::string(cat::base_of<kvevict::LayerEngineScores>()) == "layer");

  // Generically: compose(base_of<P>(), P's selector) with P's selector parameters selects what P selects.
  Rng rng(1204);
  const Shape s{8, 4, 6, 90, 16};
  const auto a = kvevict_test::store_v<double>(kvevict_test::random_vlayer(s, 24, rng), Layout::heads_major);
  const auto b = kvevict_test::store_v<double>(kvevict_test::random_vlayer(s, 24, rng), Layout::heads_major);
  const std::vector<kvevict::LayerInputs<double>> model = {a.in, b.in};
  cat::for_each(cat::entries(), [&](const auto& entry) {
    using P = typename std::decay_t<decltype(entry)>::policy_type;
    if constexpr (!std::is_same_v<P, kvevict::StreamingLLM>) {
      INFO(entry.name << " as " << cat::base_of<P>());
      bool composed = false;
      cat::for_each(cat::selectors(), [&](const auto& selector_entry) {
        using Sel = typename std::decay_t<decltype(selector_entry)>::selector_type;
        if constexpr (std::is_same_v<Sel, typename P::SelectorType>) {
          composed = cat::compose(cat::base_of<P>(), selector_entry.name, [&](const auto& c) {
            using C = typename std::decay_t<decltype(c)>::policy_type;
            if constexpr (std::is_same_v<typename C::SelectorType, Sel>) {  // compose() instantiates every pair
              typename P::Params p;
              p.window = s.w;
              typename C::Params q;
              // The selector's and the layout's parameters are P's (TOVA's window 1, H2O's recent share, ...).
              static_cast<typename Sel::Params&>(q) = p;
              static_cast<kvevict::ScoringParams&>(q) = p;
              CHECK(same(kvevict::select_layers<double>(C(q), model, Budget::tokens(40)),
                         kvevict::select_layers<double>(P(p), model, Budget::tokens(40))));
            }
          });
        }
      });
      CHECK(composed);
    }
  });
}

namespace {
struct WrongSelect : kvevict::KeyNormSelector {  // a select() the policy would never call
  void select() const {}
};
struct WrongTemplateSelect : kvevict::KeyNormSelector {
  template <class S>
  void select(const Layer<S>&, kvevict::extend::KeepFlags&) const {}
};
}  // namespace

TEST_CASE("the contracts: what may be a Base, a Selector or an Allocation", "[catalogue][composition]") {
  using namespace kvevict;
  STATIC_REQUIRE(detail::is_allocation<UniformAllocation>::value);
  STATIC_REQUIRE(detail::is_allocation<HeadAdaptiveAllocation>::value);
  STATIC_REQUIRE_FALSE(detail::is_allocation<SnapKV>::value);
  STATIC_REQUIRE(detail::is_selector<AttentionSelector>::value);
  STATIC_REQUIRE(detail::is_selector<CriticalSelector>::value);
  STATIC_REQUIRE(detail::is_selector<DefensiveSelector>::value);
  STATIC_REQUIRE_FALSE(detail::is_selector<int>::value);
  STATIC_REQUIRE_FALSE(detail::is_selector<UniformAllocation>::value);
  // select() is optional (each head's top of `allocation` by default), but one with another signature is an error.
  STATIC_REQUIRE(detail::has_select<CriticalSelector>::value);
  STATIC_REQUIRE_FALSE(detail::has_select<AttentionSelector>::value);
  STATIC_REQUIRE(detail::is_selector<H2OSelector>::value);
  STATIC_REQUIRE_FALSE(detail::is_selector<WrongSelect>::value);
  STATIC_REQUIRE_FALSE(detail::is_selector<WrongTemplateSelect>::value);
  STATIC_REQUIRE(detail::base_traits<SnapKV>::valid);
  STATIC_REQUIRE(detail::base_traits<DefensiveKV>::valid);
  STATIC_REQUIRE(detail::base_traits<AdaKVDefensive>::valid);
  STATIC_REQUIRE(detail::is_layer_global<LayerDefensiveKV>::value);
  STATIC_REQUIRE(detail::base_traits<StreamingLLM>::valid);  // Policy<StreamingLLM, S>: uniform allocation, as SnapKV
  STATIC_REQUIRE_FALSE(detail::base_traits<AttentionSelector>::valid);
  STATIC_REQUIRE_FALSE(detail::base_traits<double>::valid);
}

// ---- storage types that differ ---------------------------------------------------------------------------------

namespace {

/// One layer whose KV cache is stored as KV, window queries as Q and W_o as W, next to float storage of the same
/// values.
template <class KV, class Q, class W>
struct Mixed {
  kvevict_test::VStored<KV> kv;
  kvevict_test::VStored<Q> q;
  kvevict_test::VStored<W> w;
  kvevict_test::VStored<float> wide;
  kvevict::LayerInputs<KV, Q, W> in;
  Mixed(const VLayer& l, Layout layout)
      : kv(kvevict_test::store_v<KV>(l, layout)),
        q(kvevict_test::store_v<Q>(l, layout)),
        w(kvevict_test::store_v<W>(l, layout)),
        wide(kvevict_test::store_v<float>(l, layout)) {
    in.keys = kv.in.keys;
    in.values = kv.in.values;
    in.queries = q.in.queries;
    in.w_o = w.in.w_o;
    in.scores = q.in.scores;  // the engine's scores go with the queries' storage type: float storage holds them rounded
    for (std::size_t i = 0; i < wide.scores.size(); ++i) wide.scores[i] = static_cast<float>(q.scores[i]);
  }
};

template <class KV, class Q, class W>
void mixed_selects_as_float(Rng& rng, int cases) {
  for (int c = 0; c < cases; ++c) {
    const Shape s = kvevict_test::random_shape(rng, 120);
    VLayer l = kvevict_test::random_vlayer(s, 24, rng);
    // Round each tensor to its own storage type, so float storage holds exactly the same values.
    const VLayer rk = kvevict_test::rounded_to<KV>(l), rq = kvevict_test::rounded_to<Q>(l),
                 rw = kvevict_test::rounded_to<W>(l);
    l.k = rk.k;
    l.v = rk.v;
    l.q = rq.q;
    l.w_o = rw.w_o;
    const Layout layout = c % 2 ? Layout::heads_major : Layout::tokens_major;
    const Mixed<KV, Q, W> m(l, layout);
    const std::int64_t n = std::uniform_int_distribution<std::int64_t>(1, s.L)(rng);
    const Budget b = Budget::tokens(n);
    kvevict::catalogue::for_each(kvevict::catalogue::entries(), [&](const auto& e) {
      INFO(e.name << " " << kvevict_test::describe(s) << " n_kept " << n);
      const auto policy = e.make(window_of(s));
      if constexpr (std::decay_t<decltype(e)>::layer_global) {
        // plan(budget).add() deduces each layer's storage types; layers may differ in them.
        auto plan = policy.plan(b);
        plan.add(m.in);
        plan.add(m.wide.in);
        const std::vector<Selection> got = plan.apply();
        const std::vector<Selection> want =
            policy.select(std::vector<kvevict::LayerInputs<float>>{m.wide.in, m.wide.in}, b);
        CHECK(same(got, want));
      } else {
        CHECK(same(policy.select(m.in, b, 1, 2), policy.select(m.wide.in, b, 1, 2)));  // layer 1 of 2 (PyramidKV)
      }
    });
  }
}

}  // namespace

TEST_CASE(
    "an fp16 KV cache with fp32 queries (and fp32 or bf16 W_o) selects exactly as float storage of the same "
    "values",
    "[catalogue][half]") {
  Rng rng(1203);
  mixed_selects_as_float<Eigen::half, float, float>(rng, kvevict_test::cases(12));
  mixed_selects_as_float<Eigen::half, float, Eigen::bfloat16>(rng, kvevict_test::cases(8));
  mixed_selects_as_float<Eigen::bfloat16, float, Eigen::half>(rng, kvevict_test::cases(8));
  mixed_selects_as_float<float, Eigen::half, Eigen::half>(rng, kvevict_test::cases(6));
}

TEST_CASE("the precomputed Gram of a bf16 W_o goes with the W_o storage type", "[catalogue][half]") {
  Rng rng(1204);
  const Shape s{8, 2, 4, 50, 16};
  const VLayer l = kvevict_test::rounded_to<Eigen::bfloat16>(kvevict_test::random_vlayer(s, 24, rng));
  Mixed<Eigen::half, float, Eigen::bfloat16> m(kvevict_test::rounded_to<Eigen::half>(l), Layout::heads_major);
  const auto gram = kvevict::OutputGram<float>::compute(m.in.w_o);
  m.in.w_o_gram = &gram;
  kvevict::CriticalKV::Params p;
  p.window = s.w;
  p.value_norm = kvevict::ValueNorm::l2;
  const kvevict::CriticalKV policy(p);
  auto without = m.in;
  without.w_o_gram = nullptr;
  CHECK(same(policy.select(m.in, Budget::tokens(20)), policy.select(without, Budget::tokens(20))));
}

}  // namespace test_catalogue
