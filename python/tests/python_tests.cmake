# Registered from tests/CMakeLists.txt when the Python module is built: pytest runs python/tests/ against the
# module in ${CMAKE_BINARY_DIR}/python with Debian's interpreter (cmake/python.cmake), comparing with kvevict-select.
set(_kvevict_python_env "PYTHONPATH=${CMAKE_BINARY_DIR}/python" "PYTHONDONTWRITEBYTECODE=1")
if(TARGET kvevict-select)
  list(APPEND _kvevict_python_env "KVEVICT_SELECT=$<TARGET_FILE:kvevict-select>")
endif()
add_test(NAME python.pytest
         COMMAND ${Python_EXECUTABLE} -m pytest -q -p no:cacheprovider ${PROJECT_SOURCE_DIR}/python/tests)
set_tests_properties(python.pytest PROPERTIES ENVIRONMENT "${_kvevict_python_env}" LABELS python TIMEOUT 600)

# The PyTorch example (examples/python/): the tinycode model evicting with the module reproduces kvevict-demo's
# per-doc losses (docs/results/tinycode-full.json) on the first docs, for a per-layer and a layer-global policy.
foreach(_policy snapkv layer-defensivekv)
  add_test(NAME examples.python_tinycode_${_policy}
           COMMAND ${Python_EXECUTABLE} ${PROJECT_SOURCE_DIR}/examples/python/tinycode_torch.py --policy ${_policy}
                   --keep 0.1 --docs 2 --check-against ${PROJECT_SOURCE_DIR}/docs/results/tinycode-full.json)
  set_tests_properties(examples.python_tinycode_${_policy} PROPERTIES ENVIRONMENT "${_kvevict_python_env}"
                                                                   LABELS python TIMEOUT 600)
endforeach()

# The same over 2 processes (torch.distributed, gloo) splitting the KV heads, each evicting its heads with
# select_layers(shard=...): the single-process demo's losses within the same tolerance (docs/algorithms.md#sharded).
foreach(_policy adakv layer-defensivekv)
  add_test(NAME examples.python_tinycode_gloo_${_policy}
           COMMAND ${Python_EXECUTABLE} ${PROJECT_SOURCE_DIR}/examples/python/tinycode_torch.py --policy ${_policy}
                   --keep 0.1 --docs 2 --tensor-parallel 2
                   --check-against ${PROJECT_SOURCE_DIR}/docs/results/tinycode-full.json)
  set_tests_properties(examples.python_tinycode_gloo_${_policy} PROPERTIES ENVIRONMENT "${_kvevict_python_env}"
                                                                        LABELS python TIMEOUT 600 RUN_SERIAL ON)
endforeach()

# The install: the module lands in KVEVICT_PYTHON_INSTALL_DIR under the prefix and imports from there (not run for an
# absolute KVEVICT_PYTHON_INSTALL_DIR, which a scratch prefix would not contain).
if(NOT IS_ABSOLUTE "${KVEVICT_PYTHON_INSTALL_DIR}")
  add_test(NAME python.install
         COMMAND ${CMAKE_COMMAND} -DBUILD=${CMAKE_BINARY_DIR} -DPREFIX=${CMAKE_CURRENT_BINARY_DIR}/python_install
                 -DPYTHON=${Python_EXECUTABLE} -DSITE=${KVEVICT_PYTHON_INSTALL_DIR}
                 -P ${PROJECT_SOURCE_DIR}/python/tests/install_check.cmake)
  set_tests_properties(python.install PROPERTIES LABELS python TIMEOUT 300)
endif()
