// Test helpers for the value-aware selectors (CriticalKV, DefensiveKV, Layer-DefensiveKV): seeded random layers with
// values and W_o, their storage as LayerInputs, and the expected selections composed from tests/support/reference.hpp.
//
// The expectations are the reference's functions, called the way the reference code calls them: single-layer
// DefensiveKV keeps the mass-forced tokens and the window strictly first in the corrected mode, and gives them the
// layer maximum of s' under reference_quirks, where a more recent scored token that ties that maximum can displace a
// forced one (docs/algorithms.md#forcing).
#ifndef KVEVICT_TESTS_SUPPORT_SELECTOR_INPUTS_HPP
#define KVEVICT_TESTS_SUPPORT_SELECTOR_INPUTS_HPP

#include <kvevict/extend.hpp>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <random>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "support/random_inputs.hpp"
#include "support/reference.hpp"

namespace kvevict_test {

using Forced = std::vector<std::vector<std::int64_t>>;

inline kvevict_ref::Pool ref_pool(kvevict::Pooling p) {
  return p == kvevict::Pooling::avg ? kvevict_ref::Pool::avg : kvevict_ref::Pool::max;
}

/// One layer in float64, heads-major: q [H, w, d], k and v [Hkv, L, d], w_o [D, H * d] (PyTorch Linear layout).
struct VLayer {
  Shape s;
  int D = 1;
  std::vector<double> q, k, v, w_o;
};

inline VLayer random_vlayer(const Shape& s, int D, Rng& rng, double query_scale = 1.5) {
  VLayer l;
  l.s = s;
  l.D = D;
  l.q = normal_vector(sz(s.H) * sz(s.w) * sz(s.d), rng, query_scale);
  l.k = normal_vector(sz(s.Hkv) * sz(s.L) * sz(s.d), rng);
  l.v = normal_vector(sz(s.Hkv) * sz(s.L) * sz(s.d), rng);
  l.w_o = normal_vector(sz(D) * sz(s.H) * sz(s.d), rng, 1.0 / std::sqrt(static_cast<double>(s.H * s.d)));
  return l;
}

/// The library's LayerShape of a Shape.
inline kvevict::extend::LayerShape layer_shape(const Shape& s) {
  kvevict::extend::LayerShape shape;
  shape.query_heads = s.H;
  shape.kv_heads = s.Hkv;
  shape.group = s.G();
  shape.tokens = s.L;
  shape.window = s.w;
  shape.prefix = s.P();
  shape.head_dim = s.d;
  return shape;
}

/// Calls f(q, rows) with the rows [w, L] of every query head q of `attn` [H, w, L], as the observation does.
template <class S, class F>
void for_each_head_rows(const std::vector<double>& attn, const Shape& s, F&& f) {
  kvevict::RowMatrix<S> rows(s.w, s.L);
  for (int q = 0; q < s.H; ++q) {
    for (int i = 0; i < s.w; ++i)
      for (int j = 0; j < s.L; ++j) rows(i, j) = static_cast<S>(attn[(sz(q) * sz(s.w) + sz(i)) * sz(s.L) + sz(j)]);
    f(q, static_cast<const kvevict::RowMatrix<S>&>(rows));
  }
}

/// The reference's window attention rows [H, w, L] of a layer.
inline std::vector<double> ref_attention(const VLayer& l) {
  return kvevict_ref::window_attention(l.q, l.k, l.s.H, l.s.Hkv, l.s.w, l.s.L, l.s.d);
}

/// `l` with every entry rounded to T (so float storage holds exactly what T storage holds).
template <class T>
VLayer rounded_to(VLayer l) {
  for (auto* x : {&l.q, &l.k, &l.v, &l.w_o})
    for (double& v : *x) v = static_cast<double>(static_cast<float>(static_cast<T>(static_cast<float>(v))));
  return l;
}

/// The four engine layouts the catalogue-wide tests sweep (docs/algorithms.md#layouts): per head by token, per layer
/// by token, each KV head's pages of 16, the model's pages of 16.
struct EngineLayout {
  kvevict::Sharing share;
  kvevict::Index block;
};
inline std::vector<EngineLayout> engine_layouts() {
  return {{kvevict::Sharing::per_head, 1},
          {kvevict::Sharing::per_layer, 1},
          {kvevict::Sharing::per_head, 16},
          {kvevict::Sharing::per_model, 16}};
}

/// Storage of one layer in type T and the LayerInputs viewing it. Not copyable (the views point into the vectors);
/// moving keeps the buffers, so returning it by value is fine.
template <class T>
struct VStored {
  std::vector<T> q, k, v, w_o, attn, scores;  // scores: engine_scores() [Hkv, L, 1]
  kvevict::LayerInputs<T> in;
  VStored() = default;
  VStored(const VStored&) = delete;
  VStored& operator=(const VStored&) = delete;
  VStored(VStored&&) = default;
  VStored& operator=(VStored&&) = default;
};

/// Layer `l` as LayerInputs<T>: keys and values in `layout`, W_o through output_projection(); the observation is the
/// window queries, or the given attention rows [H, w, L] when `attn` is not null.
template <class T>
VStored<T> store_v(const VLayer& l, Layout layout, const std::vector<double>* attn = nullptr) {
  const Shape& s = l.s;
  VStored<T> st;
  if (attn) {
    st.attn = cast_to<T>(*attn);
    st.in.attention = kvevict::HeadsView<const T>::heads_major(st.attn.data(), s.H, s.w, s.L);
  } else {
    st.q = cast_to<T>(l.q);
    st.in.queries = kvevict::HeadsView<const T>::heads_major(st.q.data(), s.H, s.w, s.d);
  }
  if (layout == Layout::heads_major) {
    st.k = cast_to<T>(l.k);
    st.v = cast_to<T>(l.v);
    st.in.keys = kvevict::kv_heads_major<const T>(st.k.data(), s.Hkv, s.L, s.d);
    st.in.values = kvevict::kv_heads_major<const T>(st.v.data(), s.Hkv, s.L, s.d);
  } else {
    st.k = to_tokens_major(cast_to<T>(l.k), s.Hkv, s.L, s.d);
    st.v = to_tokens_major(cast_to<T>(l.v), s.Hkv, s.L, s.d);
    st.in.keys = kvevict::kv_tokens_major<const T>(st.k.data(), s.L, s.Hkv, s.d);
    st.in.values = kvevict::kv_tokens_major<const T>(st.v.data(), s.L, s.Hkv, s.d);
  }
  st.w_o = cast_to<T>(l.w_o);
  st.in.w_o = kvevict::output_projection<const T>(st.w_o.data(), l.D, s.H, s.d);
  st.scores = engine_scores<T>(s.Hkv, s.L);
  st.in.scores = kvevict::HeadsView<const T>::heads_major(st.scores.data(), s.Hkv, s.L, 1);
  return st;
}

/// At most k budgets of budget_sweep(), the most telling first: a random middle one, w + 1, w, 1, L, w - 1, L - 1.
inline std::vector<std::int64_t> some_budgets(const Shape& s, Rng& rng, std::size_t k) {
  const std::int64_t middle = std::uniform_int_distribution<std::int64_t>(1, s.L)(rng);
  const std::int64_t order[] = {middle, s.w + 1, s.w, 1, s.L, s.w - 1, s.L - 1};
  std::vector<std::int64_t> out;
  for (std::int64_t n : order)
    if (out.size() < k && n >= 1 && n <= s.L && std::find(out.begin(), out.end(), n) == out.end()) out.push_back(n);
  return out;
}

/// The knobs of the value-aware selectors, on both sides (library params and reference calls).
struct SelKnobs {
  int kernel = 5;
  kvevict::Pooling pooling = kvevict::Pooling::avg;
  kvevict::ValueNorm norm = kvevict::ValueNorm::l1;
  double eps = 1e-4;         // CriticalKV
  double ratio = 0.5;        // CriticalKV first_stage_ratio
  double threshold = 0.9;    // DefensiveKV mass_threshold
  bool value_term = true;    // DefensiveKV
  bool mass_forcing = true;  // DefensiveKV
  bool floor = true;         // DefensiveKV
  double alpha = 0.2;        // head-adaptive safeguard (DefensiveKV flat: 0)
  bool quirks = false;
  int p() const { return norm == kvevict::ValueNorm::l1 ? 1 : 2; }
};

inline std::string describe(const SelKnobs& k) {
  std::ostringstream o;
  o << "kernel=" << k.kernel << " " << kvevict::to_string(k.pooling) << " norm=" << kvevict::to_string(k.norm)
    << " eps=" << k.eps << " ratio=" << k.ratio << " threshold=" << k.threshold << " value_term=" << k.value_term
    << " mass_forcing=" << k.mass_forcing << " floor=" << k.floor << " alpha=" << k.alpha << " quirks=" << k.quirks;
  return o.str();
}

/// The knobs as the library's kvevict::Knobs (every one set), for the window of shape s.
inline kvevict::Knobs to_knobs(const Shape& s, const SelKnobs& k) {
  kvevict::Knobs out;
  out.window = s.w;
  out.kernel = k.kernel;
  out.pooling = k.pooling;
  out.reference_quirks = k.quirks;
  out.alpha = k.alpha;
  out.eps = k.eps;
  out.first_stage_ratio = k.ratio;
  out.value_norm = k.norm;
  out.mass_threshold = k.threshold;
  out.value_term = k.value_term;
  out.mass_forcing = k.mass_forcing;
  out.floor = k.floor;
  return out;
}

/// Copies the knobs into a policy's flat Params (the fields it has), through the catalogue's kvevict::apply_knobs.
template <class Params>
void apply_knobs(const Shape& s, const SelKnobs& k, Params& p) {
  kvevict::apply_knobs(to_knobs(s, k), p);
}

template <class P>
P make_policy(const Shape& s, const SelKnobs& k) {
  typename P::Params p;
  apply_knobs(s, k, p);
  return P(p);
}

/// A budget given in one form, with the n_kept it resolves to and its compression ratio (NaN unless given as one).
struct FormedBudget {
  kvevict::Budget budget;
  std::int64_t n_kept;
  double cr;
  std::string form;
};

/// n tokens per head as Budget::tokens, as a keep ratio and as a compression ratio (the forms that resolve to >= 1).
inline std::vector<FormedBudget> budget_forms(std::int64_t n, std::int64_t L) {
  const double nan = std::numeric_limits<double>::quiet_NaN();
  std::vector<FormedBudget> out = {{kvevict::Budget::tokens(n), n, nan, "tokens"}};
  const double keep = static_cast<double>(n) / static_cast<double>(L);
  const std::int64_t nk = kvevict_ref::n_kept_from_keep_ratio(L, keep);
  if (nk >= 1) out.push_back({kvevict::Budget::keep_ratio(keep), nk, nan, "keep_ratio"});
  const double cr = 1.0 - keep;
  const std::int64_t nc = kvevict_ref::n_kept_from_compression_ratio(L, cr);
  if (cr >= 0.0 && cr < 1.0 && nc >= 1)
    out.push_back({kvevict::Budget::compression_ratio(cr), nc, cr, "compression_ratio"});
  return out;
}

/// The reference's intermediate results for one layer.
struct RefLayer {
  std::vector<double> attn;    // [H, w, L]
  std::vector<double> s;       // mean scores [Hkv, P]
  std::vector<double> n;       // value norms [Hkv, L] (empty when not needed)
  std::vector<double> m;       // defensive aggregation [Hkv, P]
  std::vector<double> sprime;  // DefensiveKV scores [Hkv, P]
};

/// Everything the expectations need, from the reference's own functions.
inline RefLayer ref_layer(const VLayer& l, const std::vector<double>& attn, const SelKnobs& k) {
  const Shape& s = l.s;
  RefLayer r;
  r.attn = attn;
  r.s = kvevict_ref::mean_scores(attn, s.H, s.Hkv, s.w, s.L, k.kernel, ref_pool(k.pooling));
  r.n = kvevict_ref::value_norms(l.v, l.w_o, s.H, s.Hkv, s.L, s.d, l.D, k.p());
  r.m = kvevict_ref::defensive_scores(attn, s.H, s.Hkv, s.w, s.L, k.kernel, ref_pool(k.pooling), k.floor);
  r.sprime = kvevict_ref::defensive_value_scores(r.m, r.n, s.Hkv, s.w, s.L, k.value_term);
  return r;
}

/// Forced tokens of the reference's mass forcing (none when mass_forcing is off).
inline Forced ref_forced(const RefLayer& r, const Shape& s, const SelKnobs& k, std::int64_t n_kept, double cr) {
  if (!k.mass_forcing) return Forced(sz(s.Hkv));
  return kvevict_ref::mass_forced(r.attn, s.H, s.Hkv, s.w, s.L, k.threshold, n_kept, k.quirks, k.quirks ? cr : 0.0);
}

/// The smallest |c - tau| over every KV head and every step of the reference's cumulative mass (same arithmetic as
/// kvevict_ref::mass_forced). Below ~1e-9 the crossing index is a near-tie that a different summation order may
/// flip; tests may skip such a case (and count it), nothing else.
inline double mass_margin(const std::vector<double>& attn, const Shape& s, double threshold, bool quirks) {
  const int H = s.H, Hkv = s.Hkv, w = s.w, L = s.L, G = s.G(), P = s.P();
  const int lo = quirks ? std::max(0, P - w) : P, hi = quirks ? P : L;
  double bias = 0.0;
  for (int q = 0; q < H; ++q)
    for (int i = 0; i < w; ++i)
      for (int j = lo; j < hi; ++j) bias += attn[(sz(q) * sz(w) + sz(i)) * sz(L) + sz(j)];
  bias /= static_cast<double>(H) * static_cast<double>(w);
  const double tau = threshold - bias;
  double margin = std::numeric_limits<double>::infinity();
  for (int h = 0; h < Hkv; ++h) {
    std::vector<double> ave(sz(P), 0.0);
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < w; ++i)
        for (int j = 0; j < P; ++j) ave[sz(j)] += attn[(sz(h * G + g) * sz(w) + sz(i)) * sz(L) + sz(j)];
    double total = 0.0;
    for (double& x : ave) {
      x /= static_cast<double>(G) * static_cast<double>(w);
      total += x;
    }
    if (total == 0.0) continue;
    for (double& x : ave) x /= total;
    std::sort(ave.begin(), ave.end(), [](double a, double b) { return a > b; });
    double c = 0.0;
    for (double x : ave) {
      c += x;
      margin = std::min(margin, std::fabs(c - tau));
    }
  }
  return margin;
}

/// CriticalKV on a uniform (adaptive = false) or head-adaptive base: the reference itself.
inline Kept expect_critical(const RefLayer& r, const Shape& s, std::int64_t n_kept, bool adaptive, const SelKnobs& k) {
  return kvevict_ref::criticalkv(r.s, r.n, s.Hkv, s.w, s.L, n_kept, adaptive, k.alpha, k.eps, k.ratio, k.quirks);
}

/// CriticalKV's two stages with per-head budgets given (a layer-global base), written exactly like the per-head loop
/// of kvevict_ref::criticalkv without the safeguard: stage 1 takes the top int(b * ratio) of s padded with the layer
/// max, stage 2 the best b - stage1 of the rest by (s + eps) N (window: first, or (layer max + eps) N under quirks).
inline Kept critical_stages(const std::vector<double>& s_scores, const std::vector<double>& n, const Shape& s,
                            const std::vector<std::int64_t>& budgets, const SelKnobs& k) {
  const int Hkv = s.Hkv, L = s.L, P = s.P();
  const double layer_max = *std::max_element(s_scores.begin(), s_scores.end());
  Kept kept(sz(Hkv));
  for (int h = 0; h < Hkv; ++h) {
    // One-head views: padded row [L], entries of the reference's Entry type through its top-k (snapkv with Hkv = 1).
    std::vector<double> row(sz(P));
    for (int j = 0; j < P; ++j) row[sz(j)] = s_scores[sz(h) * sz(P) + sz(j)];
    const std::int64_t b = budgets[sz(h)];
    const auto k1 = static_cast<std::int64_t>(static_cast<double>(b) * k.ratio);
    std::vector<bool> taken(sz(L), false);
    // Stage 1: the top k1 of [row, window at the layer max] in the docs/algorithms.md#ties order (score desc, then
    // position desc).
    std::vector<std::pair<double, int>> e1;
    for (int j = 0; j < L; ++j) e1.push_back({j < P ? row[sz(j)] : layer_max, j});
    std::sort(e1.begin(), e1.end(), [](const auto& a, const auto& c) {
      return a.first != c.first ? a.first > c.first : a.second > c.second;
    });
    for (std::int64_t t = 0; t < k1; ++t) taken[sz(e1[sz(t)].second)] = true;
    std::vector<std::pair<double, int>> e2;
    for (int j = 0; j < L; ++j) {
      if (taken[sz(j)]) continue;
      const double nj = n[sz(h) * sz(L) + sz(j)];
      double score;
      if (j >= P)
        score = k.quirks ? (layer_max + k.eps) * nj : std::numeric_limits<double>::max();
      else
        score = (row[sz(j)] + k.eps) * nj;
      e2.push_back({score, j});
    }
    std::sort(e2.begin(), e2.end(), [](const auto& a, const auto& c) {
      return a.first != c.first ? a.first > c.first : a.second > c.second;
    });
    for (std::int64_t t = 0; t < b - k1; ++t) taken[sz(e2[sz(t)].second)] = true;
    for (int j = 0; j < L; ++j)
      if (taken[sz(j)]) kept[sz(h)].push_back(j);
  }
  return kept;
}

/// The bases a DefensiveSelector is plugged into.
enum class DefBase {
  flat,      ///< DefensiveKV: head-adaptive with alpha = 0 (one flat top-k)
  adaptive,  ///< AdaKV base with its safeguard (alpha = knobs.alpha)
  uniform    ///< SnapKV base: n_kept per head
};

inline const char* to_string(DefBase b) {
  return b == DefBase::flat ? "flat" : b == DefBase::adaptive ? "adaptive" : "uniform";
}

/// The reference called literally: forced tokens and the window carry the layer max of s'.
inline Kept literal_defensive(const RefLayer& r, const Forced& forced, const Shape& s, std::int64_t n_kept,
                              DefBase base, const SelKnobs& k, double cr) {
  if (base != DefBase::uniform)
    return kvevict_ref::defensivekv(r.sprime, forced, s.Hkv, s.w, s.L, n_kept, base == DefBase::flat ? 0.0 : k.alpha,
                                    k.quirks, k.quirks ? cr : 0.0);
  std::vector<double> x = r.sprime;
  const double top = *std::max_element(x.begin(), x.end());
  for (std::size_t h = 0; h < forced.size(); ++h)
    for (std::int64_t j : forced[h]) x[h * sz(s.P()) + sz(j)] = top;
  return kvevict_ref::snapkv(x, s.Hkv, s.w, s.L, n_kept);
}

/// What the library must select for a DefensiveSelector on `base`.
inline Kept expect_defensive(const RefLayer& r, const Forced& forced, const Shape& s, std::int64_t n_kept, DefBase base,
                             const SelKnobs& k, double cr) {
  return literal_defensive(r, forced, s, n_kept, base, k, k.quirks ? cr : 0.0);
}

/// Per (layer, head) counts of a layer-global selection.
inline std::vector<std::vector<std::int64_t>> lengths_of(const std::vector<Kept>& kept) {
  std::vector<std::vector<std::int64_t>> out;
  for (const Kept& k : kept) {
    out.emplace_back();
    for (const auto& h : k) out.back().push_back(static_cast<std::int64_t>(h.size()));
  }
  return out;
}

inline std::vector<Kept> kept_of(const std::vector<kvevict::Selection>& sels) {
  std::vector<Kept> out;
  for (const auto& s : sels) out.push_back(kept_of(s));
  return out;
}

/// A hand-written layer: attention rows [H, w, L], values [Hkv, L, 1] and W_o [1, H] (head_dim 1), so that the value
/// norm N[h][j] is |v[h][j]| times the mean of the group's W_o entries. Keys are zeros (only their shape is read).
struct HandLayer {
  Shape s;
  std::vector<double> attn, k, v, w_o;
  kvevict::LayerInputs<double> in;
  HandLayer(const Shape& shape, std::vector<double> a, std::vector<double> values, std::vector<double> wo)
      : s(shape), attn(std::move(a)), k(sz(shape.Hkv) * sz(shape.L), 0.0), v(std::move(values)), w_o(std::move(wo)) {
    in.attention = kvevict::HeadsView<const double>::heads_major(attn.data(), s.H, s.w, s.L);
    in.keys = kvevict::kv_heads_major<const double>(k.data(), s.Hkv, s.L, 1);
    in.values = kvevict::kv_heads_major<const double>(v.data(), s.Hkv, s.L, 1);
    in.w_o = kvevict::output_projection<const double>(w_o.data(), 1, s.H, 1);
  }
  HandLayer(const HandLayer&) = delete;
  HandLayer& operator=(const HandLayer&) = delete;
};

/// Rows [H, w, L] where every window row of query head q is rows[q] (given in units of 1/unit).
inline std::vector<double> repeated_rows(const std::vector<std::vector<double>>& rows, int w, double unit) {
  std::vector<double> attn;
  for (const auto& r : rows)
    for (int i = 0; i < w; ++i)
      for (double x : r) attn.push_back(x / unit);
  return attn;
}

/// The hand-worked DefensiveKV layer (tests/test_defensive_selector.cpp works its numbers out; the open window's
/// are in tests/test_open_window.cpp): H = 4, Hkv = 2, w = 4, L = 12, head_dim 1, W_o = [1 1 1 1] (so N = |v|),
/// attention in units of 1/32, every window row of a query head the same, the window's mass all on key 8.
inline HandLayer& defensive_hand_layer() {
  static const std::vector<std::vector<double>> rows = {
      {1, 10, 2, 3, 0, 4, 1, 2, 9, 0, 0, 0},
      {1, 10, 0, 1, 0, 8, 3, 0, 9, 0, 0, 0},
      {6, 0, 0, 0, 0, 0, 0, 16, 10, 0, 0, 0},
      {10, 0, 4, 0, 0, 0, 6, 4, 8, 0, 0, 0},
  };
  static HandLayer layer(Shape{4, 2, 4, 12, 1}, repeated_rows(rows, 4, 32.0),
                         {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,   // KV 0 values
                          3, 7, 1, 1, 1, 1, 3, 1, 1, 1, 1, 1},  // KV 1 values
                         {1, 1, 1, 1});
  return layer;
}

}  // namespace kvevict_test

#endif  // KVEVICT_TESTS_SUPPORT_SELECTOR_INPUTS_HPP
