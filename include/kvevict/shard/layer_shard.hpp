#pragma once
/// Sharded selection of one layer (docs/algorithms.md#sharded): this rank's KV heads of a layer whose heads are split
/// across tensor-parallel ranks, and the top-k the allocations rank them with.

#include <string>
#include <vector>

#include "kvevict/core/inputs.hpp"
#include "kvevict/shard/top_k.hpp"

namespace kvevict::shard {

/// This rank's part of one layer: `comm` connects the ranks that hold the layer's KV heads (a tensor-parallel
/// group), `kv_heads` the global ids of the heads this rank's LayerInputs hold, in their order (ascending), and
/// `layer` the layer's id. Policy::select(in, budget, shard) keeps, for these heads, exactly what the one-rank
/// selection of the whole layer keeps. A scheduled allocation (PyramidKV) also needs `layers`, the model's evicted
/// layers, `layer` being then the layer's place among them (select(in, budget, layer, layers)).
struct LayerShard {
  Communicator* comm = nullptr;
  std::vector<Index> kv_heads;
  Index layer = 0;
  Index layers = 0;
};

/// The top-k of a sharded layer (the allocations' `top_k`, extend::LocalTopK's counterpart): one shard::top_k_counts
/// over every rank's map of the layer.
struct LayerTopK {
  const LayerShard* shard = nullptr;
  Index layer_heads = 0;  ///< the layer's KV heads on all ranks

  template <class S, class Pred>
  std::vector<Index> operator()(const extend::ScoreMap<S>& map, Index k, Pred eligible) const {
    const std::vector<ShardMap<S>> maps{{&map, shard->layer, shard->kv_heads}};
    return top_k_counts(*shard->comm, maps, k, [&](std::size_t, std::size_t f) { return eligible(f); }).front();
  }
  template <class S>
  Index heads(const extend::ScoreMap<S>& /*map*/) const {
    return layer_heads;
  }
};

}  // namespace kvevict::shard
