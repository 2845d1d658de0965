#pragma once
// shard::Communicator over threads of one process: the tests' ranks. all_gather is two barriers around a shared slot
// per rank; a rank that waits more than 60 s throws (a test that would hang fails instead).

#include <kvevict/shard/communicator.hpp>

#include <chrono>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <memory>
#include <mutex>
#include <stdexcept>
#include <thread>
#include <vector>

namespace kvevict_test {

/// The state the ranks of one run share.
class ThreadGroup {
 public:
  explicit ThreadGroup(int size) : size_(size), slots_(static_cast<std::size_t>(size)) {}
  int size() const { return size_; }

  void all_gather(int rank, const void* send, std::size_t bytes, void* recv) {
    slots_[static_cast<std::size_t>(rank)].assign(static_cast<const unsigned char*>(send),
                                                  static_cast<const unsigned char*>(send) + bytes);
    barrier();
    for (int r = 0; r < size_; ++r) {
      const auto& slot = slots_[static_cast<std::size_t>(r)];
      if (slot.size() != bytes) throw std::logic_error("all_gather: ranks passed different byte counts");
      if (bytes > 0)
        std::memcpy(static_cast<unsigned char*>(recv) + static_cast<std::size_t>(r) * bytes, slot.data(), bytes);
    }
    barrier();  // nobody writes its slot again before every rank has read
  }

 private:
  void barrier() {
    std::unique_lock<std::mutex> lock(mutex_);
    const unsigned long generation = generation_;
    if (++arrived_ == size_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    if (!cv_.wait_for(lock, std::chrono::seconds(60), [&] { return generation_ != generation; }))
      throw std::runtime_error("ThreadGroup: a rank waited 60 s at a collective the others never reached");
  }

  int size_;
  std::vector<std::vector<unsigned char>> slots_;
  std::mutex mutex_;
  std::condition_variable cv_;
  int arrived_ = 0;
  unsigned long generation_ = 0;
};

class ThreadCommunicator : public kvevict::shard::Communicator {
 public:
  ThreadCommunicator(ThreadGroup& group, int rank) : group_(group), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return group_.size(); }
  void all_gather(const void* send, std::size_t bytes, void* recv) override {
    group_.all_gather(rank_, send, bytes, recv);
  }

 private:
  ThreadGroup& group_;
  int rank_;
};

/// Runs rank(r) on `ranks` threads; rethrows the first rank's exception (by rank order) after every thread has ended.
inline void run_threads(int ranks, const std::function<void(int)>& rank) {
  std::vector<std::exception_ptr> errors(static_cast<std::size_t>(ranks));
  std::vector<std::thread> threads;
  for (int r = 0; r < ranks; ++r)
    threads.emplace_back([&, r] {
      try {
        rank(r);
      } catch (...) {
        errors[static_cast<std::size_t>(r)] = std::current_exception();
      }
    });
  for (std::thread& t : threads) t.join();
  for (const std::exception_ptr& e : errors)
    if (e) std::rethrow_exception(e);
}

/// Runs body(comm) on `ranks` threads, one communicator each.
inline void run_ranks(int ranks, const std::function<void(kvevict::shard::Communicator&)>& body) {
  ThreadGroup group(ranks);
  run_threads(ranks, [&](int r) {
    ThreadCommunicator comm(group, r);
    body(comm);
  });
}

/// Runs body(model, stage) on tp * pp threads, a model split as pp pipeline stages of tp tensor-parallel ranks:
/// `model` connects every rank (model rank = stage * tp + tensor-parallel rank), `stage` the tp ranks of its stage.
inline void run_split_ranks(
    int tp, int pp, const std::function<void(kvevict::shard::Communicator&, kvevict::shard::Communicator&)>& body) {
  ThreadGroup model(tp * pp);
  std::vector<std::unique_ptr<ThreadGroup>> stages;
  for (int s = 0; s < pp; ++s) stages.push_back(std::make_unique<ThreadGroup>(tp));
  run_threads(tp * pp, [&](int r) {
    ThreadCommunicator all(model, r), mine(*stages[static_cast<std::size_t>(r / tp)], r % tp);
    body(all, mine);
  });
}

}  // namespace kvevict_test
