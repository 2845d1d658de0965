#pragma once
// kvevict-select's input side: the layers of a safetensors dump, validated and viewed as kvevict::LayerInputs,
// then the selections of the policy the options name. Separate from main() so that the fuzzer
// (tests/fuzz/fuzz_select.cpp) drives exactly the code the tool runs, on bytes in memory.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "options.hpp"  // src/runtime/
#include "run_policy.hpp"
#include "safetensors.hpp"

namespace kvevict::tools {

namespace st = ::safetensors;
using runtime::Options;
using runtime::run_policy;

/// Bad input data (as opposed to usage_error: a bad command line).
struct input_error : std::runtime_error {
  using std::runtime_error::runtime_error;
};

/// Number of layers: layers.{i}.keys must exist for i = 0 .. NL-1 and for no other i.
inline Index count_layers(const st::file& in) {
  Index n = 0;
  while (in.find("layers." + std::to_string(n) + ".keys")) ++n;
  if (n == 0)
    throw input_error("no tensor 'layers.0.keys' in the input; expected layers.{i}.keys [kv_heads, tokens, head_dim]");
  for (const auto& t : in.tensors()) {
    const std::string& name = t.name;
    if (name.rfind("layers.", 0) != 0) continue;
    const auto dot = name.find('.', 7);
    const std::string idx = name.substr(7, dot == std::string::npos ? std::string::npos : dot - 7);
    char* end = nullptr;
    const long long i = std::strtoll(idx.c_str(), &end, 10);
    if (idx.empty() || *end != '\0' || i < 0 || i >= n)
      throw input_error("tensor '" + name + "' does not belong to a layer 0.." + std::to_string(n - 1) +
                        " (layers must be numbered contiguously from 0, each with a 'keys' tensor)");
  }
  return n;
}

/// A floating tensor of the given rank, converted to S, with its shape.
template <class S>
struct Loaded {
  std::vector<S> data;
  std::vector<std::int64_t> shape;
};

inline std::string shape_str(const std::vector<std::int64_t>& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

inline bool is_quantized(st::dtype t) {
  return t == st::dtype::I8 || t == st::dtype::F8_E4M3 || t == st::dtype::F8_E5M2;
}

/// The dequantisation factor of every row [h, j] of a quantized cache tensor [Hkv, L, d], from '<name>_scale'
/// (F32): shape [] or [1] one factor for the tensor, [L] one per token, [Hkv, L] one per KV head and token; 1 when
/// there is none (docs/algorithms.md section 9: the factor multiplies the code's value, in float).
inline std::vector<float> row_factors(const st::file& in, const std::string& name, std::int64_t Hkv, std::int64_t L) {
  const std::string scale_name = name + "_scale";
  const st::tensor_info* s = in.find(scale_name);
  std::vector<float> factors(static_cast<std::size_t>(Hkv * L), 1.0f);
  if (!s) return factors;
  const std::string expected = "F32 [] or [1] (one factor), [" + std::to_string(L) + "] (one per token) or [" +
                               std::to_string(Hkv) + ", " + std::to_string(L) + "] (one per KV head and token)";
  if (s->type != st::dtype::F32)
    throw input_error("tensor '" + scale_name + "' has dtype " + st::dtype_name(s->type) + "; expected " + expected);
  const std::vector<float> v = in.read_floats<float>(*s);
  for (std::size_t i = 0; i < v.size(); ++i)
    if (!std::isfinite(v[i]))
      throw input_error("tensor '" + scale_name + "' element " + std::to_string(i) + " is " + std::to_string(v[i]) +
                        "; expected finite dequantisation factors");
  const auto& shape = s->shape;
  if (shape.empty() || shape == std::vector<std::int64_t>{1})
    std::fill(factors.begin(), factors.end(), v.at(0));
  else if (shape == std::vector<std::int64_t>{L})
    for (std::int64_t h = 0; h < Hkv; ++h) std::copy(v.begin(), v.end(), factors.begin() + h * L);
  else if (shape == std::vector<std::int64_t>{Hkv, L})
    factors = v;
  else
    throw input_error("tensor '" + scale_name + "' has shape " + shape_str(shape) + "; expected " + expected);
  return factors;
}

/// A quantized cache tensor [Hkv, L, d] of codes T, dequantized as the library reads T: row [h, j] is
/// float(code) * factor(h, j) in float (kvevict::detail::dequantize), then widened to S.
template <class T, class S>
std::vector<S> dequantized(const st::file& in, const st::tensor_info& t, const std::vector<float>& factors) {
  const std::int64_t rows = t.shape[0] * t.shape[1], d = t.shape[2];
  std::vector<T> codes(static_cast<std::size_t>(rows * d));
  std::memcpy(codes.data(), in.raw(t), codes.size());  // one byte per code
  std::vector<S> out(codes.size());
  std::vector<float> row(static_cast<std::size_t>(d));
  for (std::int64_t r = 0; r < rows; ++r) {
    kvevict::detail::dequantize(codes.data() + r * d, factors[static_cast<std::size_t>(r)], row.data(), d);
    std::copy(row.begin(), row.end(), out.begin() + r * d);
  }
  return out;
}

template <class S>
std::optional<Loaded<S>> load(const st::file& in, const std::string& name, std::size_t rank, const char* dims,
                              bool cache = false) {
  const st::tensor_info* t = in.find(name);
  if (!t) return std::nullopt;
  const bool quantized = cache && is_quantized(t->type);
  if (!quantized && t->type != st::dtype::F64 && t->type != st::dtype::F32 && t->type != st::dtype::F16 &&
      t->type != st::dtype::BF16)
    throw input_error("tensor '" + name + "' has dtype " + st::dtype_name(t->type) +
                      "; expected F64, F32, F16 or BF16" +
                      (cache ? " (or a quantized cache: I8, F8_E4M3 or F8_E5M2 with '" + name + "_scale')" : ""));
  if (t->shape.size() != rank)
    throw input_error("tensor '" + name + "' has rank " + std::to_string(t->shape.size()) + "; expected rank " +
                      std::to_string(rank) + " " + dims);
  for (std::int64_t e : t->shape)
    if (e == 0) throw input_error("tensor '" + name + "' is empty; expected " + dims + " with no zero extent");
  if (!quantized) {
    if (cache && in.find(name + "_scale"))
      throw input_error("tensor '" + name + "_scale' scales '" + name + "', which is " + st::dtype_name(t->type) +
                        "; expected no scale for a floating cache (scales apply to I8, F8_E4M3 or F8_E5M2)");
    return Loaded<S>{in.read_floats<S>(*t), t->shape};
  }
  const std::vector<float> factors = row_factors(in, name, t->shape[0], t->shape[1]);
  switch (t->type) {
    case st::dtype::I8:
      return Loaded<S>{dequantized<std::int8_t, S>(in, *t, factors), t->shape};
    case st::dtype::F8_E4M3:
      return Loaded<S>{dequantized<kvevict::float8_e4m3, S>(in, *t, factors), t->shape};
    default:
      return Loaded<S>{dequantized<kvevict::float8_e5m2, S>(in, *t, factors), t->shape};
  }
}

/// An integer tensor (I64, or I32 widened) of exactly the shape `expected`; nullopt when the file has none.
/// `what` describes the expected shape in words, for the message.
inline std::optional<std::vector<std::int64_t>> load_integers(const st::file& in, const std::string& name,
                                                              const std::vector<std::int64_t>& expected,
                                                              const std::string& what) {
  const st::tensor_info* t = in.find(name);
  if (!t) return std::nullopt;
  if (t->type != st::dtype::I64 && t->type != st::dtype::I32)
    throw input_error("tensor '" + name + "' has dtype " + st::dtype_name(t->type) + "; expected I64 or I32 " +
                      shape_str(expected) + " (" + what + ")");
  if (t->shape != expected)
    throw input_error("tensor '" + name + "' has shape " + shape_str(t->shape) + "; expected " + shape_str(expected) +
                      " (" + what + ")");
  return in.read_i64(*t);
}

/// One layer's tensors converted to S, and the views the library reads.
template <class S>
struct LayerTensors {
  std::optional<Loaded<S>> keys, values, queries, attention, w_o;
  std::optional<std::vector<std::int64_t>> lengths, positions;  // ragged layers (docs/algorithms.md section 6)
  kvevict::LayerInputs<S> inputs;
};

template <class S>
LayerTensors<S> load_layer(const Options& opt, const st::file& in, Index layer, std::optional<Index>& window) {
  const std::string prefix = "layers." + std::to_string(layer) + ".";
  LayerTensors<S> t;
  t.keys = load<S>(in, prefix + "keys", 3, "[kv_heads, tokens, head_dim]", /*cache=*/true);
  t.values = load<S>(in, prefix + "values", 3, "[kv_heads, tokens, head_dim]", /*cache=*/true);
  t.queries = load<S>(in, prefix + "q_window", 3, "[heads, window, head_dim]");
  t.attention = load<S>(in, prefix + "window_attention", 3, "[heads, window, tokens]");
  t.w_o = load<S>(in, prefix + "w_o", 2, "[hidden, heads * head_dim]");
  const Index Hkv = t.keys->shape[0], L = t.keys->shape[1], d = t.keys->shape[2];
  kvevict::LayerInputs<S>& li = t.inputs;
  li.keys = kvevict::kv_heads_major<const S>(t.keys->data.data(), Hkv, L, d);
  // Ragged layers: keys and values padded to L rows per head, head h holding rows [0, lengths[h]) at the original
  // positions positions[h, 0 .. lengths[h]); the library checks the values (range, increasing).
  t.lengths = load_integers(
      in, prefix + "lengths", {Hkv},
      "[kv_heads]: the entries held by each of the " + std::to_string(Hkv) + " KV heads of '" + prefix + "keys'");
  t.positions = load_integers(
      in, prefix + "positions", {Hkv, L},
      "[kv_heads, tokens]: the original position of every row of '" + prefix + "keys' " + shape_str(t.keys->shape));
  if (t.lengths) li.lengths = t.lengths->data();
  if (t.positions) li.positions = kvevict::positions_heads_major(t.positions->data(), Hkv, L);
  if (t.values) {
    if (t.values->shape[0] != Hkv || t.values->shape[1] != L)
      throw input_error("tensor '" + prefix + "values' has shape " + shape_str(t.values->shape) + "; expected [" +
                        std::to_string(Hkv) + ", " + std::to_string(L) + ", head_dim] like the keys");
    li.values = kvevict::kv_heads_major<const S>(t.values->data.data(), Hkv, L, t.values->shape[2]);
  }
  if (t.queries && t.attention)
    throw input_error("layer " + std::to_string(layer) +
                      " has both 'q_window' and 'window_attention'; expected exactly one");
  const bool needs_observation = opt.reads_observation, value_aware = opt.reads_values;
  if (!t.queries && !t.attention && needs_observation)
    throw input_error("missing tensor '" + prefix + "q_window' [heads, window, head_dim] (or '" + prefix +
                      "window_attention' [heads, window, tokens])");
  const Loaded<S>* obs = t.queries ? &*t.queries : t.attention ? &*t.attention : nullptr;
  if (obs && needs_observation) {
    const auto view =
        kvevict::HeadsView<const S>::heads_major(obs->data.data(), obs->shape[0], obs->shape[1], obs->shape[2]);
    (t.queries ? li.queries : li.attention) = view;
    if (!window) window = obs->shape[1];
    if (*window != obs->shape[1])
      throw input_error("--window " + std::to_string(*window) + " does not match the " + std::to_string(obs->shape[1]) +
                        " window rows of '" + prefix + (t.queries ? "q_window'" : "window_attention'"));
    if (value_aware) {
      if (!t.values)
        throw input_error("missing tensor '" + prefix + "values' [kv_heads, tokens, head_dim]; the " + opt.policy +
                          " policy needs it");
      if (!t.w_o)
        throw input_error("missing tensor '" + prefix + "w_o' [hidden, heads * head_dim]; the " + opt.policy +
                          " policy needs it");
      const Index H = obs->shape[0], dv = t.values->shape[2];
      if (t.w_o->shape[1] != H * dv)
        throw input_error("tensor '" + prefix + "w_o' has shape " + shape_str(t.w_o->shape) + "; expected [hidden, " +
                          std::to_string(H * dv) + "] (heads * head_dim)");
      li.w_o = kvevict::output_projection<const S>(t.w_o->data.data(), t.w_o->shape[0], H, dv);
    }
  }
  return t;
}

/// The selections (one per layer) of the policy `opt` names on the layers of `in`. Throws input_error or
/// kvevict::invalid_argument (bad tensors), usage_error (options that do not fit the data).
template <class S>
std::vector<kvevict::Selection> select_layers(const Options& opt, const st::file& in) {
  const Index n_layers = count_layers(in);
  std::optional<Index> window = opt.knobs.window;
  std::vector<LayerTensors<S>> layers;
  layers.reserve(static_cast<std::size_t>(n_layers));  // the views point into these buffers: no reallocation
  std::vector<kvevict::LayerInputs<S>> inputs;
  for (Index i = 0; i < n_layers; ++i) {
    layers.push_back(load_layer<S>(opt, in, i, window));
    inputs.push_back(layers.back().inputs);
  }
  return run_policy<S>(opt, inputs, window);
}

#ifdef KVEVICT_SELECT_RUN_EXTERN  // compiled once, in tools/select_run.cpp (tools/CMakeLists.txt)
extern template std::vector<kvevict::Selection> select_layers<float>(const Options&, const st::file&);
extern template std::vector<kvevict::Selection> select_layers<double>(const Options&, const st::file&);
#endif

/// select_layers() at the options' precision.
inline std::vector<kvevict::Selection> select_layers(const Options& opt, const st::file& in) {
  return opt.precision == "f64" ? select_layers<double>(opt, in) : select_layers<float>(opt, in);
}

}  // namespace kvevict::tools
