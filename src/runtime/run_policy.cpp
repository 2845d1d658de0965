// Every catalogue policy over float and double caches: the costliest instances to compile, compiled once here.
#include "run_policy.hpp"

namespace kvevict::runtime {
template std::vector<Selection> run_policy<float>(const Options&, const std::vector<LayerInputs<float>>&,
                                                  std::optional<Index>);
template std::vector<Selection> run_policy<double>(const Options&, const std::vector<LayerInputs<double>>&,
                                                   std::optional<Index>);
}  // namespace kvevict::runtime
