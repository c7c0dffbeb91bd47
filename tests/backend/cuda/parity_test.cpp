// SPDX-License-Identifier: Apache-2.0
// tests/backend/cuda/parity_test.cpp: CUDA kernels against the CPU reference (the oracle), for every CUDA kernel:
// the scorers (fp32/fp16/bf16; BHTD, BTHD and paged layouts; per-sequence and per-head lengths), top-k (ratio,
// fixed and device per-head budgets), compaction, gather, append and attention. Tolerances are in docs/numerics.md.
// Without a CUDA device every case prints "SKIPPED: no CUDA device" and ctest reports it skipped.
#include <kvc/backend/cpu/attention/attend.hpp>
#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/scorers/key_diff.hpp>
#include <kvc/backend/cpu/scorers/knorm.hpp>
#include <kvc/backend/cpu/scorers/random.hpp>
#include <kvc/backend/cpu/scorers/snap_kv.hpp>
#include <kvc/backend/cpu/scorers/streaming_llm.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/pipeline/blockwise.hpp>

#include "backend/cuda/cuda_kernels.hpp"
#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <string>
#include <vector>

using kvc::Index;
namespace kc = kvc::test::cuda;

#define KVC_REQUIRE_DEVICE()                               \
  do {                                                     \
    if (!kc::device_available()) {                         \
      WARN("SKIPPED: no CUDA device: parity not checked"); \
      return;                                              \
    }                                                      \
  } while (0)

namespace {

/// A random case: keys shifted off zero (KeyDiff needs an anchor), values, window queries scaled so attention is
/// not uniform, ragged lengths.
kc::Case random_case(kvc::KVExtents e, Index query_heads, Index window, bool per_head, std::uint64_t seed) {
  kc::Case c;
  c.e = e;
  auto const kv = kvc::tools::HostCache<float>::random(e, seed);
  c.k = kv.k;
  c.v = kv.v;
  for (float& x : c.k)
    x += 0.3f;
  if (per_head) {
    c.per_head = true;
    for (Index b = 0; b < e.batch; ++b)
      for (Index h = 0; h < e.heads; ++h)
        c.lengths.push_back(std::max<Index>(window + 1, e.tokens - 7 * h - 3 * b));
  } else {
    for (Index b = 0; b < e.batch; ++b)
      c.lengths.push_back(std::max<Index>(window + 1, e.tokens - 5 * b));
  }
  c.q_ext = {e.batch, query_heads, window, e.dim};
  auto const q = kvc::tools::HostCache<float>::random(c.q_ext, seed + 1);
  c.queries = q.k;
  for (float& x : c.queries)
    x *= 2.5f;
  return c;
}

/// The same case as a host cache of element type T (narrowed with the same rounding as the device side).
template <class T>
kvc::tools::HostCache<T> host_cache(kc::Case const& c) {
  kvc::tools::HostCache<T> h(c.e, c.dim_v > 0 ? c.dim_v : -1);
  for (std::size_t i = 0; i < c.k.size(); ++i)
    h.k[i] = kvc::from_float<T>(c.k[i]);
  for (std::size_t i = 0; i < c.v.size(); ++i)
    h.v[i] = kvc::from_float<T>(c.v[i]);
  h.lengths = c.lengths;
  h.per_head = c.per_head;
  h.positions = c.positions;
  return h;
}

template <class T>
std::vector<float> cpu_scores(std::string const& policy, kc::Case const& c) {
  auto const h = host_cache<T>(c);
  std::vector<T> q(c.queries.size());
  for (std::size_t i = 0; i < q.size(); ++i)
    q[i] = kvc::from_float<T>(c.queries[i]);
  kvc::test::OwnedRope const rope({}, c.e.dim, 4096);
  kvc::WindowQueries<T> wq{kvc::TokenRows<T const, kvc::StridedLayout>(q.data(), kvc::bhtd_layout(c.q_ext))};
  if (c.pre_rope)
    wq.rope = rope.table;
  auto const obs = kvc::observe(wq);
  kvc::test::OwnedScores out(c.e.batch, c.e.heads, c.e.tokens);
  auto run = [&](auto scorer) {
    kvc::test::OwnedWorkspace ws(kvc::score_workspace_bytes(kvc::Cpu{}, scorer, c.e, obs));
    REQUIRE(kvc::score(kvc::Cpu{}, scorer, h.view(), obs, out.span, ws.get()).ok());
  };
  Index const w = c.q_ext.tokens;
  if (policy == "key_diff")
    run(kvc::KeyDiffScorer{});
  else if (policy == "key_diff_raw")
    run(kvc::KeyDiffScorer{.anchor = kvc::KeyDiffAnchor::raw_mean});
  else if (policy == "knorm")
    run(kvc::KnormScorer{});
  else if (policy == "streaming_llm")
    run(kvc::StreamingLLMScorer{4});
  else if (policy == "random")
    run(kvc::RandomScorer{11});
  else if (policy == "snap_kv")
    run(kvc::SnapKVScorer{.window_size = w, .kernel_size = 5});
  else if (policy == "snap_kv_kvpress") {
    auto s = kvc::SnapKVScorer::kvpress();
    s.window_size = w;
    run(s);
  } else if (policy == "tova")
    run(kvc::TOVAScorer{});
  else if (policy == "tova_kvpress")
    run(kvc::TOVAScorer{kvc::Reference::kvpress});
  return out.data;
}

/// Scores agree where finite within `rel` of the larger magnitude (and `abs` near zero); -inf padding exactly.
void require_close(std::vector<float> const& gpu, std::vector<float> const& cpu, float rel, float abs) {
  REQUIRE(gpu.size() == cpu.size());
  for (std::size_t i = 0; i < cpu.size(); ++i) {
    if (std::isinf(cpu[i])) {
      REQUIRE(gpu[i] == cpu[i]);
      continue;
    }
    REQUIRE(std::abs(gpu[i] - cpu[i]) <= std::max(abs, rel * std::max(std::abs(cpu[i]), std::abs(gpu[i]))));
  }
}

}  // namespace

TEST_CASE(
    "cuda: every scorer matches the CPU for fp32/fp16/bf16, BHTD/BTHD/paged, per-sequence and per-head "
    "lengths (fp32 1e-5, 16-bit 1e-4 relative)",
    "[cuda][scorers]") {
  KVC_REQUIRE_DEVICE();
  for (char const* policy :
       {"key_diff", "knorm", "streaming_llm", "random", "snap_kv", "snap_kv_kvpress", "tova", "tova_kvpress"})
    for (auto dtype : {kc::Dtype::f32, kc::Dtype::f16, kc::Dtype::bf16})
      for (auto layout : {kc::Layout::bhtd, kc::Layout::bthd, kc::Layout::paged})
        for (bool per_head : {false, true}) {
          bool const tova = std::string(policy).rfind("tova", 0) == 0;
          if (tova && per_head)
            continue;  // TOVA needs equal lengths within a sequence
          auto c = random_case({2, 2, 300, 64}, 4, 8, per_head, 17);
          c.dtype = dtype;
          c.layout = layout;
          c.pre_rope = std::string(policy) == "snap_kv";
          INFO(policy << " dtype " << static_cast<int>(dtype) << " layout " << static_cast<int>(layout) << " per_head "
                      << per_head);
          std::vector<float> gpu;
          REQUIRE(kc::scores(policy, c, gpu) == "");
          std::vector<float> cpu = dtype == kc::Dtype::f32   ? cpu_scores<float>(policy, c)
                                   : dtype == kc::Dtype::f16 ? cpu_scores<kvc::half>(policy, c)
                                                             : cpu_scores<kvc::bfloat16>(policy, c);
          float const rel = dtype == kc::Dtype::f32 ? 1e-5f : 1e-4f;
          require_close(gpu, cpu, rel, rel);
        }
}

TEST_CASE(
    "cuda: Knorm and KeyDiff (both anchors) match the CPU on their range paths: fp32 keys at 1e20, 3e38 and "
    "1e-25, bf16 keys at 1e30 (1e-5 / 1e-4 relative)",
    "[cuda][scorers][range]") {
  KVC_REQUIRE_DEVICE();
  // Six heads, one flavour each (docs/numerics.md, "Range"); `big` is 1e20 for fp32 keys and 1e30 for bf16 keys.
  //   (0, 0) ordinary rows mixed with rows at big (squares overflow fp32: fp64 norms and cosines), rows with one
  //          element at -3e38, one row of 3e38 everywhere (a norm past FLT_MAX: Knorm's -inf), rows at 1e-25
  //          (squares underflow fp32: fp64) and rows at 1e10 (in range, but their dot with the raw anchor, ~1e36,
  //          overflows fp32 unless it is scaled);
  //   (0, 1) every row at big;
  //   (0, 2) rows on either side of the fp32 range's edges: |x| = 2^-48 (sum of squares 2^-90 at d = 64: in
  //          range), 2^-48 (1 - 2^-8) (just below: fp64), 2^61 (1 - 2^-8) (just below FLT_MAX: fp32), 2^61
  //          (2^128: fp64), with every sum exact in any order;
  //   (1, 0) every row at 1e-25;
  //   (1, 1) every element at 3e38 / 8 (norms around FLT_MAX, some past it);
  //   (1, 2) rows of +-2^-14 in pairs that cancel exactly and one last row of 2^-26 * {+-1, +-2, +-3}: the raw
  //          anchor is ~1e-10 (below the 1e-8 floor), exact in any order, and the scores are ~1e-2, not ~0.
  // Every raw anchor, and (1, 0)'s unit anchor, leaves [2^-64, 2^64]: the power-of-two scaling (CUDA: the
  // shared-memory atomicMax of the exponents) runs. 2500 tokens: two splits, so the fp64 partial anchors combine.
  for (auto dtype : {kc::Dtype::f32, kc::Dtype::bf16})
    for (auto layout : {kc::Layout::bhtd, kc::Layout::paged})
      for (bool per_head : {false, true}) {
        auto c = random_case({2, 3, 2500, 64}, 6, 8, per_head, 23);
        c.dtype = dtype;
        c.layout = layout;
        float const big = dtype == kc::Dtype::bf16 ? 1e30f : 1e20f;
        Index const d = c.e.dim, heads = c.e.heads, tokens = c.e.tokens;
        for (Index b = 0; b < 2; ++b)
          for (Index h = 0; h < heads; ++h) {
            Index const n = c.lengths[static_cast<std::size_t>(per_head ? b * heads + h : b)];
            Index const pairs_end = (n - 1) / 2 * 2;  // (1, 2): rows [0, pairs_end) in pairs, then the last row
            for (Index t = 0; t < tokens; ++t) {
              float* row = &c.k[static_cast<std::size_t>(((b * heads + h) * tokens + t) * d)];
              auto const flavour = b * heads + h;
              if (flavour == 2) {
                float const edge[] = {0x1p-48f, 0x1p-48f * (1.0f - 0x1p-8f), 0x1p61f * (1.0f - 0x1p-8f), 0x1p61f};
                if (t % 5 < 4)
                  for (Index i = 0; i < d; ++i)
                    row[i] = std::copysign(edge[t % 5], row[i]);
                continue;
              }
              if (flavour == 5) {
                for (Index i = 0; i < d; ++i) {
                  if (t < pairs_end)  // row 2j + 1 is -row 2j: the sign pattern of row 2j
                    row[i] = ((t % 2 == 1) != ((((t / 2) * 7 + i * 3) % 5) < 2) ? 0x1p-14f : -0x1p-14f);
                  else if (t < n - 1)
                    row[i] = 0.0f;
                  else if (t == n - 1)
                    row[i] = 0x1p-26f * static_cast<float>(static_cast<int>((i * 5 + 1) % 7) - 3);
                }
                continue;
              }
              float scale = 1.0f;
              if (flavour == 0)
                scale = t % 7 == 1 ? big : t % 11 == 5 ? 1e-25f : t % 13 == 6 ? 1e10f : 1.0f;
              else
                scale = flavour == 1 ? big : flavour == 3 ? 1e-25f : 3e38f / 8.0f;
              for (Index i = 0; i < d; ++i)
                row[i] *= scale;
              if (flavour == 0 && t == 8)
                std::fill_n(row, d, 3e38f);
              else if (flavour == 0 && scale == 1.0f && t % 7 == 3)
                row[t % d] = -3e38f;
            }
          }
        for (char const* policy : {"knorm", "key_diff", "key_diff_raw"}) {
          INFO(policy << " dtype " << static_cast<int>(dtype) << " layout " << static_cast<int>(layout) << " per_head "
                      << per_head);
          std::vector<float> gpu;
          REQUIRE(kc::scores(policy, c, gpu) == "");
          std::vector<float> const cpu =
              dtype == kc::Dtype::f32 ? cpu_scores<float>(policy, c) : cpu_scores<kvc::bfloat16>(policy, c);
          for (float x : cpu)  // the oracle itself: finite, but for Knorm past FLT_MAX and the -inf padding
            REQUIRE((std::isfinite(x) || x == -std::numeric_limits<float>::infinity()));
          float const rel = dtype == kc::Dtype::f32 ? 1e-5f : 1e-4f;
          require_close(gpu, cpu, rel, rel);
        }
      }
}

TEST_CASE("cuda: attention matches the CPU (causal by position, GQA, 16-bit caches)", "[cuda][attention]") {
  KVC_REQUIRE_DEVICE();
  for (auto dtype : {kc::Dtype::f32, kc::Dtype::f16, kc::Dtype::bf16})
    for (auto layout : {kc::Layout::bhtd, kc::Layout::paged}) {
      auto c = random_case({2, 2, 200, 32}, 4, 6, true, 3);
      c.dtype = dtype;
      c.layout = layout;
      std::vector<float> out, lse;
      REQUIRE(kc::attend(c, out, lse) == "");
      auto run_cpu = [&](auto tag) {
        using T = decltype(tag);
        auto const h = host_cache<T>(c);
        std::vector<T> q(c.queries.size());
        for (std::size_t i = 0; i < q.size(); ++i)
          q[i] = kvc::from_float<T>(c.queries[i]);
        kvc::AttendQueries<T> const aq{
            kvc::TokenRows<T const, kvc::StridedLayout>(q.data(), kvc::bhtd_layout(c.q_ext))};
        std::vector<float> o(out.size()), l(lse.size());
        kvc::test::OwnedWorkspace ws(kvc::attend_workspace_bytes(kvc::Cpu{}, kvc::Attention{}, aq, h.view()));
        REQUIRE(kvc::attend(kvc::Cpu{}, kvc::Attention{}, aq, h.view(), {o.data(), l.data()}, ws.get()).ok());
        require_close(out, o, 1e-4f, 1e-5f);
        require_close(lse, l, 1e-5f, 1e-5f);
      };
      if (dtype == kc::Dtype::f32)
        run_cpu(float{});
      else if (dtype == kc::Dtype::f16)
        run_cpu(kvc::half{});
      else
        run_cpu(kvc::bfloat16{});
    }
}

TEST_CASE(
    "cuda: top-k keeps exactly the CPU's set for identical scores (ties, NaN, protection, ragged, ratio, "
    "per-head budgets)",
    "[cuda][selectors]") {
  KVC_REQUIRE_DEVICE();
  kvc::tools::Rng rng(9);
  for (int trial = 0; trial < 48; ++trial) {
    // Most trials take the one-block path; every fourth is long enough for the multi-block path (> 16384 slots).
    Index const batch = 2, heads = 3,
                tokens = trial % 4 == 3 ? 16385 + static_cast<Index>(rng.next() % 60000)
                                        : 1 + static_cast<Index>(rng.next() % 3000);
    std::vector<float> scores(static_cast<std::size_t>(batch * heads * tokens));
    for (float& x : scores) {
      auto const r = rng.next() % 100;
      x = r < 3 ? std::numeric_limits<float>::quiet_NaN() : (r < 6 ? -0.0f : static_cast<float>(rng.next() % 50));
    }
    bool const per_head = trial % 2 == 1;
    std::vector<Index> lengths;
    for (Index i = 0; i < (per_head ? batch * heads : batch); ++i)
      lengths.push_back(static_cast<Index>(rng.next() % static_cast<std::uint64_t>(tokens + 1)));
    Index const fixed = static_cast<Index>(rng.next() % static_cast<std::uint64_t>(tokens + 5));
    Index const n_sink = static_cast<Index>(rng.next() % 5), n_recent = static_cast<Index>(rng.next() % 9);
    double const ratio = trial % 3 == 0 ? 0.37 : -1.0;
    kvc::Lengths const table = per_head ? kvc::head_lengths(lengths.data(), heads) : kvc::Lengths(lengths.data());
    kvc::ScoreSpan<> const span{scores.data(), batch, heads, tokens, table};
    kvc::test::OwnedPlan cpu(batch, heads, tokens);
    auto select_cpu = [&](auto const& sel) {
      kvc::test::OwnedWorkspace ws(kvc::select_workspace_bytes(kvc::Cpu{}, sel, batch, heads, tokens));
      REQUIRE(kvc::select(kvc::Cpu{}, sel, span, cpu.plan, ws.get()).ok());
    };
    if (ratio >= 0)
      select_cpu(kvc::TopKSelector{kvc::RatioBudget{ratio}, n_sink, n_recent});
    else
      select_cpu(kvc::TopKSelector{kvc::FixedBudget{fixed}, n_sink, n_recent});
    std::vector<Index> index, count;
    REQUIRE(kc::top_k(ratio, fixed, n_sink, n_recent, batch, heads, tokens, scores, lengths, per_head, tokens, index,
                      count) == "");
    for (Index bh = 0; bh < batch * heads; ++bh) {
      REQUIRE(count[static_cast<std::size_t>(bh)] == cpu.count[static_cast<std::size_t>(bh)]);
      for (Index j = 0; j < count[static_cast<std::size_t>(bh)]; ++j)
        REQUIRE(index[static_cast<std::size_t>(bh * tokens + j)] ==
                cpu.index[static_cast<std::size_t>(bh * tokens + j)]);
    }
  }
  // A device-resident per-head budget table.
  std::vector<float> scores(2 * 3 * 100);
  for (std::size_t i = 0; i < scores.size(); ++i)
    scores[i] = static_cast<float>((i * 7919) % 101);
  std::vector<Index> const budget = {5, 0, 100, 17, 3, 64};
  kvc::TopKSelector<kvc::PerHeadBudget<>> const sel{kvc::PerHeadBudget<>{budget.data(), 3}};
  kvc::test::OwnedPlan cpu(2, 3, 100);
  kvc::test::OwnedWorkspace ws(kvc::select_workspace_bytes(kvc::Cpu{}, sel, 2, 3, 100));
  REQUIRE(kvc::select(kvc::Cpu{}, sel, kvc::ScoreSpan<>{scores.data(), 2, 3, 100}, cpu.plan, ws.get()).ok());
  std::vector<Index> index, count;
  REQUIRE(kc::top_k_per_head(budget, 2, 3, 100, scores, index, count) == "");
  CHECK(count == cpu.count);
  for (Index bh = 0; bh < 6; ++bh)
    for (Index j = 0; j < count[static_cast<std::size_t>(bh)]; ++j)
      REQUIRE(index[static_cast<std::size_t>(bh * 100 + j)] == cpu.index[static_cast<std::size_t>(bh * 100 + j)]);
  // A plan too small for the most a head can keep is an error, not a silent clamp.
  std::vector<Index> small_index, small_count;
  std::vector<Index> const no_lengths;
  CHECK(kc::top_k(-1, 50, 0, 0, 2, 3, 100, scores, no_lengths, false, 10, small_index, small_count) != "");
}

TEST_CASE("cuda: compaction, gather and append produce the CPU's bytes, positions and lengths", "[cuda][pipeline]") {
  KVC_REQUIRE_DEVICE();
  for (auto dtype : {kc::Dtype::f32, kc::Dtype::f16, kc::Dtype::bf16})
    for (auto layout : {kc::Layout::bhtd, kc::Layout::bthd, kc::Layout::paged}) {
      auto c = random_case({2, 4, 300, 64}, 4, 4, true, 3);
      c.dtype = dtype;
      c.layout = layout;
      c.positions.resize(static_cast<std::size_t>(c.e.rows()));
      for (std::size_t i = 0; i < c.positions.size(); ++i)
        c.positions[i] = 3 * (static_cast<Index>(i) % 300) + 1;
      kvc::tools::Rng rng(4);
      kvc::test::OwnedPlan plan(2, 4, 300);
      for (Index bh = 0; bh < 8; ++bh) {
        Index j = 0;
        for (Index t = 0; t < c.lengths[static_cast<std::size_t>(bh)]; ++t)
          if (rng.next() % 3 == 0)
            plan.index[static_cast<std::size_t>(bh * 300 + j++)] = t;
        plan.count[static_cast<std::size_t>(bh)] = j;
      }
      auto run_cpu = [&](auto tag) {
        using T = decltype(tag);
        // gather first (from the uncompacted cache), then compaction in place, then append.
        auto src = host_cache<T>(c);
        kvc::tools::HostCache<T> dst({2, 4, 300, 64});
        dst.track(0);
        REQUIRE(kvc::gather(kvc::Cpu{}, plan.plan, src.view(), dst.view()).ok());
        kc::Case gathered;
        REQUIRE(kc::gather(c, plan.index, plan.count, 300, gathered) == "");
        CHECK(gathered.lengths == dst.lengths);
        for (Index bh = 0; bh < 8; ++bh)
          for (Index j = 0; j < dst.lengths[static_cast<std::size_t>(bh)]; ++j) {
            auto const at = static_cast<std::size_t>(bh * 300 + j);
            REQUIRE(gathered.positions[at] == dst.positions[at]);
            for (Index i = 0; i < 64; ++i)
              REQUIRE(gathered.k[at * 64 + static_cast<std::size_t>(i)] ==
                      kvc::to_float(dst.k[at * 64 + static_cast<std::size_t>(i)]));
          }
        auto host = host_cache<T>(c);
        REQUIRE(kvc::compact(kvc::Cpu{}, plan.plan, host.view()).ok());
        kc::Case gpu = c;
        REQUIRE(kc::compact(gpu, plan.index, plan.count, 300) == "");
        CHECK(gpu.lengths == host.lengths);
        for (Index bh = 0; bh < 8; ++bh)
          for (Index j = 0; j < host.lengths[static_cast<std::size_t>(bh)]; ++j) {
            auto const at = static_cast<std::size_t>(bh * 300 + j);
            REQUIRE(gpu.positions[at] == host.positions[at]);
            for (Index i = 0; i < 64; ++i) {
              REQUIRE(gpu.k[at * 64 + static_cast<std::size_t>(i)] ==
                      kvc::to_float(host.k[at * 64 + static_cast<std::size_t>(i)]));
              REQUIRE(gpu.v[at * 64 + static_cast<std::size_t>(i)] ==
                      kvc::to_float(host.v[at * 64 + static_cast<std::size_t>(i)]));
            }
          }
        // Append 5 tokens of a second case after the compacted lengths.
        auto const fresh = random_case({2, 4, 5, 64}, 4, 1, false, 8);
        auto host_src = host_cache<T>(fresh);
        host_src.lengths.clear();
        REQUIRE(kvc::append(kvc::Cpu{}, host.view(), host_src.view()).ok());
        kc::Case fresh_gpu = fresh;
        fresh_gpu.lengths.clear();
        fresh_gpu.dtype = dtype;
        REQUIRE(kc::append(gpu, fresh_gpu, 0, 5) == "");
        CHECK(gpu.lengths == host.lengths);
        CHECK(gpu.positions == host.positions);
      };
      if (dtype == kc::Dtype::f32)
        run_cpu(float{});
      else if (dtype == kc::Dtype::f16)
        run_cpu(kvc::half{});
      else
        run_cpu(kvc::bfloat16{});
    }
}

TEST_CASE("cuda: the block-wise driver runs on the device and keeps the CPU's positions", "[cuda][pipeline]") {
  KVC_REQUIRE_DEVICE();
  auto c = random_case({2, 3, 200, 32}, 3, 1, false, 21);
  c.lengths = {200, 150};
  for (Index block : {1, 16, 64}) {
    std::vector<Index> lengths, positions;
    REQUIRE(kc::blockwise_key_diff(c, 40, block, lengths, positions) == "");
    kvc::Press const press{kvc::KeyDiffScorer{}, kvc::TopKSelector{kvc::FixedBudget{40}}};
    Index const cap = kvc::blockwise_capacity(press.selector, block);
    auto const src = host_cache<float>(c);
    kvc::tools::HostCache<float> work({2, 3, cap, 32});
    work.track(0);
    kvc::test::OwnedWorkspace ws(kvc::blockwise_workspace_bytes(kvc::Cpu{}, press, work.ext));
    REQUIRE(kvc::blockwise_compress(kvc::Cpu{}, press, src.view(), block, work.view(), ws.get()).ok());
    REQUIRE(lengths == work.lengths);
    for (Index bh = 0; bh < 6; ++bh)
      for (Index j = 0; j < lengths[static_cast<std::size_t>(bh)]; ++j)
        REQUIRE(positions[static_cast<std::size_t>(bh * cap + j)] ==
                work.positions[static_cast<std::size_t>(bh * cap + j)]);
  }
}
