#pragma once
/// What a policy reads for one layer, and the shape checks every policy runs once on it.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <type_traits>
#include <vector>

#include "kvevict/core/error.hpp"
#include "kvevict/core/quantized.hpp"
#include "kvevict/core/views.hpp"
#include "kvevict/value/output_gram.hpp"

namespace kvevict {

/// The scalar of a precomputed OutputGram for storage T: double for double storage, float otherwise.
template <class T>
using gram_scalar_t = std::conditional_t<std::is_same_v<std::remove_const_t<T>, double>, double, float>;

/// One layer's tensors, all views (nothing is copied). Each group of tensors has its own storage type (float,
/// double, Eigen::half or Eigen::bfloat16; the cache also std::int8_t, float8_e4m3 or float8_e5m2, read through
/// keys_scale and values_scale), so an fp16 KV cache can come with fp32 queries and bf16 weights:
///   KV: keys and values (the cache)    Q: queries or attention (default KV)    W: w_o (default Q)
/// Give either `queries` or `attention`:
///   queries   [H, w, head_dim]  post-RoPE queries of the window positions L-w .. L-1
///   attention [H, w, L]         full softmax rows of those queries (engines with eager attention)
///   keys      [Hkv, L, head_dim] post-RoPE keys, either KV layout (see KVView)
///   values    [Hkv, L, head_dim] values (only value-aware selectors read them; may be empty otherwise)
///   w_o       [H, D, head_dim]  the output projection W_o [D, H * head_dim] seen per query head (build it with
///                               output_projection(); only value-aware selectors read it)
///   lengths   optional, ragged caches (docs/algorithms.md#ragged): [Hkv] entries held by each KV head; head h's
///             entries are rows [0, lengths[h]) of keys and values, the rows beyond are spare capacity. Null: every
///             head holds keys.rows() entries. With lengths, attention needs >= max lengths[h] columns.
///   positions optional: original token positions [Hkv, >= L_h] of the entries (positions_heads_major() or
///             positions_tokens_major()), strictly increasing along each head; ties across heads go to the higher
///             position. Empty: entry j of every head is at position j.
///   w_o_gram  optional: OutputGram::compute(w_o), made once per model layer. The L2 value term
///             (ValueNorm::l2) then reads it instead of recomputing W_o^T W_o [d, d] per query head on every
///             select (2 H D d^2 FLOPs, as much as the value term itself at 4k tokens for Llama-3.1-8B). It must be
///             the Gram of this w_o (the library checks its shape and finiteness, not its values). A float Gram
///             used by select<double>() is widened, not recomputed.
///   accumulated optional: [Hkv, >= L_h, 1] the attention each entry has received over the steps so far
///             (accumulate_attention(), LayerBook::accumulate()); only H2OSelector reads it (docs/algorithms.md#h2o).
///             Empty: H2O scores the attention received from the window queries alone.
///   scores    optional: [Hkv, >= L_h, 1] a score per entry that the engine computed (KVzip's context
///             reconstruction, a calibrated projection, ...; docs/algorithms.md#engine-scores), stored as Q; only
///             EngineScoreSelector reads it, and it needs it.
///   keys_scale, values_scale  int8 and fp8 caches only (docs/algorithms.md#quantized): entry j of KV head h holds
///             float(stored) * (tensor * token(h, j)); the default (tensor 1, no token scales) reads the codes as
///             they are. Every stage selects exactly as on float storage holding those values.
///   retrieval_heads  optional: distinct KV heads of this layer in [0, Hkv) kept whole where the budget allows
///             (retrieval heads, docs/algorithms.md#retrieval-heads; induction_scores() finds them): every entry of
///             each enters the forced tier. Empty: none.
///   evict     false: a layer the engine keeps whole, a sliding-window or full-attention layer of a hybrid model
///             (docs/algorithms.md#hybrid-models). Only keys (with lengths and positions) are read, for the shape;
///             its Selection keeps every entry; model budgets, share = per_model and PyramidKV's schedule count the
///             evicted layers only.
template <class KV, class Q = KV, class W = Q>
struct LayerInputs {
  using kv_type = KV;
  using query_type = Q;
  using weight_type = W;

  HeadsView<const Q> queries;
  HeadsView<const Q> attention;
  KVView<const KV> keys;
  KVView<const KV> values;
  HeadsView<const W> w_o;
  const OutputGram<gram_scalar_t<W>>* w_o_gram = nullptr;
  const std::int64_t* lengths = nullptr;
  PositionsView positions;
  HeadsView<const float> accumulated;
  KVScale keys_scale, values_scale;
  HeadsView<const Q> scores;
  bool evict = true;
  std::vector<Index> retrieval_heads;
};

}  // namespace kvevict

namespace kvevict::extend {

/// The dimensions of one layer after validation. On a ragged layer (docs/algorithms.md#ragged) `tokens` and
/// `prefix` are the longest head's, and length(h) / prefix_of(h) each head's own.
struct LayerShape {
  Index query_heads = 0;       ///< H
  Index kv_heads = 0;          ///< Hkv
  Index group = 0;             ///< G = H / Hkv
  Index tokens = 0;            ///< L (the longest head's L_h)
  Index window = 0;            ///< w
  Index prefix = 0;            ///< P = L - w
  Index head_dim = 0;          ///< d
  std::vector<Index> lengths;  ///< L_h [Hkv] when the heads hold different numbers of entries; empty: all L
  PositionsView positions;     ///< original positions [Hkv, >= L_h]; empty: entry j is at position j

  /// L_h, the entries of KV head h.
  Index length(Index h) const { return lengths.empty() ? tokens : lengths[static_cast<std::size_t>(h)]; }
  /// P_h = L_h - w.
  Index prefix_of(Index h) const { return length(h) - window; }
  /// Whether the heads hold different numbers of entries.
  bool ragged() const { return !lengths.empty(); }
  /// The sum of L_h over KV heads.
  Index entries() const {
    if (lengths.empty()) return kv_heads * tokens;
    Index n = 0;
    for (Index l : lengths) n += l;
    return n;
  }
  /// The original position of entry j of KV head h.
  std::int64_t position(Index h, Index j) const { return positions.heads() > 0 ? *positions.row(h, j) : j; }
};

}  // namespace kvevict::extend

namespace kvevict::detail {

/// Per-head lengths [Hkv] of a ragged layer into `s` (kept only when they differ; s.tokens becomes the longest).
inline void read_lengths(const std::int64_t* lengths, Index capacity, extend::LayerShape& s, const char* where) {
  Index longest = 0;
  bool equal = true;
  for (Index h = 0; h < s.kv_heads; ++h) {
    const auto l = static_cast<Index>(lengths[h]);
    require(l >= 1 && l <= capacity, where, "lengths[", h, "] must be in [1, ", capacity,
            "] (the keys' rows, the capacity), got ", lengths[h]);
    longest = std::max(longest, l);
    equal = equal && l == static_cast<Index>(lengths[0]);
  }
  s.tokens = longest;
  if (!equal) s.lengths.assign(lengths, lengths + s.kv_heads);
}

/// Checks the positions view [Hkv, >= L_h, 1] (strictly increasing along each head) and stores it in `s`.
inline void read_positions(const PositionsView& pos, extend::LayerShape& s, const char* where) {
  require(pos.heads() == s.kv_heads && pos.cols() == 1 && pos.rows() >= s.tokens, where, "positions [", pos.heads(),
          ", ", pos.rows(), ", ", pos.cols(), "] must be [kv_heads = ", s.kv_heads, ", >= ", s.tokens,
          " entries] (one column)");
  for (Index h = 0; h < s.kv_heads; ++h)
    for (Index j = 1; j < s.length(h); ++j)
      require(*pos.row(h, j) > *pos.row(h, j - 1), where, "positions of KV head ", h,
              " must be strictly increasing, got ", *pos.row(h, j - 1), " then ", *pos.row(h, j), " at entry ", j);
  s.positions = pos;
}

/// The entries of a layer: keys [Hkv, capacity, d], lengths and positions (docs/algorithms.md#ragged), checked;
/// all a positional policy (StreamingLLM) reads. O(1), or O(sum of L_h) with positions.
template <class KV, class Q, class W>
extend::LayerShape read_entries(const LayerInputs<KV, Q, W>& in, const char* where) {
  require(in.keys.heads() >= 1 && in.keys.rows() >= 1 && in.keys.cols() >= 1, where,
          "keys must be a non-empty [kv_heads, tokens, head_dim] view, got [", in.keys.heads(), ", ", in.keys.rows(),
          ", ", in.keys.cols(), "]");
  extend::LayerShape s;
  s.kv_heads = in.keys.heads();
  s.tokens = in.keys.rows();
  s.head_dim = in.keys.cols();
  if (in.lengths) read_lengths(in.lengths, in.keys.rows(), s, where);
  if (in.positions.heads() * in.positions.rows() * in.positions.cols() > 0) read_positions(in.positions, s, where);
  return s;
}

/// A quantized cache's scale (docs/algorithms.md#quantized): a finite tensor factor, token factors [Hkv, >= L, 1].
/// Any other cache takes none.
inline void require_scale(const KVScale& scale, bool quantized, const extend::LayerShape& s, const char* name,
                          const char* where) {
  require(quantized || !scale.given(), where, name, "_scale is for int8 and fp8 caches; ", name,
          " stored as float, double, half or bfloat16 are read as they are (leave the scale at its default)");
  require(std::isfinite(scale.tensor), where, name, "_scale.tensor must be finite, got ", scale.tensor);
  if (!scale.has_token()) return;
  require(scale.token.heads() == s.kv_heads && scale.token.rows() >= s.tokens && scale.token.cols() == 1, where, name,
          "_scale.token [", scale.token.heads(), ", ", scale.token.rows(), ", ", scale.token.cols(),
          "] must be [kv_heads, >= tokens, 1] = [", s.kv_heads, ", >= ", s.tokens,
          ", 1] (per_token_scales() or per_head_token_scales())");
}

/// The observation's part of validate_inputs: queries [H, w, d] or attention [H, w, >= L] against `s` (sets
/// query_heads and group).
template <class KV, class Q, class W>
void validate_observation(const LayerInputs<KV, Q, W>& in, bool has_q, extend::LayerShape& s, const char* where) {
  const Index window = s.window;
  const HeadsView<const Q>& obs = has_q ? in.queries : in.attention;
  const char* obs_name = has_q ? "queries" : "attention";
  s.query_heads = obs.heads();
  require(s.query_heads % s.kv_heads == 0, where, obs_name, " heads (", s.query_heads,
          ") must be a multiple of the KV heads (", s.kv_heads, ")");
  s.group = s.query_heads / s.kv_heads;
  require(obs.rows() == window, where, obs_name, " rows (", obs.rows(), ") must equal the window (", window, ")");
  if (has_q)
    require(in.queries.cols() == s.head_dim, where, "queries head_dim (", in.queries.cols(),
            ") must equal the keys head_dim (", s.head_dim, ")");
  else if (in.lengths)
    require(in.attention.cols() >= s.tokens, where, "attention columns (", in.attention.cols(),
            ") must cover the longest head (", s.tokens, " entries)");
  else
    require(in.attention.cols() == s.tokens, where, "attention columns (", in.attention.cols(),
            ") must equal the context length (", s.tokens, ")");
}

/// Checks `in` against the rules of docs/algorithms.md#setting (and docs/algorithms.md#ragged for ragged layers) for
/// a window of `window` queries; O(1), or O(sum of L_h) with positions. With needs_observation false (key-only
/// selectors) the queries and attention are not read, nor checked: the shape has query_heads = kv_heads, group 1.
template <class KV, class Q, class W>
extend::LayerShape validate_inputs(const LayerInputs<KV, Q, W>& in, Index window, const char* where,
                                   bool needs_observation = true) {
  const bool has_q = in.queries.heads() * in.queries.rows() * in.queries.cols() > 0;
  const bool has_a = in.attention.heads() * in.attention.rows() * in.attention.cols() > 0;
  extend::LayerShape s = read_entries(in, where);
  require(!needs_observation || has_q != has_a, where,
          "exactly one of queries [H, w, head_dim] and attention [H, w, L] must be given, got ",
          has_q ? "both" : "neither");
  s.window = window;
  require(window >= (needs_observation ? 1 : 0), where, "window must be >= ", needs_observation ? 1 : 0, ", got ",
          window);
  if (s.ragged()) {
    for (Index h = 0; h < s.kv_heads; ++h)
      require(window < s.length(h), where, "window (", window, ") must be smaller than the entries of KV head ", h,
              " (", s.length(h), ")");
  } else {
    require(window < s.tokens, where, "window (", window, ") must be smaller than the context length (", s.tokens, ")");
  }
  s.prefix = s.tokens - window;
  if (needs_observation) {
    validate_observation(in, has_q, s, where);
  } else {  // key-only: queries or attention, if given, are not read
    s.query_heads = s.kv_heads;
    s.group = 1;
  }
  for (std::size_t i = 0; i < in.retrieval_heads.size(); ++i) {
    const Index h = in.retrieval_heads[i];
    require(h >= 0 && h < s.kv_heads, where, "retrieval_heads names KV head ", h,
            ", expected a KV head of the layer in [0, ", s.kv_heads, ")");
    for (std::size_t k = 0; k < i; ++k)
      require(in.retrieval_heads[k] != h, where, "retrieval_heads names KV head ", h,
              " twice, expected distinct heads");
  }
  require_scale(in.keys_scale, is_quantized_v<KV>, s, "keys", where);
  require_scale(in.values_scale, is_quantized_v<KV>, s, "values", where);
  const bool has_v = in.values.heads() * in.values.rows() * in.values.cols() > 0;
  if (has_v && in.lengths)
    require(in.values.heads() == s.kv_heads && in.values.rows() >= s.tokens, where, "values [", in.values.heads(), ", ",
            in.values.rows(), ", ", in.values.cols(), "] must have the keys' KV heads (", s.kv_heads,
            ") and hold the longest head (", s.tokens, " entries)");
  else if (has_v)
    require(in.values.heads() == s.kv_heads && in.values.rows() == s.tokens, where, "values [", in.values.heads(), ", ",
            in.values.rows(), ", ", in.values.cols(), "] must have the keys' KV heads (", s.kv_heads, ") and tokens (",
            s.tokens, ")");
  return s;
}

/// reference_quirks reproduces the reference code, which has no ragged caches (docs/algorithms.md#ragged).
inline void require_dense_for_quirks(const extend::LayerShape& s, bool reference_quirks, const char* where) {
  if (!reference_quirks || !s.ragged()) return;
  Index h = 1;
  while (s.length(h) == s.length(0)) ++h;
  require(false, where, "reference_quirks needs every KV head to hold the same number of entries (the reference has ",
          "no ragged caches), got ", s.length(0), " in KV head 0 and ", s.length(h), " in KV head ", h);
}

}  // namespace kvevict::detail
