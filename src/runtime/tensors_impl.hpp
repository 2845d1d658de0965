#pragma once
// The input contract, written once (tensors.hpp): select_storage<KV>: raw C tensors (any dtype, any strides) to
// kvevict::LayerInputs<KV, S, S> and the selections of the policy. Keys and values are read in place whenever the
// library can view them (innermost stride 1, row stride
// >= the row's length, head stride >= 0) and copied otherwise; queries, attention and W_o are read in place when
// stored in the arithmetic type S, converted to S otherwise (they are small next to the cache, except W_o, which
// only value-aware policies read).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "run_policy.hpp"
#include "tensors.hpp"

namespace kvevict::runtime {

inline const char* dtype_name(std::int32_t dt) {
  switch (dt) {
    case KVEVICT_F32:
      return "f32";
    case KVEVICT_F64:
      return "f64";
    case KVEVICT_F16:
      return "f16";
    case KVEVICT_BF16:
      return "bf16";
    case KVEVICT_I8:
      return "i8";
    case KVEVICT_F8_E4M3:
      return "f8_e4m3";
    case KVEVICT_F8_E5M2:
      return "f8_e5m2";
  }
  return "unknown";
}

template <class T>
constexpr kvevict_dtype dtype_of() {
  if constexpr (std::is_same_v<T, float>)
    return KVEVICT_F32;
  else if constexpr (std::is_same_v<T, double>)
    return KVEVICT_F64;
  else if constexpr (std::is_same_v<T, Eigen::half>)
    return KVEVICT_F16;
  else if constexpr (std::is_same_v<T, Eigen::bfloat16>)
    return KVEVICT_BF16;
  else if constexpr (std::is_same_v<T, std::int8_t>)
    return KVEVICT_I8;
  else if constexpr (std::is_same_v<T, float8_e4m3>)
    return KVEVICT_F8_E4M3;
  else
    return KVEVICT_F8_E5M2;
}

inline bool is_code_dtype(std::int32_t dt) {
  return dt == KVEVICT_I8 || dt == KVEVICT_F8_E4M3 || dt == KVEVICT_F8_E5M2;
}

/// Element `offset` (in elements) of `base`, stored as `dt`, as T (a quantized T: the code itself, dt being T's).
template <class T>
T read_element(std::int32_t dt, const void* base, std::int64_t offset) {
  if constexpr (is_quantized_v<T>) {
    return static_cast<const T*>(base)[offset];
  } else {
    switch (dt) {
      case KVEVICT_F64:
        return static_cast<T>(static_cast<const double*>(base)[offset]);
      case KVEVICT_F16:
        return static_cast<T>(static_cast<float>(static_cast<const Eigen::half*>(base)[offset]));
      case KVEVICT_BF16:
        return static_cast<T>(static_cast<float>(static_cast<const Eigen::bfloat16*>(base)[offset]));
      case KVEVICT_F32:
        break;
    }
    return static_cast<T>(static_cast<const float*>(base)[offset]);
  }
}

/// Checks a present tensor's dtype, rank and extents (the caller vouches for the memory its shape and strides
/// address). `name` is e.g. "layers[0].keys", `dims` the expected shape in words; `codes`: whether the quantized
/// dtypes (the cache's keys and values only) are allowed.
inline void check_tensor(const kvevict_tensor& t, int rank, const std::string& name, const char* dims,
                         bool codes = false) {
  const bool floating =
      t.dtype == KVEVICT_F32 || t.dtype == KVEVICT_F64 || t.dtype == KVEVICT_F16 || t.dtype == KVEVICT_BF16;
  if (!floating && !(codes && is_code_dtype(t.dtype))) {
    const std::string expected = codes ? "KVEVICT_F32, KVEVICT_F64, KVEVICT_F16, KVEVICT_BF16, KVEVICT_I8, "
                                         "KVEVICT_F8_E4M3 or KVEVICT_F8_E5M2"
                                       : "KVEVICT_F32, KVEVICT_F64, KVEVICT_F16 or KVEVICT_BF16";
    throw invalid_argument(name +
                           (is_code_dtype(t.dtype) ? " is " + std::string(dtype_name(t.dtype)) +
                                                         ": quantized codes are for the keys and values only"
                                                   : ": unknown dtype " + std::to_string(t.dtype)) +
                           "; expected " + expected);
  }
  if (t.rank != rank)
    throw invalid_argument(name + " has rank " + std::to_string(t.rank) + "; expected rank " + std::to_string(rank) +
                           " " + dims);
  std::int64_t elements = 1;
  for (int i = 0; i < rank; ++i) {
    if (t.shape[i] < 1)
      throw invalid_argument(name + " has extent " + std::to_string(t.shape[i]) + " in dimension " + std::to_string(i) +
                             "; expected " + dims + " with every extent >= 1");
    if (t.shape[i] > (std::int64_t{1} << 40) || elements > std::numeric_limits<std::int64_t>::max() / t.shape[i])
      throw invalid_argument(name + " is too large: extent " + std::to_string(t.shape[i]) + " in dimension " +
                             std::to_string(i));
    elements *= t.shape[i];
  }
}

/// A tensor as the library views it: [heads, rows, cols] at (head_stride, row_stride), unit stride along cols,
/// either in the caller's memory or in `copy`.
template <class T>
struct Held {
  std::vector<T> copy;
  const T* data = nullptr;
  Index heads = 0, rows = 0, cols = 0, head_stride = 0, row_stride = 0;
  HeadsView<const T> view() const { return HeadsView<const T>(data, heads, rows, cols, head_stride, row_stride); }
};

/// Views a rank-3 tensor [heads, rows, cols] (or, for W_o, the rank-2 [D, H * d] as [H, D, d]) as T.
template <class T>
Held<T> hold(const kvevict_tensor& t, Index heads, Index rows, Index cols, Index head_stride, Index row_stride,
             Index col_stride) {
  Held<T> h;
  h.heads = heads, h.rows = rows, h.cols = cols;
  if (t.dtype == dtype_of<T>() && col_stride == 1 && row_stride >= cols && head_stride >= 0) {
    h.data = static_cast<const T*>(t.data);
    h.head_stride = head_stride, h.row_stride = row_stride;
    return h;
  }
  h.copy.resize(static_cast<std::size_t>(heads * rows * cols));
  std::size_t i = 0;
  for (Index a = 0; a < heads; ++a)
    for (Index r = 0; r < rows; ++r)
      for (Index c = 0; c < cols; ++c)
        h.copy[i++] = read_element<T>(t.dtype, t.data, a * head_stride + r * row_stride + c * col_stride);
  h.data = h.copy.data();
  h.head_stride = rows * cols, h.row_stride = cols;
  return h;
}

template <class T>
Held<T> hold3(const kvevict_tensor& t) {
  return hold<T>(t, t.shape[0], t.shape[1], t.shape[2], t.strides[0], t.strides[1], t.strides[2]);
}

inline std::string shape_str(const kvevict_tensor& t) {
  std::string s = "[";
  for (int i = 0; i < t.rank && i < 3; ++i) s += (i ? ", " : "") + std::to_string(t.shape[i]);
  return s + "]";
}

/// One layer's tensors as the library reads them.
template <class KV, class S>
struct LayerHold {
  Held<KV> keys, values;
  Held<S> observation, w_o, scores;  // scores: [Hkv, L, 1]
  std::vector<std::int64_t> positions;
  std::vector<float> keys_scale, values_scale;  // token factors, [Hkv, L] or [L]
  LayerInputs<KV, S, S> inputs;
};

/// The dequantisation scale of a quantized cache tensor [Hkv, L, d] from its F32 scale tensor `t` (present):
/// [] (or [1]) one factor, [L] one per token, [Hkv, L] one per KV head and token (copied into `token`, any strides).
/// `name` is e.g. "layers[0].keys_scale".
inline KVScale scale_factors(const kvevict_tensor& t, Index Hkv, Index L, std::vector<float>& token,
                             const std::string& name) {
  KVScale scale;
  const std::string dims = "[] (one factor), [" + std::to_string(L) + "] (one per token) or [" + std::to_string(Hkv) +
                           ", " + std::to_string(L) + "] (one per KV head and token)";
  if (t.dtype != KVEVICT_F32)
    throw invalid_argument(name + " is " + dtype_name(t.dtype) + "; expected F32 dequantisation factors " + dims);
  if (t.rank < 0 || t.rank > 2)
    throw invalid_argument(name + " has rank " + std::to_string(t.rank) + "; expected " + dims);
  const auto* data = static_cast<const float*>(t.data);
  const auto require_finite = [&](float f, const std::string& at) {
    if (!std::isfinite(f))
      throw invalid_argument(detail::concat(name, at, " is ", f, "; expected finite dequantisation factors"));
  };
  if (t.rank == 0 || (t.rank == 1 && t.shape[0] == 1)) {  // [1] too, as kvevict-select reads it
    require_finite(data[0], "");
    scale.tensor = data[0];
    return scale;
  }
  const bool per_head = t.rank == 2;
  if (t.shape[0] != (per_head ? Hkv : L) || (per_head && t.shape[1] != L)) {
    std::string got = "[" + std::to_string(t.shape[0]) + (per_head ? ", " + std::to_string(t.shape[1]) : "") + "]";
    throw invalid_argument(name + " has shape " + got + "; expected " + dims);
  }
  token.resize(static_cast<std::size_t>(per_head ? Hkv * L : L));
  for (Index a = 0; a < (per_head ? Hkv : 1); ++a)
    for (Index j = 0; j < L; ++j)
      require_finite(token[static_cast<std::size_t>(a * L + j)] =
                         per_head ? data[a * t.strides[0] + j * t.strides[1]] : data[j * t.strides[0]],
                     "[" + (per_head ? std::to_string(a) + ", " : std::string()) + std::to_string(j) + "]");
  scale.token = per_head ? per_head_token_scales(token.data(), Hkv, L) : per_token_scales(token.data(), Hkv, L);
  return scale;
}

/// The scale `t` (layer `in`'s keys_scale or values_scale, named `name`) of a cache stored as KV: none when absent,
/// refused for a floating cache.
template <class KV>
KVScale scale_of(const kvevict_layer& in, const kvevict_tensor& t, Index Hkv, Index L, std::vector<float>& token,
                 const std::string& name) {
  if (!t.data) return {};
  if constexpr (!is_quantized_v<KV>) {
    throw invalid_argument(name + " is given and the cache is " + dtype_name(in.keys.dtype) +
                           "; expected scales only for quantized caches (KVEVICT_I8, KVEVICT_F8_E4M3, "
                           "KVEVICT_F8_E5M2)");
  } else {
    return scale_factors(t, Hkv, L, token, name);
  }
}

/// Checks layer `at`'s keys (present, [Hkv, L, d], stored as KV) and its values when present (the keys' dtype, Hkv
/// and L).
template <class KV>
void check_cache(const kvevict_layer& in, const std::string& at, TensorNames names) {
  if (!in.keys.data) throw invalid_argument(at + "keys is missing; expected [kv_heads, tokens, head_dim]");
  check_tensor(in.keys, 3, at + "keys", "[kv_heads, tokens, head_dim]", true);
  if (in.keys.dtype != dtype_of<KV>())
    throw invalid_argument(at + "keys are " + dtype_name(in.keys.dtype) + "; expected " + dtype_name(dtype_of<KV>()) +
                           " like " + layer_prefix(names, 0) + "keys (one cache dtype for every layer)");
  if (!in.values.data) return;
  check_tensor(in.values, 3, at + "values", "[kv_heads, tokens, head_dim]", true);
  if (in.values.dtype != in.keys.dtype)
    throw invalid_argument(at + "values are " + dtype_name(in.values.dtype) + " and keys " + dtype_name(in.keys.dtype) +
                           "; expected one dtype for both");
  if (in.values.shape[0] != in.keys.shape[0] || in.values.shape[1] != in.keys.shape[1])
    throw invalid_argument(at + "values have shape " + shape_str(in.values) + "; expected [" +
                           std::to_string(in.keys.shape[0]) + ", " + std::to_string(in.keys.shape[1]) +
                           ", head_dim] like the keys");
}

template <class KV, class S>
std::vector<Selection> select_typed(const Options& options, const kvevict_layer* layers, std::size_t n_layers,
                                    TensorNames names) {
  std::optional<Index> window = options.knobs.window;
  std::vector<LayerHold<KV, S>> held(n_layers);  // never resized: the views point into these
  std::vector<LayerInputs<KV, S, S>> inputs;
  if (!options.shard && !options.keep_whole.empty() && options.keep_whole.back() >= static_cast<Index>(n_layers))
    throw invalid_argument("the layers kept whole name layer " + std::to_string(options.keep_whole.back()) +
                           "; the model has " + std::to_string(n_layers) + " layers");
  if (!options.shard && !options.retrieval_heads.empty() &&
      options.retrieval_heads.back().first >= static_cast<Index>(n_layers))
    throw invalid_argument("the retrieval heads name layer " + std::to_string(options.retrieval_heads.back().first) +
                           "; the model has " + std::to_string(n_layers) + " layers");
  for (std::size_t l = 0; l < n_layers; ++l) {
    const kvevict_layer& in = layers[l];
    // A layer kept whole (docs/algorithms.md#hybrid-models) is read for its keys' shape only.
    const bool whole = options.keeps_whole(options.shard ? options.shard->layers[l] : static_cast<Index>(l));
    LayerHold<KV, S>& h = held[l];
    const std::string at = layer_prefix(names, l);
    check_cache<KV>(in, at, names);
    const Index Hkv = in.keys.shape[0], L = in.keys.shape[1];
    h.keys = hold3<KV>(in.keys);
    h.inputs.keys = h.keys.view();
    if (in.values.data) {
      h.values = hold3<KV>(in.values);
      h.inputs.values = h.values.view();
    }
    const KVScale keys_scale = scale_of<KV>(in, in.keys_scale, Hkv, L, h.keys_scale, at + "keys_scale");
    const KVScale values_scale = scale_of<KV>(in, in.values_scale, Hkv, L, h.values_scale, at + "values_scale");
    if constexpr (is_quantized_v<KV>) {
      h.inputs.keys_scale = keys_scale;
      h.inputs.values_scale = values_scale;
    }
    if (in.q_window.data && in.window_attention.data)
      throw invalid_argument(at + "q_window and " + at + "window_attention are both given; expected exactly one");
    const bool queries = in.q_window.data != nullptr;
    const kvevict_tensor* obs = queries ? &in.q_window : in.window_attention.data ? &in.window_attention : nullptr;
    if (!obs && options.reads_observation && !whole)
      throw invalid_argument(at + "q_window [heads, window, head_dim] (or " + at +
                             "window_attention [heads, window, tokens]) is missing; the " + options.policy +
                             " policy needs it");
    if (obs && options.reads_observation && !whole) {
      check_tensor(*obs, 3, at + (queries ? "q_window" : "window_attention"),
                   queries ? "[heads, window, head_dim]" : "[heads, window, tokens]");
      h.observation = hold3<S>(*obs);
      (queries ? h.inputs.queries : h.inputs.attention) = h.observation.view();
      if (!window) window = obs->shape[1];
      if (*window != obs->shape[1])
        throw invalid_argument("window " + std::to_string(*window) + " does not match the " +
                               std::to_string(obs->shape[1]) + " rows of " + at +
                               (queries ? "q_window" : "window_attention"));
      if (options.reads_values) {
        if (!in.values.data)
          throw invalid_argument(at + "values [kv_heads, tokens, head_dim] is missing; the " + options.policy +
                                 " policy needs it");
        if (!in.w_o.data)
          throw invalid_argument(at + "w_o [hidden, heads * head_dim] is missing; the " + options.policy +
                                 " policy needs it");
        check_tensor(in.w_o, 2, at + "w_o", "[hidden, heads * head_dim]");
        const Index H = obs->shape[0], dv = in.values.shape[2];
        if (in.w_o.shape[1] != H * dv)
          throw invalid_argument(at + "w_o has shape " + shape_str(in.w_o) + "; expected [hidden, " +
                                 std::to_string(H * dv) + "] (heads * head_dim)");
        h.w_o = hold<S>(in.w_o, H, in.w_o.shape[0], dv, dv * in.w_o.strides[1], in.w_o.strides[0], in.w_o.strides[1]);
        h.inputs.w_o = h.w_o.view();
      }
    }
    if (options.reads_scores && !whole) {
      if (!in.scores.data)
        throw invalid_argument(at + "scores [kv_heads, tokens] is missing; the " + options.policy +
                               " policy ranks the score the engine computed for each entry");
      check_tensor(in.scores, 2, at + "scores", "[kv_heads, tokens]");
      if (in.scores.shape[0] != Hkv || in.scores.shape[1] != L)
        throw invalid_argument(at + "scores has shape " + shape_str(in.scores) + "; expected [" + std::to_string(Hkv) +
                               ", " + std::to_string(L) + "] (kv_heads, tokens) like the keys");
      h.scores = hold<S>(in.scores, Hkv, L, 1, in.scores.strides[0], in.scores.strides[1], 1);
      h.inputs.scores = h.scores.view();
    }
    h.inputs.lengths = in.lengths;
    if (in.positions) {
      const std::int64_t s0 = in.positions_strides[0], s1 = in.positions_strides[1];
      if (s0 == 0 && s1 == 0)
        throw invalid_argument(at + "positions_strides are {0, 0}: set them to the positions' strides in elements ({" +
                               std::to_string(L) + ", 1} for [kv_heads, tokens] storage, {1, " + std::to_string(Hkv) +
                               "} for [tokens, kv_heads])");
      if (s1 >= 1 && s0 >= 0) {
        h.inputs.positions = PositionsView(in.positions, Hkv, L, 1, s0, s1);
      } else {
        h.positions.resize(static_cast<std::size_t>(Hkv * L));
        for (Index a = 0; a < Hkv; ++a)
          for (Index r = 0; r < L; ++r)
            h.positions[static_cast<std::size_t>(a * L + r)] = in.positions[a * s0 + r * s1];
        h.inputs.positions = positions_heads_major(h.positions.data(), Hkv, L);
      }
    }
    h.inputs.evict = !whole;
    // Retrieval heads (docs/algorithms.md#retrieval-heads) name global KV heads; a rank's inputs hold shard->kv_heads.
    for (Index g : options.retrieval_heads_of(options.shard ? options.shard->layers[l] : static_cast<Index>(l))) {
      Index local = g;
      if (options.shard) {
        const auto& held_heads = options.shard->kv_heads;
        const auto it = std::find(held_heads.begin(), held_heads.end(), g);
        if (it == held_heads.end()) continue;  // another rank's head
        local = static_cast<Index>(it - held_heads.begin());
      }
      h.inputs.retrieval_heads.push_back(local);
    }
    inputs.push_back(h.inputs);
  }
  return run_policy<S>(options, inputs, window);
}

/// Keys or values `t` [Hkv, L, d] stored as KV (checked by the caller) as F64 values, in `out`: what select<double>
/// reads from them. A floating value is widened exactly; a quantized row [h, j] is float(code) * factor(h, j) in
/// float, as the library dequantizes it, then widened (a NaN code or a factor that overflows a value is named here,
/// as the library names it).
template <class KV>
kvevict_tensor widened_f64(const kvevict_tensor& t, const KVScale& scale, std::vector<double>& out,
                           const std::string& name) {
  const Index Hkv = t.shape[0], L = t.shape[1], d = t.shape[2];
  if constexpr (!is_quantized_v<KV>) {
    out = hold3<double>(t).copy;  // KV is not double: always a contiguous copy
  } else {
    const Held<KV> codes = hold3<KV>(t);
    out.resize(static_cast<std::size_t>(Hkv * L * d));
    std::vector<float> row(static_cast<std::size_t>(d));
    for (Index h = 0; h < Hkv; ++h) {
      const detail::RowScale factor = detail::row_scale(scale, h);
      for (Index j = 0; j < L; ++j) {
        detail::dequantize(codes.view().row(h, j), factor(j), row.data(), d);
        for (Index c = 0; c < d; ++c)
          if (!std::isfinite(row[static_cast<std::size_t>(c)]))
            throw invalid_argument(detail::concat(name, "[", h, ", ", j, ", ", c, "] is not finite (",
                                                  row[static_cast<std::size_t>(c)], " = stored ",
                                                  static_cast<float>(codes.view().row(h, j)[c]), " x scale ", factor(j),
                                                  "); the inputs contain NaN or Inf values"));
        std::copy(row.begin(), row.end(), out.begin() + (h * L + j) * d);
      }
    }
  }
  kvevict_tensor wide{};
  wide.data = out.data();
  wide.dtype = KVEVICT_F64;
  wide.rank = 3;
  wide.shape[0] = Hkv, wide.shape[1] = L, wide.shape[2] = d;
  wide.strides[0] = L * d, wide.strides[1] = d, wide.strides[2] = 1;
  return wide;
}

/// The selections of the layers, whose keys (and values) are stored as KV. At precision f32 the cache is read as
/// stored (in place where the library can view it). At f64, a reference precision, a cache stored in any other type
/// than double is widened into F64 copies first (widened_f64: what select<double> reads from it, so the selection is
/// the same), so that tensors_f64.cpp's instances serve every dtype: one instance per dtype instead of two.
template <class KV>
std::vector<Selection> select_storage(const Options& options, const Budget& budget, const kvevict_layer* layers,
                                      std::size_t n_layers, TensorNames names) {
  Options o = options;
  o.budget = budget;
  if constexpr (std::is_same_v<KV, double>) {
    return options.precision == "f64" ? select_typed<double, double>(o, layers, n_layers, names)
                                      : select_typed<double, float>(o, layers, n_layers, names);
  } else {
    if (options.precision != "f64") return select_typed<KV, float>(o, layers, n_layers, names);
    std::vector<kvevict_layer> copies(layers, layers + n_layers);
    std::vector<std::vector<double>> widened(2 * n_layers);  // layer l's keys at 2l, its values at 2l + 1
    for (std::size_t l = 0; l < n_layers; ++l) {
      const kvevict_layer& in = layers[l];
      const std::string at = layer_prefix(names, l);
      check_cache<KV>(in, at, names);
      const Index Hkv = in.keys.shape[0], L = in.keys.shape[1];
      std::vector<float> token;
      const KVScale keys_scale = scale_of<KV>(in, in.keys_scale, Hkv, L, token, at + "keys_scale");
      copies[l].keys = widened_f64<KV>(in.keys, keys_scale, widened[2 * l], at + "keys");
      const KVScale values_scale = scale_of<KV>(in, in.values_scale, Hkv, L, token, at + "values_scale");
      if (in.values.data)
        copies[l].values = widened_f64<KV>(in.values, values_scale, widened[2 * l + 1], at + "values");
      copies[l].keys_scale.data = copies[l].values_scale.data = nullptr;
    }
    return select_storage<double>(options, budget, copies.data(), n_layers, names);  // tensors_f64.cpp's instance
  }
}

}  // namespace kvevict::runtime
