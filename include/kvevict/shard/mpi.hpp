#pragma once
/// shard::Communicator over MPI (docs/algorithms.md#sharded): MPI_Allgather of bytes on a communicator the engine
/// made. Not part of <kvevict/kvevict.hpp>: include it where <mpi.h> is found and link MPI (CMake: MPI::MPI_CXX).
/// MPI's default error handler aborts every rank on a failed collective, so no rank is left waiting.

// Only MPI's C API is used: skip the deprecated C++ bindings (their casts fail -Wcast-function-type).
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>

#include <algorithm>
#include <climits>
#include <cstddef>
#include <cstring>
#include <vector>

#include "kvevict/shard/communicator.hpp"

namespace kvevict::shard {

class MpiCommunicator : public Communicator {
 public:
  /// The ranks of `comm` (MPI_COMM_WORLD by default); MPI must be initialised and outlive this object.
  explicit MpiCommunicator(MPI_Comm comm = MPI_COMM_WORLD) : comm_(comm) {
    MPI_Comm_rank(comm_, &rank_);
    MPI_Comm_size(comm_, &size_);
  }
  int rank() const override { return rank_; }
  int size() const override { return size_; }
  /// Chunks of at most INT_MAX bytes (MPI counts are int).
  void all_gather(const void* send, std::size_t bytes, void* recv) override {
    const auto ranks = static_cast<std::size_t>(size_);
    if (bytes <= static_cast<std::size_t>(INT_MAX)) {
      check(MPI_Allgather(send, static_cast<int>(bytes), MPI_BYTE, recv, static_cast<int>(bytes), MPI_BYTE, comm_));
      return;
    }
    std::vector<unsigned char> part;
    for (std::size_t first = 0; first < bytes; first += static_cast<std::size_t>(INT_MAX)) {
      const std::size_t n = std::min(bytes - first, static_cast<std::size_t>(INT_MAX));
      part.resize(n * ranks);
      check(MPI_Allgather(static_cast<const unsigned char*>(send) + first, static_cast<int>(n), MPI_BYTE, part.data(),
                          static_cast<int>(n), MPI_BYTE, comm_));
      for (std::size_t r = 0; r < ranks; ++r)
        std::memcpy(static_cast<unsigned char*>(recv) + r * bytes + first, part.data() + r * n, n);
    }
  }

 private:
  void check(int code) const {
    kvevict::detail::require(code == MPI_SUCCESS, "shard::MpiCommunicator::all_gather",
                             "MPI_Allgather failed with code ", code, " on rank ", rank_, " of ", size_);
  }
  MPI_Comm comm_;
  int rank_ = 0;
  int size_ = 1;
};

}  // namespace kvevict::shard
