#pragma once
// kvevict-select's input side: the tensors of a safetensors dump handed to the bindings' runtime as kvevict_layer
// (src/runtime/tensors.hpp), which checks them against the input contract and runs the policy the options name.
// Only what belongs to the file format is here: the layers' numbering, the dtypes a file may hold, I32 lengths and
// positions widened to I64, and aligned copies of the tensors' bytes (a file's data may be unaligned). Every rule of
// the contract itself (shapes, dtypes of the cache, scales, the window, what a policy needs) is the runtime's, so
// the CLI, C and Python refuse the same input with the same message, naming the tensor "layers.<i>.<name>".
// Separate from main() so that the fuzzer (tests/fuzz/fuzz_select.cpp) drives exactly the tool's code.

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <optional>
#include <stdexcept>
#include <string>
#include <type_traits>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "options.hpp"  // src/runtime/
#include "safetensors.hpp"
#include "tensors.hpp"

namespace kvevict::tools {

namespace st = ::safetensors;
using runtime::Options;

/// Bad input data that only a file can hold (as opposed to usage_error: a bad command line).
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

inline std::string shape_str(const std::vector<std::int64_t>& s) {
  std::string out = "[";
  for (std::size_t i = 0; i < s.size(); ++i) out += (i ? ", " : "") + std::to_string(s[i]);
  return out + "]";
}

/// The runtime's dtype of a file's floating or quantized dtype; nullopt for the integer ones (I64, I32, U8, BOOL).
inline std::optional<kvevict_dtype> runtime_dtype(st::dtype t) {
  switch (t) {
    case st::dtype::F64:
      return KVEVICT_F64;
    case st::dtype::F32:
      return KVEVICT_F32;
    case st::dtype::F16:
      return KVEVICT_F16;
    case st::dtype::BF16:
      return KVEVICT_BF16;
    case st::dtype::I8:
      return KVEVICT_I8;
    case st::dtype::F8_E4M3:
      return KVEVICT_F8_E4M3;
    case st::dtype::F8_E5M2:
      return KVEVICT_F8_E5M2;
    default:
      return std::nullopt;
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

/// One layer of the file as the runtime reads it: `layer` points into the aligned copies held here.
struct LayerTensors {
  kvevict_layer layer{};
  std::vector<std::vector<std::uint64_t>> bytes;  // each tensor's data, 8-byte aligned (moving keeps the buffers)
  std::vector<std::int64_t> lengths, positions;

  /// The tensor `name` of the file as a contiguous kvevict_tensor (host byte order: the file's little-endian bytes
  /// as they are, so a big-endian host would misread them); an absent tensor is left empty (data NULL).
  /// `cache`: keys or values (quantized dtypes allowed); `scale`: a quantized cache's F32 scale.
  kvevict_tensor tensor(const st::file& in, const std::string& name, bool cache, bool scale = false) {
    kvevict_tensor out{};
    const st::tensor_info* t = in.find(name);
    if (!t) return out;
    const std::optional<kvevict_dtype> dtype = runtime_dtype(t->type);
    if (!dtype && scale)
      throw input_error("tensor '" + name + "' has dtype " + st::dtype_name(t->type) +
                        "; expected F32 dequantisation factors");
    if (!dtype)
      throw input_error("tensor '" + name + "' has dtype " + st::dtype_name(t->type) +
                        "; expected F64, F32, F16 or BF16" +
                        (cache ? " (or a quantized cache: I8, F8_E4M3 or F8_E5M2 with '" + name + "_scale')" : ""));
    if (t->shape.size() > 3)
      throw input_error("tensor '" + name + "' has rank " + std::to_string(t->shape.size()) +
                        "; expected rank 3 or less");
    out.dtype = *dtype;
    out.rank = static_cast<std::int32_t>(t->shape.size());
    std::int64_t stride = 1;
    for (int i = out.rank - 1; i >= 0; --i) {
      out.shape[i] = t->shape[static_cast<std::size_t>(i)];
      out.strides[i] = stride;
      stride *= out.shape[i];
    }
    const std::size_t size = t->end - t->begin;
    bytes.emplace_back((size + 7) / 8 + 1);  // never empty: an empty tensor still has a non-NULL address
    if (size > 0) std::memcpy(bytes.back().data(), in.raw(*t), size);
    out.data = bytes.back().data();
    return out;
  }
};

/// Layer `layer` of the file: its tensors, and its lengths and positions checked against the keys' [Hkv, L] (the
/// runtime checks their values).
inline LayerTensors load_layer(const st::file& in, Index layer) {
  const std::string prefix = "layers." + std::to_string(layer) + ".";
  LayerTensors t;
  kvevict_layer& l = t.layer;
  l.keys = t.tensor(in, prefix + "keys", /*cache=*/true);
  l.values = t.tensor(in, prefix + "values", /*cache=*/true);
  l.q_window = t.tensor(in, prefix + "q_window", false);
  l.window_attention = t.tensor(in, prefix + "window_attention", false);
  l.w_o = t.tensor(in, prefix + "w_o", false);
  l.keys_scale = t.tensor(in, prefix + "keys_scale", false, /*scale=*/true);
  l.values_scale = t.tensor(in, prefix + "values_scale", false, /*scale=*/true);
  l.scores = t.tensor(in, prefix + "scores", false);
  if (l.keys.rank != 3 || l.keys.shape[0] < 1 || l.keys.shape[1] < 1 || l.keys.shape[2] < 1)
    return t;  // the runtime refuses these keys before it reads lengths or positions
  const Index Hkv = l.keys.shape[0], L = l.keys.shape[1];
  // Ragged layers: keys and values padded to L rows per head, head h holding rows [0, lengths[h]) at the original
  // positions positions[h, 0 .. lengths[h]) (docs/algorithms.md#ragged).
  if (auto v = load_integers(
          in, prefix + "lengths", {Hkv},
          "[kv_heads]: the entries held by each of the " + std::to_string(Hkv) + " KV heads of '" + prefix + "keys'")) {
    t.lengths = std::move(*v);
    l.lengths = t.lengths.data();
  }
  if (auto v = load_integers(in, prefix + "positions", {Hkv, L},
                             "[kv_heads, tokens]: the original position of every row of '" + prefix + "keys' [" +
                                 std::to_string(Hkv) + ", " + std::to_string(L) + ", " +
                                 std::to_string(l.keys.shape[2]) + "]")) {
    t.positions = std::move(*v);
    l.positions = t.positions.data();
    l.positions_strides[0] = L;
    l.positions_strides[1] = 1;
  }
  return t;
}

/// The selections (one per layer) of the policy `opt` names on the layers of `in`. Throws input_error or
/// kvevict::invalid_argument (bad tensors), usage_error (options that do not fit the data).
inline std::vector<kvevict::Selection> select_layers(const Options& opt, const st::file& in) {
  const Index n_layers = count_layers(in);
  static_assert(std::is_nothrow_move_constructible_v<LayerTensors>,
                "growing `tensors` must move each layer's buffers, which `layers` points into, not copy them");
  std::vector<LayerTensors> tensors;
  std::vector<kvevict_layer> layers;
  tensors.reserve(static_cast<std::size_t>(n_layers));
  for (Index i = 0; i < n_layers; ++i) {
    tensors.push_back(load_layer(in, i));
    layers.push_back(tensors.back().layer);  // points into buffers that moving `tensors` keeps in place
  }
  // The command line names one budget (runtime::parse_command_line refuses it otherwise).
  return runtime::select_tensors(opt, *opt.budget, layers.data(), layers.size(), runtime::TensorNames::dotted);
}

}  // namespace kvevict::tools
