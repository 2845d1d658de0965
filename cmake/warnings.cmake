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
  target_compile_options(kvevict_native INTERFACE -march=native)
endif()
