#pragma once
/// Sharded selection (docs/algorithms.md#sharded): the collectives an engine supplies over the ranks that hold one
/// model's shards (tensor-parallel ranks splitting KV heads, pipeline stages splitting layers, or both). kvevict
/// decides what is exchanged, never how: the engine implements all_gather over NCCL, MPI, torch.distributed or
/// anything else.

#include <cstdint>
#include <cstring>
#include <string>
#include <type_traits>
#include <vector>

#include "kvevict/core/error.hpp"

namespace kvevict::shard {

/// One collective, all_gather of plain bytes in rank order. Every rank of the communicator calls the same
/// collectives in the same order with the same byte counts: kvevict's calls depend only on what every rank knows
/// (the sizes of variable parts are gathered first). A collective that fails should throw on every rank (or abort),
/// never leave the others waiting.
class Communicator {
 public:
  virtual ~Communicator() = default;
  /// This rank, in [0, size()).
  virtual int rank() const = 0;
  /// The number of ranks, >= 1.
  virtual int size() const = 0;
  /// recv [size() * bytes] = the `bytes` bytes at `send` of rank 0, then of rank 1, ... (every rank passes the same
  /// `bytes`; recv is written whole on every rank).
  virtual void all_gather(const void* send, std::size_t bytes, void* recv) = 0;
};

/// A communicator of one rank (a layer no other rank shares: ModelShard::layer_group left null).
class SelfCommunicator : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  void all_gather(const void* send, std::size_t bytes, void* recv) override {
    if (bytes > 0) std::memmove(recv, send, bytes);
  }
};

/// Counts what another communicator carries for this rank: bytes sent and collective rounds (the traffic of a
/// sharded selection, for benchmarks and tests).
class CountingCommunicator : public Communicator {
 public:
  explicit CountingCommunicator(Communicator& inner) : inner_(inner) {}
  int rank() const override { return inner_.rank(); }
  int size() const override { return inner_.size(); }
  void all_gather(const void* send, std::size_t bytes, void* recv) override {
    bytes_ += bytes;
    ++rounds_;
    inner_.all_gather(send, bytes, recv);
  }
  std::uint64_t bytes_sent() const { return bytes_; }
  int rounds() const { return rounds_; }

 private:
  Communicator& inner_;
  std::uint64_t bytes_ = 0;
  int rounds_ = 0;
};

/// Every rank's `mine`, in rank order; the vectors may differ in length (the lengths are gathered first, then the
/// items padded to the longest). T: trivially copyable, the same type on every rank.
template <class T>
std::vector<std::vector<T>> all_gather(Communicator& comm, const std::vector<T>& mine) {
  static_assert(std::is_trivially_copyable_v<T>, "shard::all_gather: items must be trivially copyable");
  const auto ranks = static_cast<std::size_t>(comm.size());
  const auto count = static_cast<std::uint64_t>(mine.size());
  std::vector<std::uint64_t> counts(ranks);
  comm.all_gather(&count, sizeof count, counts.data());
  std::uint64_t longest = 0;
  for (std::uint64_t c : counts) longest = c > longest ? c : longest;
  std::vector<std::vector<T>> out(ranks);
  if (longest == 0) return out;
  std::vector<unsigned char> send(static_cast<std::size_t>(longest) * sizeof(T), 0),
      recv(ranks * static_cast<std::size_t>(longest) * sizeof(T));
  if (!mine.empty()) std::memcpy(send.data(), mine.data(), mine.size() * sizeof(T));
  comm.all_gather(send.data(), send.size(), recv.data());
  for (std::size_t r = 0; r < ranks; ++r) {
    out[r].resize(static_cast<std::size_t>(counts[r]));
    if (counts[r] > 0) std::memcpy(out[r].data(), recv.data() + r * send.size(), out[r].size() * sizeof(T));
  }
  return out;
}

/// A check every rank makes together: throws kvevict::invalid_argument on every rank when it fails on any, naming
/// the lowest failing rank and its message, so that no rank goes on to a collective the others never reach.
inline void require_on_every_rank(Communicator& comm, bool ok, const char* where, const std::string& message) {
  const std::string text = message.empty() ? std::string("failed") : message;
  const std::vector<char> mine = ok ? std::vector<char>{} : std::vector<char>(text.begin(), text.end());
  const std::vector<std::vector<char>> all = all_gather(comm, mine);
  for (std::size_t r = 0; r < all.size(); ++r)
    if (!all[r].empty())
      throw invalid_argument(detail::concat("kvevict::", where, ": rank ", r, " of ", all.size(), ": ",
                                            std::string(all[r].begin(), all[r].end())));
}

}  // namespace kvevict::shard

namespace kvevict {

namespace detail {

/// The message of a sharded check, without the "kvevict::<where>: " prefix require_on_every_rank puts back (a
/// layer's "kvevict::<where> (layer i): " becomes "layer i: ").
inline std::string shard_message(const invalid_argument& e, const std::string& where) {
  const std::string text = e.what(), prefix = "kvevict::" + where;
  if (text.compare(0, prefix.size(), prefix) != 0) return text;
  std::string rest = text.substr(prefix.size());
  if (rest.compare(0, 2, ": ") == 0) return rest.substr(2);
  if (rest.compare(0, 2, " (") == 0) {
    const std::size_t close = rest.find("): ");
    if (close != std::string::npos) return rest.substr(2, close - 2) + rest.substr(close + 1);
  }
  return text;
}

}  // namespace detail

}  // namespace kvevict
