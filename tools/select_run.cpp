// kvevict-select's selections, every catalogue policy at both precisions (tools/select_run.hpp), compiled once for
// the tool and the fuzz corpus replay (tests/fuzz/fuzz_select.cpp), which see them as extern templates.
#include "select_run.hpp"

template std::vector<kvevict::Selection> kvevict::tools::select_layers<float>(const Options&, const st::file&);
template std::vector<kvevict::Selection> kvevict::tools::select_layers<double>(const Options&, const st::file&);
