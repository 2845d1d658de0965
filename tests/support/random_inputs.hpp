// Test helpers: seeded random layers, layout conversions, comparisons of results with tests/support/reference.hpp.
#ifndef KVEVICT_TESTS_SUPPORT_RANDOM_INPUTS_HPP
#define KVEVICT_TESTS_SUPPORT_RANDOM_INPUTS_HPP

#include <kvevict/extend.hpp>

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "support/reference.hpp"

namespace kvevict_test {

using Rng = std::mt19937_64;
using kvevict_ref::Kept;

inline std::size_t sz(std::int64_t v) { return static_cast<std::size_t>(v); }

/// The dimensions of one random layer.
struct Shape {
  int H = 1;    ///< query heads
  int Hkv = 1;  ///< KV heads
  int w = 1;    ///< observation window
  int L = 2;    ///< context length
  int d = 16;   ///< head_dim
  int P() const { return L - w; }
  int G() const { return H / Hkv; }
};

inline std::string describe(const Shape& s) {
  std::ostringstream o;
  o << "H=" << s.H << " Hkv=" << s.Hkv << " w=" << s.w << " L=" << s.L << " d=" << s.d;
  return o.str();
}

/// Standard normal entries times `scale`.
inline std::vector<double> normal_vector(std::size_t n, Rng& rng, double scale = 1.0) {
  std::normal_distribution<double> dist(0.0, 1.0);
  std::vector<double> x(n);
  for (double& v : x) v = scale * dist(rng);
  return x;
}

/// The score an engine gives the entry of KV head h at original position `pos` (LayerInputs::scores: the engine-score
/// policies):
/// a fixed pseudo-random value in [0, 1), so that reading it draws nothing from a test's random stream.
inline double engine_score(int h, std::int64_t pos) {
  const double x = std::sin(12.9898 * static_cast<double>(pos + 1) + 78.233 * static_cast<double>(h + 1)) * 43758.5453;
  return x - std::floor(x);
}

/// engine_score() of every entry of a dense layer, [Hkv, L, 1] heads-major, stored as T.
template <class T>
std::vector<T> engine_scores(int Hkv, int L) {
  std::vector<T> out(sz(Hkv) * sz(L));
  for (int h = 0; h < Hkv; ++h)
    for (int j = 0; j < L; ++j) out[sz(h) * sz(L) + sz(j)] = static_cast<T>(engine_score(h, j));
  return out;
}

/// One layer's tensors in float64, heads-major: q [H, w, d], k and v [Hkv, L, d].
/// Queries are scaled so that the window attention is peaked enough for the selections to be meaningful.
struct Layer {
  Shape s;
  std::vector<double> q, k, v;
};

inline Layer random_layer(const Shape& s, Rng& rng, double query_scale = 1.5) {
  Layer l;
  l.s = s;
  l.q = normal_vector(sz(s.H) * sz(s.w) * sz(s.d), rng, query_scale);
  l.k = normal_vector(sz(s.Hkv) * sz(s.L) * sz(s.d), rng);
  l.v = normal_vector(sz(s.Hkv) * sz(s.L) * sz(s.d), rng);
  return l;
}

/// Random shapes of the sweeps: H, Hkv in {1, 2, 4, 8} with H % Hkv == 0, d in {16, 64, 128}, w in {1, 4, 32},
/// L in [w + 1, max_L].
inline Shape random_shape(Rng& rng, int max_L) {
  static const int heads[] = {1, 2, 4, 8};
  static const int dims[] = {16, 64, 128};
  static const int windows[] = {1, 4, 32};
  Shape s;
  s.Hkv = heads[std::uniform_int_distribution<int>(0, 3)(rng)];
  do {
    s.H = heads[std::uniform_int_distribution<int>(0, 3)(rng)];
  } while (s.H % s.Hkv != 0);
  s.d = dims[std::uniform_int_distribution<int>(0, 2)(rng)];
  s.w = windows[std::uniform_int_distribution<int>(0, 2)(rng)];
  if (s.w + 1 > max_L) s.w = 1;
  // Short contexts are the interesting ones (budgets around w); bias towards them.
  const int hi = std::uniform_int_distribution<int>(0, 2)(rng) == 0 ? max_L : std::min(max_L, 4 * s.w + 40);
  s.L = std::uniform_int_distribution<int>(s.w + 1, std::max(s.w + 1, hi))(rng);
  return s;
}

template <class T>
std::vector<T> cast_to(const std::vector<double>& x) {
  std::vector<T> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = static_cast<T>(x[i]);
  return out;
}

template <class T>
std::vector<double> to_double(const std::vector<T>& x) {
  std::vector<double> out(x.size());
  for (std::size_t i = 0; i < x.size(); ++i) out[i] = static_cast<double>(x[i]);
  return out;
}

/// [heads, rows, dim] -> [rows, heads, dim] (the tokens-major layout of llama.cpp and vLLM).
template <class T>
std::vector<T> to_tokens_major(const std::vector<T>& heads_major, int heads, int rows, int dim) {
  std::vector<T> out(heads_major.size());
  for (int h = 0; h < heads; ++h)
    for (int r = 0; r < rows; ++r)
      for (int c = 0; c < dim; ++c)
        out[(sz(r) * sz(heads) + sz(h)) * sz(dim) + sz(c)] = heads_major[(sz(h) * sz(rows) + sz(r)) * sz(dim) + sz(c)];
  return out;
}

/// Window attention rows [H, w, L] computed by the library in arithmetic type S (one head at a time), e.g. for
/// the precomputed-attention route.
template <class S, class T>
std::vector<S> library_attention(const kvevict::HeadsView<const T>& queries, const kvevict::KVView<const T>& keys) {
  const kvevict::Index H = queries.heads(), w = queries.rows(), L = keys.rows();
  const kvevict::Index G = H / keys.heads();
  std::vector<S> out(sz(H * w * L));
  kvevict::RowMatrix<S> rows;
  for (kvevict::Index q = 0; q < H; ++q) {
    kvevict::extend::window_attention<S, T>(queries, keys, q, G, rows);
    for (kvevict::Index i = 0; i < w; ++i)
      for (kvevict::Index j = 0; j < L; ++j) out[sz((q * w + i) * L + j)] = rows(i, j);
  }
  return out;
}

/// Storage of one layer in type T plus the LayerInputs viewing it (heads-major or tokens-major keys and values).
template <class T>
struct Stored {
  std::vector<T> q, k, v, attn, scores;  // scores: engine_scores() [Hkv, L, 1]
  kvevict::LayerInputs<T> in;
};

enum class Layout { heads_major, tokens_major };

/// Layer `l` as LayerInputs<T> with queries [H, w, d], keys/values in `layout`.
template <class T>
Stored<T> store(const Layer& l, Layout layout, bool with_values = false) {
  const Shape& s = l.s;
  Stored<T> st;
  st.q = cast_to<T>(l.q);
  st.in.queries = kvevict::HeadsView<const T>::heads_major(st.q.data(), s.H, s.w, s.d);
  st.scores = engine_scores<T>(s.Hkv, s.L);
  st.in.scores = kvevict::HeadsView<const T>::heads_major(st.scores.data(), s.Hkv, s.L, 1);
  if (layout == Layout::heads_major) {
    st.k = cast_to<T>(l.k);
    st.in.keys = kvevict::kv_heads_major<const T>(st.k.data(), s.Hkv, s.L, s.d);
  } else {
    st.k = to_tokens_major(cast_to<T>(l.k), s.Hkv, s.L, s.d);
    st.in.keys = kvevict::kv_tokens_major<const T>(st.k.data(), s.L, s.Hkv, s.d);
  }
  if (with_values) {
    if (layout == Layout::heads_major) {
      st.v = cast_to<T>(l.v);
      st.in.values = kvevict::kv_heads_major<const T>(st.v.data(), s.Hkv, s.L, s.d);
    } else {
      st.v = to_tokens_major(cast_to<T>(l.v), s.Hkv, s.L, s.d);
      st.in.values = kvevict::kv_tokens_major<const T>(st.v.data(), s.L, s.Hkv, s.d);
    }
  }
  return st;
}

/// LayerInputs over precomputed attention rows `attn` [H, w, L] and keys [Hkv, L, d] (heads-major).
template <class T>
kvevict::LayerInputs<T> attention_inputs(const std::vector<T>& attn, const std::vector<T>& keys, const Shape& s) {
  kvevict::LayerInputs<T> in;
  in.attention = kvevict::HeadsView<const T>::heads_major(attn.data(), s.H, s.w, s.L);
  in.keys = kvevict::kv_heads_major<const T>(keys.data(), s.Hkv, s.L, s.d);
  return in;
}

/// The kept lists of a Selection, in the reference's form.
inline Kept kept_of(const kvevict::Selection& sel) {
  Kept out(sz(sel.heads()));
  for (kvevict::Index h = 0; h < sel.heads(); ++h)
    for (auto j : sel.head(h)) out[sz(h)].push_back(j);
  return out;
}

/// Empty when equal; otherwise the first difference, readable.
inline std::string first_difference(const Kept& got, const Kept& want) {
  std::ostringstream o;
  if (got.size() != want.size()) {
    o << "heads: got " << got.size() << ", want " << want.size();
    return o.str();
  }
  for (std::size_t h = 0; h < got.size(); ++h) {
    if (got[h] == want[h]) continue;
    o << "head " << h << ": got " << got[h].size() << " tokens, want " << want[h].size();
    const std::size_t n = std::min(got[h].size(), want[h].size());
    for (std::size_t i = 0; i < n; ++i)
      if (got[h][i] != want[h][i]) {
        o << "; first difference at position " << i << ": got " << got[h][i] << ", want " << want[h][i];
        break;
      }
    return o.str();
  }
  return {};
}

/// Empty when the selection's structure is sound: offsets[0] == 0, offsets size Hkv + 1 and non-decreasing,
/// indices of every head sorted ascending, unique and in [0, L), lengths/total/kept/mask consistent.
inline std::string structure_errors(const kvevict::Selection& sel, kvevict::Index Hkv, kvevict::Index L) {
  std::ostringstream o;
  const auto& off = sel.offsets();
  if (sel.heads() != Hkv) o << "heads " << sel.heads() << " != " << Hkv << "; ";
  if (sel.context_length() != L) o << "context_length " << sel.context_length() << " != " << L << "; ";
  if (off.size() != sz(Hkv) + 1) return o.str() + "offsets size wrong";
  if (off[0] != 0) o << "offsets[0] = " << off[0] << "; ";
  if (off.back() != static_cast<std::int64_t>(sel.indices().size())) o << "offsets.back() != indices size; ";
  if (sel.total() != static_cast<kvevict::Index>(sel.indices().size())) o << "total() != indices size; ";
  const auto lengths = sel.lengths();
  for (kvevict::Index h = 0; h < Hkv; ++h) {
    if (off[sz(h) + 1] < off[sz(h)]) o << "offsets decrease at head " << h << "; ";
    if (lengths[sz(h)] != off[sz(h) + 1] - off[sz(h)] || sel.length(h) != lengths[sz(h)])
      o << "length of head " << h << " inconsistent; ";
    const auto r = sel.head(h);
    if (r.size() != lengths[sz(h)]) o << "head(" << h << ").size() inconsistent; ";
    for (kvevict::Index i = 0; i < r.size(); ++i) {
      if (r[i] < 0 || r[i] >= L) o << "head " << h << " index " << r[i] << " out of [0, " << L << "); ";
      if (i > 0 && r[i] <= r[i - 1]) o << "head " << h << " not strictly ascending at " << i << "; ";
    }
  }
  return o.str();
}

/// Empty when mask() and kept() agree with indices() for every (head, token).
inline std::string mask_errors(const kvevict::Selection& sel) {
  const auto m = sel.mask();
  std::ostringstream o;
  if (m.rows() != sel.heads() || m.cols() != sel.context_length()) return "mask shape wrong";
  const Kept k = kept_of(sel);
  for (kvevict::Index h = 0; h < sel.heads(); ++h) {
    std::vector<bool> want(sz(sel.context_length()), false);
    for (auto j : k[sz(h)]) want[sz(j)] = true;
    for (kvevict::Index j = 0; j < sel.context_length(); ++j) {
      if (m(h, j) != want[sz(j)]) o << "mask(" << h << ", " << j << ") wrong; ";
      if (sel.kept(h, j) != want[sz(j)]) o << "kept(" << h << ", " << j << ") wrong; ";
    }
    if (!o.str().empty()) break;
  }
  return o.str();
}

/// Empty when |got - want| <= rtol |want| + atol everywhere; otherwise the worst entry.
inline std::string compare_close(const std::vector<double>& got, const std::vector<double>& want, double rtol,
                                 double atol) {
  if (got.size() != want.size()) return "sizes differ";
  double worst = 0.0;
  std::size_t at = 0;
  bool bad = false;
  for (std::size_t i = 0; i < got.size(); ++i) {
    const double err = std::fabs(got[i] - want[i]);
    const double tol = rtol * std::fabs(want[i]) + atol;
    if (!(err <= tol)) {
      const double excess = std::isfinite(err) ? err / tol : HUGE_VAL;
      if (!bad || excess > worst) {
        worst = excess;
        at = i;
      }
      bad = true;
    }
  }
  if (!bad) return {};
  std::ostringstream o;
  o.precision(17);
  o << "entry " << at << ": got " << got[at] << ", want " << want[at] << " (" << worst << " x tolerance)";
  return o.str();
}

/// Reference scores [Hkv, P] -> RowMatrix.
inline kvevict::RowMatrix<double> to_matrix(const std::vector<double>& x, int rows, int cols) {
  kvevict::RowMatrix<double> m(rows, cols);
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < cols; ++c) m(r, c) = x[sz(r) * sz(cols) + sz(c)];
  return m;
}

/// Scores quantised to `levels` distinct values (many exact ties).
inline std::vector<double> quantised_scores(std::size_t n, int levels, Rng& rng) {
  std::uniform_int_distribution<int> dist(0, levels - 1);
  std::vector<double> x(n);
  for (double& v : x) v = static_cast<double>(dist(rng)) / 8.0;
  return x;
}

/// The budgets 1, w-1, w, w+1, a random middle one and L (those that lie in [1, L]), deduplicated.
inline std::vector<std::int64_t> budget_sweep(const Shape& s, Rng& rng) {
  std::vector<std::int64_t> b = {1, s.w - 1, s.w, s.w + 1, s.L, s.L - 1};
  b.push_back(std::uniform_int_distribution<std::int64_t>(1, s.L)(rng));
  std::vector<std::int64_t> out;
  for (auto n : b)
    if (n >= 1 && n <= s.L && std::find(out.begin(), out.end(), n) == out.end()) out.push_back(n);
  return out;
}

}  // namespace kvevict_test

#endif  // KVEVICT_TESTS_SUPPORT_RANDOM_INPUTS_HPP
