// The C API's selections over i8 keys and values (one translation unit per cache dtype: see select_impl.hpp).
#include "select_impl.hpp"

template std::vector<kvevict::Selection> kvevict::c_api::select_storage<std::int8_t>(const kvevict::tools::Options&,
                                                                                     const kvevict::Budget&,
                                                                                     const kvevict_layer*, std::size_t);
