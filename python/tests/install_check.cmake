# python.install: `cmake --install --component python` into a scratch prefix puts the module where that prefix's
# interpreter finds it (KVEVICT_PYTHON_INSTALL_DIR), and it imports from there and selects.
#   cmake -DBUILD=<build dir> -DPREFIX=<scratch> -DPYTHON=<interpreter> -DSITE=<dir relative to PREFIX> -P install_check.cmake
file(REMOVE_RECURSE "${PREFIX}")
execute_process(COMMAND "${CMAKE_COMMAND}" --install "${BUILD}" --component python --prefix "${PREFIX}"
                RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "cmake --install --component python failed (${rc})")
endif()
file(GLOB modules "${PREFIX}/${SITE}/kvevict*.so")
if(NOT modules)
  message(FATAL_ERROR "no kvevict module under ${PREFIX}/${SITE}")
endif()
set(ENV{PYTHONPATH} "${PREFIX}/${SITE}")
execute_process(
  COMMAND "${PYTHON}" -c "import numpy as np, kvevict; assert kvevict.__file__.startswith('${PREFIX}'), kvevict.__file__; \
k = np.random.default_rng(0).standard_normal((2, 64, 8)).astype(np.float32); \
q = np.random.default_rng(1).standard_normal((4, 8, 8)).astype(np.float32); \
s = kvevict.select('snapkv', keys=k, q_window=q, keep=0.25); assert s.total == 32, s; print(kvevict.__file__, s)"
  RESULT_VARIABLE rc)
if(NOT rc EQUAL 0)
  message(FATAL_ERROR "the installed module does not import or select (${rc})")
endif()
