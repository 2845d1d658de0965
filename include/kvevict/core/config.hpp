#pragma once
/// Build configuration that changes generated code: the threading mode.
///
/// KVEVICT_OPENMP (core/parallel.hpp) changes the body of the templates that loop over heads. So that translation
/// units built with and without it can link into one program without violating the one-definition rule, everything
/// whose code depends on the mode lives in an inline namespace named after it (kvevict::openmp or kvevict::serial,
/// and likewise inside kvevict::extend and kvevict::detail): the same source names, distinct symbols. Objects of
/// those types (the presets, the selectors) belong to one mode; plain data (views, LayerInputs, Budget, Selection,
/// OutputGram, errors) is shared by both.

#if defined(KVEVICT_OPENMP)
#define KVEVICT_ABI_NAMESPACE openmp
#else
#define KVEVICT_ABI_NAMESPACE serial
#endif

namespace kvevict::detail {
inline namespace KVEVICT_ABI_NAMESPACE {
/// The threading mode this translation unit was built with: "openmp" or "serial".
inline const char* threading_mode() {
#if defined(KVEVICT_OPENMP)
  return "openmp";
#else
  return "serial";
#endif
}
}  // namespace KVEVICT_ABI_NAMESPACE
}  // namespace kvevict::detail
