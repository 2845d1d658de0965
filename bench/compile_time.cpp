// The compile-time check (the target is < 20 s): one translation unit that includes the umbrella header and
// instantiates select() of every preset of the catalogue (kvevict::catalogue::entries(), through
// kvevict::select_layers: a layer-global preset selects a model of one layer) for float storage and arithmetic;
// with -DKVEVICT_PROBE_EVERY_STORAGE also for Eigen::half and Eigen::bfloat16 storage (float arithmetic) and
// float64. bench/compile_time.sh times both.

#include <type_traits>
#include <vector>

#include "kvevict/kvevict.hpp"

namespace {

template <class T>
std::size_t select_with_every_preset(const kvevict::LayerInputs<T>& in, const kvevict::Budget& b) {
  using S = std::conditional_t<std::is_same_v<T, double>, double, float>;
  const std::vector<kvevict::LayerInputs<T>> layers{in};
  std::size_t n = 0;
  kvevict::catalogue::for_each(kvevict::catalogue::entries(), [&](const auto& entry) {
    for (const kvevict::Selection& s : kvevict::select_layers<S>(entry.make(), layers, b)) n += s.indices().size();
  });
  return n;
}

}  // namespace

std::size_t kvevict_compile_time_probe(const kvevict::LayerInputs<float>& f, const kvevict::LayerInputs<Eigen::half>& h,
                                       const kvevict::LayerInputs<Eigen::bfloat16>& bf,
                                       const kvevict::LayerInputs<double>& d, const kvevict::Budget& b) {
#if defined(KVEVICT_PROBE_EVERY_STORAGE)
  return select_with_every_preset(f, b) + select_with_every_preset(h, b) + select_with_every_preset(bf, b) +
         select_with_every_preset(d, b);
#else
  (void)h, (void)bf, (void)d;
  return select_with_every_preset(f, b);
#endif
}
