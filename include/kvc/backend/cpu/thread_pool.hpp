// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/thread_pool.hpp: a small std::thread pool that implements kvc::ParallelFor. Engines with their
// own pools implement ParallelFor directly; this one serves tools, tests and benchmarks.
#pragma once

#include <kvc/core/backend.hpp>

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <mutex>
#include <thread>
#include <vector>

namespace kvc {

/// `threads` workers (the caller is worker 0, so threads - 1 are spawned). Items are handed out dynamically from
/// an atomic counter; each run blocks until every item is done. One run at a time (runs are serialised).
class ThreadPool {
 public:
  explicit ThreadPool(Index threads) : workers_(threads < 1 ? 1 : threads) {
    for (Index w = 1; w < workers_; ++w)
      threads_.emplace_back([this, w] { loop(w); });
  }
  ThreadPool(ThreadPool const&) = delete;
  ThreadPool& operator=(ThreadPool const&) = delete;
  ~ThreadPool() {
    {
      std::lock_guard lock(mutex_);
      stop_ = true;
    }
    wake_.notify_all();
    for (auto& t : threads_)
      t.join();
  }

  Index workers() const noexcept { return workers_; }

  /// The backend tag that runs kernels on this pool.
  Cpu cpu() noexcept { return Cpu{ParallelFor{this, &ThreadPool::dispatch, workers_}}; }

 private:
  static void dispatch(void* self, Index n, ParallelFor::Task task) { static_cast<ThreadPool*>(self)->run(n, task); }

  void run(Index n, ParallelFor::Task task) {
    std::lock_guard serial(run_mutex_);
    {
      std::lock_guard lock(mutex_);
      task_ = task;
      n_ = n;
      next_.store(0);
      busy_ = workers_ - 1;
      ++generation_;
    }
    wake_.notify_all();
    work(0);
    std::unique_lock lock(mutex_);
    done_.wait(lock, [this] { return busy_ == 0; });
  }

  void work(Index worker) {
    for (Index i = next_.fetch_add(1); i < n_; i = next_.fetch_add(1))
      task_.fn(task_.context, i, worker);
  }

  void loop(Index worker) {
    std::size_t seen = 0;
    for (;;) {
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return stop_ || generation_ != seen; });
        if (stop_)
          return;
        seen = generation_;
      }
      work(worker);
      {
        std::lock_guard lock(mutex_);
        --busy_;
      }
      done_.notify_one();
    }
  }

  Index workers_;
  std::vector<std::thread> threads_;
  std::mutex run_mutex_, mutex_;
  std::condition_variable wake_, done_;
  ParallelFor::Task task_{};
  Index n_ = 0;
  std::atomic<Index> next_{0};
  Index busy_ = 0;
  std::size_t generation_ = 0;
  bool stop_ = false;
};

}  // namespace kvc
