# Documentation checks: included from tests/CMakeLists.txt, next to headers/headers.cmake.
#   docs.anchors  every citation of docs/algorithms.md (`docs/algorithms.md#forcing`, markdown links, the document's
#                 own `](#forcing)` links) names an anchor the document has, and none cites a section by number
#                 (tests/docs/anchors.py; docs/results/ is left as written). Needs Python 3; skipped (with a message)
#                 without it.
find_package(Python3 COMPONENTS Interpreter QUIET)
if(Python3_Interpreter_FOUND)
  add_test(NAME docs.anchors COMMAND Python3::Interpreter ${CMAKE_CURRENT_LIST_DIR}/anchors.py ${PROJECT_SOURCE_DIR})
  set_tests_properties(docs.anchors PROPERTIES LABELS "docs" TIMEOUT 60)
else()
  message(STATUS "kvevict: docs.anchors not registered (needs Python 3)")
endif()
