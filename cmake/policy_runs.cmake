include_guard(GLOBAL)
# kvevict_policy_runs: every catalogue policy over float and double caches (tools/policy_runs.cpp), the costliest
# instances to compile, compiled once (position-independent, hidden, portable) for the C API's libraries and, unless
# KVEVICT_NATIVE gives the tool instances of its own, for kvevict-select and the fuzz corpus replay. A target that
# compiles against them defines KVEVICT_POLICY_RUNS_EXTERN and takes $<TARGET_OBJECTS:kvevict_policy_runs>.
add_library(kvevict_policy_runs OBJECT ${PROJECT_SOURCE_DIR}/tools/policy_runs.cpp)
set_target_properties(kvevict_policy_runs PROPERTIES POSITION_INDEPENDENT_CODE ON CXX_VISIBILITY_PRESET hidden
                                                     VISIBILITY_INLINES_HIDDEN ON)
target_link_libraries(kvevict_policy_runs PRIVATE $<BUILD_INTERFACE:kvevict>)
if(TARGET kvevict_warnings)
  target_link_libraries(kvevict_policy_runs PRIVATE $<BUILD_INTERFACE:kvevict_warnings>)
endif()
