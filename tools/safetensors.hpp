#pragma once
/// Safetensors reader/writer for the kvevict command-line tools and examples (header-only, C++17, namespace
/// safetensors; not part of the installed library). The parts, in tools/safetensors/:
///   text.hpp     the error type; escaping and quoting of untrusted text in messages
///   dtype.hpp    element types: names, sizes, parsing; checked element counts
///   convert.hpp  F16/BF16 <-> float/double conversions (decoding through Eigen), little-endian bytes
///   header.hpp   the JSON header: limits, tensor_info, the streaming (SAX) parser
///   reader.hpp   file: open/parse a file, read_floats, read_i64
///   writer.hpp   tensor_out, make_tensor, serialize, write

#include "safetensors/reader.hpp"
#include "safetensors/writer.hpp"
