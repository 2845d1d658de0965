// kvevict reference implementation (tests only).
//
// Plain, obviously-correct float64 versions of the eviction stages of
// docs/algorithms.md, written independently of include/kvevict/ so that the
// optimised library can be tested against it. Slow on purpose: every top-k is a full
// std::sort with the spec's deterministic order (docs/algorithms.md#ties).
//
// Conventions: all tensors are std::vector<double>, row-major, with explicit dimensions.
//   q      [H][w][d]     window queries (post-RoPE)
//   k      [Hkv][L][d]   keys (post-RoPE)
//   attn   [H][w][L]     full softmax rows of the window queries
//   scores [Hkv][P]      one score per (KV head, prefix token), P = L - w
// Kept token lists are per KV head, sorted ascending.
#ifndef KVEVICT_TESTS_SUPPORT_REFERENCE_HPP
#define KVEVICT_TESTS_SUPPORT_REFERENCE_HPP

#include <algorithm>
#include <cassert>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <vector>

namespace kvevict_ref {

enum class Pool { avg, max };

using Kept = std::vector<std::vector<std::int64_t>>;  // per KV head, ascending token indices

namespace detail {

inline std::size_t sz(std::int64_t v) {
  assert(v >= 0);
  return static_cast<std::size_t>(v);
}

inline std::size_t sz(int v) {
  assert(v >= 0);
  return static_cast<std::size_t>(v);
}

// One candidate of a top-k.
struct Entry {
  double score;
  std::int64_t pos;   // token position
  std::int64_t head;  // KV head
};

// docs/algorithms.md#ties: score descending; exact ties go to the higher token position first,
// then to the lower KV head.
inline bool ranks_before(const Entry& a, const Entry& b) {
  if (a.score != b.score) return a.score > b.score;
  if (a.pos != b.pos) return a.pos > b.pos;
  return a.head < b.head;
}

// The first k entries in the docs/algorithms.md#ties order.
inline std::vector<Entry> top_k(std::vector<Entry> entries, std::int64_t k) {
  assert(k >= 0 && sz(k) <= entries.size());
  std::sort(entries.begin(), entries.end(), ranks_before);
  entries.resize(sz(k));
  return entries;
}

inline void sort_kept(Kept& kept) {
  for (auto& v : kept) std::sort(v.begin(), v.end());
}

inline void assert_finite(const std::vector<double>& x) {
  for (double v : x) {
    assert(std::isfinite(v));
    (void)v;
  }
}

// docs/algorithms.md#allocation (reference): scores [Hkv][P] padded on the right with w copies of the maximum
// of the whole layer's [Hkv][P] tensor. Returns [Hkv][L].
inline std::vector<double> pad_window_with_layer_max(const std::vector<double>& scores, int Hkv, int w, int L) {
  const int P = L - w;
  assert(scores.size() == sz(Hkv) * sz(P));
  const double layer_max = *std::max_element(scores.begin(), scores.end());
  std::vector<double> padded(sz(Hkv) * sz(L), layer_max);
  for (int h = 0; h < Hkv; ++h)
    for (int j = 0; j < P; ++j) padded[sz(h) * sz(L) + sz(j)] = scores[sz(h) * sz(P) + sz(j)];
  return padded;
}

// Round half to even (torch.round), independent of the floating-point rounding mode.
inline double round_half_even(double x) {
  const double f = std::floor(x);
  const double diff = x - f;
  if (diff < 0.5) return f;
  if (diff > 0.5) return f + 1.0;
  return (std::fmod(f, 2.0) == 0.0) ? f : f + 1.0;
}

inline void check_selection_args(const std::vector<double>& scores, int Hkv, int w, int L, std::int64_t n_kept) {
  assert(Hkv >= 1);
  assert(w >= 1 && w < L);             // 1 <= w < L, so P >= 1
  assert(n_kept >= 1 && n_kept <= L);  // docs/algorithms.md#ties: n_kept < 1 or n_kept > L is an error
  assert(scores.size() == sz(Hkv) * sz(L - w));
  assert_finite(scores);  // the DBL_MAX safeguard of adakv must outrank every real score
  (void)scores;
  (void)Hkv;
  (void)w;
  (void)L;
  (void)n_kept;
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// docs/algorithms.md#window-attention: window attention. Returns full softmax rows attn [H][w][L].
// logits[i][j] = q[h][i] . k[h / G][j] / sqrt(d); row i sits at absolute position L - w + i and
// masks keys j > L - w + i (masked entries are exactly 0). Softmax in double, row max subtracted.
inline std::vector<double> window_attention(const std::vector<double>& q, const std::vector<double>& k, int H, int Hkv,
                                            int w, int L, int d) {
  using detail::sz;
  assert(H >= 1 && Hkv >= 1 && H % Hkv == 0);
  assert(w >= 1 && w <= L);
  assert(d >= 1);
  assert(q.size() == sz(H) * sz(w) * sz(d));
  assert(k.size() == sz(Hkv) * sz(L) * sz(d));
  const int G = H / Hkv;
  const double scale = 1.0 / std::sqrt(static_cast<double>(d));
  std::vector<double> attn(sz(H) * sz(w) * sz(L), 0.0);
  std::vector<double> logits(sz(L));
  for (int h = 0; h < H; ++h) {
    const int kvh = h / G;
    for (int i = 0; i < w; ++i) {
      const int last = L - w + i;  // last visible key (causal)
      const double* qi = &q[(sz(h) * sz(w) + sz(i)) * sz(d)];
      double row_max = -std::numeric_limits<double>::infinity();
      for (int j = 0; j <= last; ++j) {
        const double* kj = &k[(sz(kvh) * sz(L) + sz(j)) * sz(d)];
        double dot = 0.0;
        for (int c = 0; c < d; ++c) dot += qi[c] * kj[c];
        logits[sz(j)] = dot * scale;
        row_max = std::max(row_max, logits[sz(j)]);
      }
      double sum = 0.0;
      for (int j = 0; j <= last; ++j) {
        logits[sz(j)] = std::exp(logits[sz(j)] - row_max);
        sum += logits[sz(j)];
      }
      double* out = &attn[(sz(h) * sz(w) + sz(i)) * sz(L)];
      for (int j = 0; j <= last; ++j) out[j] = logits[sz(j)] / sum;
      // keys j > last stay 0 (masked with -inf before the softmax)
    }
  }
  return attn;
}

// ---------------------------------------------------------------------------------------------
// docs/algorithms.md#pooling: 1-D pooling along tokens, kernel odd, stride 1, padding kernel/2.
// avg: sum of the in-range neighbours divided by kernel (padding counts as zeros, count_include_pad);
// max: max over the in-range neighbours.
inline std::vector<double> pool1d(const std::vector<double>& x, int kernel, Pool pool) {
  using detail::sz;
  assert(kernel >= 1 && kernel % 2 == 1);
  const std::int64_t n = static_cast<std::int64_t>(x.size());
  const std::int64_t r = kernel / 2;
  std::vector<double> out(x.size());
  for (std::int64_t j = 0; j < n; ++j) {
    const std::int64_t lo = std::max<std::int64_t>(0, j - r);
    const std::int64_t hi = std::min<std::int64_t>(n - 1, j + r);
    if (pool == Pool::avg) {
      double s = 0.0;
      for (std::int64_t t = lo; t <= hi; ++t) s += x[sz(t)];
      out[sz(j)] = s / static_cast<double>(kernel);
    } else {
      double m = x[sz(lo)];
      for (std::int64_t t = lo; t <= hi; ++t) m = std::max(m, x[sz(t)]);
      out[sz(j)] = m;
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// docs/algorithms.md#aggregation, mean aggregation (SnapKV / AdaKV / CriticalKV) from full rows attn [H][w][L].
// A[q] = prefix block [w][P] (no renormalisation), s_q = mean over the w rows, pool(s_q),
// then s[h] = mean over the G query heads of group h. Returns scores [Hkv][P].
inline std::vector<double> mean_scores(const std::vector<double>& attn, int H, int Hkv, int w, int L, int kernel,
                                       Pool pool) {
  using detail::sz;
  assert(H >= 1 && Hkv >= 1 && H % Hkv == 0);
  assert(w >= 1 && w < L);
  assert(kernel >= 1 && kernel % 2 == 1);
  assert(attn.size() == sz(H) * sz(w) * sz(L));
  const int G = H / Hkv;
  const int P = L - w;
  std::vector<double> scores(sz(Hkv) * sz(P), 0.0);
  for (int h = 0; h < H; ++h) {
    std::vector<double> s(sz(P), 0.0);
    for (int i = 0; i < w; ++i)
      for (int j = 0; j < P; ++j) s[sz(j)] += attn[(sz(h) * sz(w) + sz(i)) * sz(L) + sz(j)];
    for (double& v : s) v /= static_cast<double>(w);
    const std::vector<double> pooled = pool1d(s, kernel, pool);
    const int kvh = h / G;
    for (int j = 0; j < P; ++j) scores[sz(kvh) * sz(P) + sz(j)] += pooled[sz(j)];
  }
  for (double& v : scores) v /= static_cast<double>(G);
  return scores;
}

// ---------------------------------------------------------------------------------------------
// docs/algorithms.md#budgets: budgets. n_kept = int(L * (1 - cr)) in double, truncated toward zero
// (L = 1000, cr = 0.8 gives 199); keep ratio: int(L * keep).
inline std::int64_t n_kept_from_compression_ratio(std::int64_t L, double cr) {
  assert(L >= 0);
  assert(cr >= 0.0 && cr <= 1.0);
  return static_cast<std::int64_t>(static_cast<double>(L) * (1.0 - cr));
}

inline std::int64_t n_kept_from_keep_ratio(std::int64_t L, double keep) {
  assert(L >= 0);
  assert(keep >= 0.0 && keep <= 1.0);
  return static_cast<std::int64_t>(static_cast<double>(L) * keep);
}

// ---------------------------------------------------------------------------------------------
// docs/algorithms.md#allocation, uniform (SnapKV), literally as the reference does it: pad the window with the
// layer max, then per head the top n_kept of its L entries (docs/algorithms.md#ties order). With n_kept < w this
// keeps the most recent n_kept window tokens.
inline Kept snapkv(const std::vector<double>& scores, int Hkv, int w, int L, std::int64_t n_kept) {
  using detail::sz;
  detail::check_selection_args(scores, Hkv, w, L, n_kept);
  const std::vector<double> padded = detail::pad_window_with_layer_max(scores, Hkv, w, L);
  Kept kept(sz(Hkv));
  for (int h = 0; h < Hkv; ++h) {
    std::vector<detail::Entry> entries;
    for (int j = 0; j < L; ++j) entries.push_back({padded[sz(h) * sz(L) + sz(j)], j, h});
    for (const auto& e : detail::top_k(entries, n_kept)) kept[sz(h)].push_back(e.pos);
  }
  detail::sort_kept(kept);
  return kept;
}

// ---------------------------------------------------------------------------------------------
// docs/algorithms.md#allocation, head-adaptive (kvpress AdaKVPress), literally: pad the window with the layer max;
// n_safe = int(n_kept * alpha); each head's top n_safe entries (window included) are set to
// DBL_MAX; then one top-k of size Hkv * n_kept over the flattened [Hkv * L] scores (docs/algorithms.md#ties order,
// ties: higher position, then lower head). Head h keeps its selected entries.
inline Kept adakv(const std::vector<double>& scores, int Hkv, int w, int L, std::int64_t n_kept, double alpha) {
  using detail::sz;
  detail::check_selection_args(scores, Hkv, w, L, n_kept);
  assert(alpha >= 0.0 && alpha <= 1.0);
  std::vector<double> padded = detail::pad_window_with_layer_max(scores, Hkv, w, L);
  const std::int64_t n_safe = static_cast<std::int64_t>(static_cast<double>(n_kept) * alpha);
  // Safeguard: per head, force its top n_safe entries.
  for (int h = 0; h < Hkv; ++h) {
    std::vector<detail::Entry> entries;
    for (int j = 0; j < L; ++j) entries.push_back({padded[sz(h) * sz(L) + sz(j)], j, h});
    for (const auto& e : detail::top_k(entries, n_safe))
      padded[sz(h) * sz(L) + sz(e.pos)] = std::numeric_limits<double>::max();
  }
  // One flat top-k over the layer.
  std::vector<detail::Entry> flat;
  for (int h = 0; h < Hkv; ++h)
    for (int j = 0; j < L; ++j) flat.push_back({padded[sz(h) * sz(L) + sz(j)], j, h});
  Kept kept(sz(Hkv));
  for (const auto& e : detail::top_k(flat, static_cast<std::int64_t>(Hkv) * n_kept)) kept[sz(e.head)].push_back(e.pos);
  detail::sort_kept(kept);
  return kept;
}

// ---------------------------------------------------------------------------------------------
// docs/algorithms.md#allocation, original AdaKV repo variant. If n_kept <= w every head keeps its most recent n_kept
// tokens (library convention). Otherwise, with B = n_kept - w:
//   count_h = head h's share of one flat top-k of size Hkv * B over the [Hkv * P] prefix scores,
//   b_h     = round_half_even(count_h * (1 - alpha) + floor(alpha * B)) + w,
// and head h keeps its top (b_h - w) prefix tokens plus the whole window.
// Note: sum of b_h is not guaranteed to equal Hkv * n_kept (rounding, floor).
inline Kept adakv_original(const std::vector<double>& scores, int Hkv, int w, int L, std::int64_t n_kept,
                           double alpha) {
  using detail::sz;
  detail::check_selection_args(scores, Hkv, w, L, n_kept);
  assert(alpha >= 0.0 && alpha <= 1.0);
  const int P = L - w;
  Kept kept(sz(Hkv));
  if (n_kept <= w) {
    for (int h = 0; h < Hkv; ++h)
      for (std::int64_t j = L - n_kept; j < L; ++j) kept[sz(h)].push_back(j);
    return kept;
  }
  const std::int64_t B = n_kept - w;  // 1 <= B <= P
  std::vector<detail::Entry> flat;
  for (int h = 0; h < Hkv; ++h)
    for (int j = 0; j < P; ++j) flat.push_back({scores[sz(h) * sz(P) + sz(j)], j, h});
  std::vector<std::int64_t> count(sz(Hkv), 0);
  for (const auto& e : detail::top_k(flat, static_cast<std::int64_t>(Hkv) * B)) ++count[sz(e.head)];
  const double floor_part = std::floor(alpha * static_cast<double>(B));
  for (int h = 0; h < Hkv; ++h) {
    const double b = detail::round_half_even(static_cast<double>(count[sz(h)]) * (1.0 - alpha) + floor_part);
    const std::int64_t n_prefix = static_cast<std::int64_t>(b);  // b_h - w
    assert(n_prefix >= 0 && n_prefix <= P);
    std::vector<detail::Entry> entries;
    for (int j = 0; j < P; ++j) entries.push_back({scores[sz(h) * sz(P) + sz(j)], j, h});
    for (const auto& e : detail::top_k(entries, n_prefix)) kept[sz(h)].push_back(e.pos);
    for (int j = P; j < L; ++j) kept[sz(h)].push_back(j);  // the whole window
  }
  detail::sort_kept(kept);
  return kept;
}

// ---------------------------------------------------------------------------------------------
// docs/algorithms.md#allocation, StreamingLLM: every head keeps its first min(sinks, n_kept) tokens and the most
// recent max(0, n_kept - sinks) tokens (disjoint because n_kept <= L).
inline Kept streamingllm(int Hkv, int L, std::int64_t n_kept, int sinks) {
  using detail::sz;
  assert(Hkv >= 1);
  assert(n_kept >= 1 && n_kept <= L);
  assert(sinks >= 0);
  const std::int64_t n_sinks = std::min<std::int64_t>(sinks, n_kept);
  const std::int64_t n_recent = std::max<std::int64_t>(0, n_kept - sinks);
  Kept kept(sz(Hkv));
  for (int h = 0; h < Hkv; ++h) {
    for (std::int64_t j = 0; j < n_sinks; ++j) kept[sz(h)].push_back(j);
    for (std::int64_t j = L - n_recent; j < L; ++j) kept[sz(h)].push_back(j);
  }
  detail::sort_kept(kept);
  return kept;
}

// =============================================================================================
// Selectors: value term (docs/algorithms.md#value-term), defensive aggregation (docs/algorithms.md#aggregation),
// forcing (docs/algorithms.md#forcing), CriticalKV, DefensiveKV and Layer-DefensiveKV (docs/algorithms.md#allocation
// layer-global). Same conventions as above; in addition
//   v      [Hkv][L][d]   values
//   w_o    [D][H*d]      output projection (PyTorch Linear layout); W_o^q = columns q*d .. q*d+d-1
//   n      [Hkv][L]      value norms N (only the prefix columns j < P are used by the selectors)
//   sprime [Hkv][P]      DefensiveKV scores s'
// ---------------------------------------------------------------------------------------------

namespace detail {

inline void assert_nonneg_finite(const std::vector<double>& x) {
  for (double v : x) {
    assert(std::isfinite(v) && v >= 0.0);
    (void)v;
  }
}

inline void check_attn_args(const std::vector<double>& attn, int H, int Hkv, int w, int L) {
  assert(H >= 1 && Hkv >= 1 && H % Hkv == 0);
  assert(w >= 1 && w < L);
  assert(attn.size() == sz(H) * sz(w) * sz(L));
  assert_nonneg_finite(attn);
  (void)attn;
  (void)H;
  (void)Hkv;
  (void)w;
  (void)L;
}

// Forced token lists: one list per KV head (or none at all = nothing forced), indices in [0, P), no duplicates.
inline void check_forced(const std::vector<std::vector<std::int64_t>>& forced, int Hkv, int P) {
  assert(forced.empty() || forced.size() == sz(Hkv));
  for (const auto& f : forced) {
    std::vector<std::int64_t> c = f;
    std::sort(c.begin(), c.end());
    assert(std::adjacent_find(c.begin(), c.end()) == c.end());
    for (std::int64_t j : c) {
      assert(j >= 0 && j < P);
      (void)j;
    }
  }
  (void)Hkv;
  (void)P;
}

// Python's int(x) for a float: truncation toward zero.
inline std::int64_t py_int(double x) {
  assert(std::isfinite(x));
  return static_cast<std::int64_t>(x);
}

// Per head h of [Hkv][L] values, the top n entries (docs/algorithms.md#ties order) are set to DBL_MAX; marks them
// in `safe`.
inline void apply_safeguard(std::vector<double>& padded, std::vector<bool>& safe, int Hkv, int L, std::int64_t n_safe) {
  for (int h = 0; h < Hkv; ++h) {
    std::vector<Entry> entries;
    for (int j = 0; j < L; ++j) entries.push_back({padded[sz(h) * sz(L) + sz(j)], j, h});
    for (const auto& e : top_k(entries, n_safe)) {
      padded[sz(h) * sz(L) + sz(e.pos)] = std::numeric_limits<double>::max();
      safe[sz(h) * sz(L) + sz(e.pos)] = true;
    }
  }
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// docs/algorithms.md#value-term: value norms N [Hkv][L], computed directly (no Gram-matrix shortcut):
//   N[q][j] = || V[q/G][j, :] (W_o^q)^T ||_p over the D output dims, out[r] = sum_c V[j][c] * W_o[r][q*d + c];
//   N[h][j] = mean over the G query heads of group h. p = 1 or 2.
inline std::vector<double> value_norms(const std::vector<double>& v, const std::vector<double>& w_o, int H, int Hkv,
                                       int L, int d, int D, int p) {
  using detail::sz;
  assert(H >= 1 && Hkv >= 1 && H % Hkv == 0);
  assert(L >= 1 && d >= 1 && D >= 1);
  assert(p == 1 || p == 2);
  assert(v.size() == sz(Hkv) * sz(L) * sz(d));
  assert(w_o.size() == sz(D) * sz(H) * sz(d));
  detail::assert_finite(v);
  detail::assert_finite(w_o);
  const int G = H / Hkv;
  const std::size_t row = sz(H) * sz(d);  // row length of W_o
  std::vector<double> n(sz(Hkv) * sz(L), 0.0);
  for (int q = 0; q < H; ++q) {
    const int h = q / G;
    for (int j = 0; j < L; ++j) {
      const double* vj = &v[(sz(h) * sz(L) + sz(j)) * sz(d)];
      double acc = 0.0;
      for (int r = 0; r < D; ++r) {
        double o = 0.0;
        for (int c = 0; c < d; ++c) o += vj[c] * w_o[sz(r) * row + sz(q) * sz(d) + sz(c)];
        acc += (p == 1) ? std::fabs(o) : o * o;
      }
      n[sz(h) * sz(L) + sz(j)] += (p == 1) ? acc : std::sqrt(acc);
    }
  }
  for (double& x : n) x /= static_cast<double>(G);
  return n;
}

// ---------------------------------------------------------------------------------------------
// Defensive aggregation (DefensiveKV, docs/algorithms.md#aggregation) from full rows attn [H][w][L].
// Returns M [Hkv][P].
//   1. R[q][i] = pool(A[q][i, :P]) (each window row separately);
//   2. R[q][i] *= sum(A[q][i, :P]) / sum(R[q][i]), done as (R / sum(R)) * mass like the reference;
//      a row whose pooled sum is 0 stays all zeros (the reference would produce NaN);
//   3. M[h][j] = max over the G query heads of h and the w rows of R[q][i][j];
//   4. if floor: M[h][j] = max(M[h][j], mean over j of M[h][:]).
inline std::vector<double> defensive_scores(const std::vector<double>& attn, int H, int Hkv, int w, int L, int kernel,
                                            Pool pool, bool floor) {
  using detail::sz;
  detail::check_attn_args(attn, H, Hkv, w, L);
  assert(kernel >= 1 && kernel % 2 == 1);
  const int G = H / Hkv;
  const int P = L - w;
  std::vector<double> m(sz(Hkv) * sz(P), -std::numeric_limits<double>::infinity());
  for (int q = 0; q < H; ++q) {
    const int h = q / G;
    for (int i = 0; i < w; ++i) {
      const double* row = &attn[(sz(q) * sz(w) + sz(i)) * sz(L)];
      const std::vector<double> prefix(row, row + P);
      double mass = 0.0;
      for (double x : prefix) mass += x;
      std::vector<double> r = pool1d(prefix, kernel, pool);
      double pooled_sum = 0.0;
      for (double x : r) pooled_sum += x;
      for (double& x : r) x = (pooled_sum == 0.0) ? 0.0 : (x / pooled_sum) * mass;
      for (int j = 0; j < P; ++j) {
        double& dst = m[sz(h) * sz(P) + sz(j)];
        dst = std::max(dst, r[sz(j)]);
      }
    }
  }
  if (floor) {
    for (int h = 0; h < Hkv; ++h) {
      double mean = 0.0;
      for (int j = 0; j < P; ++j) mean += m[sz(h) * sz(P) + sz(j)];
      mean /= static_cast<double>(P);
      for (int j = 0; j < P; ++j) {
        double& x = m[sz(h) * sz(P) + sz(j)];
        x = std::max(x, mean);
      }
    }
  }
  return m;
}

// ---------------------------------------------------------------------------------------------
// Cumulative-mass forcing (DefensiveKV, docs/algorithms.md#forcing). Returns per KV head the forced prefix tokens,
// ascending.
//   p[h][j] = mean over the G heads and w rows of attn[q][i][j] (j < P, unpooled), divided by its sum over j;
//   order = p descending, ties -> higher position first; c = running sum in that order;
//   tau = threshold - window_bias; k = first index with c >= tau (0 if never reached; the token at that index
//   is NOT forced); if p's sum is 0, k = 0 (order then = positions descending);
//   k = min(k, cap); forced = order[:k] with Python slicing (k < 0: all but the last |k|, empty if |k| >= P).
//   corrected: window_bias = mean over all H heads and w rows of the mass on the window columns [P, L);
//              cap = max(0, n_kept - w).
//   quirks:    window_bias = mean over all H heads and w rows of the mass on the prefix columns [max(0, P-w), P);
//              cap = int(P * (1 - cr) - w) in double, truncated toward zero (may be negative).
// window_bias is one scalar for the whole layer (not per KV head).
inline std::vector<std::vector<std::int64_t>> mass_forced(const std::vector<double>& attn, int H, int Hkv, int w, int L,
                                                          double threshold, std::int64_t n_kept, bool quirks,
                                                          double cr) {
  using detail::sz;
  detail::check_attn_args(attn, H, Hkv, w, L);
  assert(std::isfinite(threshold));
  assert(n_kept >= 1 && n_kept <= L);
  assert(cr >= 0.0 && cr <= 1.0);
  const int G = H / Hkv;
  const int P = L - w;

  const int bias_lo = quirks ? std::max(0, P - w) : P;
  const int bias_hi = quirks ? P : L;
  double window_bias = 0.0;
  for (int q = 0; q < H; ++q)
    for (int i = 0; i < w; ++i)
      for (int j = bias_lo; j < bias_hi; ++j) window_bias += attn[(sz(q) * sz(w) + sz(i)) * sz(L) + sz(j)];
  window_bias /= static_cast<double>(H) * static_cast<double>(w);
  const double tau = threshold - window_bias;

  const std::int64_t cap = quirks ? detail::py_int(static_cast<double>(P) * (1.0 - cr) - static_cast<double>(w))
                                  : std::max<std::int64_t>(0, n_kept - w);

  std::vector<std::vector<std::int64_t>> forced(sz(Hkv));
  for (int h = 0; h < Hkv; ++h) {
    std::vector<double> ave(sz(P), 0.0);
    for (int g = 0; g < G; ++g) {
      const int q = h * G + g;
      for (int i = 0; i < w; ++i)
        for (int j = 0; j < P; ++j) ave[sz(j)] += attn[(sz(q) * sz(w) + sz(i)) * sz(L) + sz(j)];
    }
    for (double& x : ave) x /= static_cast<double>(G) * static_cast<double>(w);
    double total = 0.0;
    for (double x : ave) total += x;

    std::vector<detail::Entry> order;
    for (int j = 0; j < P; ++j) order.push_back({total == 0.0 ? 0.0 : ave[sz(j)] / total, j, h});
    order = detail::top_k(order, P);  // full sort: p descending, ties -> higher position

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
    const std::int64_t n_take = (k >= 0) ? k : std::max<std::int64_t>(0, P + k);
    for (std::int64_t t = 0; t < n_take; ++t) forced[sz(h)].push_back(order[sz(t)].pos);
    std::sort(forced[sz(h)].begin(), forced[sz(h)].end());
  }
  return forced;
}

// ---------------------------------------------------------------------------------------------
// CriticalKV (docs/algorithms.md#forcing fraction forcing, kvpress CriticalAdaKVPress / CriticalKVPress), literally.
// s = base scores [Hkv][P] (mean_scores), n = value norms [Hkv][L].
//   padded = s with the window padded with the layer max of s (docs/algorithms.md#allocation).
//   adaptive: n_safe = int(n_kept * alpha); per head the top n_safe entries of padded -> DBL_MAX ("safeguard");
//             b_h = head h's share of one flat top-(Hkv * n_kept) over the safeguarded [Hkv * L] tensor.
//   uniform (adaptive = false): b_h = n_kept, no safeguard (alpha ignored).
//   stage 1: per head, its top int(b_h * ratio) entries of the (safeguarded) padded row;
//   stage 2: the best b_h - stage1 of the remaining entries by
//            safeguard entry                 -> DBL_MAX (checked first, so a safeguarded window token is DBL_MAX)
//            window entry j >= P             -> DBL_MAX (corrected) or (layer max of s + eps) * N[h][j] (quirks)
//            prefix entry j < P              -> (s[h][j] + eps) * N[h][j].
// Every top-k uses the docs/algorithms.md#ties order. Each head keeps exactly b_h.
inline Kept criticalkv(const std::vector<double>& s, const std::vector<double>& n, int Hkv, int w, int L,
                       std::int64_t n_kept, bool adaptive, double alpha, double eps, double ratio, bool quirks) {
  using detail::sz;
  detail::check_selection_args(s, Hkv, w, L, n_kept);
  assert(n.size() == sz(Hkv) * sz(L));
  detail::assert_nonneg_finite(n);
  assert(alpha >= 0.0 && alpha <= 1.0);
  assert(std::isfinite(eps) && eps >= 0.0);
  assert(ratio >= 0.0 && ratio <= 1.0);
  const int P = L - w;
  const double layer_max = *std::max_element(s.begin(), s.end());
  const double dbl_max = std::numeric_limits<double>::max();

  std::vector<double> padded = detail::pad_window_with_layer_max(s, Hkv, w, L);
  std::vector<bool> safe(sz(Hkv) * sz(L), false);
  std::vector<std::int64_t> budget(sz(Hkv), n_kept);
  if (adaptive) {
    const std::int64_t n_safe = detail::py_int(static_cast<double>(n_kept) * alpha);
    detail::apply_safeguard(padded, safe, Hkv, L, n_safe);
    std::vector<detail::Entry> flat;
    for (int h = 0; h < Hkv; ++h)
      for (int j = 0; j < L; ++j) flat.push_back({padded[sz(h) * sz(L) + sz(j)], j, h});
    std::fill(budget.begin(), budget.end(), 0);
    for (const auto& e : detail::top_k(flat, static_cast<std::int64_t>(Hkv) * n_kept)) ++budget[sz(e.head)];
  }

  Kept kept(sz(Hkv));
  for (int h = 0; h < Hkv; ++h) {
    const std::int64_t b = budget[sz(h)];
    const std::int64_t k1 = detail::py_int(static_cast<double>(b) * ratio);
    assert(k1 >= 0 && k1 <= b && b <= L);
    std::vector<bool> taken(sz(L), false);
    std::vector<detail::Entry> stage1;
    for (int j = 0; j < L; ++j) stage1.push_back({padded[sz(h) * sz(L) + sz(j)], j, h});
    for (const auto& e : detail::top_k(stage1, k1)) {
      taken[sz(e.pos)] = true;
      kept[sz(h)].push_back(e.pos);
    }
    std::vector<detail::Entry> stage2;
    for (int j = 0; j < L; ++j) {
      if (taken[sz(j)]) continue;
      const double nj = n[sz(h) * sz(L) + sz(j)];
      double score;
      if (safe[sz(h) * sz(L) + sz(j)])
        score = dbl_max;
      else if (j >= P)
        score = quirks ? (layer_max + eps) * nj : dbl_max;
      else
        score = (s[sz(h) * sz(P) + sz(j)] + eps) * nj;
      stage2.push_back({score, j, h});
    }
    for (const auto& e : detail::top_k(stage2, b - k1)) kept[sz(h)].push_back(e.pos);
  }
  detail::sort_kept(kept);
  return kept;
}

// ---------------------------------------------------------------------------------------------
// docs/algorithms.md#value-term, DefensiveKV value term: s'[h][j] = M[h][j] * N[h][j] / sum over h' of N[h'][j]
// for j < P (Nn = 0 where that sum is 0); value_term = false returns M unchanged. Returns [Hkv][P].
inline std::vector<double> defensive_value_scores(const std::vector<double>& m, const std::vector<double>& n, int Hkv,
                                                  int w, int L, bool value_term) {
  using detail::sz;
  assert(Hkv >= 1 && w >= 1 && w < L);
  const int P = L - w;
  assert(m.size() == sz(Hkv) * sz(P));
  assert(n.size() == sz(Hkv) * sz(L));
  detail::assert_finite(m);
  detail::assert_nonneg_finite(n);
  if (!value_term) return m;
  std::vector<double> out(m.size(), 0.0);
  for (int j = 0; j < P; ++j) {
    double sum = 0.0;
    for (int h = 0; h < Hkv; ++h) sum += n[sz(h) * sz(L) + sz(j)];
    for (int h = 0; h < Hkv; ++h) {
      const double nn = (sum == 0.0) ? 0.0 : n[sz(h) * sz(L) + sz(j)] / sum;
      out[sz(h) * sz(P) + sz(j)] = m[sz(h) * sz(P) + sz(j)] * nn;
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// DefensiveKV, one layer. sprime [Hkv][P]; forced per KV head (mass_forced), or empty for no mass forcing.
//   x = sprime padded to [Hkv][L]; forced prefix entries and the window -> DBL_MAX (corrected: kept strictly
//   first, a prefix entry tied with the layer max never displaces them) or the layer max of sprime (quirks);
//   if alpha > 0: per head top int(n_kept * alpha) entries of x -> DBL_MAX (AdaKV safeguard);
//   one flat top-k over [Hkv * L] of total = Hkv * n_kept (corrected) or int(L * (1 - cr) * Hkv) (quirks,
//   evaluated left to right in double, truncated). Ties per docs/algorithms.md#ties.
inline Kept defensivekv(const std::vector<double>& sprime, const std::vector<std::vector<std::int64_t>>& forced,
                        int Hkv, int w, int L, std::int64_t n_kept, double alpha, bool quirks, double cr) {
  using detail::sz;
  detail::check_selection_args(sprime, Hkv, w, L, n_kept);
  const int P = L - w;
  detail::check_forced(forced, Hkv, P);
  assert(alpha >= 0.0 && alpha <= 1.0);
  assert(cr >= 0.0 && cr <= 1.0);
  // Corrected: DBL_MAX, above every score and equal to the safeguard's value (forced, window and safeguard
  // entries all fit in the total, except when n_kept < w, where the window's most recent entries win either way).
  const double top = quirks ? *std::max_element(sprime.begin(), sprime.end()) : std::numeric_limits<double>::max();
  std::vector<double> x = detail::pad_window_with_layer_max(sprime, Hkv, w, L);
  for (int h = 0; h < Hkv; ++h)
    for (int j = P; j < L; ++j) x[sz(h) * sz(L) + sz(j)] = top;
  for (std::size_t h = 0; h < forced.size(); ++h)
    for (std::int64_t j : forced[h]) x[h * sz(L) + sz(j)] = top;
  if (alpha > 0.0) {
    std::vector<bool> safe(sz(Hkv) * sz(L), false);
    detail::apply_safeguard(x, safe, Hkv, L, detail::py_int(static_cast<double>(n_kept) * alpha));
  }
  const std::int64_t total = quirks ? detail::py_int(static_cast<double>(L) * (1.0 - cr) * static_cast<double>(Hkv))
                                    : static_cast<std::int64_t>(Hkv) * n_kept;
  assert(total >= 0 && total <= static_cast<std::int64_t>(Hkv) * L);
  std::vector<detail::Entry> flat;
  for (int h = 0; h < Hkv; ++h)
    for (int j = 0; j < L; ++j) flat.push_back({x[sz(h) * sz(L) + sz(j)], j, h});
  Kept kept(sz(Hkv));
  for (const auto& e : detail::top_k(flat, total)) kept[sz(e.head)].push_back(e.pos);
  detail::sort_kept(kept);
  return kept;
}

// ---------------------------------------------------------------------------------------------
// Layer-DefensiveKV (docs/algorithms.md#allocation layer-global + docs/algorithms.md#forcing layer-global forcing).
// sprime[l] [Hkv][P], forced[l] per KV head (or empty). Per layer, forced and window entries get +infinity (corrected)
// or that layer's max of sprime[l] (quirks); one top-k over all [NL * Hkv * L] entries of total NL * Hkv * n_kept
// (corrected) or int(L * (1 - cr) * Hkv * NL) (quirks, left to right in double, truncated).
// Ties: score desc, higher position, lower layer, lower head. Returns the kept sets per layer.
inline std::vector<Kept> layer_defensivekv(const std::vector<std::vector<double>>& sprime,
                                           const std::vector<std::vector<std::vector<std::int64_t>>>& forced, int Hkv,
                                           int w, int L, std::int64_t n_kept, bool quirks, double cr) {
  using detail::sz;
  const std::size_t NL = sprime.size();
  assert(NL >= 1);
  assert(forced.empty() || forced.size() == NL);
  assert(cr >= 0.0 && cr <= 1.0);
  const int P = L - w;
  std::vector<detail::Entry> flat;
  for (std::size_t l = 0; l < NL; ++l) {
    detail::check_selection_args(sprime[l], Hkv, w, L, n_kept);
    const std::vector<std::vector<std::int64_t>> none;
    const auto& fl = forced.empty() ? none : forced[l];
    detail::check_forced(fl, Hkv, P);
    const double top =
        quirks ? *std::max_element(sprime[l].begin(), sprime[l].end()) : std::numeric_limits<double>::infinity();
    std::vector<double> x = detail::pad_window_with_layer_max(sprime[l], Hkv, w, L);
    for (std::int64_t h = 0; h < Hkv; ++h)
      for (std::int64_t j = P; j < L; ++j) x[sz(h) * sz(L) + sz(j)] = top;
    for (std::size_t h = 0; h < fl.size(); ++h)
      for (std::int64_t j : fl[h]) x[h * sz(L) + sz(j)] = top;
    // head key = l * Hkv + h: ascending means lower layer first, then lower head.
    for (std::int64_t h = 0; h < Hkv; ++h)
      for (std::int64_t j = 0; j < L; ++j)
        flat.push_back({x[sz(h) * sz(L) + sz(j)], j, static_cast<std::int64_t>(l) * Hkv + h});
  }
  const double nl = static_cast<double>(NL);
  const std::int64_t total = quirks
                                 ? detail::py_int(static_cast<double>(L) * (1.0 - cr) * static_cast<double>(Hkv) * nl)
                                 : static_cast<std::int64_t>(NL) * Hkv * n_kept;
  assert(total >= 0 && static_cast<std::size_t>(total) <= flat.size());
  std::vector<Kept> kept(NL, Kept(sz(Hkv)));
  for (const auto& e : detail::top_k(flat, total)) kept[sz(e.head / Hkv)][sz(e.head % Hkv)].push_back(e.pos);
  for (auto& k : kept) detail::sort_kept(k);
  return kept;
}

}  // namespace kvevict_ref

#endif  // KVEVICT_TESTS_SUPPORT_REFERENCE_HPP
