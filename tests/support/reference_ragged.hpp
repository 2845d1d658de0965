// kvevict reference implementation for ragged layers (tests only).
//
// Plain, obviously-correct float64 versions of the eviction policies of docs/algorithms.md on *ragged* layers
// (docs/algorithms.md#ragged): every KV head holds its own number of entries L_h, and entry j of head h sits at the
// original token position pos_h[j] (strictly increasing in j). Corrected mode only (docs/algorithms.md#ragged refuses
// `reference_quirks` on ragged layers). Slow on purpose: every top-k is a full std::sort with one total order.
//
// Per-head stages (window attention, mean and defensive aggregation, pooling, floor, value norms) are the dense
// ones of tests/support/reference.hpp applied to one KV head's own entries (Hkv = 1, H = G, L = L_h), which is
// exactly the "as if they were a dense head of length L_h" of docs/algorithms.md#ragged. Everything that crosses heads
// (window bias, the DefensiveKV normalisation by position, flat and layer-global top-k, rankings by position) is
// written here.
//
// Conventions: tensors are std::vector<double>, row-major, per KV head h (or query head q) where ragged.
//   Layer::q        [H][w][d]       window queries (post-RoPE); query head q reads KV head q / G, G = H / Hkv
//   Head::keys      [L_h][d]        keys of KV head h (post-RoPE)
//   Head::values    [L_h][d]        values of KV head h
//   Head::pos       [L_h]           original positions of head h's entries, strictly increasing
//   Layer::w_o      [D][H*d]        output projection (PyTorch Linear layout); W_o^q = columns q*d .. q*d+d-1
//   Attn            [H] of [w][L_{q/G}]   full softmax rows of query head q over its KV head's entries
//   Ragged scores   [Hkv] of [P_h]  one score per (KV head, prefix entry), P_h = L_h - w
//   Ragged norms    [Hkv] of [L_h]  value norms N (window included)
//   Positions       [Hkv] of [L_h]  pos_h; L_h = pos[h].size()
//   KeptRows        [Hkv] of kept ROW indices, ascending (rows, not positions; pos[h][row] gives the position)
//
// Ranking (docs/algorithms.md#ties with docs/algorithms.md#ragged): tier first (forced > window > scored; in the
// layer-global step forced and window are one tier, "non-scored alike"), then the score (scored tier only: inside a
// non-scored tier the score is ignored), then the HIGHER POSITION, then the lower layer, then the lower KV head.
// Positions are unique within a head, so (position, layer, head) makes the order total.
#ifndef KVEVICT_TESTS_SUPPORT_REFERENCE_RAGGED_HPP
#define KVEVICT_TESTS_SUPPORT_REFERENCE_RAGGED_HPP

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

#include "support/reference.hpp"

namespace kvevict_ref {
namespace ragged {

using kvevict_ref::Pool;

using Ragged = std::vector<std::vector<double>>;           // per KV head
using Positions = std::vector<std::vector<std::int64_t>>;  // per KV head: pos_h [L_h]
using KeptRows = std::vector<std::vector<std::int64_t>>;   // per KV head: kept rows, ascending
using Attn = std::vector<std::vector<double>>;             // per query head q: [w][L_{q/G}]

// One KV head's entries.
struct Head {
  std::vector<double> keys;       // [L_h][d]
  std::vector<double> values;     // [L_h][d] (only read by value-aware policies)
  std::vector<std::int64_t> pos;  // [L_h], strictly increasing; L_h = pos.size()
};

// One ragged layer.
struct Layer {
  int H = 1;                // query heads
  int Hkv = 1;              // KV heads
  int w = 1;                // observation window (the last w entries of every head), 1 <= w < L_h
  int d = 1;                // head_dim
  int D = 1;                // hidden size (rows of w_o)
  std::vector<Head> heads;  // [Hkv]
  std::vector<double> q;    // [H][w][d]
  std::vector<double> w_o;  // [D][H*d] (only read by value-aware policies)
};

namespace detail {

using kvevict_ref::detail::py_int;
using kvevict_ref::detail::sz;

inline std::size_t sz(std::size_t v) { return v; }

// Tiers of docs/algorithms.md#stages (ScoreMap): a higher tier ranks above every entry of a lower tier.
constexpr int kScored = 0;
constexpr int kWindow = 1;
constexpr int kForced = 2;

// One candidate of a top-k: an entry (row) of KV head `head` of layer `layer`.
struct Entry {
  int tier;
  double score;  // compared in the scored tier only
  std::int64_t pos;
  std::int64_t layer;
  std::int64_t head;
  std::int64_t row;
};

// Tier desc, then (scored tier) score desc, then higher position, then lower layer, then lower KV head.
inline bool ranks_before(const Entry& a, const Entry& b) {
  if (a.tier != b.tier) return a.tier > b.tier;
  if (a.tier == kScored && a.score != b.score) return a.score > b.score;
  if (a.pos != b.pos) return a.pos > b.pos;
  if (a.layer != b.layer) return a.layer < b.layer;
  return a.head < b.head;
}

// The first k entries in that order.
inline std::vector<Entry> top_k(std::vector<Entry> entries, std::int64_t k) {
  assert(k >= 0 && sz(k) <= entries.size());
  std::sort(entries.begin(), entries.end(), ranks_before);
  entries.resize(sz(k));
  return entries;
}

inline std::int64_t length(const Positions& pos, std::size_t h) { return static_cast<std::int64_t>(pos[h].size()); }

inline void check_positions(const Positions& pos, int w) {
  assert(!pos.empty());
  assert(w >= 1);
  for (const auto& p : pos) {
    assert(static_cast<std::int64_t>(p.size()) > w);  // w < L_h, so P_h >= 1
    for (std::size_t j = 1; j < p.size(); ++j) assert(p[j] > p[j - 1]);
    (void)p;
  }
  (void)w;
}

inline std::int64_t total_entries(const Positions& pos) {
  std::int64_t t = 0;
  for (std::size_t h = 0; h < pos.size(); ++h) t += length(pos, h);
  return t;
}

// Scores [Hkv][P_h] match the positions [Hkv][L_h]; all finite.
inline void check_scores(const Ragged& scores, const Positions& pos, int w) {
  check_positions(pos, w);
  assert(scores.size() == pos.size());
  for (std::size_t h = 0; h < pos.size(); ++h) {
    assert(static_cast<std::int64_t>(scores[h].size()) == length(pos, h) - w);
    for (double v : scores[h]) {
      assert(std::isfinite(v));
      (void)v;
    }
  }
  (void)scores;
}

// Layer total Hkv * n_kept must fit the entries (docs/algorithms.md#ragged: 1 <= n_kept, Hkv * n_kept <= sum of L_h).
inline void check_n_kept(const Positions& pos, std::int64_t n_kept) {
  assert(n_kept >= 1);
  assert(static_cast<std::int64_t>(pos.size()) * n_kept <= total_entries(pos));
  (void)pos;
  (void)n_kept;
}

// Every entry of head h of layer `layer`: prefix rows in the scored tier with scores[h][j], window rows (the
// last w) in the window tier.
inline std::vector<Entry> head_entries(const Ragged& scores, const Positions& pos, int w, std::size_t h,
                                       std::int64_t layer = 0) {
  const std::int64_t L = length(pos, h);
  const std::int64_t P = L - w;
  std::vector<Entry> e;
  for (std::int64_t j = 0; j < L; ++j) {
    const bool window = j >= P;
    e.push_back({window ? kWindow : kScored, window ? 0.0 : scores[h][sz(j)], pos[h][sz(j)], layer,
                 static_cast<std::int64_t>(h), j});
  }
  return e;
}

// Moves the top n entries of one head's list (in the ranking order) to the forced tier.
inline void promote_top(std::vector<Entry>& head, std::int64_t n) {
  for (const Entry& t : top_k(head, n))
    for (Entry& e : head)
      if (e.row == t.row) e.tier = kForced;
}

inline void sort_rows(KeptRows& kept) {
  for (auto& v : kept) std::sort(v.begin(), v.end());
}

// One flat top-k over all entries of every head; head h keeps its selected rows.
inline KeptRows flat_top_k(const std::vector<std::vector<Entry>>& per_head, std::int64_t total) {
  std::vector<Entry> flat;
  for (const auto& h : per_head) flat.insert(flat.end(), h.begin(), h.end());
  KeptRows kept(per_head.size());
  for (const Entry& e : top_k(flat, total)) kept[sz(e.head)].push_back(e.row);
  sort_rows(kept);
  return kept;
}

// Query heads h*G .. h*G+G-1 of attn, concatenated: [G][w][L_h] for the dense per-head functions.
inline std::vector<double> group_attention(const Attn& attn, int Hkv, int w, int h, std::int64_t& L) {
  const int H = static_cast<int>(attn.size());
  assert(Hkv >= 1 && H >= Hkv && H % Hkv == 0);
  const int G = H / Hkv;
  L = static_cast<std::int64_t>(attn[sz(h * G)].size()) / w;
  std::vector<double> a;
  for (int g = 0; g < G; ++g) {
    const auto& row = attn[sz(h * G + g)];
    assert(static_cast<std::int64_t>(row.size()) == L * w);
    a.insert(a.end(), row.begin(), row.end());
  }
  assert(L > w);
  return a;
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// Layer helpers.
inline std::vector<std::int64_t> lengths(const Layer& l) {
  std::vector<std::int64_t> n;
  for (const Head& h : l.heads) n.push_back(static_cast<std::int64_t>(h.pos.size()));
  return n;
}

inline Positions positions(const Layer& l) {
  Positions p;
  for (const Head& h : l.heads) p.push_back(h.pos);
  return p;
}

inline void check_layer(const Layer& l, bool needs_values) {
  using detail::sz;
  assert(l.H >= 1 && l.Hkv >= 1 && l.H % l.Hkv == 0);
  assert(l.w >= 1 && l.d >= 1 && l.D >= 1);
  assert(l.heads.size() == sz(l.Hkv));
  assert(l.q.size() == sz(l.H) * sz(l.w) * sz(l.d));
  detail::check_positions(positions(l), l.w);
  for (const Head& h : l.heads) {
    assert(h.keys.size() == h.pos.size() * sz(l.d));
    if (needs_values) assert(h.values.size() == h.pos.size() * sz(l.d));
    (void)h;
  }
  if (needs_values) assert(l.w_o.size() == sz(l.D) * sz(l.H) * sz(l.d));
  (void)l;
  (void)needs_values;
}

// ---------------------------------------------------------------------------------------------
// Budgets on ragged layers (docs/algorithms.md#ragged): n_kept resolved against L̄ = (sum of L_h) / Hkv in double,
// truncated toward zero.
inline double mean_length(const std::vector<std::int64_t>& lengths) {
  assert(!lengths.empty());
  std::int64_t sum = 0;
  for (std::int64_t n : lengths) sum += n;
  return static_cast<double>(sum) / static_cast<double>(lengths.size());
}

inline std::int64_t n_kept_keep_ratio(const std::vector<std::int64_t>& lengths, double r) {
  assert(r > 0.0 && r <= 1.0);
  return detail::py_int(mean_length(lengths) * r);
}

inline std::int64_t n_kept_compression_ratio(const std::vector<std::int64_t>& lengths, double c) {
  assert(c >= 0.0 && c < 1.0);
  return detail::py_int(mean_length(lengths) * (1.0 - c));
}

// ---------------------------------------------------------------------------------------------
// docs/algorithms.md#ragged, window attention: window query i of query head q sits at entry P_h + i of KV head
// h = q / G and sees entries 0 .. P_h + i of that head only (softmax over those, in double). Returns Attn [H] of
// [w][L_h].
inline Attn window_attention(const Layer& l) {
  using detail::sz;
  check_layer(l, false);
  const int G = l.H / l.Hkv;
  const std::size_t per_query_head = sz(l.w) * sz(l.d);
  Attn attn(sz(l.H));
  for (int h = 0; h < l.Hkv; ++h) {
    const Head& head = l.heads[sz(h)];
    const int L = static_cast<int>(head.pos.size());
    const auto first = l.q.begin() + static_cast<std::ptrdiff_t>(sz(h * G) * per_query_head);
    const std::vector<double> q_group(first, first + static_cast<std::ptrdiff_t>(sz(G) * per_query_head));
    const std::vector<double> a = kvevict_ref::window_attention(q_group, head.keys, G, 1, l.w, L, l.d);  // [G][w][L]
    const std::size_t block = sz(l.w) * sz(L);
    for (int g = 0; g < G; ++g) {
      const auto b = a.begin() + static_cast<std::ptrdiff_t>(sz(g) * block);
      attn[sz(h * G + g)].assign(b, b + static_cast<std::ptrdiff_t>(block));
    }
  }
  return attn;
}

// ---------------------------------------------------------------------------------------------
// Mean aggregation (docs/algorithms.md#aggregation) per head (pooling along the head's own P_h prefix entries).
// Returns [Hkv][P_h].
inline Ragged mean_scores(const Attn& attn, int Hkv, int w, int kernel, Pool pool) {
  const int G = static_cast<int>(attn.size()) / Hkv;
  Ragged s;
  for (int h = 0; h < Hkv; ++h) {
    std::int64_t L = 0;
    const std::vector<double> a = detail::group_attention(attn, Hkv, w, h, L);
    s.push_back(kvevict_ref::mean_scores(a, G, 1, w, static_cast<int>(L), kernel, pool));
  }
  return s;
}

// Key-only scores (docs/algorithms.md#key-only), per head over its own entries. Returns [Hkv][P_h].
//   K-norm:  score_j = -||k_j||_2.
//   KeyDiff: a = (1 / L_h) sum over all L_h entries of k_j / ||k_j|| (a zero key adds nothing);
//            score_j = -(k_j . a) / (||k_j|| ||a||), 0 when either norm is 0.
inline double key_norm2(const Layer& layer, std::size_t h, std::size_t j) {
  double s = 0.0;
  for (int c = 0; c < layer.d; ++c) {
    const double x = layer.heads[h].keys[j * detail::sz(layer.d) + detail::sz(c)];
    s += x * x;
  }
  return std::sqrt(s);
}
inline Ragged key_norm_scores(const Layer& layer) {
  Ragged s(detail::sz(layer.Hkv));
  for (std::size_t h = 0; h < s.size(); ++h)
    for (std::size_t j = 0; j + detail::sz(layer.w) < layer.heads[h].pos.size(); ++j)
      s[h].push_back(-key_norm2(layer, h, j));
  return s;
}
inline Ragged key_diff_scores(const Layer& layer) {
  const std::size_t d = detail::sz(layer.d);
  Ragged s(detail::sz(layer.Hkv));
  for (std::size_t h = 0; h < s.size(); ++h) {
    const std::vector<double>& k = layer.heads[h].keys;
    const std::size_t L = layer.heads[h].pos.size();
    std::vector<double> a(d, 0.0);
    for (std::size_t j = 0; j < L; ++j) {
      const double n = key_norm2(layer, h, j);
      if (n > 0.0)
        for (std::size_t c = 0; c < d; ++c) a[c] += k[j * d + c] / n;
    }
    double an = 0.0;
    for (std::size_t c = 0; c < d; ++c) {
      a[c] /= static_cast<double>(L);
      an += a[c] * a[c];
    }
    an = std::sqrt(an);
    for (std::size_t j = 0; j + detail::sz(layer.w) < L; ++j) {
      const double n = key_norm2(layer, h, j);
      double dot = 0.0;
      for (std::size_t c = 0; c < d; ++c) dot += k[j * d + c] * a[c];
      s[h].push_back(n > 0.0 && an > 0.0 ? -dot / (n * an) : 0.0);
    }
  }
  return s;
}

// R-KV's key redundancy (docs/algorithms.md#redundancy), per head over all its L_h entries. Returns [Hkv][L_h]:
//   u_j = k_j / (||k_j|| + 1e-8); C[i][j] = u_i . u_j (i != j), C[i][i] = 0;
//   r_i = the largest j with C[i][j] > 0.5, 0 when none; C[i][r_i] = 0;
//   m_j = (1 / L_h) sum_i C[i][j]; R_j = exp(m_j) / sum_t exp(m_t).
inline Ragged key_redundancy(const Layer& layer) {
  const std::size_t d = detail::sz(layer.d);
  Ragged out(detail::sz(layer.Hkv));
  for (std::size_t h = 0; h < out.size(); ++h) {
    const std::vector<double>& k = layer.heads[h].keys;
    const std::size_t L = layer.heads[h].pos.size();
    std::vector<double> u(L * d);
    for (std::size_t j = 0; j < L; ++j) {
      const double n = key_norm2(layer, h, j) + 1e-8;
      for (std::size_t c = 0; c < d; ++c) u[j * d + c] = k[j * d + c] / n;
    }
    std::vector<std::vector<double>> C(L, std::vector<double>(L, 0.0));
    for (std::size_t i = 0; i < L; ++i)
      for (std::size_t j = 0; j < L; ++j)
        if (i != j)
          for (std::size_t c = 0; c < d; ++c) C[i][j] += u[i * d + c] * u[j * d + c];
    for (std::size_t i = 0; i < L; ++i) {
      std::size_t r = 0;
      for (std::size_t j = 0; j < L; ++j)
        if (C[i][j] > 0.5) r = j;
      C[i][r] = 0.0;
    }
    std::vector<double> m(L, 0.0);
    for (std::size_t j = 0; j < L; ++j) {
      for (std::size_t i = 0; i < L; ++i) m[j] += C[i][j];
      m[j] /= static_cast<double>(L);
    }
    double total = 0.0;
    for (std::size_t j = 0; j < L; ++j) total += std::exp(m[j]);
    for (std::size_t j = 0; j < L; ++j) out[h].push_back(std::exp(m[j]) / total);
  }
  return out;
}

// Defensive aggregation (docs/algorithms.md#aggregation) per head (floor at the mean of the head's own P_h scores).
// Returns [Hkv][P_h].
inline Ragged defensive_scores(const Attn& attn, int Hkv, int w, int kernel, Pool pool, bool floor) {
  const int G = static_cast<int>(attn.size()) / Hkv;
  Ragged m;
  for (int h = 0; h < Hkv; ++h) {
    std::int64_t L = 0;
    const std::vector<double> a = detail::group_attention(attn, Hkv, w, h, L);
    m.push_back(kvevict_ref::defensive_scores(a, G, 1, w, static_cast<int>(L), kernel, pool, floor));
  }
  return m;
}

// docs/algorithms.md#value-term, value norms of each head's own rows: N[h][j] = mean over the G query heads q of h of
// || V_h[j] (W_o^q)^T ||_p, p = 1 or 2. Returns [Hkv][L_h].
inline Ragged value_norms(const Layer& l, int p) {
  using detail::sz;
  check_layer(l, true);
  const int G = l.H / l.Hkv;
  const std::size_t row = sz(l.H) * sz(l.d);  // row length of W_o
  const std::size_t cols = sz(G) * sz(l.d);   // columns of one group
  Ragged n;
  for (int h = 0; h < l.Hkv; ++h) {
    std::vector<double> w_o_group;  // [D][G*d]: columns h*G*d .. (h+1)*G*d - 1
    for (int r = 0; r < l.D; ++r) {
      const auto b = l.w_o.begin() + static_cast<std::ptrdiff_t>(sz(r) * row + sz(h) * cols);
      w_o_group.insert(w_o_group.end(), b, b + static_cast<std::ptrdiff_t>(cols));
    }
    const Head& head = l.heads[sz(h)];
    n.push_back(kvevict_ref::value_norms(head.values, w_o_group, G, 1, static_cast<int>(head.pos.size()), l.d, l.D, p));
  }
  return n;
}

// ---------------------------------------------------------------------------------------------
// docs/algorithms.md#forcing, window bias (corrected), one scalar for the layer: the mean over ALL query heads q and
// window rows i of the mass row i puts on its own KV head's window entries P_h .. L_h - 1 (h = q / G).
inline double window_bias(const Attn& attn, int w) {
  using detail::sz;
  assert(!attn.empty() && w >= 1);
  double bias = 0.0;
  for (const auto& a : attn) {
    const std::size_t L = a.size() / sz(w);
    const std::size_t P = L - sz(w);
    for (std::size_t i = 0; i < sz(w); ++i)
      for (std::size_t j = P; j < L; ++j) bias += a[i * L + j];
  }
  return bias / (static_cast<double>(attn.size()) * static_cast<double>(w));
}

// Cumulative-mass forcing (docs/algorithms.md#forcing, corrected) per head over its own prefix. Returns forced rows
// per head.
//   p[h][j] = mean over the G query heads and w rows of attn[q][i][j] (j < P_h, unpooled), divided by its sum;
//   order = p descending, ties -> higher position (= higher row inside one head); c = running sum;
//   tau = threshold - window_bias; k = first index with c >= tau (the entry there is not forced), 0 if never
//   reached or p has no mass; k = min(k, max(0, n_kept - w)) (and k < P_h by construction).
inline KeptRows mass_forced(const Attn& attn, int Hkv, int w, double threshold, std::int64_t n_kept) {
  using detail::sz;
  assert(std::isfinite(threshold));
  assert(n_kept >= 1);
  const int G = static_cast<int>(attn.size()) / Hkv;
  const double tau = threshold - window_bias(attn, w);
  const std::int64_t cap = std::max<std::int64_t>(0, n_kept - w);
  KeptRows forced(sz(Hkv));
  for (int h = 0; h < Hkv; ++h) {
    std::int64_t L = 0;
    const std::vector<double> a = detail::group_attention(attn, Hkv, w, h, L);
    const std::int64_t P = L - w;
    std::vector<double> ave(sz(P), 0.0);
    for (int g = 0; g < G; ++g)
      for (int i = 0; i < w; ++i)
        for (std::int64_t j = 0; j < P; ++j) ave[sz(j)] += a[(sz(g) * sz(w) + sz(i)) * sz(L) + sz(j)];
    for (double& x : ave) x /= static_cast<double>(G) * static_cast<double>(w);
    double total = 0.0;
    for (double x : ave) total += x;

    std::vector<detail::Entry> order;
    for (std::int64_t j = 0; j < P; ++j)
      order.push_back({detail::kScored, total == 0.0 ? 0.0 : ave[sz(j)] / total, j, 0, h, j});
    order = detail::top_k(order, P);

    std::int64_t k = 0;
    if (total != 0.0) {
      double c = 0.0;
      for (std::int64_t t = 0; t < P; ++t) {
        c += order[sz(t)].score;
        if (c >= tau) {
          k = t;
          break;
        }
      }
    }
    k = std::min(k, cap);
    for (std::int64_t t = 0; t < k; ++t) forced[sz(h)].push_back(order[sz(t)].row);
    std::sort(forced[sz(h)].begin(), forced[sz(h)].end());
  }
  return forced;
}

// ---------------------------------------------------------------------------------------------
// docs/algorithms.md#ragged, DefensiveKV value term: s'[h][j] = M[h][j] * (N[h][j] / S), S = the sum of N[h'][j'] over
// the KV heads h' (ascending) whose PREFIX holds an entry j' with pos[h'][j'] == pos[h][j] (h itself included; a window
// entry at that position does not count); s' = 0 where S = 0. value_term = false returns M. m [Hkv][P_h],
// n [Hkv][L_h]; returns [Hkv][P_h].
inline Ragged defensive_value_scores(const Ragged& m, const Ragged& n, const Positions& pos, int w, bool value_term) {
  using detail::sz;
  detail::check_scores(m, pos, w);
  assert(n.size() == pos.size());
  for (std::size_t h = 0; h < pos.size(); ++h) assert(n[h].size() == pos[h].size());
  if (!value_term) return m;
  Ragged out(m.size());
  for (std::size_t h = 0; h < pos.size(); ++h) {
    for (std::size_t j = 0; j < m[h].size(); ++j) {
      double sum = 0.0;
      for (std::size_t h2 = 0; h2 < pos.size(); ++h2)
        for (std::size_t j2 = 0; j2 < m[h2].size(); ++j2)  // prefix entries of h2 only
          if (pos[h2][j2] == pos[h][j]) sum += n[h2][j2];
      const double nn = (sum == 0.0) ? 0.0 : n[h][j] / sum;
      out[h].push_back(m[h][j] * nn);
    }
  }
  return out;
}

// =============================================================================================
// Selections from scores (the functions the tests can feed with hand-made ragged scores).

// docs/algorithms.md#ragged, uniform (SnapKV): b_h = min(n_kept, L_h); head h keeps its top b_h entries (window tier
// first, then score, then higher position). With n_kept <= w this is its last n_kept entries.
inline KeptRows snapkv(const Ragged& scores, const Positions& pos, int w, std::int64_t n_kept) {
  detail::check_scores(scores, pos, w);
  detail::check_n_kept(pos, n_kept);
  KeptRows kept(pos.size());
  for (std::size_t h = 0; h < pos.size(); ++h) {
    const std::int64_t b = std::min(n_kept, detail::length(pos, h));
    for (const auto& e : detail::top_k(detail::head_entries(scores, pos, w, h), b)) kept[h].push_back(e.row);
  }
  detail::sort_rows(kept);
  return kept;
}

// docs/algorithms.md#ragged, head-adaptive, kvpress variant (AdaKV): each head's top min(int(n_kept * alpha), L_h)
// entries (window ranks above scored) go to the forced tier; then one flat top-k of Hkv * n_kept over every entry of
// every head.
inline KeptRows adakv(const Ragged& scores, const Positions& pos, int w, std::int64_t n_kept, double alpha) {
  detail::check_scores(scores, pos, w);
  detail::check_n_kept(pos, n_kept);
  assert(alpha >= 0.0 && alpha <= 1.0);
  const std::int64_t n_safe = detail::py_int(static_cast<double>(n_kept) * alpha);
  std::vector<std::vector<detail::Entry>> per_head;
  for (std::size_t h = 0; h < pos.size(); ++h) {
    per_head.push_back(detail::head_entries(scores, pos, w, h));
    detail::promote_top(per_head.back(), std::min(n_safe, detail::length(pos, h)));
  }
  return detail::flat_top_k(per_head, static_cast<std::int64_t>(pos.size()) * n_kept);
}

// docs/algorithms.md#ragged, head-adaptive, original AdaKV repository. n_kept <= w: each head keeps its last n_kept
// entries. Otherwise B = n_kept - w; count_h = head h's share of one flat top-k of Hkv * B over all prefix entries
// (score, higher position, lower head); head h keeps its top min(P_h, round_half_even(count_h (1 - alpha) +
// floor(alpha B))) prefix entries and its window.
inline KeptRows adakv_original(const Ragged& scores, const Positions& pos, int w, std::int64_t n_kept, double alpha) {
  using detail::sz;
  detail::check_scores(scores, pos, w);
  detail::check_n_kept(pos, n_kept);
  assert(alpha >= 0.0 && alpha <= 1.0);
  const std::size_t Hkv = pos.size();
  KeptRows kept(Hkv);
  if (n_kept <= w) {
    for (std::size_t h = 0; h < Hkv; ++h)
      for (std::int64_t j = detail::length(pos, h) - n_kept; j < detail::length(pos, h); ++j) kept[h].push_back(j);
    return kept;
  }
  const std::int64_t B = n_kept - w;
  std::vector<detail::Entry> prefix;  // scored tier only
  for (std::size_t h = 0; h < Hkv; ++h)
    for (const auto& e : detail::head_entries(scores, pos, w, h))
      if (e.tier == detail::kScored) prefix.push_back(e);
  std::vector<std::int64_t> count(Hkv, 0);
  for (const auto& e : detail::top_k(prefix, static_cast<std::int64_t>(Hkv) * B)) ++count[sz(e.head)];
  const double floor_part = std::floor(alpha * static_cast<double>(B));
  for (std::size_t h = 0; h < Hkv; ++h) {
    const std::int64_t P = detail::length(pos, h) - w;
    const double b = kvevict_ref::detail::round_half_even(static_cast<double>(count[h]) * (1.0 - alpha) + floor_part);
    const std::int64_t n_prefix = std::min(P, static_cast<std::int64_t>(b));  // b_h - w, at most P_h
    assert(n_prefix >= 0);
    std::vector<detail::Entry> own;
    for (const auto& e : detail::head_entries(scores, pos, w, h))
      if (e.tier == detail::kScored) own.push_back(e);
    for (const auto& e : detail::top_k(own, n_prefix)) kept[h].push_back(e.row);
    for (std::int64_t j = P; j < P + w; ++j) kept[h].push_back(j);  // the whole window
  }
  detail::sort_rows(kept);
  return kept;
}

// docs/algorithms.md#ragged, StreamingLLM: b_h = min(n_kept, L_h); head h keeps its first min(sinks, b_h) entries and
// its last b_h - min(sinks, b_h) entries.
inline KeptRows streamingllm(const std::vector<std::int64_t>& lengths, std::int64_t n_kept, int sinks) {
  assert(!lengths.empty());
  assert(n_kept >= 1 && sinks >= 0);
  assert(static_cast<double>(n_kept) <= mean_length(lengths));  // Hkv * n_kept <= sum of L_h
  KeptRows kept;
  for (std::int64_t L : lengths) {
    assert(L >= 1);
    const std::int64_t b = std::min(n_kept, L);
    const std::int64_t n_sinks = std::min<std::int64_t>(sinks, b);
    std::vector<std::int64_t> rows;
    for (std::int64_t j = 0; j < n_sinks; ++j) rows.push_back(j);
    for (std::int64_t j = L - (b - n_sinks); j < L; ++j) rows.push_back(j);
    kept.push_back(rows);
  }
  return kept;
}

// docs/algorithms.md#forcing, CriticalKV inside each head's b_h. s [Hkv][P_h] mean scores, n [Hkv][L_h] value norms.
//   adaptive: the AdaKV (kvpress) allocation of adakv() with its safeguard; b_h = head h's share.
//   uniform (adaptive = false): b_h = min(n_kept, L_h), no safeguard (alpha ignored).
//   stage 1: head h's top int(b_h * ratio) entries by (safeguard > window > s, higher position);
//   stage 2: the best b_h - stage 1 of the rest by (safeguard > window > (s + eps) * N[h][j], higher position).
inline KeptRows criticalkv(const Ragged& s, const Ragged& n, const Positions& pos, int w, std::int64_t n_kept,
                           bool adaptive, double alpha, double eps, double ratio) {
  using detail::sz;
  detail::check_scores(s, pos, w);
  detail::check_n_kept(pos, n_kept);
  assert(n.size() == pos.size());
  assert(alpha >= 0.0 && alpha <= 1.0);
  assert(std::isfinite(eps) && eps >= 0.0);
  assert(ratio >= 0.0 && ratio <= 1.0);
  const std::size_t Hkv = pos.size();
  std::vector<std::vector<detail::Entry>> per_head;
  for (std::size_t h = 0; h < Hkv; ++h) {
    assert(n[h].size() == pos[h].size());
    per_head.push_back(detail::head_entries(s, pos, w, h));
  }
  std::vector<std::int64_t> budget(Hkv, 0);
  if (adaptive) {
    const std::int64_t n_safe = detail::py_int(static_cast<double>(n_kept) * alpha);
    for (std::size_t h = 0; h < Hkv; ++h) detail::promote_top(per_head[h], std::min(n_safe, detail::length(pos, h)));
    const KeptRows base = detail::flat_top_k(per_head, static_cast<std::int64_t>(Hkv) * n_kept);
    for (std::size_t h = 0; h < Hkv; ++h) budget[h] = static_cast<std::int64_t>(base[h].size());
  } else {
    for (std::size_t h = 0; h < Hkv; ++h) budget[h] = std::min(n_kept, detail::length(pos, h));
  }
  KeptRows kept(Hkv);
  for (std::size_t h = 0; h < Hkv; ++h) {
    const std::int64_t b = budget[h];
    const std::int64_t k1 = detail::py_int(static_cast<double>(b) * ratio);
    assert(k1 >= 0 && k1 <= b);
    std::vector<bool> taken(pos[h].size(), false);
    for (const auto& e : detail::top_k(per_head[h], k1)) {
      taken[sz(e.row)] = true;
      kept[h].push_back(e.row);
    }
    std::vector<detail::Entry> stage2;
    for (detail::Entry e : per_head[h]) {
      if (taken[sz(e.row)]) continue;
      if (e.tier == detail::kScored) e.score = (s[h][sz(e.row)] + eps) * n[h][sz(e.row)];
      stage2.push_back(e);  // safeguard and window keep their tiers
    }
    for (const auto& e : detail::top_k(stage2, b - k1)) kept[h].push_back(e.row);
  }
  detail::sort_rows(kept);
  return kept;
}

// DefensiveKV (corrected), one layer. sprime [Hkv][P_h]; forced rows per head (mass_forced(); empty = none).
// Forced rows go to the forced tier and the window to the window tier, above every score; if alpha > 0 each
// head's top min(int(n_kept * alpha), L_h) entries are also promoted (AdaKV safeguard; DefensiveKV uses 0);
// then one flat top-k of Hkv * n_kept over every entry of every head.
inline KeptRows defensivekv(const Ragged& sprime, const KeptRows& forced, const Positions& pos, int w,
                            std::int64_t n_kept, double alpha) {
  using detail::sz;
  detail::check_scores(sprime, pos, w);
  detail::check_n_kept(pos, n_kept);
  assert(forced.empty() || forced.size() == pos.size());
  assert(alpha >= 0.0 && alpha <= 1.0);
  const std::int64_t n_safe = detail::py_int(static_cast<double>(n_kept) * alpha);
  std::vector<std::vector<detail::Entry>> per_head;
  for (std::size_t h = 0; h < pos.size(); ++h) {
    per_head.push_back(detail::head_entries(sprime, pos, w, h));
    if (!forced.empty())
      for (std::int64_t j : forced[h]) {
        assert(j >= 0 && j < detail::length(pos, h) - w);
        per_head.back()[sz(j)].tier = detail::kForced;
      }
    if (alpha > 0.0) detail::promote_top(per_head.back(), std::min(n_safe, detail::length(pos, h)));
  }
  return detail::flat_top_k(per_head, static_cast<std::int64_t>(pos.size()) * n_kept);
}

// Layer-DefensiveKV (docs/algorithms.md#allocation layer-global with docs/algorithms.md#ragged). Per layer l: sprime[l]
// [Hkv_l][P_h], forced[l] (or forced empty: none), pos[l], w[l], n_kept[l]. Forced and window entries of every layer
// form one tier above every score (ranked among themselves by position alike); one top-k over every entry of every
// layer of total sum_l Hkv_l * n_kept_l; ties: score, higher position, lower layer, lower head. Returns kept rows per
// layer.
inline std::vector<KeptRows> layer_defensivekv(const std::vector<Ragged>& sprime, const std::vector<KeptRows>& forced,
                                               const std::vector<Positions>& pos, const std::vector<int>& w,
                                               const std::vector<std::int64_t>& n_kept) {
  using detail::sz;
  const std::size_t NL = sprime.size();
  assert(NL >= 1);
  assert(forced.empty() || forced.size() == NL);
  assert(pos.size() == NL && w.size() == NL && n_kept.size() == NL);
  std::vector<detail::Entry> flat;
  std::int64_t total = 0;
  for (std::size_t l = 0; l < NL; ++l) {
    detail::check_scores(sprime[l], pos[l], w[l]);
    detail::check_n_kept(pos[l], n_kept[l]);
    total += static_cast<std::int64_t>(pos[l].size()) * n_kept[l];
    for (std::size_t h = 0; h < pos[l].size(); ++h) {
      std::vector<detail::Entry> e = detail::head_entries(sprime[l], pos[l], w[l], h, static_cast<std::int64_t>(l));
      assert(forced.empty() || forced[l].empty() || forced[l].size() == pos[l].size());
      if (!forced.empty() && !forced[l].empty())
        for (std::int64_t j : forced[l][h]) {
          assert(j >= 0 && j < detail::length(pos[l], h) - w[l]);
          e[sz(j)].tier = detail::kForced;
        }
      for (detail::Entry& x : e)
        if (x.tier != detail::kScored) x.tier = detail::kWindow;  // non-scored alike
      flat.insert(flat.end(), e.begin(), e.end());
    }
  }
  std::vector<KeptRows> kept;
  for (std::size_t l = 0; l < NL; ++l) kept.emplace_back(pos[l].size());
  for (const auto& e : detail::top_k(flat, total)) kept[sz(e.layer)][sz(e.head)].push_back(e.row);
  for (auto& k : kept) detail::sort_rows(k);
  return kept;
}

// =============================================================================================
// Whole policies on a Layer (queries -> window attention -> scores -> selection).

inline KeptRows snapkv(const Layer& l, std::int64_t n_kept, int kernel, Pool pool) {
  return snapkv(mean_scores(window_attention(l), l.Hkv, l.w, kernel, pool), positions(l), l.w, n_kept);
}

inline KeptRows adakv(const Layer& l, std::int64_t n_kept, double alpha, int kernel, Pool pool) {
  return adakv(mean_scores(window_attention(l), l.Hkv, l.w, kernel, pool), positions(l), l.w, n_kept, alpha);
}

inline KeptRows adakv_original(const Layer& l, std::int64_t n_kept, double alpha, int kernel, Pool pool) {
  return adakv_original(mean_scores(window_attention(l), l.Hkv, l.w, kernel, pool), positions(l), l.w, n_kept, alpha);
}

struct CriticalParams {
  bool adaptive = true;  // AdaKV (kvpress) base; false: uniform (CriticalSnapKV)
  double alpha = 0.2;    // safeguard of the adaptive base
  double eps = 1e-4;
  double first_stage_ratio = 0.5;
  int value_norm = 1;  // 1 or 2
  int kernel = 5;
  Pool pool = Pool::avg;
};

inline KeptRows criticalkv(const Layer& l, std::int64_t n_kept, const CriticalParams& p) {
  const Ragged s = mean_scores(window_attention(l), l.Hkv, l.w, p.kernel, p.pool);
  const Ragged n = value_norms(l, p.value_norm);
  return criticalkv(s, n, positions(l), l.w, n_kept, p.adaptive, p.alpha, p.eps, p.first_stage_ratio);
}

struct DefensiveParams {
  double mass_threshold = 0.9;
  int value_norm = 1;  // 1 or 2
  int kernel = 5;
  Pool pool = Pool::avg;
  bool value_term = true;
  bool mass_forcing = true;
  bool floor = true;
  double alpha = 0.0;  // AdaKV safeguard on top (DefensiveKV: 0); must be 0 for layer_defensivekv
};

// The scores s' [Hkv][P_h] and the forced rows of one layer (DefensiveSelector, corrected).
inline Ragged defensive_layer_scores(const Layer& l, std::int64_t n_kept, const DefensiveParams& p, KeptRows& forced) {
  const Attn attn = window_attention(l);
  const Ragged m = defensive_scores(attn, l.Hkv, l.w, p.kernel, p.pool, p.floor);
  forced = p.mass_forcing ? mass_forced(attn, l.Hkv, l.w, p.mass_threshold, n_kept) : KeptRows{};
  if (!p.value_term) return m;
  return defensive_value_scores(m, value_norms(l, p.value_norm), positions(l), l.w, true);
}

inline KeptRows defensivekv(const Layer& l, std::int64_t n_kept, const DefensiveParams& p) {
  KeptRows forced;
  const Ragged sprime = defensive_layer_scores(l, n_kept, p, forced);
  return defensivekv(sprime, forced, positions(l), l.w, n_kept, p.alpha);
}

// n_kept[l] is layer l's own n_kept (resolved against its own L̄).
inline std::vector<KeptRows> layer_defensivekv(const std::vector<Layer>& layers,
                                               const std::vector<std::int64_t>& n_kept, const DefensiveParams& p) {
  assert(layers.size() == n_kept.size());
  assert(p.alpha == 0.0);  // the layer-global step has no safeguard
  std::vector<Ragged> sprime;
  std::vector<KeptRows> forced;
  std::vector<Positions> pos;
  std::vector<int> w;
  for (std::size_t l = 0; l < layers.size(); ++l) {
    KeptRows f;
    sprime.push_back(defensive_layer_scores(layers[l], n_kept[l], p, f));
    forced.push_back(f);
    pos.push_back(positions(layers[l]));
    w.push_back(layers[l].w);
  }
  return layer_defensivekv(sprime, forced, pos, w, n_kept);
}

}  // namespace ragged
}  // namespace kvevict_ref

#endif  // KVEVICT_TESTS_SUPPORT_REFERENCE_RAGGED_HPP
