# kvevict_catch_main: Catch2's main (tests/main.cpp, the whole Catch2 implementation) compiled once and linked into
# every Catch2 test program of the build (unit, OpenMP, reference, CLI, C API, engine, ODR): under the sanitizers one
# compile of it takes about a minute. Included from the top-level CMakeLists.txt before tools/ and examples/.
find_package(Catch2 REQUIRED)
add_library(kvevict_catch_main OBJECT ${CMAKE_CURRENT_LIST_DIR}/main.cpp)
target_link_libraries(kvevict_catch_main PUBLIC Catch2::Catch2)
