#pragma once
// The C API's C++ side (include/kvevict/c/kvevict.h): the opaque types, and the selection over raw tensors that
// the per-storage translation units (select_<dtype>.cpp) instantiate. Internal to kvevict::c.

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

#include "kvevict/c/kvevict.h"
#include "kvevict/kvevict.hpp"
#include "select_options.hpp"  // tools/: the option names and checks kvevict-select has

struct kvevict_policy {
  kvevict::tools::Options options;
};

struct kvevict_selection {
  std::vector<kvevict::Selection> layers;
};

namespace kvevict::c_api {

/// The selections of `options`' policy over `layers`, whose keys and values are stored as KV (float, double,
/// Eigen::half, Eigen::bfloat16, or the codes std::int8_t, float8_e4m3, float8_e5m2 with their scales). Throws
/// kvevict::invalid_argument or tools::usage_error on bad input.
template <class KV>
std::vector<Selection> select_storage(const tools::Options& options, const Budget& budget, const kvevict_layer* layers,
                                      std::size_t n_layers);

extern template std::vector<Selection> select_storage<float>(const tools::Options&, const Budget&, const kvevict_layer*,
                                                             std::size_t);
extern template std::vector<Selection> select_storage<double>(const tools::Options&, const Budget&,
                                                              const kvevict_layer*, std::size_t);
extern template std::vector<Selection> select_storage<Eigen::half>(const tools::Options&, const Budget&,
                                                                   const kvevict_layer*, std::size_t);
extern template std::vector<Selection> select_storage<Eigen::bfloat16>(const tools::Options&, const Budget&,
                                                                       const kvevict_layer*, std::size_t);
extern template std::vector<Selection> select_storage<std::int8_t>(const tools::Options&, const Budget&,
                                                                   const kvevict_layer*, std::size_t);
extern template std::vector<Selection> select_storage<float8_e4m3>(const tools::Options&, const Budget&,
                                                                   const kvevict_layer*, std::size_t);
extern template std::vector<Selection> select_storage<float8_e5m2>(const tools::Options&, const Budget&,
                                                                   const kvevict_layer*, std::size_t);

}  // namespace kvevict::c_api
