// Extending kvevict: a new Selector (KeyNormSelector) and a new Allocation (ProportionalAllocation), composed with a
// built-in base, with each other and with the layer-global allocation, then checked against a brute-force
// computation of the same rules. docs/extending.md walks through this file. Returns non-zero on any failed check.
//
// Build with -DKVEVICT_SHOW_CONTRACT_ERROR to see what the compiler says about a type that breaks a contract.

#include <kvevict/extend.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <random>
#include <tuple>
#include <vector>

namespace mylab {

using kvevict::Index;
namespace ext = kvevict::extend;

/// ||x||_p of one key row of `d` entries stored as T, computed in S.
template <class S, class T>
S key_norm(const T* x, Index d, double p) {
  S sum = 0;
  for (Index c = 0; c < d; ++c) sum += std::pow(std::abs(static_cast<S>(x[c])), static_cast<S>(p));
  return std::pow(sum, static_cast<S>(1.0 / p));
}

// ---- [selector] ------------------------------------------------------------------------------------------------
/// K-norm (Devoto et al., arXiv 2406.11430): keys with a LOW L2 norm draw high attention, so a cache keeps them.
/// Prefix token j of KV head h scores s[h][j] = -||K[h][j, :]||_p (lowest norm = highest score); the window ranks
/// above every prefix token, as in the built-in selectors. Reads only the keys (no attention, no values).
/// (It calls no kvevict::extend observation or value helper, so it needs no KVEVICT_ABI_NAMESPACE: see the guide.)
struct KeyNormSelector {
  static constexpr const char* type_name = "KeyNormSelector";  // optional: names the policy in messages
  struct Params {
    double norm_order = 2.0;  ///< p of the L_p norm (2 in the paper); field names must not clash with other Params
    void validate(const char* where) const {
      kvevict::extend::require(std::isfinite(norm_order) && norm_order >= 1.0, where,
                               "norm_order must be finite and >= 1, got ", norm_order);
    }
  };
  template <class S>
  struct Layer {
    ext::ScoreMap<S> allocation;  ///< [Hkv, L]: what the allocation ranks, and here also what select() picks from
  };

  explicit KeyNormSelector(const Params& p) : params_(p) {}
  bool reads_values() const { return false; }

  void adjust_budget(ext::LayerBudget& /*budget*/, const ext::LayerShape& /*shape*/,
                     const kvevict::ScoringParams& /*common*/, const char* /*where*/) const {}

  template <class S, class In>
  Layer<S> score(const In& in, const ext::LayerShape& shape, const kvevict::ScoringParams& common,
                 const ext::LayerBudget& /*budget*/, const char* where) const {
    kvevict::RowMatrix<S> prefix = kvevict::RowMatrix<S>::Zero(shape.kv_heads, shape.prefix);  // [Hkv, P]
    for (Index h = 0; h < shape.kv_heads; ++h)
      for (Index j = 0; j < shape.prefix_of(h); ++j)  // P_h: a ragged head's own prefix (docs/algorithms.md#ragged)
        prefix(h, j) = -key_norm<S>(in.keys.row(h, j), shape.head_dim, params_.norm_order);
    Layer<S> layer{ext::scores_with_window(prefix, shape, common.reference_quirks)};
    layer.allocation.require_finite(where);  // NaN or Inf keys: kvevict::invalid_argument naming the policy
    return layer;
  }

  // No select(): each head keeps its top budgets[h] entries of `allocation` (docs/algorithms.md#ties order).

 private:
  Params params_;
};
// ---- [/selector] -----------------------------------------------------------------------------------------------

// ---- [allocation] ----------------------------------------------------------------------------------------------
/// Per-head budgets in proportion to each head's score mass (a demonstration rule, not a published method). Each
/// head first gets its entries above the scored tier (window, forced; at most total / Hkv). The E entries left go
/// by weight w_h = u / Hkv + (1 - u) m_h / sum(m), with m_h = sum over head h's scored entries of (s - min s) (the
/// minimum over the layer, so any score sign works) and u = uniform_share: head h gets floor(E w_h / sum(w)),
/// capped at its token count, then the rest one at a time to the head with room that is furthest below its
/// share (ties: the lower head). The budgets sum to budget.total exactly.
struct ProportionalAllocation {
  static constexpr const char* type_name = "ProportionalAllocation";
  struct Params {
    double uniform_share = 0.5;  ///< 1: split evenly (= the uniform allocation), 0: by score mass alone
    void validate(const char* where) const {
      kvevict::extend::require(std::isfinite(uniform_share) && uniform_share >= 0.0 && uniform_share <= 1.0, where,
                               "uniform_share must be in [0, 1], got ", uniform_share);
    }
  };
  explicit ProportionalAllocation(const Params& p) : params_(p) {}

  template <class S>
  std::vector<Index> allocate(ext::ScoreMap<S>& scores, const ext::LayerBudget& budget) const {
    const auto H = static_cast<std::size_t>(scores.heads), L = static_cast<std::size_t>(scores.tokens);
    std::vector<Index> b(H, 0);         // the budgets
    std::vector<double> share(H, 0.0);  // m_h, then w_h, then head h's share of the rest not yet given
    double low = std::numeric_limits<double>::infinity();
    for (std::size_t f = 0; f < scores.score.size(); ++f)
      if (scores.tier[f] == ext::Tier::scored) low = std::min(low, static_cast<double>(scores.score[f]));
    for (std::size_t f = 0; f < scores.score.size(); ++f) {
      if (scores.tier[f] == ext::Tier::scored)
        share[f / L] += static_cast<double>(scores.score[f]) - low;
      else if (scores.tier[f] != ext::Tier::absent && b[f / L] < budget.total / scores.heads)
        ++b[f / L];  // entries above the scored tier (window, forced) first
    }
    Index left = budget.total;
    double mass = 0, weight = 0;
    for (std::size_t h = 0; h < H; ++h) {
      left -= b[h];
      mass += share[h];
    }
    const double u = params_.uniform_share, even = 1.0 / static_cast<double>(H);
    for (double& x : share) {
      x = u * even + (1 - u) * (mass > 0 ? x / mass : even);  // w_h
      weight += x;
    }
    const double rest = static_cast<double>(left);
    for (std::size_t h = 0; h < H; ++h) {
      share[h] *= rest / weight;
      const Index n = std::min(scores.length(static_cast<Index>(h)) - b[h], static_cast<Index>(std::floor(share[h])));
      b[h] += n;
      left -= n;
      share[h] -= static_cast<double>(n);
    }
    for (; left > 0; --left) {  // some head has room: budget.total <= the entries of the layer
      std::size_t best = H;
      for (std::size_t h = 0; h < H; ++h)
        if (b[h] < scores.length(static_cast<Index>(h)) && (best == H || share[h] > share[best])) best = h;
      ++b[best];
      share[best] -= 1.0;
    }
    return b;
  }

 private:
  Params params_;
};
// ---- [/allocation] ---------------------------------------------------------------------------------------------

}  // namespace mylab

// ---- [compose] -------------------------------------------------------------------------------------------------
using KeyNormSnap = kvevict::Policy<kvevict::SnapKV, mylab::KeyNormSelector>;  // uniform: n_kept per head
using KeyNormProportional = kvevict::Policy<mylab::ProportionalAllocation, mylab::KeyNormSelector>;
using SnapKVProportional = kvevict::Policy<mylab::ProportionalAllocation>;      // the built-in AttentionSelector
using KeyNormLayerGlobal = kvevict::LayerGlobalPolicy<mylab::KeyNormSelector>;  // one budget across layers
// ---- [/compose] ------------------------------------------------------------------------------------------------

#ifdef KVEVICT_SHOW_CONTRACT_ERROR
// A selector whose select() has the wrong signature, and an allocation whose allocate() returns the wrong type,
// fail at compile time with
//   error: static assertion failed: kvevict::Policy<Base, Selector>: Selector must meet the Selector contract
//          (Params, Layer<S>, adjust_budget, score<S>, select if any; see selectors/selector.hpp): AttentionSelector,
//          CriticalSelector, DefensiveSelector, or your own
//   error: static assertion failed: kvevict::Policy<Base, Selector>: Base must be an allocation (UniformAllocation,
//          HeadAdaptiveAllocation, or a type meeting the Allocation contract of docs/extending.md) or a scored
//          preset (...)
struct NoSelect : mylab::KeyNormSelector {
  void select() const {}
};
struct WrongAllocate {
  struct Params {
    void validate(const char*) const {}
  };
  explicit WrongAllocate(const Params&) {}
  template <class S>
  std::vector<int> allocate(kvevict::extend::ScoreMap<S>&, const kvevict::extend::LayerBudget&) const {
    return {};
  }
};
kvevict::Policy<kvevict::SnapKV, NoSelect> broken_selector;
kvevict::Policy<WrongAllocate, mylab::KeyNormSelector> broken_allocation;
#endif

namespace {

using kvevict::Index;
using Kept = std::vector<std::vector<Index>>;  // per KV head, ascending

int failures = 0;
void check(bool ok, const char* what, Index n_kept) {
  if (!ok && ++failures <= 10) std::printf("FAILED: %s (n_kept %ld)\n", what, static_cast<long>(n_kept));
}

/// One random layer in double, heads-major: queries [H, w, d] (the pipeline needs an observation even though
/// KeyNormSelector reads none), keys [Hkv, L, d] with some rows copied so that exact norm ties occur, within a head
/// and across heads.
struct RandomLayer {
  Index H, Hkv, w, L, d;
  std::vector<double> q, k;
  kvevict::LayerInputs<double> in;
  RandomLayer(Index H_, Index Hkv_, Index w_, Index L_, Index d_, std::mt19937_64& rng)
      : H(H_),
        Hkv(Hkv_),
        w(w_),
        L(L_),
        d(d_),
        q(static_cast<std::size_t>(H * w * d)),
        k(static_cast<std::size_t>(Hkv * L * d)) {
    std::normal_distribution<double> normal(0.0, 1.0);
    for (double& x : q) x = normal(rng);
    for (std::size_t i = 0; i < k.size(); ++i)  // KV head h's keys scaled by 1 + h / 2: heads differ in norm
      k[i] = normal(rng) * (1.0 + static_cast<double>(i / static_cast<std::size_t>(L * d)) / 2);
    const auto row = [&](Index h, Index j) { return k.begin() + (h * L + j) * d; };
    for (Index j = 1; j < L; j += 7) std::copy(row(0, j - 1), row(0, j), row(0, j));  // ties in a head
    for (Index h = 1; h < Hkv; ++h) std::copy(row(0, 3), row(0, 4), row(h, 5 + h));   // across heads
    in.queries = kvevict::HeadsView<const double>::heads_major(q.data(), H, w, d);
    in.keys = kvevict::kv_heads_major<const double>(k.data(), Hkv, L, d);
  }
  double norm(Index h, Index j) const { return mylab::key_norm<double>(k.data() + (h * L + j) * d, d, 2.0); }
};

Kept kept_of(const kvevict::Selection& s) {
  Kept out(static_cast<std::size_t>(s.heads()));
  for (Index h = 0; h < s.heads(); ++h)
    for (auto j : s.head(h)) out[static_cast<std::size_t>(h)].push_back(static_cast<Index>(j));
  return out;
}

/// Brute force over several layers: every (layer, head, token) entry ranked by (window first, then the lowest key
/// norm; ties: the more recent token, the lower layer, the lower head); per_head: each head keeps its own top
/// budget[h] (layer 0 only), else the top `total` of all entries.
std::vector<Kept> brute_force(const std::vector<const RandomLayer*>& layers, const std::vector<Index>& per_head,
                              Index total) {
  using Entry = std::tuple<int, double, Index, Index, Index>;  // (not window, norm, -j, layer, head): ascending
  std::vector<Entry> all;
  std::vector<Kept> out;
  for (std::size_t l = 0; l < layers.size(); ++l) {
    const RandomLayer& x = *layers[l];
    out.emplace_back(static_cast<std::size_t>(x.Hkv));
    for (Index h = 0; h < x.Hkv; ++h)
      for (Index j = 0; j < x.L; ++j) {
        const bool window = j >= x.L - x.w;
        all.emplace_back(window ? 0 : 1, window ? 0.0 : x.norm(h, j), -j, static_cast<Index>(l), h);
      }
  }
  std::sort(all.begin(), all.end());
  std::vector<Index> taken(static_cast<std::size_t>(layers[0]->Hkv), 0);
  for (const Entry& e : all) {
    const auto [nw, norm, minus_j, l, h] = e;
    Index& t = taken[static_cast<std::size_t>(h)];
    if (!per_head.empty() ? t < per_head[static_cast<std::size_t>(h)] : total > 0) {
      out[static_cast<std::size_t>(l)][static_cast<std::size_t>(h)].push_back(-minus_j);
      ++t, --total;
    }
  }
  for (Kept& kept : out)
    for (auto& head : kept) std::sort(head.begin(), head.end());
  return out;
}

/// The window (or, when n_kept < w, the most recent n_kept tokens) is kept in every head of `s`.
bool window_kept(const kvevict::Selection& s, Index w, Index n_kept) {
  const Index L = s.context_length();
  for (Index h = 0; h < s.heads(); ++h)
    for (Index j = L - std::min(w, n_kept); j < L; ++j)
      if (!s.kept(h, j)) return false;
  return true;
}

}  // namespace

int main() {
  std::mt19937_64 rng(2406);
  const Index w = 8;
  const RandomLayer a(8, 4, w, 96, 16, rng), b(8, 4, w, 64, 16, rng);

  KeyNormSnap::Params sp;
  sp.window = w;
  const KeyNormSnap snap(sp);
  KeyNormProportional::Params pp;
  pp.window = w;
  pp.uniform_share = 0.25;
  const KeyNormProportional proportional(pp);
  pp.uniform_share = 1.0;
  const KeyNormProportional proportional_even(pp);
  SnapKVProportional::Params ap;
  ap.window = w;
  const SnapKVProportional attention_proportional(ap);
  KeyNormLayerGlobal::Params gp;
  gp.window = w;
  const KeyNormLayerGlobal global(gp);

  for (const Index n : {Index{1}, Index{5}, w, Index{20}, Index{41}, Index{64}}) {
    const kvevict::Budget budget = kvevict::Budget::tokens(n);
    // Uniform base: exactly n_kept per head, the window kept, and the brute force's choice.
    const kvevict::Selection u = snap.select<double>(a.in, budget);
    for (Index h = 0; h < a.Hkv; ++h) check(u.length(h) == n, "SnapKV base: n_kept per head", n);
    check(u.total() == a.Hkv * n, "SnapKV base: layer total", n);
    check(window_kept(u, w, n), "SnapKV base: window kept", n);
    check(kept_of(u) == brute_force({&a}, std::vector<Index>(static_cast<std::size_t>(a.Hkv), n), 0)[0],
          "SnapKV base: brute force", n);
    const kvevict::Selection uf = snap.select(a.in, budget);  // float arithmetic (the default)
    check(uf.total() == a.Hkv * n && window_kept(uf, w, n), "SnapKV base, float: total, window", n);

    // Proportional allocation: the layer total exactly, the window kept, each head its best tokens.
    const kvevict::Selection p = proportional.select<double>(a.in, budget);
    std::vector<Index> lengths;
    for (Index h = 0; h < a.Hkv; ++h) lengths.push_back(p.length(h));
    check(p.total() == a.Hkv * n, "proportional: layer total", n);
    check(window_kept(p, w, n), "proportional: window kept", n);
    check(kept_of(p) == brute_force({&a}, lengths, 0)[0], "proportional: each head's best tokens", n);
    check(kept_of(proportional_even.select<double>(a.in, budget)) == kept_of(u), "uniform_share 1 = SnapKV base", n);
    const kvevict::Selection s = attention_proportional.select(a.in, budget);
    check(s.total() == a.Hkv * n && window_kept(s, w, n), "proportional + AttentionSelector: total, window", n);

    // Layer-global: the model total exactly, every window kept, and the brute force's choice across layers.
    const std::vector<kvevict::Selection> g = global.select<double>(std::vector{a.in, b.in}, budget);
    check(g.size() == 2 && g[0].total() + g[1].total() == (a.Hkv + b.Hkv) * n, "layer-global: model total", n);
    check(window_kept(g[0], w, n) || n < w, "layer-global: window kept", n);
    const std::vector<Kept> want = brute_force({&a, &b}, {}, (a.Hkv + b.Hkv) * n);
    check(kept_of(g[0]) == want[0] && kept_of(g[1]) == want[1], "layer-global: brute force", n);

    std::printf("n_kept %2ld: proportional per-head lengths", static_cast<long>(n));
    for (Index len : lengths) std::printf(" %ld", static_cast<long>(len));
    std::printf("; layer-global layer totals %ld, %ld\n", static_cast<long>(g[0].total()),
                static_cast<long>(g[1].total()));
  }

  // Near n_kept = L the proportional shares exceed some heads' token counts: the caps bind, the total still holds.
  pp.uniform_share = 0.0;
  const KeyNormProportional by_mass(pp);
  for (const Index n : {Index{90}, a.L}) {
    const kvevict::Selection p = by_mass.select<double>(a.in, kvevict::Budget::tokens(n));
    std::vector<Index> lengths;
    for (Index h = 0; h < a.Hkv; ++h) lengths.push_back(p.length(h));
    check(p.total() == a.Hkv * n && kept_of(p) == brute_force({&a}, lengths, 0)[0], "proportional: capped", n);
    std::printf("n_kept %ld, by mass alone: per-head lengths", static_cast<long>(n));
    for (Index len : lengths) std::printf(" %ld", static_cast<long>(len));
    std::printf(" (at most %ld)\n", static_cast<long>(a.L));
  }

  // A bad parameter is refused with a message that names the policy and the field.
  try {
    sp.norm_order = 0.5;
    const KeyNormSnap bad(sp);
    check(false, "norm_order 0.5 must be refused", 0);
  } catch (const kvevict::invalid_argument& e) {
    std::printf("refused: %s\n", e.what());
  }
  std::printf("custom_selector: %d failures\n", failures);
  return failures == 0 ? 0 : 1;
}
