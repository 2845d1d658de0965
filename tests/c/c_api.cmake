# The C API's tests (include/kvevict/c/kvevict.h, cmake/c_api.cmake), when kvevict::c is built:
#   c_api.c_program   tests/c/test_c_api.c, a C99 program (no framework) against the static kvevict::c
#   c_api.*           tests/c/test_c_api_matches.cpp (Catch2): the C API's selections equal the C++ API's;
#                     tests/c/test_c_api_sharded.cpp: kvevict_select_layers_sharded over thread ranks
if(NOT TARGET kvevict_c)
  return()
endif()

# A C compiler: the C program is the point of the C API's tests (a header that only compiles as C++ is a bug).
include(CheckLanguage)
check_language(C)
if(NOT CMAKE_C_COMPILER)
  message(STATUS "kvevict: no C compiler: c_api.c_program not built")
else()
  enable_language(C)
  add_executable(kvevict_c_program ${CMAKE_CURRENT_LIST_DIR}/test_c_api.c)
  target_link_libraries(kvevict_c_program PRIVATE kvevict::c)
  # C99 exactly (no GNU extensions). kvevict_c is a static library of C++ objects: CMake links its consumers with the
  # C++ driver (and runtime) by itself, so the program needs no LINKER_LANGUAGE.
  set_target_properties(kvevict_c_program PROPERTIES C_STANDARD 99 C_STANDARD_REQUIRED ON C_EXTENSIONS OFF)
  target_compile_options(kvevict_c_program PRIVATE
    $<$<C_COMPILER_ID:GNU,Clang,AppleClang>:-Wall -Wextra -pedantic -Wshadow -Werror>)
  # The sanitizer presets set CMAKE_CXX_FLAGS only: the C program gets the same sanitizers (and their -O level), so that
  # the sanitizer run covers it too.
  if(KVEVICT_SANITIZED)
    separate_arguments(_kvevict_c_sanitize UNIX_COMMAND "${CMAKE_CXX_FLAGS}")
    list(FILTER _kvevict_c_sanitize INCLUDE REGEX "^-(fsanitize|fno-sanitize|fno-omit-frame-pointer|O)")
    target_compile_options(kvevict_c_program PRIVATE ${_kvevict_c_sanitize})
    target_link_options(kvevict_c_program PRIVATE ${_kvevict_c_sanitize})
  endif()
  if(NOT CMAKE_C_COMPILER_ID MATCHES "MSVC")
    target_link_libraries(kvevict_c_program PRIVATE m)  # sqrt, exp, ldexp, nan
  endif()
  add_test(NAME c_api.c_program COMMAND kvevict_c_program)  # the exit status: nonzero on any failed CHECK
endif()

# The comparison with the C++ API in dev (under the sanitizers the C program above covers the C API's
# memory: every policy and every error path; this test is a 4-minute compile there and adds no path of its own).
if(KVEVICT_SANITIZED)
  return()
endif()
find_package(Threads REQUIRED)
add_executable(kvevict_c_api_tests ${CMAKE_CURRENT_LIST_DIR}/test_c_api_matches.cpp
                                  ${CMAKE_CURRENT_LIST_DIR}/test_c_api_sharded.cpp)
target_include_directories(kvevict_c_api_tests PRIVATE ${CMAKE_CURRENT_LIST_DIR}/..)
target_link_libraries(kvevict_c_api_tests PRIVATE kvevict::c kvevict::kvevict kvevict_catch_main Threads::Threads
                                                  kvevict_warnings)
catch_discover_tests(kvevict_c_api_tests TEST_PREFIX "c_api.")
