// The pruned L1 value term (docs/algorithms.md#pruned-l1, include/kvevict/value/value_bound.hpp): the exact term
// on chosen rows equals value_norms bit for bit, the bound holds for the computed term (adversarial values included),
// and CriticalKV with pruning selects exactly what it selects without, over random and adversarial layers.

#include <catch2/catch.hpp>

#include <kvevict/extend.hpp>
#include <kvevict/kvevict.hpp>

#include <cmath>
#include <cstdint>
#include <cstring>
#include <random>
#include <string>
#include <utility>
#include <vector>

#include "support/cases.hpp"
#include "support/selector_inputs.hpp"

namespace test_value_pruning {

using kvevict::Budget;
using kvevict::Index;
using kvevict::RowMatrix;
using kvevict::Selection;
using kvevict_test::Layout;
using kvevict_test::Rng;
using kvevict_test::Shape;
using kvevict_test::sz;
using kvevict_test::VLayer;

namespace {

/// How the values of a test layer are built.
enum class Values { normal, ties, spiky, flat_projection, cancelling, zero, huge };

const char* to_string(Values v) {
  switch (v) {
    case Values::normal:
      return "normal";
    case Values::ties:
      return "ties";
    case Values::spiky:
      return "spiky";
    case Values::flat_projection:
      return "flat projection";
    case Values::cancelling:
      return "cancelling";
    case Values::zero:
      return "zero values";
    case Values::huge:
      return "huge";
  }
  return "?";
}

/// A random layer whose values and W_o are of kind `kind`:
///   ties             every value row one of 3 rows, queries 0 (equal attention): scores tie exactly
///   spiky            a few tokens with 50x the value norm, sharp attention
///   flat_projection  W_o rows of +-1 (Sylvester-Hadamard signs) and one-hot value rows: |x_i| all equal, so
///                    ||x||_1 = sqrt(D) ||x||_2 exactly (the bound's equality case)
///   cancelling       two equal columns of W_o and values e_a - e_b (1e-4 apart): x ~ 0 by cancellation
VLayer layer_of(const Shape& s, int D, Values kind, Rng& rng) {
  VLayer l = kvevict_test::random_vlayer(s, D, rng, kind == Values::spiky ? 4.0 : 1.5);
  const auto row = [&](int h, int j) { return (sz(h) * sz(s.L) + sz(j)) * sz(s.d); };
  switch (kind) {
    case Values::normal:
      break;
    case Values::ties:
      std::fill(l.q.begin(), l.q.end(), 0.0);
      for (int h = 0; h < s.Hkv; ++h)
        for (int j = 0; j < s.L; ++j)
          for (int c = 0; c < s.d; ++c) l.v[row(h, j) + sz(c)] = l.v[row(0, j % 3) + sz(c)];
      break;
    case Values::spiky:
      for (int h = 0; h < s.Hkv; ++h)
        for (int j = 0; j < s.L; j += 7)
          for (int c = 0; c < s.d; ++c) l.v[row(h, j) + sz(c)] *= 50.0;
      break;
    case Values::flat_projection: {
      for (int r = 0; r < D; ++r)
        for (int c = 0; c < s.H * s.d; ++c)
          l.w_o[sz(r) * sz(s.H * s.d) + sz(c)] = __builtin_popcount(static_cast<unsigned>(r & c)) % 2 ? -1.0 : 1.0;
      std::uniform_int_distribution<int> pick(0, s.d - 1);
      for (int h = 0; h < s.Hkv; ++h)
        for (int j = 0; j < s.L; ++j) {
          for (int c = 0; c < s.d; ++c) l.v[row(h, j) + sz(c)] = 0.0;
          l.v[row(h, j) + sz(pick(rng))] = j % 2 ? 1.0 : 0.5;
        }
      break;
    }
    case Values::cancelling:
      if (s.d >= 2) {
        for (int r = 0; r < D; ++r)
          for (int q = 0; q < s.H; ++q)
            l.w_o[sz(r) * sz(s.H * s.d) + sz(q * s.d + 1)] = l.w_o[sz(r) * sz(s.H * s.d) + sz(q * s.d)];
        for (int h = 0; h < s.Hkv; ++h)
          for (int j = 0; j < s.L; ++j) {
            for (int c = 0; c < s.d; ++c) l.v[row(h, j) + sz(c)] = 0.0;
            l.v[row(h, j)] = 1.0 + 1e-4 * j;
            l.v[row(h, j) + 1] = -1.0;
          }
      }
      break;
    case Values::zero:
      std::fill(l.v.begin(), l.v.end(), 0.0);
      break;
    case Values::huge:
      for (double& x : l.v) x *= 1e17;
      break;
  }
  return l;
}

Shape random_shape(Rng& rng, int max_L) {
  const auto pick = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
  Shape s;
  s.Hkv = pick(1, 2);
  s.H = s.Hkv * pick(1, 3);
  static const int dims[] = {1, 2, 5, 16, 64};
  s.d = dims[pick(0, 4)];
  s.w = pick(1, 8);
  s.L = s.w + pick(1, max_L);
  return s;
}

template <class S>
bool same_bits(S a, S b) {
  return std::memcmp(&a, &b, sizeof(S)) == 0;
}

/// Checks l1_value_norms_of_rows against value_norms (bit for bit) and l1_value_bounds (>=) on every head of `in`.
template <class S, class KV, class W>
void check_rows_and_bounds(const kvevict::LayerInputs<KV, KV, W>& in, const Shape& s, Rng& rng,
                           const std::string& where) {
  const auto length = [&](Index) { return static_cast<Index>(s.L); };
  const RowMatrix<S> exact =
      kvevict::extend::value_norms<S>(in.values, in.w_o, s.G(), kvevict::ValueNorm::l1, nullptr, in.values_scale);
  const auto gram = kvevict::OutputGram<S>::compute(in.w_o);
  const RowMatrix<S> bound =
      kvevict::extend::l1_value_bounds<S>(in.values, in.w_o, s.G(), gram, length, in.values_scale);
  for (int h = 0; h < s.Hkv; ++h) {
    for (Index j = 0; j < s.L; ++j)
      if (!(bound(h, j) >= exact(h, j))) FAIL_CHECK(where << ": bound " << bound(h, j) << " < N " << exact(h, j));
    // Row subsets: all, one, the last block only, sparse, dense.
    std::vector<std::vector<Index>> subsets(5);
    std::bernoulli_distribution sparse(0.05), dense(0.7);
    for (Index j = 0; j < s.L; ++j) {
      subsets[0].push_back(j);
      if (j >= s.L / 128 * 128) subsets[2].push_back(j);
      if (sparse(rng)) subsets[3].push_back(j);
      if (dense(rng)) subsets[4].push_back(j);
    }
    subsets[1].push_back(std::uniform_int_distribution<Index>(0, s.L - 1)(rng));
    for (const auto& rows : subsets) {
      const std::vector<S> got =
          kvevict::extend::l1_value_norms_of_rows<S>(in.values, in.w_o, s.G(), h, s.L, rows, in.values_scale);
      for (std::size_t i = 0; i < rows.size(); ++i)
        if (!same_bits(got[i], exact(h, rows[i])))
          FAIL_CHECK(where << " head " << h << " row " << rows[i] << " of " << rows.size() << ": " << got[i]
                           << " != value_norms " << exact(h, rows[i]));
    }
  }
}

/// Whether policy P with the selector parameters `selector` selects the same with and without pruning (or refuses
/// alike); a failure names the first difference.
template <class P, class In>
bool same_with_and_without(const kvevict::CriticalSelector::Params& selector, int window, bool quirks, const In& in,
                           const Budget& budget, const std::string& where) {
  typename P::Params p;
  static_cast<kvevict::CriticalSelector::Params&>(p) = selector;
  p.window = window;
  p.reference_quirks = quirks;
  auto q = p;
  q.prune = false;
  const P pruned(p), full(q);
  const std::string what = where + " " + pruned.name();
  std::string error_pruned, error_full;
  Selection a, b;
  try {
    a = pruned.select(in, budget);
  } catch (const std::exception& e) {
    error_pruned = e.what();
  }
  try {
    b = full.select(in, budget);
  } catch (const std::exception& e) {
    error_full = e.what();
  }
  if (error_pruned != error_full) {
    FAIL_CHECK(what << ": pruned threw '" << error_pruned << "', unpruned '" << error_full << "'");
    return false;
  }
  if (a.indices() != b.indices() || a.offsets() != b.offsets()) {
    FAIL_CHECK(what << ": " << kvevict_test::first_difference(kvevict_test::kept_of(a), kvevict_test::kept_of(b)));
    return false;
  }
  return true;
}

}  // namespace

TEMPLATE_TEST_CASE("pruned L1 term: chosen rows give value_norms' bits, and the bound holds", "[value_pruning]", float,
                   double) {
  using S = TestType;
  Rng rng(20261202);
  static const int hidden[] = {16, 17, 40, 256};
  static const int lengths[] = {1, 2, 3, 127, 128, 129, 257, 300};
  for (int c = 0; c < kvevict_test::cases(120); ++c) {
    Shape s = random_shape(rng, 40);
    s.L = std::max(s.w + 1, lengths[c % 8]);
    const int D = hidden[(c / 8) % 4];
    const auto kind = static_cast<Values>(c % 7);
    const VLayer l = layer_of(s, D, kind, rng);
    const std::string where = "case " + std::to_string(c) + " " + kvevict_test::describe(s) +
                              " D=" + std::to_string(D) + " " + to_string(kind);
    const auto stored = kvevict_test::store_v<S>(l, c % 2 ? Layout::heads_major : Layout::tokens_major);
    check_rows_and_bounds<S>(stored.in, s, rng, where);
    if constexpr (std::is_same_v<S, float>) {
      if (kind == Values::huge) continue;  // beyond half's range
      // Half values and a bfloat16 W_o (converted block by block, W^q once per head).
      const auto half =
          kvevict_test::store_v<Eigen::half>(kvevict_test::rounded_to<Eigen::half>(l), Layout::heads_major);
      const auto bf =
          kvevict_test::store_v<Eigen::bfloat16>(kvevict_test::rounded_to<Eigen::bfloat16>(l), Layout::heads_major);
      kvevict::LayerInputs<Eigen::half, Eigen::half, Eigen::bfloat16> mixed;
      mixed.values = half.in.values;
      mixed.w_o = bf.in.w_o;
      check_rows_and_bounds<float>(mixed, s, rng, where + " f16 values, bf16 w_o");
      // int8 values with a tensor factor and per-(head, token) factors.
      std::vector<std::int8_t> codes(l.v.size());
      std::vector<float> token_scale(sz(s.Hkv) * sz(s.L));
      for (std::size_t i = 0; i < codes.size(); ++i)
        codes[i] = static_cast<std::int8_t>(std::lround(std::max(-127.0, std::min(127.0, 40.0 * l.v[i]))));
      for (float& f : token_scale) f = std::uniform_real_distribution<float>(0.01f, 0.1f)(rng);
      kvevict::LayerInputs<std::int8_t, std::int8_t, float> q8;
      q8.values = kvevict::kv_heads_major<const std::int8_t>(codes.data(), s.Hkv, s.L, s.d);
      q8.values_scale = kvevict::KVScale{0.5f, kvevict::per_head_token_scales(token_scale.data(), s.Hkv, s.L)};
      q8.w_o = stored.in.w_o;
      check_rows_and_bounds<float>(q8, s, rng, where + " int8 values");
    }
  }
}

TEMPLATE_TEST_CASE("pruned L1 term: CriticalKV selects exactly as without pruning, and prunes", "[value_pruning]",
                   float, double) {
  using S = TestType;
  Rng rng(7);
  int failures = 0;
  kvevict::extend::ValueTermCounter counter;
  const kvevict::extend::ValueTermCounter::Scope counting(counter);
  for (int c = 0; c < kvevict_test::cases(300) && failures < 5; ++c) {
    Shape s = random_shape(rng, c % 3 == 0 ? 700 : 160);
    const int D = std::uniform_int_distribution<int>(16, 80)(rng);
    const auto kind = static_cast<Values>(c % 7);
    const VLayer l = layer_of(s, D, kind, rng);
    const auto stored = kvevict_test::store_v<S>(l, c % 2 ? Layout::heads_major : Layout::tokens_major);
    for (const std::int64_t n_kept : kvevict_test::some_budgets(s, rng, 3)) {
      kvevict::CriticalSelector::Params selector;
      selector.first_stage_ratio = std::vector<double>{0.5, 0.0, 0.3, 1.0}[sz(c % 4)];
      selector.eps = c % 5 == 0 ? 0.0 : 1e-4;
      const bool quirks = c % 4 == 1;
      const auto budget =
          quirks ? Budget::compression_ratio(1.0 - static_cast<double>(n_kept) / s.L) : Budget::tokens(n_kept);
      const std::string where = "case " + std::to_string(c) + " " + kvevict_test::describe(s) +
                                " D=" + std::to_string(D) + " " + to_string(kind) +
                                " n_kept=" + std::to_string(n_kept) + (quirks ? " quirks" : "");
      failures += !same_with_and_without<kvevict::CriticalKV>(selector, s.w, quirks, stored.in, budget, where);
      failures += !same_with_and_without<kvevict::CriticalSnapKV>(selector, s.w, quirks, stored.in, budget, where);
      if (!quirks)
        failures += !same_with_and_without<kvevict::Policy<kvevict::DefensiveKV, kvevict::CriticalSelector>>(
            selector, s.w, false, stored.in, budget, where);
    }
  }
  // The pruning is on: part of the scored entries never had their term computed.
  INFO("computed " << counter.computed << " of " << counter.scored);
  CHECK(counter.scored > 0);
  CHECK(counter.fraction() < 0.9);
}

TEMPLATE_TEST_CASE(
    "pruned L1 term under one budget across layers: select(layers) refines after the model-wide "
    "allocation and selects exactly as without pruning and as a plan",
    "[value_pruning][layer_global]", float, double) {
  using S = TestType;
  using Global = kvevict::LayerGlobalPolicy<kvevict::CriticalSelector>;
  Rng rng(29);
  int failures = 0;
  kvevict::extend::ValueTermCounter counter;
  const kvevict::extend::ValueTermCounter::Scope counting(counter);
  for (int c = 0; c < kvevict_test::cases(60) && failures < 5; ++c) {
    const Shape first = random_shape(rng, c % 4 == 0 ? 600 : 160);
    const int D = std::uniform_int_distribution<int>(16, 64)(rng);
    const bool quirks = c % 5 == 1;  // the reference's model total: every layer alike
    const int NL = 1 + c % 3;
    std::vector<VLayer> model;
    std::vector<decltype(kvevict_test::store_v<S>(std::declval<const VLayer&>(), Layout::heads_major))> stored;
    stored.reserve(sz(NL));  // the inputs view the stored buffers
    for (int l = 0; l < NL; ++l) {
      Shape s = first;
      if (!quirks) s.L = std::uniform_int_distribution<int>(s.w + 1, first.L + 40)(rng);
      model.push_back(layer_of(s, D, static_cast<Values>((c + l) % 7), rng));
    }
    for (const VLayer& l : model) stored.push_back(kvevict_test::store_v<S>(l, Layout::heads_major));
    std::vector<decltype(stored.front().in)> inputs;
    for (const auto& st : stored) inputs.push_back(st.in);
    for (const std::int64_t n_kept : kvevict_test::some_budgets(first, rng, 3)) {
      typename Global::Params p;
      p.window = first.w;
      p.reference_quirks = quirks;
      p.first_stage_ratio = std::vector<double>{0.5, 0.0, 0.3, 1.0}[sz(c % 4)];
      auto q = p;
      q.prune = false;
      const Budget budget =
          quirks ? Budget::compression_ratio(1.0 - static_cast<double>(n_kept) / first.L) : Budget::tokens(n_kept);
      const std::string where = "case " + std::to_string(c) + " " + kvevict_test::describe(first) + " layers " +
                                std::to_string(NL) + " n_kept " + std::to_string(n_kept) + (quirks ? " quirks" : "");
      const auto outcome = [&](auto&& f) -> std::pair<std::string, std::vector<Selection>> {
        try {
          return {"", f()};
        } catch (const kvevict::invalid_argument& e) {
          return {e.what(), {}};
        }
      };
      const auto pruned = outcome([&] { return Global(p).template select<S>(inputs, budget); });
      const auto full = outcome([&] { return Global(q).template select<S>(inputs, budget); });
      const auto planned = outcome([&] {
        auto plan = Global(p).template plan<S>(budget, NL);
        for (const auto& in : inputs) plan.add(in);
        return plan.apply();
      });
      INFO(where << ": pruned '" << pruned.first << "', unpruned '" << full.first << "'");
      bool same = pruned.first == full.first && planned.first == full.first &&
                  pruned.second.size() == full.second.size() && planned.second.size() == full.second.size();
      for (std::size_t l = 0; same && l < full.second.size(); ++l)
        same = kvevict_test::kept_of(pruned.second[l]) == kvevict_test::kept_of(full.second[l]) &&
               kvevict_test::kept_of(planned.second[l]) == kvevict_test::kept_of(full.second[l]);
      CHECK(same);
      failures += !same;
    }
  }
  INFO("computed " << counter.computed << " of " << counter.scored);
  CHECK(counter.scored > 0);
  CHECK(counter.fraction() < 0.9);
}

}  // namespace test_value_pruning
