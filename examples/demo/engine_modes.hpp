#pragma once
/// The demo's engine modes (--engines): each engine's layout and positions (docs/engines.md), the tinycode engine run
/// as that engine would hold its cache, and every selection handed to the engine's adapter (kvevict/adapters/), which
/// must accept it; a configuration the adapter refuses is reported as refused, with the adapter's message.

#include <cstdint>
#include <numeric>
#include <string>
#include <vector>

#include <kvevict/adapters/llama_cpp.hpp>
#include <kvevict/adapters/openvino.hpp>
#include <kvevict/adapters/sglang.hpp>
#include <kvevict/adapters/tensorrt_llm.hpp>
#include <kvevict/adapters/vllm.hpp>
#include <kvevict/kvevict.hpp>

namespace demo {

enum class Adapter { llama_cpp, sglang, vllm, openvino, tensorrt_llm };

/// One engine's way of holding the cache: the layout its storage unit needs, whether it renumbers positions (a
/// K-shift), and a page pool (the tinycode engine's pages, vLLM's plans applied) or slabs.
struct EngineMode {
  std::string name;
  kvevict::Sharing share = kvevict::Sharing::per_head;
  long block = 1;
  bool renumber = false;
  long pages = 0;
  Adapter adapter = Adapter::vllm;
};

/// The modes, in the order docs/engines.md lists the engines' layouts: TensorRT-LLM per head (its sparse KV gather),
/// llama.cpp (one set of cells, K-shift), SGLang (one token map), vLLM (one block table, blocks of 16, by the layout
/// flags and from a page pool) and OpenVINO GenAI (a block table per layer, rotated blocks).
inline const std::vector<EngineMode>& engine_modes() {
  using kvevict::Sharing;
  static const std::vector<EngineMode> modes = {
      {"tensorrt-llm", Sharing::per_head, 1, false, 0, Adapter::tensorrt_llm},
      {"llama.cpp", Sharing::per_model, 1, true, 0, Adapter::llama_cpp},
      {"sglang", Sharing::per_model, 1, false, 0, Adapter::sglang},
      {"vllm", Sharing::per_model, 16, false, 0, Adapter::vllm},
      {"vllm-pages", Sharing::per_model, 16, false, 16, Adapter::vllm},
      {"openvino", Sharing::per_layer, 16, true, 0, Adapter::openvino},
  };
  return modes;
}

inline const EngineMode* find_engine_mode(const std::string& name) {
  for (const EngineMode& m : engine_modes())
    if (m.name == name) return &m;
  return nullptr;
}

/// Hands `layers` (one Selection per layer over the request's L tokens) to the mode's adapter as the engine would;
/// throws kvevict::invalid_argument, naming what the engine cannot hold, when the adapter refuses them.
inline void check_adapter(const EngineMode& m, const std::vector<kvevict::Selection>& layers) {
  namespace a = kvevict::adapters;
  const a::Positions positions = m.renumber ? a::Positions::renumbered : a::Positions::kept;
  const kvevict::Index L = layers.at(0).context_length();
  switch (m.adapter) {
    case Adapter::llama_cpp:
      a::llama_cpp_plan(layers, positions);
      return;
    case Adapter::sglang: {
      std::vector<std::int64_t> slots(static_cast<std::size_t>(L));
      std::iota(slots.begin(), slots.end(), 0);
      a::sglang_plan(layers, slots, positions);
      return;
    }
    case Adapter::vllm: {
      std::vector<std::int64_t> table(static_cast<std::size_t>((L + 15) / 16));
      std::iota(table.begin(), table.end(), 0);
      a::vllm_plan(layers, table, 16, positions);
      return;
    }
    case Adapter::openvino:
      a::openvino_plan(layers, m.block, positions);
      return;
    case Adapter::tensorrt_llm:
      for (const kvevict::Selection& layer : layers) a::tensorrt_llm_sparse_kv({layer});
      return;
  }
}

}  // namespace demo
