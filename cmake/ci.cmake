# The `ci` configure preset (KVEVICT_CI=ON): the format check, then the dev, clang, asan and fuzz workflows of CMakePresets.json as this build
# tree's tests, run one after another by the `ci` test preset. CMake workflow presets allow a single configure
# preset each, so `cmake --workflow --preset ci` (what CI and the README run) drives them through CTest:
# each test runs `cmake --workflow --preset <name>` in the source tree, building into build/<name> exactly as a
# developer running that workflow would.
if(CMAKE_VERSION VERSION_LESS 3.25)
  message(FATAL_ERROR "KVEVICT_CI needs CMake >= 3.25 (cmake --workflow), this is ${CMAKE_VERSION}")
endif()
if(NOT EXISTS "${PROJECT_SOURCE_DIR}/CMakePresets.json")
  message(FATAL_ERROR "KVEVICT_CI needs ${PROJECT_SOURCE_DIR}/CMakePresets.json")
endif()

set(KVEVICT_CI_WORKFLOWS "dev;clang;asan;fuzz" CACHE STRING "Workflow presets the ci preset runs, in order")
# Each workflow takes 1-25 minutes on 2 cores; a hung one fails within an hour, inside CI's 90 minutes, with its
# log (each test of a workflow also stops after 1200 s: the test presets' timeout).
set(KVEVICT_CI_TIMEOUT 3600 CACHE STRING "Seconds each workflow of the ci preset may take")

enable_testing()
# First, the formatting: any difference from .clang-format fails CI (scripts/format fixes it).
add_test(NAME ci.format COMMAND "${PROJECT_SOURCE_DIR}/scripts/format" --check WORKING_DIRECTORY "${PROJECT_SOURCE_DIR}")
set_tests_properties(ci.format PROPERTIES RUN_SERIAL TRUE TIMEOUT 600 LABELS "ci")
set(_kvevict_ci_previous "")
foreach(_workflow IN LISTS KVEVICT_CI_WORKFLOWS)
  add_test(NAME ci.${_workflow} COMMAND "${CMAKE_COMMAND}" --workflow --preset ${_workflow}
           WORKING_DIRECTORY "${PROJECT_SOURCE_DIR}")
  set_tests_properties(ci.${_workflow} PROPERTIES RUN_SERIAL TRUE TIMEOUT ${KVEVICT_CI_TIMEOUT} LABELS "ci")
  if(_kvevict_ci_previous)
    set_tests_properties(ci.${_workflow} PROPERTIES DEPENDS ci.${_kvevict_ci_previous})
  endif()
  set(_kvevict_ci_previous ${_workflow})
endforeach()
