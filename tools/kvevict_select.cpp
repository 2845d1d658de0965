// kvevict-select: runs a kvevict policy on tensors dumped from an engine (safetensors in, safetensors out).
//
//   kvevict-select --policy snapkv --keep 0.2 dump.safetensors selection.safetensors
//
// Input, per layer i (layers 0 .. NL-1):
//   layers.{i}.q_window [H, w, d]  or  layers.{i}.window_attention [H, w, L]  (full softmax rows)
//   layers.{i}.keys [Hkv, L, d], layers.{i}.values [Hkv, L, d] (optional for attention-only policies),
//   layers.{i}.w_o [D, H*d] (value-aware policies only)
//   layers.{i}.scores [Hkv, L] (the engine's score of each entry: the engine-score policies only)
//   dtypes F64, F32, F16, BF16 (keys and values in one dtype, the same in every layer: the cache's); keys and
//   values also I8, F8_E4M3 or F8_E5M2 (a quantized cache), each with an
//   optional F32 layers.{i}.keys_scale / values_scale: [] (one factor), [L] or [Hkv, L] (docs/algorithms.md#quantized)
//   Ragged layers (docs/algorithms.md#ragged), both optional, I64 or I32:
//   layers.{i}.lengths [Hkv]      head h holds rows [0, lengths[h]) of keys and values (the rest is padding);
//                                 absent: every head holds all L rows
//   layers.{i}.positions [Hkv, L] original token position of each row, strictly increasing along a head
//                                 (read up to lengths[h]); absent: row j is at position j
// Output, per layer: layers.{i}.kept_indices I64 (rows, heads concatenated, each ascending),
//                    layers.{i}.kept_offsets I64 [Hkv + 1],
//                    layers.{i}.kept_positions I64 (original positions, parallel to kept_indices);
//                    with --block B > 1 (docs/algorithms.md#layouts) also
//                    layers.{i}.kept_blocks I64 (kept block ids, heads concatenated, each ascending; block b = rows
//                                               [bB, bB + B), a head's partial tail block included),
//                    layers.{i}.kept_block_offsets I64 [Hkv + 1] (head h's blocks: [offsets[h], offsets[h + 1])).
// Layout options (every policy): --share head|layer|model, --reduce max|mean, --block B; recorded in the metadata.
// Any bad input: one line on stderr starting with "kvevict-select:" and exit status 1 (2 for usage errors).

#include <cstdio>
#include <cstdlib>
#include <exception>
#include <iostream>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "kvevict/kvevict.hpp"
#include "options.hpp"  // src/runtime/
#include "safetensors.hpp"
#include "select_run.hpp"

namespace {

namespace st = safetensors;

int run(const kvevict::runtime::Options& opt) {
  const std::vector<kvevict::Selection> selections = kvevict::tools::select_layers(opt, st::file::open(opt.input));
  std::vector<st::tensor_out> out;
  for (std::size_t i = 0; i < selections.size(); ++i) {
    const kvevict::Selection& sel = selections[i];
    const std::string prefix = "layers." + std::to_string(i) + ".";
    out.push_back(st::make_tensor_i64(prefix + "kept_indices", {sel.total()}, sel.indices()));
    out.push_back(st::make_tensor_i64(prefix + "kept_offsets", {sel.heads() + 1}, sel.offsets()));
    out.push_back(st::make_tensor_i64(prefix + "kept_positions", {sel.total()}, sel.positions()));
    if (opt.block() > 1) {
      out.push_back(st::make_tensor_i64(prefix + "kept_blocks", {static_cast<kvevict::Index>(sel.blocks().size())},
                                        sel.blocks()));
      out.push_back(st::make_tensor_i64(prefix + "kept_block_offsets", {sel.heads() + 1}, sel.block_offsets()));
    }
  }
  st::write(opt.output, out, opt.metadata());
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    const std::optional<kvevict::runtime::Options> opt = kvevict::runtime::parse_command_line(argc, argv);
    if (!opt) return 0;  // --help
    return run(*opt);
  } catch (const kvevict::runtime::usage_error& e) {
    std::cerr << "kvevict-select: " << e.what() << " (see --help)\n";
    return 2;
  } catch (const std::exception& e) {
    std::cerr << "kvevict-select: " << e.what() << '\n';
    return 1;
  } catch (...) {
    std::cerr << "kvevict-select: unknown error\n";
    return 1;
  }
}
