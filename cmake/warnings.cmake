include_guard(GLOBAL)
# Warnings for the project's own targets (never the interface target).
add_library(kvevict_warnings INTERFACE)
target_compile_options(kvevict_warnings INTERFACE
  $<$<CXX_COMPILER_ID:GNU,Clang,AppleClang>:-Wall -Wextra -Wpedantic -Wconversion -Wshadow>)
option(KVEVICT_WERROR "Treat warnings as errors on the project's own targets" OFF)
if(KVEVICT_WERROR)
  target_compile_options(kvevict_warnings INTERFACE $<$<CXX_COMPILER_ID:GNU,Clang,AppleClang>:-Werror>)
endif()
add_library(kvevict_native INTERFACE)
if(KVEVICT_NATIVE)
  # GCC 12 reports false maybe-uninitialized warnings inside its own AVX-512 intrinsics headers when Eigen
  # vectorises with them (GCC bug 105593, also as -Wuninitialized); they are not about our code.
  target_compile_options(kvevict_native INTERFACE -march=native
    "$<$<CXX_COMPILER_ID:GNU>:-Wno-maybe-uninitialized;-Wno-uninitialized>")
endif()
