// Fuzz target: the safetensors reader of tools/ (what kvevict-select reads files with).
//
// Property: any byte string either parses into a file whose every tensor can be read back (within the data
// section, element count equal to the shape's product), or is refused with safetensors::error. Any other
// exception, crash, sanitizer report or hang is a finding.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <vector>

#include "safetensors.hpp"

namespace st = safetensors;

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::vector<unsigned char> bytes(data, data + size);
  try {
    const st::file f = st::file::parse(std::move(bytes), "fuzz");
    for (const st::tensor_info& t : f.tensors()) {
      const std::int64_t n = t.numel();
      std::size_t read = 0;
      if (t.type == st::dtype::F64 || t.type == st::dtype::F32 || t.type == st::dtype::F16 || t.type == st::dtype::BF16)
        read = f.read_floats<float>(t).size();
      else if (t.type == st::dtype::I64 || t.type == st::dtype::I32)
        read = f.read_i64(t).size();
      else
        continue;
      if (read != static_cast<std::size_t>(n)) std::abort();  // a tensor read back with the wrong element count
    }
  } catch (const st::error&) {
    // refused with a message: the expected outcome for malformed input
  }
  return 0;
}
