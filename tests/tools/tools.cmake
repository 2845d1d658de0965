# kvevict-select end to end: float64 agreement with the reference, every dtype, every bad-input path; every
# tests/tools/test_*.cpp (test_select_cli.cpp, _ragged, _selectors, _layout: --share/--reduce/--block) is built in.
if(TARGET kvevict-select)
  find_package(nlohmann_json 3 REQUIRED)
  file(GLOB KVEVICT_CLI_TEST_SOURCES CONFIGURE_DEPENDS ${CMAKE_CURRENT_LIST_DIR}/test_*.cpp)
  add_executable(kvevict_cli_tests ${KVEVICT_CLI_TEST_SOURCES})
  target_include_directories(kvevict_cli_tests PRIVATE ${PROJECT_SOURCE_DIR}/tests ${PROJECT_SOURCE_DIR}/tools)
  target_link_libraries(kvevict_cli_tests PRIVATE kvevict::kvevict nlohmann_json::nlohmann_json kvevict_catch_main kvevict_warnings)
  target_compile_definitions(kvevict_cli_tests PRIVATE KVEVICT_SELECT_PATH="$<TARGET_FILE:kvevict-select>")
  add_dependencies(kvevict_cli_tests kvevict-select)
  kvevict_unity_batches(kvevict_cli_tests)
  catch_discover_tests(kvevict_cli_tests TEST_PREFIX "cli.")
endif()
