# A test of the test programs themselves: fails when a Catch2 test name holds '[', ']' or ';'. catch_discover_tests
# passes the names through CMake lists, where those characters are list syntax: the names after such a one merge
# into a single bogus test that matches no test case, and Catch2 then exits 0, so every test case after it would
# silently not run. Usage: cmake -DEXE=<test program> -P check_test_names.cmake
# (Catch2 v2 exits with the number of names listed, so the exit status is not checked; an empty list fails below.)
execute_process(COMMAND "${EXE}" --list-test-names-only OUTPUT_VARIABLE names)
# Made inert before the output is split into lines (a list): ';' and '[' ']' are list syntax.
string(REPLACE ";" "<semicolon>" names "${names}")
string(REPLACE "[" "<lbracket>" names "${names}")
string(REPLACE "]" "<rbracket>" names "${names}")
string(REPLACE "\n" ";" lines "${names}")
set(bad "")
set(count 0)
foreach(line IN LISTS lines)
  if(line STREQUAL "")
    continue()
  endif()
  math(EXPR count "${count} + 1")
  if(line MATCHES "<semicolon>|<lbracket>|<rbracket>")
    string(APPEND bad "\n  ${line}")
  endif()
endforeach()
if(NOT bad STREQUAL "")
  message(FATAL_ERROR "test names with '[', ']' or ';' (catch_discover_tests would lose the tests after them):${bad}")
endif()
if(count EQUAL 0)
  message(FATAL_ERROR "${EXE} lists no test")
endif()
message(STATUS "${count} test names, none with '[', ']' or ';'")
