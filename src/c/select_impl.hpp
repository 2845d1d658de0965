#pragma once
// select_storage<KV>: raw C tensors (any dtype, any strides) to kvevict::LayerInputs<KV, S, S> and the selections of
// the policy. Keys and values are read in place whenever the library can view them (innermost stride 1, row stride
// >= the row's length, head stride >= 0) and copied otherwise; queries, attention and W_o are read in place when
// stored in the arithmetic type S, converted to S otherwise (they are small next to the cache, except W_o, which
// only value-aware policies read).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <optional>
#include <string>
#include <vector>

#include "binding.hpp"

namespace kvevict::c_api {

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
  else
    return KVEVICT_BF16;
}

/// Element `offset` (in elements) of `base`, stored as `dt`, as T.
template <class T>
T read_element(std::int32_t dt, const void* base, std::int64_t offset) {
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

/// Checks a present tensor's dtype, rank and extents (the caller vouches for the memory its shape and strides
/// address). `name` is e.g. "layers[0].keys", `dims` the expected shape in words.
inline void check_tensor(const kvevict_tensor& t, int rank, const std::string& name, const char* dims) {
  if (t.dtype != KVEVICT_F32 && t.dtype != KVEVICT_F64 && t.dtype != KVEVICT_F16 && t.dtype != KVEVICT_BF16)
    throw invalid_argument(name + ": unknown dtype " + std::to_string(static_cast<int>(t.dtype)) +
                           "; expected KVEVICT_F32, KVEVICT_F64, KVEVICT_F16 or KVEVICT_BF16");
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
  Held<S> observation, w_o;
  std::vector<std::int64_t> positions;
  LayerInputs<KV, S, S> inputs;
};

template <class KV, class S>
std::vector<Selection> select_typed(const tools::Options& options, const kvevict_layer* layers, std::size_t n_layers) {
  std::optional<Index> window = options.knobs.window;
  std::vector<LayerHold<KV, S>> held(n_layers);  // never resized: the views point into these
  std::vector<LayerInputs<KV, S, S>> inputs;
  for (std::size_t l = 0; l < n_layers; ++l) {
    const kvevict_layer& in = layers[l];
    LayerHold<KV, S>& h = held[l];
    const std::string at = "layers[" + std::to_string(l) + "].";
    if (!in.keys.data) throw invalid_argument(at + "keys is missing; expected [kv_heads, tokens, head_dim]");
    check_tensor(in.keys, 3, at + "keys", "[kv_heads, tokens, head_dim]");
    if (in.keys.dtype != dtype_of<KV>())
      throw invalid_argument(at + "keys are " + dtype_name(in.keys.dtype) + "; expected " + dtype_name(dtype_of<KV>()) +
                             " like layers[0].keys (one cache dtype for every layer)");
    const Index Hkv = in.keys.shape[0], L = in.keys.shape[1];
    h.keys = hold3<KV>(in.keys);
    h.inputs.keys = h.keys.view();
    if (in.values.data) {
      check_tensor(in.values, 3, at + "values", "[kv_heads, tokens, head_dim]");
      if (in.values.dtype != in.keys.dtype)
        throw invalid_argument(at + "values are " + dtype_name(in.values.dtype) + " and keys " +
                               dtype_name(in.keys.dtype) + "; expected one dtype for both");
      if (in.values.shape[0] != Hkv || in.values.shape[1] != L)
        throw invalid_argument(at + "values have shape " + shape_str(in.values) + "; expected [" + std::to_string(Hkv) +
                               ", " + std::to_string(L) + ", head_dim] like the keys");
      h.values = hold3<KV>(in.values);
      h.inputs.values = h.values.view();
    }
    if (in.q_window.data && in.window_attention.data)
      throw invalid_argument(at + "q_window and " + at + "window_attention are both given; expected exactly one");
    const bool queries = in.q_window.data != nullptr;
    const kvevict_tensor* obs = queries ? &in.q_window : in.window_attention.data ? &in.window_attention : nullptr;
    if (!obs && options.reads_observation)
      throw invalid_argument(at + "q_window [heads, window, head_dim] (or " + at +
                             "window_attention [heads, window, tokens]) is missing; the " + options.policy +
                             " policy needs it");
    if (obs && options.reads_observation) {
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
    inputs.push_back(h.inputs);
  }
  return tools::run_policy<S>(options, inputs, window);
}

template <class KV>
std::vector<Selection> select_storage(const tools::Options& options, const Budget& budget, const kvevict_layer* layers,
                                      std::size_t n_layers) {
  tools::Options o = options;
  o.budget = budget;
  return options.precision == "f64" ? select_typed<KV, double>(o, layers, n_layers)
                                    : select_typed<KV, float>(o, layers, n_layers);
}

}  // namespace kvevict::c_api
