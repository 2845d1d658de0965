// The selections over bf16 keys and values (one translation unit per cache storage type: tensors_impl.hpp).
#include "tensors_impl.hpp"

namespace kvevict::runtime {
template std::vector<Selection> select_storage<Eigen::bfloat16>(const Options&, const Budget&, const kvevict_layer*,
                                                                std::size_t, TensorNames);
}  // namespace kvevict::runtime
