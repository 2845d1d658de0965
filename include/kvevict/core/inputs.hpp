#pragma once
/// What a policy reads for one layer, and the shape checks every policy runs once on it.

#include <cstdint>
#include <type_traits>

#include "kvevict/core/error.hpp"
#include "kvevict/core/views.hpp"
#include "kvevict/value/output_gram.hpp"

namespace kvevict {

/// The scalar of a precomputed OutputGram for storage T: double for double storage, float otherwise.
template <class T>
using gram_scalar_t = std::conditional_t<std::is_same_v<std::remove_const_t<T>, double>, double, float>;

/// One layer's tensors, all views (nothing is copied). Each group of tensors has its own storage type (float,
/// double, Eigen::half or Eigen::bfloat16), so an fp16 KV cache can come with fp32 queries and bf16 weights:
///   KV: keys and values (the cache)    Q: queries or attention (default KV)    W: w_o (default Q)
/// Give either `queries` or `attention`:
///   queries   [H, w, head_dim]  post-RoPE queries of the window positions L-w .. L-1
///   attention [H, w, L]         full softmax rows of those queries (engines with eager attention)
///   keys      [Hkv, L, head_dim] post-RoPE keys, either KV layout (see KVView)
///   values    [Hkv, L, head_dim] values (only value-aware selectors read them; may be empty otherwise)
///   w_o       [H, D, head_dim]  the output projection W_o [D, H * head_dim] seen per query head (build it with
///                               output_projection(); only value-aware selectors read it)
///   w_o_gram  optional: OutputGram::compute(w_o), made once per model layer. The L2 value term
///             (ValueNorm::l2) then reads it instead of recomputing W_o^T W_o [d, d] per query head on every
///             select (2 H D d^2 FLOPs, as much as the value term itself at 4k tokens for Llama-3.1-8B). It must be
///             the Gram of this w_o (the library checks its shape and finiteness, not its values). A float Gram
///             used by select<double>() is widened, not recomputed.
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
};

}  // namespace kvevict

namespace kvevict::extend {

/// The dimensions of one layer after validation.
struct LayerShape {
  Index query_heads = 0;  ///< H
  Index kv_heads = 0;     ///< Hkv
  Index group = 0;        ///< G = H / Hkv
  Index tokens = 0;       ///< L
  Index window = 0;       ///< w
  Index prefix = 0;       ///< P = L - w
  Index head_dim = 0;     ///< d
};

}  // namespace kvevict::extend

namespace kvevict::detail {

/// Checks `in` against the rules of docs/algorithms.md section 1 for a window of `window` queries; O(1).
template <class KV, class Q, class W>
extend::LayerShape validate_inputs(const LayerInputs<KV, Q, W>& in, Index window, const char* where) {
  const bool has_q = in.queries.heads() * in.queries.rows() * in.queries.cols() > 0;
  const bool has_a = in.attention.heads() * in.attention.rows() * in.attention.cols() > 0;
  require(in.keys.heads() >= 1 && in.keys.rows() >= 1 && in.keys.cols() >= 1, where,
          "keys must be a non-empty [kv_heads, tokens, head_dim] view, got [", in.keys.heads(), ", ", in.keys.rows(),
          ", ", in.keys.cols(), "]");
  require(has_q != has_a, where, "exactly one of queries [H, w, head_dim] and attention [H, w, L] must be given, got ",
          has_q ? "both" : "neither");
  extend::LayerShape s;
  s.kv_heads = in.keys.heads();
  s.tokens = in.keys.rows();
  s.head_dim = in.keys.cols();
  s.window = window;
  require(window >= 1, where, "window must be >= 1, got ", window);
  require(window < s.tokens, where, "window (", window, ") must be smaller than the context length (", s.tokens, ")");
  s.prefix = s.tokens - window;
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
  else
    require(in.attention.cols() == s.tokens, where, "attention columns (", in.attention.cols(),
            ") must equal the context length (", s.tokens, ")");
  const bool has_v = in.values.heads() * in.values.rows() * in.values.cols() > 0;
  if (has_v)
    require(in.values.heads() == s.kv_heads && in.values.rows() == s.tokens, where, "values [", in.values.heads(), ", ",
            in.values.rows(), ", ", in.values.cols(), "] must have the keys' KV heads (", s.kv_heads, ") and tokens (",
            s.tokens, ")");
  return s;
}

}  // namespace kvevict::detail
