// docs/algorithms.md#layouts (sharing, blocks, reductions) for every policy against the independent float64
// reference of tests/support/reference_layout.hpp, row for row, on random layers (ragged per head, shared
// positions per layer or per model), with capacity padding and original positions.
#include <catch2/catch.hpp>

#include <kvevict/kvevict.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <string>
#include <vector>

#include "support/cases.hpp"
#include "support/matchers.hpp"
#include "support/ragged_inputs.hpp"
#include "support/random_inputs.hpp"
#include "support/reference_layout.hpp"

namespace test_layout_reference {  // this file's scope in unity builds (tests/CMakeLists.txt)

using kvevict::Budget;
using kvevict::Index;
using kvevict::Selection;
using kvevict_test::Ragged;
using kvevict_test::Rng;
using kvevict_test::rows_of;
namespace ref = kvevict_ref::ragged;
namespace lref = kvevict_ref::layout;

namespace {

std::string show(const std::vector<ref::KeptRows>& model) {
  std::string out;
  for (const auto& k : model) {
    out += "[";
    for (const auto& head : k) {
      out += "{";
      for (std::int64_t j : head) out += std::to_string(j) + " ";
      out += "} ";
    }
    out += "] ";
  }
  return out;
}

/// NL layers; heads hold their own random positions (per_head), one set per layer (per_layer) or one per model.
std::vector<Ragged> random_model(Rng& rng, int NL, int H, int Hkv, int w, int d, int T, double keep,
                                 kvevict::Sharing share) {
  std::vector<Ragged> layers;
  for (int l = 0; l < NL; ++l) {
    Ragged r = kvevict_test::random_ragged(rng, H, Hkv, w, d, T, keep);
    if (share != kvevict::Sharing::per_head)
      for (int h = 1; h < Hkv; ++h) {  // every head at head 0's positions (keys/values of head 0's length)
        auto& head = r.heads[static_cast<std::size_t>(h)];
        head.pos = r.heads[0].pos;
        head.keys = kvevict_test::normal_vector(head.pos.size() * static_cast<std::size_t>(d), rng);
        head.values = kvevict_test::normal_vector(head.pos.size() * static_cast<std::size_t>(d), rng);
      }
    if (share == kvevict::Sharing::per_model && l > 0)
      for (int h = 0; h < Hkv; ++h) {
        auto& head = r.heads[static_cast<std::size_t>(h)];
        head.pos = layers.front().heads[0].pos;
        head.keys = kvevict_test::normal_vector(head.pos.size() * static_cast<std::size_t>(d), rng);
        head.values = kvevict_test::normal_vector(head.pos.size() * static_cast<std::size_t>(d), rng);
      }
    layers.push_back(r);
  }
  return layers;
}

/// When the library and the reference differ, whether every difference is a swap between blocks of one ranked tier
/// (scored, or forced: ranked by score too) whose reference scores tie within rounding (1e-12 relative; mean
/// reductions of scores computed in another order can tie exactly in value yet differ in the last bit). Returns
/// false for any other difference.
bool near_tie_swap(const std::vector<ref::KeptRows>& got, const std::vector<ref::KeptRows>& want, lref::Method m,
                   const std::vector<Ragged>& model, const std::vector<std::int64_t>& n_kept,
                   const lref::MethodParams& p, const lref::Layout& layout) {
  if (got.size() != want.size()) return false;
  const lref::Maps maps = lref::method_maps(m, model, n_kept, p);
  const std::vector<lref::Group> groups = lref::make_groups(layout.share, maps.pos);
  for (const lref::Group& g : groups) {
    const auto [l, h] = g.members.front();
    const auto& a = got[l][h];
    const auto& b = want[l][h];
    if (a == b) continue;
    std::vector<double> only_got, only_want;
    int tier = -1;  // the tier of every differing block
    for (const lref::ModelMap* map : {&maps.alloc, &maps.stage2}) {
      if (map->empty()) continue;
      const lref::Blocks blocks =
          lref::cut_blocks(g, lref::reduce_group(g, *map, layout.reduce), layout.block, layout.reduce);
      for (const lref::Block& x : blocks.blocks) {
        const auto rows_in = [&](const std::vector<std::int64_t>& rows) {
          return std::find(rows.begin(), rows.end(), x.id * layout.block) != rows.end();
        };
        if (rows_in(a) == rows_in(b)) continue;
        if ((x.tier != lref::kScored && x.tier != lref::kForced) || (tier >= 0 && x.tier != tier)) return false;
        tier = x.tier;
        (rows_in(a) ? only_got : only_want).push_back(x.score);
      }
    }
    if (only_got.empty() || only_want.empty()) return false;
    for (double x : only_got)
      for (double y : only_want)
        if (std::abs(x - y) > 1e-12 * std::max(std::abs(x), std::abs(y))) return false;
  }
  return true;
}

/// A random model stored for the library: each layer with `pad` rows of NaN padding past its longest head,
/// tokens-major or not, positions shifted by `shift`; the layers' inputs and the mean entries per head of each.
struct StoredModel {
  std::vector<kvevict_test::RaggedStored<double>> stored;
  std::vector<kvevict::LayerInputs<double>> inputs;
  std::vector<std::int64_t> entries;                      // per layer: the mean entries per head, rounded down
  Index min_entries = std::numeric_limits<Index>::max();  // the fewest of them
  Index min_length = std::numeric_limits<Index>::max();   // the shortest head of any layer
};

StoredModel store_model(const std::vector<Ragged>& model, Index pad, bool tokens_major, std::int64_t shift) {
  StoredModel out;
  for (const Ragged& r : model) {
    out.stored.push_back(kvevict_test::store<double>(r, kvevict_test::longest(r) + pad, tokens_major,
                                                     std::numeric_limits<double>::quiet_NaN(), shift));
    Index entries = 0;
    for (int h = 0; h < r.Hkv; ++h) {
      entries += kvevict_test::length(r, h);
      out.min_length = std::min(out.min_length, kvevict_test::length(r, h));
    }
    out.entries.push_back(entries / r.Hkv);
    out.min_entries = std::min(out.min_entries, entries / r.Hkv);
  }
  for (const auto& st : out.stored) out.inputs.push_back(st.in);
  return out;
}

template <class P>
P make(typename P::Params p, int w, const kvevict::LayoutParams& layout) {
  p.window = w;
  static_cast<kvevict::LayoutParams&>(p) = layout;
  return P(p);
}

/// check(name, method, policy) for the presets the protected-prefix and threshold cases compare, window w, `layout`.
template <class Check>
void for_each_modelled(int w, const kvevict::LayoutParams& layout, Check&& check) {
  check("snapkv", lref::Method::snapkv, make<kvevict::SnapKV>({}, w, layout));
  check("adakv", lref::Method::adakv, make<kvevict::AdaKV>({}, w, layout));
  check("criticalkv", lref::Method::criticalkv, make<kvevict::CriticalKV>({}, w, layout));
  check("critical_snapkv", lref::Method::critical_snapkv, make<kvevict::CriticalSnapKV>({}, w, layout));
  check("defensivekv", lref::Method::defensivekv, make<kvevict::DefensiveKV>({}, w, layout));
  check("layer_defensivekv", lref::Method::layer_defensivekv, make<kvevict::LayerDefensiveKV>({}, w, layout));
  check("knorm", lref::Method::knorm, make<kvevict::KNorm>({}, w, layout));
  kvevict::StreamingLLM::Params sp;
  static_cast<kvevict::LayoutParams&>(sp) = layout;
  check("streamingllm", lref::Method::streamingllm, kvevict::StreamingLLM(sp));
}

lref::Layout ref_layout(const kvevict::LayoutParams& l) {
  lref::Layout out;
  out.share = l.share == kvevict::Sharing::per_head    ? lref::Share::per_head
              : l.share == kvevict::Sharing::per_layer ? lref::Share::per_layer
                                                       : lref::Share::per_model;
  out.reduce = l.reduce == kvevict::Reduce::max ? lref::Reduce::max : lref::Reduce::mean;
  out.block = l.block;
  return out;
}

}  // namespace

TEST_CASE("layout reference: every policy x sharing x block x reduce, random layers", "[layout][reference]") {
  Rng rng(880);
  int compared = 0, near_ties = 0;
  for (int trial = 0; trial < kvevict_test::cases(18); ++trial) {
    const int Hkv = 1 + trial % 3, G = 1 + (trial / 3) % 2, w = 1 + trial % 4, d = 4 + 4 * (trial % 2);
    const int NL = 1 + trial % 3, T = 30 + 5 * trial;
    for (kvevict::Sharing share :
         {kvevict::Sharing::per_head, kvevict::Sharing::per_layer, kvevict::Sharing::per_model}) {
      const std::vector<Ragged> model = random_model(rng, NL, Hkv * G, Hkv, w, d, T, 0.4 + 0.02 * trial, share);
      if (trial % 6 == 5)  // uniform attention: ties everywhere
        for (const Ragged& r : model) std::fill(const_cast<Ragged&>(r).q.begin(), const_cast<Ragged&>(r).q.end(), 0.0);
      const StoredModel stored = store_model(model, 3, trial % 2 == 1, 7 * trial);
      const std::vector<kvevict::LayerInputs<double>>& inputs = stored.inputs;
      const Index min_entries = stored.min_entries, min_length = stored.min_length;
      for (Index block : {Index(1), Index(2), Index(5)})
        for (kvevict::Reduce reduce : {kvevict::Reduce::max, kvevict::Reduce::mean}) {
          kvevict::LayoutParams layout;
          layout.share = share;
          layout.block = block;
          layout.reduce = reduce;
          for (Index n : {std::max<Index>(block, w), std::max<Index>(block, min_entries / 2), min_entries}) {
            if (n < block || n > min_entries) continue;
            const Budget budget = Budget::tokens(n);
            const std::vector<std::int64_t> n_kept(model.size(), n);
            const auto check_kept = [&](const char* name, lref::Method m, const std::vector<Selection>& got,
                                        lref::MethodParams p, const std::vector<std::int64_t>& kept_n) {
              const std::vector<ref::KeptRows> want = lref::select(m, model, kept_n, p, ref_layout(layout));
              INFO(name << " share " << kvevict::to_string(share) << " block " << block << " reduce "
                        << kvevict::to_string(reduce) << " n " << n << " trial " << trial);
              INFO("got  " << show(rows_of(got)));
              INFO("want " << show(want));
              if (rows_of(got) != want) {
                ++near_ties;
                CHECK(near_tie_swap(rows_of(got), want, m, model, kept_n, p, ref_layout(layout)));
              }
              ++compared;
            };
            const auto check = [&](const char* name, lref::Method m, const std::vector<Selection>& got,
                                   lref::MethodParams p) { check_kept(name, m, got, p, n_kept); };
            check("snapkv", lref::Method::snapkv,
                  kvevict::select_layers<double>(make<kvevict::SnapKV>({}, w, layout), inputs, budget),
                  lref::preset(lref::Method::snapkv));
            check("adakv", lref::Method::adakv,
                  kvevict::select_layers<double>(make<kvevict::AdaKV>({}, w, layout), inputs, budget),
                  lref::preset(lref::Method::adakv));
            check("criticalkv", lref::Method::criticalkv,
                  kvevict::select_layers<double>(make<kvevict::CriticalKV>({}, w, layout), inputs, budget),
                  lref::preset(lref::Method::criticalkv));
            check("critical_snapkv", lref::Method::critical_snapkv,
                  kvevict::select_layers<double>(make<kvevict::CriticalSnapKV>({}, w, layout), inputs, budget),
                  lref::preset(lref::Method::critical_snapkv));
            check("defensivekv", lref::Method::defensivekv,
                  kvevict::select_layers<double>(make<kvevict::DefensiveKV>({}, w, layout), inputs, budget),
                  lref::preset(lref::Method::defensivekv));
            check("adakv_defensive", lref::Method::adakv_defensive,
                  kvevict::select_layers<double>(make<kvevict::AdaKVDefensive>({}, w, layout), inputs, budget),
                  lref::preset(lref::Method::adakv_defensive));
            check("layer_defensivekv", lref::Method::layer_defensivekv,
                  kvevict::select_layers<double>(make<kvevict::LayerDefensiveKV>({}, w, layout), inputs, budget),
                  lref::preset(lref::Method::layer_defensivekv));
            check("tova", lref::Method::tova,
                  kvevict::select_layers<double>(make<kvevict::TOVA>({}, w, layout), inputs, budget),
                  lref::preset(lref::Method::tova));
            check("knorm", lref::Method::knorm,
                  kvevict::select_layers<double>(make<kvevict::KNorm>({}, w, layout), inputs, budget),
                  lref::preset(lref::Method::knorm));
            check("keydiff", lref::Method::keydiff,
                  kvevict::select_layers<double>(make<kvevict::KeyDiff>({}, w, layout), inputs, budget),
                  lref::preset(lref::Method::keydiff));
            {  // docs/algorithms.md#redundancy: R-KV's preset, and the redundancy term on other scores (every map)
              const double rho =
                  1.0 - std::pow(10.0, -1 - trial % 4);  // 0.9 .. 0.9999: redundancy decides more and more
              const auto with_rho = [&](lref::Method m) {
                lref::MethodParams p = lref::preset(m);
                p.redundancy = rho;
                return p;
              };
              lref::MethodParams rkv = lref::preset(lref::Method::snapkv);
              rkv.kernel = 7;
              rkv.pool = kvevict_ref::Pool::max;
              rkv.redundancy = 0.93;
              check("rkv", lref::Method::snapkv,
                    kvevict::select_layers<double>(make<kvevict::RKV>({}, w, layout), inputs, budget), rkv);
              kvevict::CriticalKV::Params cp;
              kvevict::LayerDefensiveKV::Params dp;
              kvevict::KeyDiff::Params kp;
              cp.redundancy = dp.redundancy = kp.redundancy = rho;
              check("criticalkv+redundancy", lref::Method::criticalkv,
                    kvevict::select_layers<double>(make<kvevict::CriticalKV>(cp, w, layout), inputs, budget),
                    with_rho(lref::Method::criticalkv));
              check("layer_defensivekv+redundancy", lref::Method::layer_defensivekv,
                    kvevict::select_layers<double>(make<kvevict::LayerDefensiveKV>(dp, w, layout), inputs, budget),
                    with_rho(lref::Method::layer_defensivekv));
              check("keydiff+redundancy", lref::Method::keydiff,
                    kvevict::select_layers<double>(make<kvevict::KeyDiff>(kp, w, layout), inputs, budget),
                    with_rho(lref::Method::keydiff));
            }
            {  // PyramidKV: SnapKV with each layer's share of the model (per_model: one set of n)
              std::vector<std::int64_t> shares = n_kept;
              if (share != kvevict::Sharing::per_model)
                shares = lref::pyramid_shares(20.0, n, std::max<std::int64_t>(w, block), static_cast<std::int64_t>(NL));
              // A share above a head's length keeps all of it (tests/test_pyramid.cpp): compared where none is.
              if (*std::max_element(shares.begin(), shares.end()) <= min_length)
                check_kept("pyramidkv", lref::Method::snapkv,
                           kvevict::select_layers<double>(make<kvevict::PyramidKV>({}, w, layout), inputs, budget),
                           lref::preset(lref::Method::snapkv), shares);
            }
            kvevict::StreamingLLM::Params sp;
            static_cast<kvevict::LayoutParams&>(sp) = layout;
            sp.sinks = 1 + trial % 5;
            lref::MethodParams rp = lref::preset(lref::Method::streamingllm);
            rp.sinks = 1 + trial % 5;
            check("streamingllm", lref::Method::streamingllm,
                  kvevict::select_layers<double>(kvevict::StreamingLLM(sp), inputs, budget), rp);
            if (share != kvevict::Sharing::per_head || block == 1 ||
                min_length == kvevict_test::longest(model.front())) {
              kvevict::AdaKV::Params ap;
              ap.variant = kvevict::HeadAdaptiveAllocation::Variant::original;
              check("adakv_original", lref::Method::adakv_original,
                    kvevict::select_layers<double>(make<kvevict::AdaKV>(ap, w, layout), inputs, budget),
                    lref::preset(lref::Method::adakv_original));
            }
          }
        }
    }
  }
  CHECK(compared > kvevict_test::cases(1000));
  CHECK(near_ties * 100 < compared);  // rare: a tie broken by rounding, not a semantic difference
}

TEST_CASE("layout reference: a protected prefix, counted or on top, under every layout, refused when it does not fit",
          "[layout][reference][protected]") {
  // docs/algorithms.md#protected-prefix: the entries at original positions < p rank above every other entry of every
  // map. The library keeps what the reference keeps with that tier; it refuses the budget exactly when the
  // reference's selection would drop a protected entry.
  Rng rng(881);
  int compared = 0, refused = 0, near_ties = 0;
  for (int trial = 0; trial < kvevict_test::cases(12); ++trial) {
    const int Hkv = 1 + trial % 3, G = 1 + (trial / 3) % 2, w = 1 + trial % 4, d = 4 + 4 * (trial % 2);
    const int NL = 1 + trial % 3, T = 40 + 5 * trial;
    for (kvevict::Sharing share :
         {kvevict::Sharing::per_head, kvevict::Sharing::per_layer, kvevict::Sharing::per_model}) {
      const std::vector<Ragged> model = random_model(rng, NL, Hkv * G, Hkv, w, d, T, 0.5 + 0.02 * trial, share);
      const StoredModel stored = store_model(model, 2, trial % 2 == 0, 0);
      const std::vector<kvevict::LayerInputs<double>>& inputs = stored.inputs;
      const Index min_entries = stored.min_entries;
      const std::int64_t p = 3 + (trial * 7) % (T / 3);
      for (Index block : {Index(1), Index(4)})
        for (Budget::PrefixBudget counting : {Budget::PrefixBudget::counted, Budget::PrefixBudget::extra})
          for (Index n : {std::max<Index>(block, w), std::max<Index>(block, min_entries / 2)}) {
            kvevict::LayoutParams layout;
            layout.share = share;
            layout.block = block;
            layout.reduce = trial % 2 ? kvevict::Reduce::mean : kvevict::Reduce::max;
            const Budget budget = Budget::tokens(n).protect_prefix(p, counting);
            // The reference's n_kept: the library's (n, plus p on top: at most the mean entries per head).
            const std::int64_t n_ref =
                counting == Budget::PrefixBudget::extra ? n + std::min<std::int64_t>(p, min_entries) : n;
            if (n_ref > min_entries) continue;
            const std::vector<std::int64_t> n_kept(model.size(), n_ref);
            const auto check = [&](const char* name, lref::Method m, const auto& policy) {
              const std::vector<ref::KeptRows> want =
                  lref::select(m, model, n_kept, lref::preset(m), ref_layout(layout), p);
              bool drops = false;  // whether the reference drops a protected entry
              for (std::size_t l = 0; l < model.size(); ++l)
                for (int h = 0; h < Hkv; ++h) {
                  const auto& pos = model[l].heads[static_cast<std::size_t>(h)].pos;
                  const auto& kept = want[l][static_cast<std::size_t>(h)];
                  for (std::size_t j = 0; j < pos.size(); ++j)
                    if (pos[j] < p && !std::binary_search(kept.begin(), kept.end(), static_cast<std::int64_t>(j)))
                      drops = true;
                }
              INFO(name << " share " << kvevict::to_string(share) << " block " << block << " n " << n << " p " << p
                        << (counting == Budget::PrefixBudget::extra ? " extra" : " counted") << " trial " << trial);
              INFO("want " << show(want));
              if (drops) {
                ++refused;
                REQUIRE_THROWS_MATCHES(kvevict::select_layers<double>(policy, inputs, budget),
                                       kvevict::invalid_argument,
                                       kvevict_test::MessageContains("its protected prefix: a budget that counts"));
                return;
              }
              const std::vector<Selection> got = kvevict::select_layers<double>(policy, inputs, budget);
              INFO("got  " << show(rows_of(got)));
              if (rows_of(got) != want) {
                ++near_ties;
                CHECK(near_tie_swap(rows_of(got), want, m, model, n_kept, lref::preset(m), ref_layout(layout)));
              }
              ++compared;
            };
            for_each_modelled(w, layout, check);
          }
    }
  }
  INFO("compared " << compared << ", refused " << refused);
  CHECK(compared > kvevict_test::cases(300));
  CHECK(refused > 20);
  CHECK(near_ties * 50 < compared + 50);
}

TEST_CASE("layout reference: retrieval heads forced whole in every map, under every layout",
          "[layout][reference][retrieval]") {
  // docs/algorithms.md#retrieval-heads: every entry of a KV head named in LayerInputs::retrieval_heads is forced
  // (the window stays the window); what fits of it is kept before any scored entry, ranked by score.
  Rng rng(884);
  int compared = 0, near_ties = 0, whole = 0, changed = 0;
  for (int trial = 0; trial < kvevict_test::cases(12); ++trial) {
    const int Hkv = 1 + trial % 3, G = 1 + (trial / 3) % 2, w = 1 + trial % 4, d = 4 + 4 * (trial % 2);
    const int NL = 1 + trial % 3, T = 40 + 5 * trial;
    for (kvevict::Sharing share :
         {kvevict::Sharing::per_head, kvevict::Sharing::per_layer, kvevict::Sharing::per_model}) {
      const std::vector<Ragged> model = random_model(rng, NL, Hkv * G, Hkv, w, d, T, 0.5 + 0.02 * trial, share);
      const StoredModel stored = store_model(model, 2, trial % 2 == 0, 0);
      const std::vector<kvevict::LayerInputs<double>>& plain = stored.inputs;
      std::vector<kvevict::LayerInputs<double>> inputs = plain;
      std::vector<std::vector<int>> retrieval(model.size());
      const Index min_entries = stored.min_entries;
      for (std::size_t l = 0; l < model.size(); ++l) {
        const int pick = (trial + static_cast<int>(l)) % (Hkv + 1);  // Hkv: none in this layer
        if (pick < Hkv) retrieval[l].push_back(pick);
        for (int h : retrieval[l]) inputs[l].retrieval_heads.push_back(h);
      }
      for (Index block : {Index(1), Index(4)})
        for (Index n : {std::max<Index>(block, min_entries / 3), std::max<Index>(block, 3 * min_entries / 4)}) {
          kvevict::LayoutParams layout;
          layout.share = share;
          layout.block = block;
          layout.reduce = trial % 2 ? kvevict::Reduce::mean : kvevict::Reduce::max;
          const Budget budget = Budget::tokens(n);
          const std::vector<std::int64_t> n_kept(model.size(), n);
          const auto check = [&](const char* name, lref::Method m, const auto& policy) {
            const std::vector<ref::KeptRows> want =
                lref::select(m, model, n_kept, lref::preset(m), ref_layout(layout), 0, {}, retrieval);
            INFO(name << " share " << kvevict::to_string(share) << " block " << block << " n " << n << " trial "
                      << trial);
            INFO("want " << show(want));
            const std::vector<Selection> got = kvevict::select_layers<double>(policy, inputs, budget);
            INFO("got  " << show(rows_of(got)));
            if (rows_of(got) != want) {
              ++near_ties;
              CHECK(near_tie_swap(rows_of(got), want, m, model, n_kept, lref::preset(m), ref_layout(layout)));
            }
            ++compared;
            changed += rows_of(kvevict::select_layers<double>(policy, plain, budget)) != want;
            for (std::size_t l = 0; l < model.size(); ++l)
              for (int h : retrieval[l])
                whole += want[l][static_cast<std::size_t>(h)].size() ==
                         model[l].heads[static_cast<std::size_t>(h)].pos.size();
          };
          for_each_modelled(w, layout, check);
        }
    }
  }
  INFO("compared " << compared << ", changed " << changed << ", heads kept whole " << whole);
  CHECK(compared > kvevict_test::cases(200));
  CHECK(changed * 5 > compared);           // the heads named change what is kept (a quarter of the cases here)
  CHECK(whole > kvevict_test::cases(40));  // and, where the allocation moves budget to them, keep them whole
  CHECK(near_ties * 50 < compared + 50);
}

TEST_CASE("layout reference: threshold budgets, every scope and bounds, under every layout",
          "[layout][reference][threshold]") {
  // docs/algorithms.md#threshold-budgets: the blocks (rows) that pass tau, counted per group, per layer or per model,
  // clamped to the bounds in whole blocks; tau sits midway between two distinct scores of the allocation map's blocks
  // near their median, so that no block ties it within rounding.
  Rng rng(882);
  int compared = 0, near_ties = 0;
  for (int trial = 0; trial < kvevict_test::cases(12); ++trial) {
    const int Hkv = 1 + trial % 3, G = 1 + (trial / 3) % 2, w = 1 + trial % 4, d = 4 + 4 * (trial % 2);
    const int NL = 1 + trial % 3, T = 40 + 5 * trial;
    for (kvevict::Sharing share :
         {kvevict::Sharing::per_head, kvevict::Sharing::per_layer, kvevict::Sharing::per_model}) {
      const std::vector<Ragged> model = random_model(rng, NL, Hkv * G, Hkv, w, d, T, 0.6 + 0.02 * trial, share);
      const StoredModel stored = store_model(model, 2, trial % 2 == 0, 0);
      const std::vector<kvevict::LayerInputs<double>>& inputs = stored.inputs;
      const std::vector<std::int64_t>& n_kept = stored.entries;  // what the selectors read
      for (Index block : {Index(1), Index(4)})
        for (const lref::ThresholdScope scope :
             {lref::ThresholdScope::head, lref::ThresholdScope::layer, lref::ThresholdScope::model}) {
          kvevict::LayoutParams layout;
          layout.share = share;
          layout.block = block;
          layout.reduce = trial % 2 ? kvevict::Reduce::mean : kvevict::Reduce::max;
          const auto check = [&](const char* name, lref::Method m, const auto& policy) {
            const lref::MethodParams p = lref::preset(m);
            // tau: midway in the widest gap among the middle third of the allocation map's scored block scores.
            const lref::Maps maps = lref::method_maps(m, model, n_kept, p);
            std::vector<double> scores;
            for (const lref::Group& g : lref::make_groups(ref_layout(layout).share, maps.pos))
              for (const lref::Block& b :
                   lref::cut_blocks(g, lref::reduce_group(g, maps.alloc, ref_layout(layout).reduce), block,
                                    ref_layout(layout).reduce)
                       .blocks)
                if (b.tier == lref::kScored) scores.push_back(b.score);
            if (scores.size() < 3) return;
            std::sort(scores.begin(), scores.end());
            double tau = scores.front() - 1.0, gap = -1.0;
            for (std::size_t i = scores.size() / 3; i + 1 < std::max<std::size_t>(2 * scores.size() / 3, 2); ++i)
              if (scores[i + 1] - scores[i] > gap)
                gap = scores[i + 1] - scores[i], tau = 0.5 * (scores[i] + scores[i + 1]);
            if (!(gap > 1e-9 * std::max(std::abs(tau), 1e-300))) return;
            const std::int64_t unit = scope == lref::ThresholdScope::head    ? 1
                                      : scope == lref::ThresholdScope::layer ? Hkv
                                                                             : NL * Hkv;
            const std::int64_t lo = (trial * 5 + static_cast<int>(scope)) % (unit * 6 + 1);
            const std::int64_t hi = trial % 3 == 0 ? -1 : lo + (trial * 11) % (unit * 10 + 1);
            lref::Threshold t;
            t.on = true;
            t.tau = tau;
            t.lo = lo;
            t.hi = hi < 0 ? std::numeric_limits<std::int64_t>::max() : hi;
            t.scope = scope;
            const Budget budget =
                Budget::threshold(tau).count_bounds(lo, hi,
                                                    scope == lref::ThresholdScope::head    ? Budget::Scope::head
                                                    : scope == lref::ThresholdScope::layer ? Budget::Scope::layer
                                                                                           : Budget::Scope::model);
            std::vector<std::int64_t> seen = n_kept;  // a per-head upper bound lowers what the selectors read
            if (scope == lref::ThresholdScope::head && hi >= 0)
              for (std::int64_t& x : seen) x = std::max<std::int64_t>(1, std::min<std::int64_t>(x, hi));
            for (std::int64_t x : seen)
              if (x < block) return;  // the reference's blocks need n_kept >= B
            const std::vector<ref::KeptRows> want = lref::select(m, model, seen, p, ref_layout(layout), 0, t);
            INFO(name << " share " << kvevict::to_string(share) << " block " << block << " scope "
                      << static_cast<int>(scope) << " tau " << tau << " lo " << lo << " hi " << hi << " trial "
                      << trial);
            INFO("want " << show(want));
            const std::vector<Selection> got = kvevict::select_layers<double>(policy, inputs, budget);
            INFO("got  " << show(rows_of(got)));
            if (rows_of(got) != want) {
              ++near_ties;
              CHECK(near_tie_swap(rows_of(got), want, m, model, seen, p, ref_layout(layout)));
            }
            ++compared;
          };
          for_each_modelled(w, layout, check);
        }
    }
  }
  INFO("compared " << compared << ", near ties " << near_ties);
  CHECK(compared > kvevict_test::cases(300));
  CHECK(near_ties * 50 < compared + 50);
}

}  // namespace test_layout_reference
