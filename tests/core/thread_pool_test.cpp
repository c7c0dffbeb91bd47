// SPDX-License-Identifier: Apache-2.0
// tests/core/thread_pool_test.cpp mirrors include/kvc/backend/cpu/thread_pool.hpp and the ParallelFor contract of
// include/kvc/core/backend.hpp: every item exactly once, worker indices in [0, workers), no two concurrent calls on
// one worker index, and kernels bit-identical to serial.
#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/scorers/key_diff.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/backend/cpu/thread_pool.hpp>
#include <kvc/pipeline/press.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"

#include <atomic>
#include <chrono>
#include <memory>
#include <thread>
#include <vector>

using kvc::Index;

namespace {

/// Records, per item, how many times it ran and on which worker; flags a worker index used by two calls at once.
struct Recorder {
  std::vector<std::atomic<int>> runs;
  std::vector<std::atomic<Index>> worker_of;
  std::vector<std::atomic<int>> busy;  ///< per worker index: calls in flight
  std::atomic<int> overlaps{0}, bad_workers{0};
  Index workers;

  Recorder(Index n, Index w)
      : runs(static_cast<std::size_t>(n)),
        worker_of(static_cast<std::size_t>(n)),
        busy(static_cast<std::size_t>(w)),
        workers(w) {}

  static void call(void* self, Index item, Index worker) {
    auto& r = *static_cast<Recorder*>(self);
    if (worker < 0 || worker >= r.workers) {
      r.bad_workers.fetch_add(1);
      return;
    }
    if (r.busy[static_cast<std::size_t>(worker)].fetch_add(1) != 0)
      r.overlaps.fetch_add(1);
    r.runs[static_cast<std::size_t>(item)].fetch_add(1);
    r.worker_of[static_cast<std::size_t>(item)].store(worker);
    if (item % 7 == 0)  // uneven work, so items migrate between workers
      std::this_thread::sleep_for(std::chrono::microseconds(50));
    r.busy[static_cast<std::size_t>(worker)].fetch_sub(1);
  }
};

}  // namespace

TEST_CASE("thread_pool: every item runs exactly once on a worker in range", "[core][thread_pool]") {
  for (Index threads : {1, 2, 3, 5}) {
    kvc::ThreadPool pool(threads);
    CHECK(pool.workers() == threads);
    kvc::Cpu const cpu = pool.cpu();
    CHECK(cpu.workers() == threads);
    for (Index n : {0, 1, 2, 7, 100, 1000}) {  // repeated runs on one pool, including empty ones
      Recorder rec(n, threads);
      REQUIRE(cpu.parallel.run != nullptr);
      cpu.parallel.run(cpu.parallel.context, n, {&rec, &Recorder::call});
      INFO("threads " << threads << " items " << n);
      CHECK(rec.bad_workers.load() == 0);
      CHECK(rec.overlaps.load() == 0);
      int wrong = 0;
      for (auto const& r : rec.runs)
        wrong += r.load() == 1 ? 0 : 1;
      CHECK(wrong == 0);
    }
  }
}

TEST_CASE("thread_pool: fewer than one thread means serial, and the caller is worker 0", "[core][thread_pool]") {
  kvc::ThreadPool zero(0);
  CHECK(zero.workers() == 1);
  CHECK(zero.cpu().workers() == 1);  // one scratch copy: kernels run serially
  CHECK(kvc::Cpu{}.workers() == 1);
  kvc::ThreadPool pool(3);
  Recorder rec(64, 3);
  std::thread::id const caller = std::this_thread::get_id();
  struct Ctx {
    Recorder* rec;
    std::thread::id caller;
    std::atomic<int> worker0_elsewhere{0};
  } ctx{&rec, caller};
  kvc::Cpu const cpu = pool.cpu();
  cpu.parallel.run(cpu.parallel.context, 64, {&ctx, [](void* p, Index item, Index worker) {
                                                auto& c = *static_cast<Ctx*>(p);
                                                if (worker == 0 && std::this_thread::get_id() != c.caller)
                                                  c.worker0_elsewhere.fetch_add(1);
                                                Recorder::call(c.rec, item, worker);
                                              }});
  CHECK(ctx.worker0_elsewhere.load() == 0);
  CHECK(rec.overlaps.load() == 0);
}

TEST_CASE("thread_pool: runs from two threads at once are serialised, each item still exactly once",
          "[core][thread_pool]") {
  kvc::ThreadPool pool(3);
  kvc::Cpu const cpu = pool.cpu();
  Recorder a(300, 3), b(500, 3);
  std::atomic<int> in_run{0}, concurrent{0};
  struct Ctx {
    Recorder* rec;
    std::atomic<int>* in_run;
    std::atomic<int>* concurrent;
  };
  auto fn = [](void* p, Index item, Index worker) {
    auto& c = *static_cast<Ctx*>(p);
    if (item == 0 && c.in_run->fetch_add(1) != 0)  // another run's first item is still in flight
      c.concurrent->fetch_add(1);
    Recorder::call(c.rec, item, worker);
    if (item == 0)
      c.in_run->fetch_sub(1);
  };
  Ctx ca{&a, &in_run, &concurrent}, cb{&b, &in_run, &concurrent};
  std::thread t1([&] { cpu.parallel.run(cpu.parallel.context, 300, {&ca, fn}); });
  std::thread t2([&] { cpu.parallel.run(cpu.parallel.context, 500, {&cb, fn}); });
  t1.join();
  t2.join();
  CHECK(concurrent.load() == 0);
  for (Recorder* r : {&a, &b}) {
    int wrong = 0;
    for (auto const& x : r->runs)
      wrong += x.load() == 1 ? 0 : 1;
    CHECK(wrong == 0);
    CHECK(r->overlaps.load() == 0);
    CHECK(r->bad_workers.load() == 0);
  }
}

TEST_CASE("thread_pool: KeyDiff scores, selection and compaction are bit-identical to serial", "[core][thread_pool]") {
  kvc::KVExtents const e{3, 4, 700, 32};  // > 2 accumulation blocks per head
  auto c = kvc::tools::HostCache<float>::random(e, 2024);
  c.track(700);
  c.lengths = {700, 13, 0, 699, 1, 256, 257, 700, 512, 3, 640, 2};  // ragged per-head lengths, empty heads too
  kvc::ThreadPool pool(3);
  kvc::Cpu const par = pool.cpu();
  for (auto const scorer : {kvc::KeyDiffScorer{}, kvc::KeyDiffScorer{kvc::KeyDiffAnchor::raw_mean}}) {
    kvc::test::OwnedScores serial(3, 4, 700), parallel(3, 4, 700);
    kvc::test::OwnedWorkspace ws1(kvc::score_workspace_bytes(kvc::Cpu{}, scorer, e));
    kvc::test::OwnedWorkspace ws3(kvc::score_workspace_bytes(par, scorer, e));
    CHECK(ws3.bytes.size() >= ws1.bytes.size());
    REQUIRE(kvc::score(kvc::Cpu{}, scorer, c.view(), serial.span, ws1.get()).ok());
    REQUIRE(kvc::score(par, scorer, c.view(), parallel.span, ws3.get()).ok());
    CHECK(serial.data == parallel.data);
  }
  // The whole press, then compaction of two copies.
  kvc::Press const press{kvc::KeyDiffScorer{}, kvc::TopKSelector{kvc::RatioBudget{0.6}, 2, 8}};
  kvc::test::OwnedWorkspace ws1(kvc::compress_workspace_bytes(kvc::Cpu{}, press, e));
  kvc::test::OwnedWorkspace ws3(kvc::compress_workspace_bytes(par, press, e));
  kvc::test::OwnedPlan a(3, 4, 700), b(3, 4, 700);
  REQUIRE(kvc::compress(kvc::Cpu{}, press, c.view(), a.plan, ws1.get()).ok());
  REQUIRE(kvc::compress(par, press, c.view(), b.plan, ws3.get()).ok());
  CHECK(a.count == b.count);
  for (Index bb = 0; bb < 3; ++bb)
    for (Index h = 0; h < 4; ++h)
      CHECK(a.kept(bb, h) == b.kept(bb, h));
  auto x = c, y = c;
  REQUIRE(kvc::compact(kvc::Cpu{}, a.plan, x.view()).ok());
  REQUIRE(kvc::compact(par, b.plan, y.view()).ok());
  CHECK(x.k == y.k);
  CHECK(x.v == y.v);
  CHECK(x.positions == y.positions);
  CHECK(x.lengths == y.lengths);
}
