include_guard(GLOBAL)
# The bindings' runtime (src/runtime/), compiled once and linked by every front end: kvevict-select (tools/), the C
# API (cmake/c_api.cmake) and through it Python. Object libraries (position-independent, hidden), taken by their
# consumers as $<TARGET_OBJECTS:...> so that the installed kvevict::c needs no other target:
#   kvevict_runtime          the parameter table and options (options.cpp) and every catalogue policy over float and
#                            double caches (run_policy.cpp: the costliest instances, compiled once)
#   kvevict_runtime_tensors  the raw-tensor input contract (tensors.cpp), one translation unit per cache storage type
# kvevict_runtime_library(NAME SOURCES...) makes one; KVEVICT_NATIVE builds a -march=native copy for the tool.
set(KVEVICT_RUNTIME_DIR ${PROJECT_SOURCE_DIR}/src/runtime)
function(kvevict_runtime_library name)
  list(TRANSFORM ARGN PREPEND ${KVEVICT_RUNTIME_DIR}/)
  add_library(${name} OBJECT ${ARGN})
  set_target_properties(${name} PROPERTIES POSITION_INDEPENDENT_CODE ON CXX_VISIBILITY_PRESET hidden
                                           VISIBILITY_INLINES_HIDDEN ON)
  target_include_directories(${name} PRIVATE ${KVEVICT_RUNTIME_DIR} ${PROJECT_SOURCE_DIR}/include)
  target_link_libraries(${name} PRIVATE $<BUILD_INTERFACE:kvevict>)
  if(TARGET kvevict_warnings)
    target_link_libraries(${name} PRIVATE $<BUILD_INTERFACE:kvevict_warnings>)
  endif()
endfunction()

set(KVEVICT_RUNTIME_SOURCES options.cpp run_policy.cpp)
set(KVEVICT_RUNTIME_TENSORS_SOURCES tensors.cpp tensors_f32.cpp tensors_f64.cpp tensors_f16.cpp tensors_bf16.cpp
                                    tensors_i8.cpp tensors_e4m3.cpp tensors_e5m2.cpp)
kvevict_runtime_library(kvevict_runtime ${KVEVICT_RUNTIME_SOURCES})
kvevict_runtime_library(kvevict_runtime_tensors ${KVEVICT_RUNTIME_TENSORS_SOURCES})
