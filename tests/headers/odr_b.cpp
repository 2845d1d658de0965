// ODR test, unit B: the same umbrella header and presets as unit A, in a second translation unit.
#include <kvevict/kvevict.hpp>

#include "odr.hpp"

kvevict_odr::Result kvevict_odr::run_b() { return run_presets<1>(); }
