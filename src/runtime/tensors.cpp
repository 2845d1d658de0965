// select_tensors: the dispatch on the cache's storage type to the instances of tensors_<dtype>.cpp.
#include "tensors.hpp"

#include <string>

namespace kvevict::runtime {

std::vector<Selection> select_tensors(const Options& options, const Budget& given, const kvevict_layer* layers,
                                      std::size_t n_layers, TensorNames names) {
  const Budget budget = options.full_budget(given);  // #protected-prefix, #threshold-budgets of docs/algorithms.md
  if (!layers || n_layers == 0)
    throw invalid_argument("expected at least one layer, got " + std::to_string(n_layers) +
                           (layers ? "" : " (layers is NULL)"));
  const std::string keys = layer_prefix(names, 0) + "keys";
  if (!layers[0].keys.data) throw invalid_argument(keys + " is missing; expected [kv_heads, tokens, head_dim]");
  switch (layers[0].keys.dtype) {
    case KVEVICT_F32:
      return select_storage<float>(options, budget, layers, n_layers, names);
    case KVEVICT_F64:
      return select_storage<double>(options, budget, layers, n_layers, names);
    case KVEVICT_F16:
      return select_storage<Eigen::half>(options, budget, layers, n_layers, names);
    case KVEVICT_BF16:
      return select_storage<Eigen::bfloat16>(options, budget, layers, n_layers, names);
    case KVEVICT_I8:
      return select_storage<std::int8_t>(options, budget, layers, n_layers, names);
    case KVEVICT_F8_E4M3:
      return select_storage<float8_e4m3>(options, budget, layers, n_layers, names);
    case KVEVICT_F8_E5M2:
      return select_storage<float8_e5m2>(options, budget, layers, n_layers, names);
  }
  throw invalid_argument(keys + ": unknown dtype " + std::to_string(static_cast<int>(layers[0].keys.dtype)) +
                         "; expected KVEVICT_F32, KVEVICT_F64, KVEVICT_F16, KVEVICT_BF16, KVEVICT_I8, "
                         "KVEVICT_F8_E4M3 or KVEVICT_F8_E5M2");
}

}  // namespace kvevict::runtime
