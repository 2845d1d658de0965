# kvevict::c, the C API (include/kvevict/c/kvevict.h, src/c/): a static library kvevict::c and a shared one
# kvevict::c_shared (both named libkvevict_c). The selection instances (one translation unit per cache dtype,
# compiled once, position-independent, and the policies over float and double caches: cmake/policy_runs.cmake) are
# shared by both; each compiles the small entry-point file itself, so that
# CMake knows both are C++ and links C consumers with the C++ runtime.
include(${CMAKE_CURRENT_LIST_DIR}/policy_runs.cmake)
add_library(kvevict_c_selections OBJECT src/c/select_f32.cpp src/c/select_f64.cpp src/c/select_f16.cpp
                                        src/c/select_bf16.cpp src/c/select_i8.cpp src/c/select_e4m3.cpp
                                        src/c/select_e5m2.cpp)
set(_kvevict_c_targets kvevict_c_selections)

add_library(kvevict_c STATIC src/c/kvevict_c.cpp $<TARGET_OBJECTS:kvevict_c_selections>
                             $<TARGET_OBJECTS:kvevict_policy_runs>)
add_library(kvevict::c ALIAS kvevict_c)
set_target_properties(kvevict_c PROPERTIES EXPORT_NAME c)

add_library(kvevict_c_shared SHARED src/c/kvevict_c.cpp $<TARGET_OBJECTS:kvevict_c_selections>
                                    $<TARGET_OBJECTS:kvevict_policy_runs>)
add_library(kvevict::c_shared ALIAS kvevict_c_shared)
set_target_properties(kvevict_c_shared PROPERTIES EXPORT_NAME c_shared OUTPUT_NAME kvevict_c VERSION ${PROJECT_VERSION}
                                                  SOVERSION ${PROJECT_VERSION_MAJOR}.${PROJECT_VERSION_MINOR})

foreach(target kvevict_c_selections kvevict_c kvevict_c_shared)
  set_target_properties(${target} PROPERTIES POSITION_INDEPENDENT_CODE ON CXX_VISIBILITY_PRESET hidden
                                             VISIBILITY_INLINES_HIDDEN ON)
  target_include_directories(${target} PRIVATE ${PROJECT_SOURCE_DIR}/tools)
  target_compile_definitions(${target} PRIVATE KVEVICT_C_BUILDING KVEVICT_POLICY_RUNS_EXTERN)
  target_link_libraries(${target} PRIVATE $<BUILD_INTERFACE:kvevict>)
  if(TARGET kvevict_warnings)
    target_link_libraries(${target} PRIVATE $<BUILD_INTERFACE:kvevict_warnings>)
  endif()
endforeach()
foreach(target kvevict_c kvevict_c_shared)
  target_include_directories(${target} PUBLIC $<BUILD_INTERFACE:${PROJECT_SOURCE_DIR}/include>
                                              $<INSTALL_INTERFACE:${CMAKE_INSTALL_INCLUDEDIR}>)
endforeach()
