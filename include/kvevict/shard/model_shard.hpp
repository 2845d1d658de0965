#pragma once
/// Sharded selection of a model (docs/algorithms.md#sharded): this rank's layers of a model whose layers are split
/// across pipeline stages and whose KV heads are split across tensor-parallel ranks, and the top-k across layers a
/// layer-global allocation ranks them with.

#include <vector>

#include "kvevict/shard/layer_shard.hpp"

namespace kvevict::shard {

/// This rank's part of a model. `comm` connects every rank of the model (all stages, all tensor-parallel ranks);
/// `layer_group` the ranks that hold the same layers as this one, this rank included (its tensor-parallel group;
/// null: no other rank holds them). `layers` are the global ids of this rank's layers, ascending, one per LayerInputs
/// passed to Policy::select(layers, budget, shard); `kv_heads` the global ids of the KV heads this rank holds of each
/// of them (ascending; the same for all its layers, as tensor parallelism splits them).
struct ModelShard {
  Communicator* comm = nullptr;
  Communicator* layer_group = nullptr;
  std::vector<Index> layers;
  std::vector<Index> kv_heads;
};

/// The top-k of a layer-global allocation over layers split across ranks (extend::LocalTopK's across_layers
/// counterpart): one shard::top_k_counts over every rank's maps. `layers[i]` names the i-th scored map of this rank
/// (its layer id and global KV heads); `total` is the model's budget, resolved over every layer of every rank.
struct ModelTopK {
  Communicator* comm = nullptr;
  std::vector<LayerShard> layers;
  Index total = 0;

  template <class S>
  std::vector<std::vector<Index>> across_layers(const std::vector<const extend::ScoreMap<S>*>& maps, Index k) const {
    std::vector<ShardMap<S>> named;
    for (std::size_t i = 0; i < maps.size(); ++i) named.push_back({maps[i], layers[i].layer, layers[i].kv_heads});
    return top_k_counts(*comm, named, k);
  }
};

}  // namespace kvevict::shard
