// ODR test, unit A: includes the umbrella header (through odr.hpp) and instantiates the presets; built with
// KVEVICT_OPENMP where the compiler has OpenMP (unit B never is), so both threading modes share one program.
#include <kvevict/kvevict.hpp>

#include "odr.hpp"

kvevict_odr::Result kvevict_odr::run_a() { return run_presets<0>(); }
