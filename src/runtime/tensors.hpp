#pragma once
// The bindings' runtime, the input contract: a model's layers as raw tensors (kvevict_layer of
// include/kvevict/c/kvevict.h: any dtype, shapes and strides, scales, lengths, positions) checked once and read
// as kvevict::LayerInputs, then the selections of the options' policy. The C API and Python call it; one
// translation unit per cache storage type (tensors_<dtype>.cpp) instantiates the catalogue over it.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kvevict/c/kvevict.h"
#include "kvevict/kvevict.hpp"
#include "options.hpp"

namespace kvevict::runtime {

/// How messages name a layer's tensors: "layers[0].keys" (the C and Python arrays of layers) or "layers.0.keys" (the
/// tensor names of a kvevict-select safetensors file).
enum class TensorNames { indexed, dotted };

/// "layers[l]." or "layers.l.": the prefix of layer l's tensor names.
inline std::string layer_prefix(TensorNames names, std::size_t l) {
  return names == TensorNames::dotted ? "layers." + std::to_string(l) + "." : "layers[" + std::to_string(l) + "].";
}

/// The selections of `options`' policy over `layers`, whose keys and values are stored as KV (float, double,
/// Eigen::half, Eigen::bfloat16, or the codes std::int8_t, float8_e4m3, float8_e5m2 with their scales). Throws
/// kvevict::invalid_argument (bad tensors) or usage_error (options that do not fit the data).
template <class KV>
std::vector<Selection> select_storage(const Options& options, const Budget& budget, const kvevict_layer* layers,
                                      std::size_t n_layers, TensorNames names);

/// select_storage for the dtype of layers[0].keys (checked: a known dtype, present).
std::vector<Selection> select_tensors(const Options& options, const Budget& budget, const kvevict_layer* layers,
                                      std::size_t n_layers, TensorNames names = TensorNames::indexed);

extern template std::vector<Selection> select_storage<float>(const Options&, const Budget&, const kvevict_layer*,
                                                             std::size_t, TensorNames);
extern template std::vector<Selection> select_storage<double>(const Options&, const Budget&, const kvevict_layer*,
                                                              std::size_t, TensorNames);
extern template std::vector<Selection> select_storage<Eigen::half>(const Options&, const Budget&, const kvevict_layer*,
                                                                   std::size_t, TensorNames);
extern template std::vector<Selection> select_storage<Eigen::bfloat16>(const Options&, const Budget&,
                                                                       const kvevict_layer*, std::size_t, TensorNames);
extern template std::vector<Selection> select_storage<std::int8_t>(const Options&, const Budget&, const kvevict_layer*,
                                                                   std::size_t, TensorNames);
extern template std::vector<Selection> select_storage<float8_e4m3>(const Options&, const Budget&, const kvevict_layer*,
                                                                   std::size_t, TensorNames);
extern template std::vector<Selection> select_storage<float8_e5m2>(const Options&, const Budget&, const kvevict_layer*,
                                                                   std::size_t, TensorNames);

}  // namespace kvevict::runtime
