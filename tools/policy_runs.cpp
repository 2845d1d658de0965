// Every catalogue policy over float and double caches (tools/select_options.hpp: run_policy), compiled once for
// kvevict-select, the fuzz corpus replay and the C API (cmake/policy_runs.cmake), which declare them extern
// (KVEVICT_POLICY_RUNS_EXTERN): the costliest instances to compile, otherwise compiled in each of them.
#include "select_options.hpp"

template std::vector<kvevict::Selection> kvevict::tools::run_policy<float>(
    const Options&, const std::vector<kvevict::LayerInputs<float>>&, std::optional<Index>);
template std::vector<kvevict::Selection> kvevict::tools::run_policy<double>(
    const Options&, const std::vector<kvevict::LayerInputs<double>>&, std::optional<Index>);
