# kvevict::c, the C API (include/kvevict/c/kvevict.h, src/c/): a static library kvevict::c and a shared one
# kvevict::c_shared (both named libkvevict_c), each the handles of src/c/kvevict_c.cpp over the bindings' runtime
# (cmake/runtime.cmake: the options, the raw-tensor input contract and the catalogue, compiled once and shared by
# both). Each compiles the small entry-point file itself, so that CMake knows both are C++ and links C consumers with
# the C++ runtime.
include(${CMAKE_CURRENT_LIST_DIR}/runtime.cmake)
set(_kvevict_runtime_objects $<TARGET_OBJECTS:kvevict_runtime> $<TARGET_OBJECTS:kvevict_runtime_tensors>)

add_library(kvevict_c STATIC src/c/kvevict_c.cpp ${_kvevict_runtime_objects})
add_library(kvevict::c ALIAS kvevict_c)
set_target_properties(kvevict_c PROPERTIES EXPORT_NAME c)

add_library(kvevict_c_shared SHARED src/c/kvevict_c.cpp ${_kvevict_runtime_objects})
add_library(kvevict::c_shared ALIAS kvevict_c_shared)
set_target_properties(kvevict_c_shared PROPERTIES EXPORT_NAME c_shared OUTPUT_NAME kvevict_c VERSION ${PROJECT_VERSION}
                                                  SOVERSION ${PROJECT_VERSION_MAJOR}.${PROJECT_VERSION_MINOR})

foreach(target kvevict_c kvevict_c_shared)
  set_target_properties(${target} PROPERTIES POSITION_INDEPENDENT_CODE ON CXX_VISIBILITY_PRESET hidden
                                             VISIBILITY_INLINES_HIDDEN ON)
  target_include_directories(${target} PRIVATE ${KVEVICT_RUNTIME_DIR})
  target_compile_definitions(${target} PRIVATE KVEVICT_C_BUILDING)
  target_link_libraries(${target} PRIVATE $<BUILD_INTERFACE:kvevict>)
  if(TARGET kvevict_warnings)
    target_link_libraries(${target} PRIVATE $<BUILD_INTERFACE:kvevict_warnings>)
  endif()
endforeach()
foreach(target kvevict_c kvevict_c_shared)
  target_include_directories(${target} PUBLIC $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
                                              $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
endforeach()
