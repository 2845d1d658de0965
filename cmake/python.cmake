# The Python module `kvevict` (python/kvevict_python.cpp, pybind11 over kvevict::c), built into
# ${CMAKE_BINARY_DIR}/python (PYTHONPATH=build/<preset>/python) and installed into the interpreter's site directory
# (KVEVICT_PYTHON_INSTALL_DIR). Debian: pybind11-dev, libdlpack-dev, python3-dev; tests: python3-pytest,
# python3-numpy (python3-torch for the DLPack tests and examples/python).
if(NOT TARGET kvevict_c)
  message(FATAL_ERROR "KVEVICT_BUILD_PYTHON needs the C API: configure with KVEVICT_BUILD_C=ON")
endif()
# Debian's interpreter, where the python3-* packages install, unless one is named (-DPython_EXECUTABLE=...): a
# pyenv or virtualenv python3 earlier on PATH would not see them.
if(NOT DEFINED Python_EXECUTABLE AND EXISTS /usr/bin/python3)
  set(Python_EXECUTABLE /usr/bin/python3)
endif()
find_package(Python 3.7 REQUIRED COMPONENTS Interpreter Development.Module)
set(PYBIND11_FINDPYTHON ON)
find_package(pybind11 2.6 CONFIG REQUIRED)
find_path(KVEVICT_DLPACK_INCLUDE_DIR dlpack/dlpack.h REQUIRED)

pybind11_add_module(kvevict_python MODULE python/kvevict_python.cpp)
set_target_properties(kvevict_python PROPERTIES OUTPUT_NAME kvevict
                                                LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}/python)
target_include_directories(kvevict_python PRIVATE ${KVEVICT_DLPACK_INCLUDE_DIR})
target_link_libraries(kvevict_python PRIVATE kvevict::c)

# Relative to the install prefix, where that prefix's interpreter looks (Debian: /usr/local/lib/python3.X/dist-packages
# for the default prefix /usr/local); give an absolute path (e.g. ${Python_SITEARCH}) to install elsewhere.
if(Python_SITEARCH MATCHES "dist-packages")
  set(_kvevict_site "lib/python${Python_VERSION_MAJOR}.${Python_VERSION_MINOR}/dist-packages")
else()
  set(_kvevict_site "lib/python${Python_VERSION_MAJOR}.${Python_VERSION_MINOR}/site-packages")
endif()
set(KVEVICT_PYTHON_INSTALL_DIR "${_kvevict_site}" CACHE PATH "Where cmake --install puts the kvevict module")
install(TARGETS kvevict_python LIBRARY DESTINATION ${KVEVICT_PYTHON_INSTALL_DIR} COMPONENT python)
