// Fuzz target: kvevict-select's argument parsing, tensor validation and every policy, on bytes in memory.
//
// Input layout: command-line arguments separated by NUL bytes, then an empty argument (two NULs in a row), then
// a safetensors file. The harness runs exactly what the tool runs (parse_options, then select_layers of
// tools/select_run.hpp) with INPUT and OUTPUT appended to the arguments.
//
// Property: either the tool refuses (usage_error, input_error, safetensors::error or kvevict::invalid_argument,
// each with a message) or every layer's Selection is well formed: one segment per KV head of the layer's keys,
// indices ascending, unique and inside [0, L), lengths summing to the total. Any other exception, crash, sanitizer
// report or hang is a finding.

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <string>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "options.hpp"  // src/runtime/
#include "safetensors.hpp"
#include "select_run.hpp"

namespace st = safetensors;
namespace tools = kvevict::tools;
namespace runtime = kvevict::runtime;

namespace {

void check_selections(const st::file& in, const std::vector<kvevict::Selection>& selections) {
  for (std::size_t l = 0; l < selections.size(); ++l) {
    const st::tensor_info& keys = in.at("layers." + std::to_string(l) + ".keys");
    const kvevict::Selection& s = selections[l];
    // A ragged layer (layers.{l}.lengths) selects over its longest head, at most the padded rows.
    if (s.heads() != keys.shape.at(0) || s.context_length() > keys.shape.at(1)) std::abort();
    if (!in.find("layers." + std::to_string(l) + ".lengths") && s.context_length() != keys.shape.at(1)) std::abort();
    if (s.positions().size() != s.indices().size()) std::abort();
    kvevict::Index total = 0;
    for (kvevict::Index h = 0; h < s.heads(); ++h) {
      const auto idx = s.head(h);
      for (kvevict::Index i = 0; i < idx.size(); ++i) {
        if (idx[i] < 0 || idx[i] >= s.context_length()) std::abort();
        if (i > 0 && idx[i] <= idx[i - 1]) std::abort();
      }
      total += s.length(h);
    }
    if (total != s.total() || total != static_cast<kvevict::Index>(s.indices().size())) std::abort();
    // Block mode (docs/algorithms.md#layouts): each head's kept block ids are its kept rows / B, ascending.
    if (s.block_size() > 1)
      for (kvevict::Index h = 0; h < s.heads(); ++h) {
        std::vector<std::int64_t> want;
        for (std::int64_t j : s.head(h))
          if (want.empty() || want.back() != j / s.block_size()) want.push_back(j / s.block_size());
        const auto got = s.head_blocks(h);
        if (std::vector<std::int64_t>(got.begin(), got.end()) != want) std::abort();
      }
  }
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  // Split off the arguments: NUL-terminated strings up to the first empty one.
  std::vector<std::string> args = {"kvevict-select"};
  std::size_t pos = 0;
  bool separated = false;
  while (pos < size && args.size() < 64) {
    std::size_t end = pos;
    while (end < size && data[end] != 0) ++end;
    if (end == pos) {  // an empty argument: the file starts after it
      separated = true;
      ++pos;
      break;
    }
    args.emplace_back(reinterpret_cast<const char*>(data + pos), end - pos);
    pos = end + 1;
  }
  if (!separated) return 0;  // not the harness's layout: nothing to run
  args.emplace_back("input.safetensors");
  args.emplace_back("output.safetensors");
  std::vector<char*> argv;
  for (std::string& a : args) argv.push_back(a.data());
  argv.push_back(nullptr);

  try {
    const auto opt = runtime::parse_command_line(static_cast<int>(args.size()), argv.data());
    if (!opt) return 0;  // --help
    std::vector<unsigned char> bytes(data + pos, data + size);
    const st::file in = st::file::parse(std::move(bytes), "fuzz");
    check_selections(in, tools::select_layers(*opt, in));
  } catch (const runtime::usage_error&) {
  } catch (const tools::input_error&) {
  } catch (const st::error&) {
  } catch (const kvevict::invalid_argument&) {
  }
  return 0;
}
