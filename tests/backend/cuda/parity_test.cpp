// SPDX-License-Identifier: Apache-2.0
// tests/backend/cuda/parity_test.cpp: CUDA kernels against the CPU reference (the oracle), for every CUDA kernel:
// the scorers (fp32/fp16/bf16; BHTD, BTHD and paged layouts; per-sequence and per-head lengths), top-k (ratio,
// fixed and device per-head budgets), compaction, gather, append, attention, query statistics, ExpectedAttention,
// H2O (update / evict / compact over several steps), ObservedAttention, AdaKV (allocation and selection, both
// behaviours), UNComp (prefill and decode updates, scores, on_evict, allocation and selection), the ragged store
// (gather, append, attention) and MomentKV (fold, MI scores, u_j cache, corrected attention, prefill driver); then
// (issue 22) every scorer, attention and compaction on the HND and CSR paged, per-head paged and ragged layouts at
// d = 128 and batch 3, heads long enough for second grid-stride passes, every entry point on a stream of its own,
// and whole decode steps that neither synchronise nor allocate (counted by the CUDA emulator). Tolerances are in
// docs/numerics.md and beside each case. Without a CUDA device every case prints "SKIPPED: no CUDA device" and ctest
// reports it skipped.
#include <kvc/backend/cpu/attention/attend.hpp>
#include <kvc/backend/cpu/attention/corrected.hpp>
#include <kvc/backend/cpu/attention/merge.hpp>
#include <kvc/backend/cpu/attention/packed.hpp>
#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/pipeline/pack.hpp>
#include <kvc/backend/cpu/pipeline/query_statistics.hpp>
#include <kvc/backend/cpu/pipeline/state.hpp>
#include <kvc/backend/cpu/scorers/expected_attention.hpp>
#include <kvc/backend/cpu/scorers/h2o.hpp>
#include <kvc/backend/cpu/scorers/key_diff.hpp>
#include <kvc/backend/cpu/scorers/knorm.hpp>
#include <kvc/backend/cpu/scorers/moment_kv.hpp>
#include <kvc/backend/cpu/scorers/random.hpp>
#include <kvc/backend/cpu/scorers/rdkv.hpp>
#include <kvc/backend/cpu/scorers/snap_kv.hpp>
#include <kvc/backend/cpu/scorers/streaming_llm.hpp>
#include <kvc/backend/cpu/scorers/tova.hpp>
#include <kvc/backend/cpu/scorers/uncomp.hpp>
#include <kvc/backend/cpu/selectors/ada_kv.hpp>
#include <kvc/backend/cpu/selectors/rdkv.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/backend/cpu/selectors/uncomp.hpp>
#include <kvc/pipeline/blockwise.hpp>
#include <kvc/pipeline/moment_kv.hpp>
#include <kvc/pipeline/pack.hpp>

#include "backend/cuda/cuda_kernels.hpp"
#include "common/ragged_store.hpp"
#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/combinations.hpp"
#include "support/helpers.hpp"

#include <algorithm>
#include <cmath>
#include <functional>
#include <iterator>
#include <limits>
#include <memory>
#include <string>
#include <tuple>
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
  kvc::test::OwnedRope const rope(kc::test_rope_spec(c.rope_style), c.e.dim, kc::test_rope_positions);
  kvc::WindowQueries<T> wq{kvc::TokenRows<T const, kvc::StridedLayout>(q.data(), kvc::bhtd_layout(c.q_ext))};
  if (c.pre_rope)
    wq.rope = rope.table;
  if (!c.query_positions.empty())
    wq.positions = c.query_positions.data();
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
  } else if (policy == "snap_kv_chunk")
    run(kvc::SnapKVScorer{kvc::Reference::authors, w, 4, kvc::Pooling::chunk_mean, kvc::GqaReduce::mean});
  else if (policy == "snap_kv_chunk_kvpress") {
    auto s = kvc::SnapKVScorer::kvpress();
    s.window_size = w;
    s.kernel_size = 6;
    s.pooling = kvc::Pooling::chunk_mean;
    run(s);
  } else if (policy == "tova")
    run(kvc::TOVAScorer{});
  else if (policy == "tova_kvpress")
    run(kvc::TOVAScorer{kvc::Reference::kvpress});
  else if (policy == "observed_attention")
    run(kvc::ObservedAttentionScorer{7});
  else if (policy == "observed_attention_one_tile")
    run(kvc::ObservedAttentionScorer{256});
  else
    FAIL("unknown policy " << policy);
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

/// Per head (rows of `tokens`): finite entries agree within rel * max(|cpu|, |gpu|, floor * the head's largest
/// |cpu|), so entries far below the head's scale are compared at the head's scale; -inf (padding) exactly.
void require_close_in_head(std::vector<float> const& gpu, std::vector<float> const& cpu, Index tokens, float rel,
                           float floor) {
  REQUIRE(gpu.size() == cpu.size());
  for (std::size_t row = 0; row < cpu.size(); row += static_cast<std::size_t>(tokens)) {
    float top = 0.0f;
    for (std::size_t i = row; i < row + static_cast<std::size_t>(tokens); ++i)
      top = std::isfinite(cpu[i]) ? std::max(top, std::abs(cpu[i])) : top;
    for (std::size_t i = row; i < row + static_cast<std::size_t>(tokens); ++i) {
      INFO("entry " << i << ": gpu " << gpu[i] << " cpu " << cpu[i] << " head max " << top);
      if (std::isinf(cpu[i])) {
        REQUIRE(gpu[i] == cpu[i]);
        continue;
      }
      REQUIRE(std::isfinite(gpu[i]));
      REQUIRE(std::abs(gpu[i] - cpu[i]) <= rel * std::max({std::abs(cpu[i]), std::abs(gpu[i]), floor * top}));
    }
  }
}

/// The CPU selector `sel` run on the GPU's and on the CPU's scores keeps the same slots per head, except slots whose
/// CPU score lies within `2 * rel * max(|score|, floor * head max)` of the head's selection boundary (the lowest kept
/// CPU score): near-ties that fp32 rounding may order either way.
template <class Sel>
void require_same_kept(Sel const& sel, std::vector<float> const& gpu, std::vector<float> const& cpu, kvc::KVExtents e,
                       std::vector<Index> const& lengths, bool per_head, float rel, float floor) {
  std::vector<Index> table = lengths;
  kvc::Lengths const len = table.empty() ? kvc::Lengths{}
                           : per_head    ? kvc::head_lengths(table.data(), e.heads)
                                         : kvc::Lengths(table.data());
  auto keep = [&](std::vector<float> const& scores) {
    kvc::test::OwnedPlan plan(e.batch, e.heads, e.tokens);
    kvc::ScoreSpan<> const span{const_cast<float*>(scores.data()), e.batch, e.heads, e.tokens, len};
    kvc::test::OwnedWorkspace ws(kvc::select_workspace_bytes(kvc::Cpu{}, sel, e.batch, e.heads, e.tokens));
    REQUIRE(kvc::select(kvc::Cpu{}, sel, span, plan.plan, ws.get()).ok());
    return plan;
  };
  auto const a = keep(cpu), b = keep(gpu);
  for (Index bh = 0; bh < e.batch * e.heads; ++bh) {
    std::vector<Index> const ka = a.kept(bh / e.heads, bh % e.heads), kb = b.kept(bh / e.heads, bh % e.heads);
    if (ka == kb)
      continue;
    float const* row = cpu.data() + bh * e.tokens;
    float boundary = std::numeric_limits<float>::infinity(), top = 0.0f;
    for (Index j : ka)
      boundary = std::min(boundary, row[j]);
    for (Index j = 0; j < e.tokens; ++j)
      top = std::isfinite(row[j]) ? std::max(top, std::abs(row[j])) : top;
    std::vector<Index> diff;
    std::set_symmetric_difference(ka.begin(), ka.end(), kb.begin(), kb.end(), std::back_inserter(diff));
    for (Index j : diff) {
      INFO("head " << bh << " slot " << j << ": cpu score " << row[j] << ", boundary " << boundary);
      REQUIRE(std::abs(row[j] - boundary) <= 2.0f * rel * std::max(std::abs(row[j]), floor * top));
    }
  }
}

}  // namespace

TEST_CASE(
    "cuda: every scorer matches the CPU for fp32/fp16/bf16, BHTD/BTHD/paged, per-sequence and per-head "
    "lengths (fp32 1e-5, 16-bit 1e-4 relative)",
    "[cuda][scorers]") {
  KVC_REQUIRE_DEVICE();
  for (char const* policy : {"key_diff", "knorm", "streaming_llm", "random", "snap_kv", "snap_kv_kvpress",
                             "snap_kv_chunk", "snap_kv_chunk_kvpress", "tova", "tova_kvpress"})
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

TEST_CASE(
    "cuda: KeyDiff (both anchors) leaves keys with a NaN or Inf element out of the anchor's mean and scores them "
    "-inf, and Knorm scores them -inf, as the CPU (fp32 and bf16, layouts, two splits, a head of non-finite keys only)",
    "[cuda][scorers][range]") {
  KVC_REQUIRE_DEVICE();
  constexpr float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (auto dtype : {kc::Dtype::f32, kc::Dtype::bf16})
    for (auto layout : {kc::Layout::bhtd, kc::Layout::paged}) {
      auto c = random_case({2, 3, 2500, 32}, 6, 8, true, 29);
      c.dtype = dtype;
      c.layout = layout;
      Index const d = c.e.dim, heads = c.e.heads, tokens = c.e.tokens;
      Index bad = 0;
      for (Index bh = 0; bh < 2 * heads; ++bh)
        for (Index t = 0; t < tokens; ++t) {
          float* row = &c.k[static_cast<std::size_t>((bh * tokens + t) * d)];
          if (bh == 5)  // every key of head (1, 2) non-finite: the anchor has no key, every score is -inf
            row[t % d] = t % 2 == 0 ? nan : -inf;
          else if (t % 97 == 3)
            row[t % d] = nan;
          else if (t % 89 == 7)
            row[(t + 1) % d] = inf;
          else if (t % 101 == 11)
            std::fill_n(row, d, -inf);
          else
            continue;
          bad += t < c.lengths[static_cast<std::size_t>(bh)] ? 1 : 0;
        }
      REQUIRE(bad > 2600);
      for (char const* policy : {"key_diff", "key_diff_raw", "knorm"}) {
        INFO(policy << " dtype " << static_cast<int>(dtype) << " layout " << static_cast<int>(layout));
        std::vector<float> gpu;
        REQUIRE(kc::scores(policy, c, gpu) == "");
        std::vector<float> const cpu =
            dtype == kc::Dtype::f32 ? cpu_scores<float>(policy, c) : cpu_scores<kvc::bfloat16>(policy, c);
        Index minus_inf = 0;
        for (float x : cpu) {  // the oracle: the bad keys and the padding at -inf, every other score finite
          REQUIRE((std::isfinite(x) || x == -inf));
          minus_inf += x == -inf ? 1 : 0;
        }
        REQUIRE(minus_inf >= bad);
        require_close(gpu, cpu, dtype == kc::Dtype::f32 ? 1e-5f : 1e-4f, 1e-6f);
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

namespace {

/// Pre-RoPE query rows [B, Hq, R, d] with correlated channels and a per-channel mean: x = offset + 0.05 (c mod 7) +
/// scale (z_c + 0.7 z_{c+1}).
std::vector<float> query_rows(kvc::KVExtents qe, float offset, float scale, std::uint64_t seed) {
  auto const z = kvc::tools::random_values<float>(qe.rows() * qe.dim, seed);
  std::vector<float> x(z.size());
  for (Index r = 0; r < qe.rows(); ++r)
    for (Index c = 0; c < qe.dim; ++c) {
      auto const at = static_cast<std::size_t>(r * qe.dim + c);
      auto const next = static_cast<std::size_t>(r * qe.dim + (c + 1) % qe.dim);
      x[at] = offset + 0.05f * static_cast<float>(c % 7) + scale * (z[at] + 0.7f * z[next]);
    }
  return x;
}

/// kvc::query_statistics on the CPU over BHTD rows narrowed to T (the device side's rounding).
template <class T>
void cpu_statistics(kvc::KVExtents qe, std::vector<float> const& rows, std::vector<Index> const& positions,
                    kvc::StatisticsRows sel, std::vector<float>& mean, std::vector<float>& cov) {
  std::vector<T> q(rows.size());
  for (std::size_t i = 0; i < q.size(); ++i)
    q[i] = kvc::from_float<T>(rows[i]);
  mean.assign(static_cast<std::size_t>(qe.batch * qe.heads * qe.dim), -9.0f);
  cov.assign(static_cast<std::size_t>(qe.batch * qe.heads * qe.dim * qe.dim), -9.0f);
  kvc::test::OwnedWorkspace ws(kvc::query_statistics_workspace_bytes(kvc::Cpu{}, qe));
  REQUIRE(kvc::query_statistics(kvc::Cpu{}, kvc::TokenRows<T const, kvc::StridedLayout>(q.data(), kvc::bhtd_layout(qe)),
                                positions.empty() ? nullptr : positions.data(), sel, mean.data(), cov.data(), ws.get())
              .ok());
}

/// ExpectedAttention on the CPU with the same inputs as kc::expected_attention.
template <class T>
std::vector<float> cpu_expected_attention(kc::Case const& c, kc::EAInputs const& in) {
  auto const h = host_cache<T>(c);
  kvc::test::OwnedRope const rope(kc::test_rope_spec(in.style, in.rotary_dim), c.e.dim, kc::test_rope_positions);
  kvc::QueryStatistics<> st{in.mean.data(), in.cov.empty() ? nullptr : in.cov.data(), c.e.batch, in.query_heads,
                            c.e.dim};
  if (in.rope)
    st.rope = rope.table;
  st.next_position = in.next_position.empty() ? nullptr : in.next_position.data();
  st.observed = in.observed;
  auto const obs = kvc::observe(st);
  kvc::test::OwnedScores out(c.e.batch, c.e.heads, c.e.tokens);
  kvc::test::OwnedWorkspace ws(kvc::score_workspace_bytes(kvc::Cpu{}, in.scorer, c.e, obs));
  REQUIRE(kvc::score(kvc::Cpu{}, in.scorer, h.view(), obs, out.span, ws.get()).ok());
  return out.data;
}

template <class Fn>
void by_host_dtype(kc::Dtype d, Fn&& fn) {
  if (d == kc::Dtype::f32)
    fn(float{});
  else if (d == kc::Dtype::f16)
    fn(kvc::half{});
  else
    fn(kvc::bfloat16{});
}

}  // namespace

TEST_CASE(
    "cuda: query statistics match the CPU (fp32/fp16, sink, skip and count rules, positions in ring order, "
    "token-major rows, three row splits, |mu| >> sigma, mean and covariance 1e-5 relative)",
    "[cuda][query_statistics]") {
  KVC_REQUIRE_DEVICE();
  // 9000 rows: three row splits on the device; d = 64 is one covariance tile, d = 80 three (one partial).
  // Tolerance: the mean within 1e-5 of max(|mean|, sigma_c), a covariance entry within 1e-5 of
  // max(|Sigma_ij|, sqrt(Sigma_ii Sigma_jj)) (correlation units: fp32 rounding of the products scales with the
  // channels' spread, not with an off-diagonal entry that happens to be near 0).
  struct Rule {
    kvc::StatisticsRows sel;
    bool positions;
  };
  std::vector<Rule> const rules = {{{.n_sink = 4}, false},
                                   {{.n_sink = 4500}, true},
                                   {{.skip_rows = 3, .count = 8000}, false},
                                   {{.n_sink = 2, .skip_rows = 1, .count = 40}, true},
                                   {{.count = 0}, false}};
  kvc::KVExtents const shapes[] = {{2, 4, 9000, 64}, {1, 3, 9000, 80}};
  kc::Dtype const dtypes[] = {kc::Dtype::f32, kc::Dtype::f16};
  float const offsets[] = {0.0f, 100.0f};
  for (auto const& pick : kvc::test::parity_combinations({2, 2, 2, 2, rules.size()})) {
    kvc::KVExtents const qe = shapes[pick[0]];
    kc::Dtype const dtype = dtypes[pick[1]];
    float const offset = offsets[pick[2]];
    bool const token_major = pick[3] == 1;
    std::size_t const k = pick[4];
    std::vector<Index> ring(static_cast<std::size_t>(qe.batch * qe.tokens));
    for (Index b = 0; b < qe.batch; ++b)
      for (Index i = 0; i < qe.tokens; ++i)  // gcd(7, 9000) = 1: a permutation of the positions
        ring[static_cast<std::size_t>(b * qe.tokens + i)] = (i * 7 + 11 * b) % qe.tokens;
    INFO("dim " << qe.dim << " dtype " << static_cast<int>(dtype) << " offset " << offset << " token_major "
                << token_major << " rule " << k);
    auto const rows = query_rows(qe, offset, 1.0f, 5 + k);
    std::vector<Index> const positions = rules[k].positions ? ring : std::vector<Index>{};
    std::vector<float> cpu_mean, cpu_cov, gpu_mean, gpu_cov;
    by_host_dtype(
        dtype, [&](auto tag) { cpu_statistics<decltype(tag)>(qe, rows, positions, rules[k].sel, cpu_mean, cpu_cov); });
    REQUIRE(kc::query_statistics(dtype, qe, rows, token_major, positions, rules[k].sel, true, gpu_mean, gpu_cov) == "");
    Index const d = qe.dim;
    for (Index item = 0; item < qe.batch * qe.heads; ++item)
      for (Index i = 0; i < d; ++i) {
        auto const at = static_cast<std::size_t>(item * d + i);
        float const var_i = cpu_cov[static_cast<std::size_t>((item * d + i) * d + i)];
        INFO("head " << item << " channel " << i << ": mean gpu " << gpu_mean[at] << " cpu " << cpu_mean[at]);
        REQUIRE(std::abs(gpu_mean[at] - cpu_mean[at]) <=
                1e-5f * std::max(std::abs(cpu_mean[at]), std::sqrt(std::max(var_i, 0.0f))));
        for (Index j = 0; j < d; ++j) {
          auto const ij = static_cast<std::size_t>((item * d + i) * d + j);
          float const var_j = cpu_cov[static_cast<std::size_t>((item * d + j) * d + j)];
          INFO("cov (" << i << ", " << j << "): gpu " << gpu_cov[ij] << " cpu " << cpu_cov[ij]);
          REQUIRE(std::abs(gpu_cov[ij] - cpu_cov[ij]) <=
                  1e-5f * std::max(std::abs(cpu_cov[ij]), std::sqrt(std::max(var_i * var_j, 0.0f))));
        }
      }
  }
  // The mean alone (covariance null) is the same mean.
  kvc::KVExtents const qe{2, 4, 9000, 64};
  auto const rows = query_rows(qe, 0.0f, 1.0f, 3);
  std::vector<float> with_cov, cov, alone, none;
  REQUIRE(kc::query_statistics(kc::Dtype::f32, qe, rows, false, {}, {.n_sink = 4}, true, with_cov, cov) == "");
  REQUIRE(kc::query_statistics(kc::Dtype::f32, qe, rows, false, {}, {.n_sink = 4}, false, alone, none) == "");
  CHECK(alone == with_cov);
}

TEST_CASE(
    "cuda: expected_attention matches the CPU (fp32/fp16, NeoX/interleaved/partial/no RoPE, GQA 2 and 4, ragged "
    "heads, t0 from the context/next_position/observed, every option, 1e-4 relative, kept sets equal but near-ties)",
    "[cuda][expected_attention]") {
  KVC_REQUIRE_DEVICE();
  // Tolerance: 1e-4 of max(|cpu|, 1e-2 * the head's largest score). The logits are fp32 dot products of d and d^2
  // terms summed in another order (a few 1e-6 absolute at |lambda| ~ 10), the CPU's softmax denominator is a
  // sequential fp32 sum (up to n * 2^-24 relative), and exp differs by an ulp or two: together well under 1e-4 of a
  // probability; scores far below the head's largest are compared at 1e-2 of it.
  using Set = void (*)(kc::EAInputs&);
  std::vector<std::pair<char const*, Set>> const variants = {
      {"default", [](kc::EAInputs&) {}},
      {"kvpress_observed",
       [](kc::EAInputs& in) {
         in.scorer.reference = kvc::Reference::kvpress;
         in.observed = 290;
       }},
      {"next_position",
       [](kc::EAInputs& in) {
         in.next_position = {1000, 2000};
       }},
      {"no_covariance",
       [](kc::EAInputs& in) {
         in.scorer.use_covariance = false;
         in.cov.clear();
       }},
      {"gqa_max_normalize_sinks",
       [](kc::EAInputs& in) {
         in.scorer.gqa = kvc::GqaReduce::max;
         in.scorer.normalize_sinks = true;
       }},
      {"no_vnorm_scale",
       [](kc::EAInputs& in) {
         in.scorer.use_vnorm = false;
         in.scorer.epsilon = 0.0f;
         in.scorer.scale = 0.2f;
       }},
      {"no_sinks_t1",
       [](kc::EAInputs& in) {
         in.scorer.n_sink = 0;
         in.scorer.n_future_positions = 1;
       }},
      {"no_rope", [](kc::EAInputs& in) { in.rope = false; }},
      {"partial_rotary", [](kc::EAInputs& in) { in.rotary_dim = 32; }},
      {"every_slot_a_sink", [](kc::EAInputs& in) { in.scorer.n_sink = 400; }},
  };
  // d = 64 is one 64-column pass of the logit kernel; d = 96 two (one partial) and three staged blocks of Σ̄;
  // d = 256 needs 76 KiB of shared memory for the key tile (the kernel opts in past 48 KiB).
  kc::Dtype const dtypes[] = {kc::Dtype::f32, kc::Dtype::f16};
  kvc::RopeStyle const styles[] = {kvc::RopeStyle::neox, kvc::RopeStyle::interleaved};
  std::pair<Index, Index> const shapes[] = {{2, 64}, {4, 64}, {4, 96}, {2, 256}};  // (GQA group, d)
  for (auto const& pick : kvc::test::parity_combinations({2, 2, 4, variants.size()})) {
    kc::Dtype const dtype = dtypes[pick[0]];
    auto const [group, d] = shapes[pick[2]];
    auto const& [name, set] = variants[pick[3]];
    auto c = random_case({2, 2, 300, d}, 2 * group, 8, true, 31 + static_cast<std::uint64_t>(group));
    c.dtype = dtype;
    kc::EAInputs in;
    in.query_heads = 2 * group;
    in.style = styles[pick[1]];
    // Statistics from structured pre-RoPE rows (spread 2.5: peaked attention).
    auto const rows = query_rows({2, 2 * group, 256, d}, 0.0f, 2.5f, 77);
    cpu_statistics<float>({2, 2 * group, 256, d}, rows, {}, {.n_sink = 4}, in.mean, in.cov);
    set(in);
    INFO(name << " dtype " << static_cast<int>(dtype) << " style " << static_cast<int>(in.style) << " group " << group
              << " dim " << d);
    std::vector<float> gpu, cpu;
    REQUIRE(kc::expected_attention(c, in, gpu) == "");
    by_host_dtype(dtype, [&](auto tag) { cpu = cpu_expected_attention<decltype(tag)>(c, in); });
    require_close_in_head(gpu, cpu, c.e.tokens, 1e-4f, 1e-2f);
    require_same_kept(kvc::TopKSelector{kvc::RatioBudget{0.5}}, gpu, cpu, c.e, c.lengths, c.per_head, 1e-4f, 1e-2f);
  }
}

TEST_CASE(
    "cuda: ExpectedAttention gives keys with a NaN or Inf element probability 0, as the CPU (covariance or not, a "
    "head whose keys past the sinks are all non-finite)",
    "[cuda][expected_attention][range]") {
  KVC_REQUIRE_DEVICE();
  constexpr float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (bool covariance : {true, false}) {
    auto c = random_case({2, 2, 300, 64}, 4, 8, true, 37);
    for (Index bh = 0; bh < 4; ++bh)
      for (Index t = 0; t < c.e.tokens; ++t) {
        float* row = &c.k[static_cast<std::size_t>((bh * c.e.tokens + t) * c.e.dim)];
        if (bh == 3 && t >= 4)  // head (1, 1): nothing finite past its 4 sinks, so every probability is 0
          row[t % c.e.dim] = t % 2 == 0 ? nan : inf;
        else if (t % 23 == 7)
          row[t % c.e.dim] = t % 2 == 0 ? nan : -inf;
      }
    kc::EAInputs in;
    in.query_heads = 4;
    auto const rows = query_rows({2, 4, 256, 64}, 0.0f, 2.5f, 77);
    cpu_statistics<float>({2, 4, 256, 64}, rows, {}, {.n_sink = 4}, in.mean, in.cov);
    if (!covariance) {
      in.scorer.use_covariance = false;
      in.cov.clear();
    }
    INFO("covariance " << covariance);
    std::vector<float> gpu;
    REQUIRE(kc::expected_attention(c, in, gpu) == "");
    auto const cpu = cpu_expected_attention<float>(c, in);
    for (float x : cpu)  // the oracle: every valid slot finite, padding -inf
      REQUIRE((std::isfinite(x) || x == -inf));
    Index const n = c.lengths[3];
    for (Index t = 4; t < n; ++t) {  // probability 0: the score is (0 + epsilon) * ||v|| (use_vnorm, epsilon 0.01)
      float const* v = &c.v[static_cast<std::size_t>((3 * c.e.tokens + t) * c.e.dim)];
      float sq = 0.0f;
      for (Index i = 0; i < c.e.dim; ++i)
        sq += v[i] * v[i];
      float const x = cpu[static_cast<std::size_t>(3 * c.e.tokens + t)];
      REQUIRE(std::abs(x - 0.01f * std::sqrt(sq)) <= 1e-5f * std::sqrt(sq));
    }
    require_close_in_head(gpu, cpu, c.e.tokens, 1e-4f, 1e-2f);
  }
}

TEST_CASE(
    "cuda: H2O's accumulator follows the CPU through updates (window queries in tiles of 7 or 256 rows, the "
    "engine's column sums), evictions with compaction and appends (fp32/fp16, GQA 2 and 4, pre-/post-RoPE, 1e-5 "
    "relative)",
    "[cuda][h2o]") {
  KVC_REQUIRE_DEVICE();
  // Tolerance: the accumulator (and the scores, which are it) within 1e-5 of max(|cpu|, 1e-2 * the head's largest):
  // column sums of fp32 probabilities whose logits differ only in summation order (~1e-6), then the same fp32 adds
  // on both sides. tracked and the lengths exactly.
  Index const batch = 2, hkv = 2, n_cap = 200, d = 64;
  Index const appends[] = {0, 5, 1, 3}, windows[] = {24, 5, 0, 3};  // step 2 feeds the engine's column sums
  for (auto dtype : {kc::Dtype::f32, kc::Dtype::f16})
    for (Index group : {2, 4})
      for (Index tile : {7, 256})
        for (bool pre_rope : {false, true}) {
          Index const hq = group * hkv;
          auto c = random_case({batch, hkv, n_cap, d}, hq, 1, true, 41);
          c.dtype = dtype;
          c.pre_rope = pre_rope;
          c.rope_style = group == 4 ? kvc::RopeStyle::interleaved : kvc::RopeStyle::neox;
          c.lengths = {150, 141, 147, 133};
          c.positions.resize(static_cast<std::size_t>(c.e.rows()));
          for (std::size_t i = 0; i < c.positions.size(); ++i)
            c.positions[i] = static_cast<Index>(i) % n_cap;
          INFO("dtype " << static_cast<int>(dtype) << " group " << group << " tile " << tile << " pre_rope "
                        << pre_rope);
          std::vector<kc::H2OStep> steps(4);
          std::vector<kc::H2OResult> want;
          std::vector<std::vector<Index>> scored_lengths;
          by_host_dtype(dtype, [&](auto tag) {
            using T = decltype(tag);
            auto host = host_cache<T>(c);
            std::vector<float> acc(static_cast<std::size_t>(c.e.rows()), -5.0f);
            std::vector<Index> tracked(static_cast<std::size_t>(batch * hkv), 0);
            kvc::H2OScorer<> const s{{{acc.data(), batch, hkv, n_cap}, tracked.data()}, tile};
            kvc::test::OwnedRope const rope(kc::test_rope_spec(c.rope_style), d, kc::test_rope_positions);
            Index next_position = 150;  // one past the longest head's last position
            for (std::size_t k = 0; k < steps.size(); ++k) {
              kc::H2OStep& step = steps[k];
              if (appends[k] > 0) {
                step.append = random_case({batch, hkv, appends[k], d}, hq, 1, false, 100 + k);
                step.append.lengths.clear();
                step.append.dtype = dtype;
                for (Index i = 0; i < step.append.e.rows(); ++i)
                  step.append.positions.push_back(next_position + i % appends[k]);
                next_position += appends[k];
                auto const src = host_cache<T>(step.append);
                REQUIRE(kvc::append(kvc::Cpu{}, host.view(), src.view()).ok());
              }
              if (windows[k] == 0) {
                step.columns = kvc::tools::random_values<float>(batch * hq * n_cap, 200 + k);
                for (float& x : step.columns)
                  x = std::abs(x);
                step.column_heads = hq;
                auto const obs = kvc::observe(kvc::AttentionColumnSums<>{step.columns.data(), batch, hq, n_cap, 1});
                REQUIRE(kvc::update(kvc::Cpu{}, s, host.view(), obs, {}).ok());
              } else {
                step.q_ext = {batch, hq, windows[k], d};
                step.queries = kvc::tools::random_values<float>(step.q_ext.rows() * d, 300 + k, 1.5f);
                std::vector<T> q(step.queries.size());
                for (std::size_t i = 0; i < q.size(); ++i)
                  q[i] = kvc::from_float<T>(step.queries[i]);
                kvc::WindowQueries<T> wq{
                    kvc::TokenRows<T const, kvc::StridedLayout>(q.data(), kvc::bhtd_layout(step.q_ext))};
                if (pre_rope)
                  wq.rope = rope.table;
                auto const obs = kvc::observe(wq);
                kvc::test::OwnedWorkspace ws(kvc::update_workspace_bytes(kvc::Cpu{}, s, host.ext, obs));
                REQUIRE(kvc::update(kvc::Cpu{}, s, host.view(), obs, ws.get()).ok());
              }
              kc::H2OResult r;
              r.acc = acc;
              r.tracked = tracked;
              kvc::test::OwnedScores out(batch, hkv, n_cap);
              REQUIRE(kvc::score(kvc::Cpu{}, s, host.view(), out.span, {}).ok());
              r.scores = out.data;
              scored_lengths.push_back(host.lengths);
              if (k + 1 < steps.size()) {  // evict every third slot (shifting with the step and head), then compact
                step.index.assign(static_cast<std::size_t>(batch * hkv * n_cap), -1);
                step.count.assign(static_cast<std::size_t>(batch * hkv), 0);
                for (Index bh = 0; bh < batch * hkv; ++bh) {
                  Index kept = 0;
                  for (Index j = 0; j < host.lengths[static_cast<std::size_t>(bh)]; ++j)
                    if ((j + static_cast<Index>(k) + bh) % 3 != 0)
                      step.index[static_cast<std::size_t>(bh * n_cap + kept++)] = j;
                  step.count[static_cast<std::size_t>(bh)] = kept;
                }
                kvc::KeepPlan<> const plan{step.index.data(), step.count.data(), batch, hkv, n_cap};
                REQUIRE(kvc::on_evict(kvc::Cpu{}, s, host.view(), plan, {}).ok());
                REQUIRE(kvc::compact(kvc::Cpu{}, plan, host.view(), s.state.accumulated).ok());
              }
              r.lengths = host.lengths;
              want.push_back(r);
            }
          });
          std::vector<kc::H2OResult> got;
          REQUIRE(kc::h2o(c, tile, steps, got) == "");
          REQUIRE(got.size() == want.size());
          for (std::size_t k = 0; k < want.size(); ++k) {
            INFO("step " << k);
            CHECK(got[k].tracked == want[k].tracked);
            CHECK(got[k].lengths == want[k].lengths);
            auto valid = [&](std::vector<float> a) {  // slots past a head's length hold stale values: masked
              for (Index bh = 0; bh < batch * hkv; ++bh)
                for (Index j = want[k].tracked[static_cast<std::size_t>(bh)]; j < n_cap; ++j)
                  a[static_cast<std::size_t>(bh * n_cap + j)] = -std::numeric_limits<float>::infinity();
              return a;
            };
            require_close_in_head(valid(got[k].acc), valid(want[k].acc), n_cap, 1e-5f, 1e-2f);
            require_close_in_head(got[k].scores, want[k].scores, n_cap, 1e-5f, 1e-2f);
            require_same_kept(kvc::TopKSelector{kvc::FixedBudget{60}}, got[k].scores, want[k].scores, c.e,
                              scored_lengths[k], true, 1e-5f, 1e-2f);
          }
        }
}

TEST_CASE(
    "cuda: ObservedAttention matches the CPU (every window query in tiles of 7 or 256 rows, default and explicit "
    "query positions, pre-/post-RoPE, fp32/fp16, GQA 2 and 4, ragged heads, 1e-5 relative, kept sets equal but "
    "near-ties)",
    "[cuda][h2o]") {
  KVC_REQUIRE_DEVICE();
  // Tolerance: 1e-5 of max(|cpu|, 1e-2 * the head's largest score), as H2O's accumulator (same column sums).
  for (auto dtype : {kc::Dtype::f32, kc::Dtype::f16})
    for (Index group : {2, 4})
      for (char const* policy : {"observed_attention", "observed_attention_one_tile"})
        for (bool explicit_positions : {false, true})
          for (bool pre_rope : {false, true}) {
            auto c = random_case({2, 2, 300, 64}, 2 * group, 40, true, 29);
            c.dtype = dtype;
            c.pre_rope = pre_rope;
            c.rope_style = group == 4 ? kvc::RopeStyle::interleaved : kvc::RopeStyle::neox;
            for (float& x : c.queries)
              x *= 0.6f;             // spread 1.5
            if (explicit_positions)  // unordered, some repeated, some before the heads' last slots
              for (Index b = 0; b < 2; ++b)
                for (Index i = 0; i < 40; ++i)
                  c.query_positions.push_back(300 - 3 * b - 1 - (i * 7) % 60);
            INFO(policy << " dtype " << static_cast<int>(dtype) << " group " << group << " explicit positions "
                        << explicit_positions << " pre_rope " << pre_rope);
            std::vector<float> gpu, cpu;
            REQUIRE(kc::scores(policy, c, gpu) == "");
            by_host_dtype(dtype, [&](auto tag) { cpu = cpu_scores<decltype(tag)>(policy, c); });
            require_close_in_head(gpu, cpu, c.e.tokens, 1e-5f, 1e-2f);
            require_same_kept(kvc::TopKSelector{kvc::RatioBudget{0.5}}, gpu, cpu, c.e, c.lengths, c.per_head, 1e-5f,
                              1e-2f);
          }
}

TEST_CASE("cuda: AdaKV allocates and selects exactly as the CPU (both behaviours, ties, ragged lengths)",
          "[cuda][selectors]") {
  KVC_REQUIRE_DEVICE();
  for (bool kvpress : {false, true})
    for (double alpha : {0.0, 0.2, 1.0})
      for (Index tokens : {40, 3000}) {
        kc::AdaKVCase c;
        c.kvpress = kvpress;
        c.alpha = alpha;
        c.batch = 2;
        c.heads = 4;
        c.tokens = tokens;
        c.fixed = tokens / 5;
        c.n_sink = 2;
        c.n_recent = 3;
        auto const r = kvc::tools::random_values<float>(c.batch * c.heads * tokens, 17, 1.0f);
        for (float x : r)  // a coarse grid: ties across heads and inside heads are frequent
          c.scores.push_back(std::round(std::abs(x) * 8.0f) / 8.0f);
        for (Index i = 0; i < c.batch * c.heads; ++i)
          c.lengths.push_back(tokens - 3 * i);
        std::vector<Index> table, index, count;
        REQUIRE(kc::ada_kv(c, table, index, count) == "");
        kvc::AdaKVSelector const sel{kvc::FixedBudget{c.fixed}, alpha,
                                     kvpress ? kvc::Reference::kvpress : kvc::Reference::authors, c.n_sink, c.n_recent};
        std::vector<Index> lengths = c.lengths;
        kvc::ScoreSpan<> const span{const_cast<float*>(c.scores.data()), c.batch, c.heads, tokens,
                                    kvc::head_lengths(lengths.data(), c.heads)};
        std::vector<Index> cpu_table(static_cast<std::size_t>(c.batch * c.heads));
        kvc::test::OwnedWorkspace ws(kvc::select_workspace_bytes(kvc::Cpu{}, sel, c.batch, c.heads, tokens));
        REQUIRE(kvc::allocate(kvc::Cpu{}, sel, span, cpu_table.data(), ws.get()).ok());
        kvc::test::OwnedPlan plan(c.batch, c.heads, tokens);
        REQUIRE(kvc::select(kvc::Cpu{}, sel, span, plan.plan, ws.get()).ok());
        INFO("kvpress " << kvpress << " alpha " << alpha << " tokens " << tokens);
        CHECK(table == cpu_table);
        CHECK(count == plan.count);
        for (Index i = 0; i < c.batch * c.heads; ++i)
          for (Index j = 0; j < count[static_cast<std::size_t>(i)]; ++j)
            REQUIRE(index[static_cast<std::size_t>(i * tokens + j)] ==
                    plan.index[static_cast<std::size_t>(i * tokens + j)]);
      }
}

namespace {

/// Plans of two selections agree: counts, then the kept indices of every head (entries past a count are not set).
void require_same_plan(std::vector<Index> const& index, std::vector<Index> const& count,
                       std::vector<Index> const& want_index, std::vector<Index> const& want_count, Index tokens) {
  REQUIRE(count == want_count);
  for (std::size_t bh = 0; bh < want_count.size(); ++bh)
    for (Index j = 0; j < want_count[bh]; ++j) {
      INFO("head " << bh << " entry " << j);
      REQUIRE(index[bh * static_cast<std::size_t>(tokens) + static_cast<std::size_t>(j)] ==
              want_index[bh * static_cast<std::size_t>(tokens) + static_cast<std::size_t>(j)]);
    }
}

}  // namespace

TEST_CASE(
    "cuda: UNComp's window rows, scores and tracked counts follow the CPU through a prefill update (w or more rows), "
    "1- and 2-row decode updates, appends, an eviction without update and compactions (fp32/fp16, GQA 1 and 4, "
    "pre-/post-RoPE, max/avg pooling, 1e-5 relative); allocation and selection exactly as the CPU's",
    "[cuda][uncomp]") {
  KVC_REQUIRE_DEVICE();
  // Tolerance: window rows (group sums of fp32 probabilities, as H2O's column sums: logits that differ only in
  // summation order, ~1e-6 relative) and scores (in-order sums of the same rows, pooled: the same fp32 operations on
  // both sides) within 1e-5 of max(|cpu|, |gpu|, 1e-2 * the head's largest); -inf padding, tracked and lengths
  // exactly. Selections: the device's UNCompSelector on the CPU's scores keeps exactly the CPU's slots, and on its own
  // scores exactly what the CPU's selector keeps from them (same input, same plan); the two score vectors' kept sets
  // differ at most by near-ties (require_same_kept).
  Index const batch = 2, hkv = 2, n_cap = 120, d = 64, w = 8;
  // Step 0: prefill; steps 1-5: decode. appends[k] tokens first, then an update with rows[k] queries (0: none;
  // step 2 evicts with tracked < length, so on_evict's lower_bound and the next update's zeroed slots are exercised).
  Index const appends[] = {0, 1, 2, 1, 1, 1}, rows[] = {w, 1, 0, 2, 1, 1};
  bool const evicts[] = {true, true, true, true, true, false};
  std::vector<Index> const budgets = {98, 60};  // head 0 of sequence 1 (97 tokens) keeps everything at prefill
  for (auto dtype : {kc::Dtype::f32, kc::Dtype::f16})
    for (Index group : {1, 4})
      for (bool pre_rope : {false, true})
        for (auto pooling : {kvc::Pooling::max, kvc::Pooling::avg}) {
          Index const hq = group * hkv, prefill_rows = pre_rope ? w : w + 3;  // w + 3: the oldest 3 are not used
          auto c = random_case({batch, hkv, n_cap, d}, hq, 1, true, 61);
          c.dtype = dtype;
          c.pre_rope = pre_rope;
          c.rope_style = group == 4 ? kvc::RopeStyle::interleaved : kvc::RopeStyle::neox;
          c.lengths = {100, 93, 97, 88};
          c.positions.resize(static_cast<std::size_t>(c.e.rows()));
          for (std::size_t i = 0; i < c.positions.size(); ++i)
            c.positions[i] = static_cast<Index>(i) % n_cap;
          kc::UNCompParams const params{w, pooling == kvc::Pooling::max ? 7 : 5, pooling, budgets};
          INFO("dtype " << static_cast<int>(dtype) << " group " << group << " pre_rope " << pre_rope << " pooling "
                        << static_cast<int>(pooling));
          std::vector<kc::UNCompStep> steps(std::size(appends));
          std::vector<kc::UNCompResult> want;
          std::vector<std::vector<Index>> scored_lengths;
          by_host_dtype(dtype, [&](auto tag) {
            using T = decltype(tag);
            auto host = host_cache<T>(c);
            std::vector<float> state_rows(static_cast<std::size_t>(c.e.rows() * w), 9.0f);
            std::vector<Index> tracked(static_cast<std::size_t>(batch * hkv), 0);
            kvc::UNCompScorer<> const s{
                {{state_rows.data(), kvc::uncomp_window_layout(c.e, w)}, tracked.data()}, w, params.kernel, pooling};
            kvc::UNCompSelector const sel{kvc::HeadBudgets{budgets.data(), hkv}, 0, w};
            kvc::test::OwnedRope const rope(kc::test_rope_spec(c.rope_style), d, kc::test_rope_positions);
            Index next_position = 100;  // one past the longest head's last position
            for (std::size_t k = 0; k < steps.size(); ++k) {
              kc::UNCompStep& step = steps[k];
              if (appends[k] > 0) {
                step.append = random_case({batch, hkv, appends[k], d}, hq, 1, false, 400 + k);
                step.append.lengths.clear();
                step.append.dtype = dtype;
                for (Index i = 0; i < step.append.e.rows(); ++i)
                  step.append.positions.push_back(next_position + i % appends[k]);
                next_position += appends[k];
                auto const src = host_cache<T>(step.append);
                REQUIRE(kvc::append(kvc::Cpu{}, host.view(), src.view()).ok());
              }
              if (Index const r = k == 0 ? prefill_rows : rows[k]; r > 0) {
                step.q_ext = {batch, hq, r, d};
                step.queries = kvc::tools::random_values<float>(step.q_ext.rows() * d, 500 + k, 1.5f);
                std::vector<T> q(step.queries.size());
                for (std::size_t i = 0; i < q.size(); ++i)
                  q[i] = kvc::from_float<T>(step.queries[i]);
                kvc::WindowQueries<T> wq{
                    kvc::TokenRows<T const, kvc::StridedLayout>(q.data(), kvc::bhtd_layout(step.q_ext))};
                if (pre_rope)
                  wq.rope = rope.table;
                auto const obs = kvc::observe(wq);
                kvc::test::OwnedWorkspace ws(kvc::update_workspace_bytes(kvc::Cpu{}, s, host.ext, obs));
                REQUIRE(kvc::update(kvc::Cpu{}, s, host.view(), obs, ws.get()).ok());
              }
              kc::UNCompResult r;
              r.rows = state_rows;
              r.tracked = tracked;
              kvc::test::OwnedScores out(batch, hkv, n_cap);
              kvc::test::OwnedWorkspace sws(kvc::score_workspace_bytes(kvc::Cpu{}, s, c.e, kvc::NoObservations{}));
              REQUIRE(kvc::score(kvc::Cpu{}, s, host.view(), out.span, sws.get()).ok());
              r.scores = out.data;
              step.cpu_scores = out.data;
              scored_lengths.push_back(host.lengths);
              if (evicts[k]) {
                std::vector<Index> lengths = host.lengths;
                kvc::ScoreSpan<> const span{out.data.data(), batch, hkv, n_cap, kvc::head_lengths(lengths.data(), hkv)};
                r.table.resize(static_cast<std::size_t>(batch * hkv));
                kvc::test::OwnedWorkspace ws(kvc::select_workspace_bytes(kvc::Cpu{}, sel, batch, hkv, n_cap));
                REQUIRE(kvc::allocate(kvc::Cpu{}, sel, span, r.table.data(), ws.get()).ok());
                kvc::test::OwnedPlan plan(batch, hkv, n_cap);
                REQUIRE(kvc::select(kvc::Cpu{}, sel, span, plan.plan, ws.get()).ok());
                step.index = plan.index;
                step.count = plan.count;
                r.index = plan.index;
                r.count = plan.count;
                REQUIRE(kvc::on_evict(kvc::Cpu{}, s, host.view(), plan.plan, {}).ok());
                r.evicted_tracked = tracked;
                REQUIRE(kvc::compact(kvc::Cpu{}, plan.plan, host.view(), s.state.window_rows).ok());
              }
              r.lengths = host.lengths;
              want.push_back(r);
            }
          });
          std::vector<kc::UNCompResult> got;
          REQUIRE(kc::uncomp(c, params, steps, got) == "");
          REQUIRE(got.size() == want.size());
          for (std::size_t k = 0; k < want.size(); ++k) {
            INFO("step " << k);
            CHECK(got[k].tracked == want[k].tracked);
            CHECK(got[k].lengths == want[k].lengths);
            auto valid = [&](std::vector<float> a) {  // rows of untracked slots are stale (9 or older rows): masked
              for (Index bh = 0; bh < batch * hkv; ++bh)
                for (Index j = want[k].tracked[static_cast<std::size_t>(bh)] * w; j < n_cap * w; ++j)
                  a[static_cast<std::size_t>(bh * n_cap * w + j)] = -std::numeric_limits<float>::infinity();
              return a;
            };
            require_close_in_head(valid(got[k].rows), valid(want[k].rows), n_cap * w, 1e-5f, 1e-2f);
            require_close_in_head(got[k].scores, want[k].scores, n_cap, 1e-5f, 1e-2f);
            if (!evicts[k])
              continue;
            CHECK(got[k].table == want[k].table);
            CHECK(got[k].evicted_tracked == want[k].evicted_tracked);
            require_same_plan(got[k].index_cpu, got[k].count_cpu, want[k].index, want[k].count, n_cap);
            kvc::UNCompSelector const sel{kvc::HeadBudgets{budgets.data(), hkv}, 0, w};
            {  // the device's selection of its own scores = the CPU's selector over the same scores
              std::vector<Index> lengths = scored_lengths[k];
              kvc::ScoreSpan<> const span{got[k].scores.data(), batch, hkv, n_cap,
                                          kvc::head_lengths(lengths.data(), hkv)};
              kvc::test::OwnedWorkspace ws(kvc::select_workspace_bytes(kvc::Cpu{}, sel, batch, hkv, n_cap));
              kvc::test::OwnedPlan plan(batch, hkv, n_cap);
              REQUIRE(kvc::select(kvc::Cpu{}, sel, span, plan.plan, ws.get()).ok());
              require_same_plan(got[k].index, got[k].count, plan.index, plan.count, n_cap);
            }
            require_same_kept(sel, got[k].scores, want[k].scores, c.e, scored_lengths[k], true, 1e-5f, 1e-2f);
          }
        }
}

TEST_CASE(
    "cuda: UNComp's allocation table and selection equal the CPU's (ragged lengths, budgets below the window "
    "and above the length, ties)",
    "[cuda][uncomp][selectors]") {
  KVC_REQUIRE_DEVICE();
  for (Index tokens : {40, 3000, 20000})  // 20000: the top-k's multi-chunk path
    for (Index n_recent : {0, 8}) {
      Index const batch = 2, heads = 4;
      // Head 0: below the window; head 1: a quarter; head 2: above every length (keeps all); head 3: zero.
      std::vector<Index> const budgets = {3, tokens / 4, tokens + 5, 0};
      std::vector<float> scores;
      auto const r = kvc::tools::random_values<float>(batch * heads * tokens, 71, 1.0f);
      for (float x : r)  // a coarse grid: ties are frequent
        scores.push_back(std::round(std::abs(x) * 8.0f) / 8.0f);
      std::vector<Index> lengths;
      for (Index i = 0; i < batch * heads; ++i)
        lengths.push_back(tokens - 3 * i - (i == 5 ? tokens / 2 : 0));
      std::vector<Index> table, index, count;
      REQUIRE(kc::uncomp_select(budgets, n_recent, batch, heads, tokens, scores, lengths, table, index, count) == "");
      kvc::UNCompSelector const sel{kvc::HeadBudgets{budgets.data(), heads}, 0, n_recent};
      std::vector<Index> host_lengths = lengths;
      kvc::ScoreSpan<> const span{scores.data(), batch, heads, tokens, kvc::head_lengths(host_lengths.data(), heads)};
      std::vector<Index> cpu_table(static_cast<std::size_t>(batch * heads));
      kvc::test::OwnedWorkspace ws(kvc::select_workspace_bytes(kvc::Cpu{}, sel, batch, heads, tokens));
      REQUIRE(kvc::allocate(kvc::Cpu{}, sel, span, cpu_table.data(), ws.get()).ok());
      kvc::test::OwnedPlan plan(batch, heads, tokens);
      REQUIRE(kvc::select(kvc::Cpu{}, sel, span, plan.plan, ws.get()).ok());
      INFO("tokens " << tokens << " n_recent " << n_recent);
      CHECK(table == cpu_table);
      require_same_plan(index, count, plan.index, plan.count, tokens);
    }
}

TEST_CASE("cuda: a ragged store gathers, appends and attends as the CPU's", "[cuda][store]") {
  KVC_REQUIRE_DEVICE();
  for (auto dtype : {kc::Dtype::f32, kc::Dtype::f16, kc::Dtype::bf16}) {
    auto c = random_case({2, 2, 64, 32}, 4, 3, true, 5);
    c.dtype = dtype;
    c.lengths = {64, 64, 64, 64};
    c.positions.resize(static_cast<std::size_t>(c.e.rows()));
    for (std::size_t i = 0; i < c.positions.size(); ++i)
      c.positions[i] = static_cast<Index>(i % 64);
    std::vector<Index> const count{10, 31, 0, 64};
    std::vector<Index> index(static_cast<std::size_t>(4 * 64), -1);
    for (Index i = 0; i < 4; ++i)  // every other slot from slot i % 2 (ascending, distinct), or all
      for (Index j = 0; j < count[static_cast<std::size_t>(i)]; ++j)
        index[static_cast<std::size_t>(i * 64 + j)] = count[static_cast<std::size_t>(i)] == 64 ? j : i % 2 + 2 * j;
    kc::Case extra = random_case({2, 2, 1, 32}, 4, 3, true, 6);
    extra.dtype = dtype;
    extra.lengths = {1, 1, 1, 1};
    extra.positions = {64, 64, 64, 64};
    kc::RaggedResult r;
    REQUIRE(kc::ragged(c, index, count, 64, 2, extra, r) == "");
    auto run_cpu = [&](auto tag) {
      using T = decltype(tag);
      auto const src = host_cache<T>(c);
      auto const add = host_cache<T>(extra);
      std::vector<Index> room(count);
      for (Index& x : room)
        ++x;
      kvc::tools::HostRaggedStore<T> store(2, 2, 32, 32, room.data(), 2);
      kvc::KeepPlan<> const plan{index.data(), const_cast<Index*>(count.data()), 2, 2, 64};
      REQUIRE(kvc::gather(kvc::Cpu{}, plan, src.view(), store.view()).ok());
      REQUIRE(kvc::append(kvc::Cpu{}, store.view(), add.view()).ok());
      CHECK(r.offsets == store.offsets);
      CHECK(r.lengths == store.lengths);
      CHECK(r.positions == store.positions);
      std::vector<float> k(store.k.size()), v(store.v.size());
      for (std::size_t i = 0; i < k.size(); ++i)
        k[i] = kvc::to_float(store.k[i]);
      for (std::size_t i = 0; i < v.size(); ++i)
        v[i] = kvc::to_float(store.v[i]);
      CHECK(r.k == k);
      CHECK(r.v == v);
      std::vector<T> q(c.queries.size());
      for (std::size_t i = 0; i < q.size(); ++i)
        q[i] = kvc::from_float<T>(c.queries[i]);
      kvc::AttendQueries<T> const aq{kvc::TokenRows<T const, kvc::StridedLayout>(q.data(), kvc::bhtd_layout(c.q_ext))};
      std::vector<float> o(r.out.size()), l(r.lse.size());
      kvc::test::OwnedWorkspace ws(kvc::attend_workspace_bytes(kvc::Cpu{}, kvc::Attention{}, aq, store.view()));
      REQUIRE(kvc::attend(kvc::Cpu{}, kvc::Attention{}, aq, store.view(), {o.data(), l.data()}, ws.get()).ok());
      require_close(r.out, o, 1e-4f, 1e-5f);
      require_close(r.lse, l, 1e-5f, 1e-5f);
    };
    if (dtype == kc::Dtype::f32)
      run_cpu(float{});
    else if (dtype == kc::Dtype::f16)
      run_cpu(kvc::half{});
    else
      run_cpu(kvc::bfloat16{});
  }
}

// ---------------------------------------------------------------------------------------------------------------
// MomentKV (spec shared/specs/moment_kv.md §10.30: fp32 CUDA within ~1e-5 relative of the CPU): the fold
// (on_evict), the MI scores, the u_j cache (update, incremental and full row updates), compaction with a TokenRows
// extra, the corrected attention and the prefill driver.

namespace {

/// A random case with d_v = `dv` (values regenerated at that width).
kc::Case moment_case(kvc::KVExtents e, Index dv, Index query_heads, Index window, std::uint64_t seed) {
  kc::Case c = random_case(e, query_heads, window, true, seed);
  c.dim_v = dv;
  c.v = kvc::tools::HostCache<float>::random({e.batch, e.heads, e.tokens, dv}, seed + 7).k;
  return c;
}

/// Zero moments of the case's shape (nothing evicted), stored as `dtype`.
kc::Moments zero_moments(kc::Case const& c, kc::Dtype dtype) {
  Index const heads = c.e.batch * c.e.heads, dk = c.e.dim, dv = c.dim_v > 0 ? c.dim_v : dk;
  kc::Moments m;
  m.dtype = dtype;
  m.count.assign(static_cast<std::size_t>(heads), 0);
  m.key_mean.assign(static_cast<std::size_t>(heads * dk), 0.0f);
  m.value_mean.assign(static_cast<std::size_t>(heads * dv), 0.0f);
  m.comoment.assign(static_cast<std::size_t>(heads * dk * dv), 0.0f);
  return m;
}

/// Host moments stored as MT, converted from and to the wrappers' fp32 description.
template <class MT>
struct HostMoments {
  kvc::KVExtents e;
  Index dv;
  std::vector<Index> count;
  std::vector<MT> key_mean, value_mean, comoment;
  HostMoments(kc::Case const& c, kc::Moments const& m) : e(c.e), dv(c.dim_v > 0 ? c.dim_v : c.e.dim), count(m.count) {
    auto narrow = [](std::vector<float> const& x) {
      std::vector<MT> out(x.size());
      for (std::size_t i = 0; i < x.size(); ++i)
        out[i] = kvc::from_float<MT>(x[i]);
      return out;
    };
    key_mean = narrow(m.key_mean);
    value_mean = narrow(m.value_mean);
    comoment = narrow(m.comoment);
  }
  kvc::MomentState<kvc::HostSpace, MT> view() {
    return {count.data(), key_mean.data(), value_mean.data(), comoment.data(), e.batch, e.heads, e.dim, dv};
  }
  kc::Moments get(kc::Dtype dtype) const {
    auto widen = [](std::vector<MT> const& x) {
      std::vector<float> out(x.size());
      for (std::size_t i = 0; i < x.size(); ++i)
        out[i] = kvc::to_float(x[i]);
      return out;
    };
    return {dtype, count, widen(key_mean), widen(value_mean), widen(comoment)};
  }
};

/// The host u_j cache view of `r` (disabled when its rows are empty).
kvc::MomentResiduals<> host_residuals(kc::Case const& c, kc::Residuals& r) {
  if (r.rows.empty())
    return {};
  kvc::KVExtents const re{c.e.batch, c.e.heads, c.e.tokens, c.dim_v > 0 ? c.dim_v : c.e.dim};
  return {kvc::TokenRows<float, kvc::StridedLayout>(r.rows.data(), kvc::bhtd_layout(re)), r.tracked.data(),
          r.age.data(), r.refresh};
}

template <class MT>
kvc::MomentKVScorer<kvc::HostSpace, MT> host_moment_scorer(kvc::MomentKVScorer<> const& p, HostMoments<MT>& m,
                                                           kvc::MomentResiduals<> r) {
  kvc::MomentKVScorer<kvc::HostSpace, MT> s;
  s.state = m.view();
  s.residuals = r;
  s.base = p.base;
  s.scale = p.scale;
  s.clamp_tau = p.clamp_tau;
  s.prefill_rounds = p.prefill_rounds;
  return s;
}

/// Calls fn(cache tag, moment tag) for two dtypes.
template <class Fn>
void with_dtypes(kc::Dtype cache, kc::Dtype moments, Fn&& fn) {
  auto inner = [&](auto t) {
    if (moments == kc::Dtype::f32)
      fn(t, float{});
    else if (moments == kc::Dtype::f16)
      fn(t, kvc::half{});
    else
      fn(t, kvc::bfloat16{});
  };
  if (cache == kc::Dtype::f32)
    inner(float{});
  else if (cache == kc::Dtype::f16)
    inner(kvc::half{});
  else
    inner(kvc::bfloat16{});
}

/// The CPU's on_evict of `plan` on the case's cache, from moments `m` (and u_j cache `r`), returned.
kc::Moments cpu_evict(kc::Case const& c, kvc::MomentKVScorer<> const& p, kc::Moments const& m, kc::Residuals& r,
                      kvc::test::OwnedPlan const& plan) {
  kc::Moments out;
  with_dtypes(c.dtype, m.dtype, [&](auto tag, auto mtag) {
    using T = decltype(tag);
    using MT = decltype(mtag);
    auto h = host_cache<T>(c);
    HostMoments<MT> hm(c, m);
    auto const s = host_moment_scorer(p, hm, host_residuals(c, r));
    kvc::test::OwnedWorkspace ws(kvc::on_evict_workspace_bytes(kvc::Cpu{}, s, c.e));
    REQUIRE(kvc::on_evict(kvc::Cpu{}, s, h.view(), plan.plan, ws.get()).ok());
    out = hm.get(m.dtype);
  });
  return out;
}

/// The CPU's MI scores.
std::vector<float> cpu_moment_scores(kc::Case const& c, kvc::MomentKVScorer<> const& p, kc::Moments const& m,
                                     kc::Residuals r, std::vector<float> const& fixed_base) {
  kvc::test::OwnedScores out(c.e.batch, c.e.heads, c.e.tokens);
  with_dtypes(c.dtype, m.dtype, [&](auto tag, auto mtag) {
    using T = decltype(tag);
    using MT = decltype(mtag);
    auto const h = host_cache<T>(c);
    HostMoments<MT> hm(c, m);
    auto s = host_moment_scorer(p, hm, host_residuals(c, r));
    if (!fixed_base.empty())
      s.fixed_base = {fixed_base.data(), c.e.batch, c.e.heads, c.e.tokens};
    std::vector<T> q(c.queries.size());
    for (std::size_t i = 0; i < q.size(); ++i)
      q[i] = kvc::from_float<T>(c.queries[i]);
    auto const obs = kvc::observe(
        kvc::WindowQueries<T>{kvc::TokenRows<T const, kvc::StridedLayout>(q.data(), kvc::bhtd_layout(c.q_ext))});
    kvc::test::OwnedWorkspace ws(kvc::score_workspace_bytes(kvc::Cpu{}, s, c.e, obs));
    REQUIRE(kvc::score(kvc::Cpu{}, s, h.view(), obs, out.span, ws.get()).ok());
  });
  return out.data;
}

/// A plan keeping about one slot in `one_in` of each head (slot 0 always); head `all` (if >= 0) keeps every slot.
kvc::test::OwnedPlan moment_plan(kc::Case const& c, std::uint64_t seed, int one_in, Index all = -1) {
  kvc::tools::Rng rng(seed);
  kvc::test::OwnedPlan plan(c.e.batch, c.e.heads, c.e.tokens);
  for (Index bh = 0; bh < c.e.batch * c.e.heads; ++bh) {
    Index j = 0;
    for (Index t = 0; t < c.lengths[static_cast<std::size_t>(bh)]; ++t)
      if (bh == all || t == 0 || rng.next() % static_cast<std::uint64_t>(one_in) == 0)
        plan.index[static_cast<std::size_t>(bh * c.e.tokens + j++)] = t;
    plan.count[static_cast<std::size_t>(bh)] = j;
  }
  return plan;
}

/// A plan that evicts the `m` slots of each head starting at `first` + (b * heads + h) (clamped to the length).
kvc::test::OwnedPlan evict_run(kc::Case const& c, Index first, Index m) {
  kvc::test::OwnedPlan plan(c.e.batch, c.e.heads, c.e.tokens);
  for (Index bh = 0; bh < c.e.batch * c.e.heads; ++bh) {
    Index const n = c.lengths[static_cast<std::size_t>(bh)], lo = std::min(first + bh, n - m);
    Index j = 0;
    for (Index t = 0; t < n; ++t)
      if (t < lo || t >= lo + m)
        plan.index[static_cast<std::size_t>(bh * c.e.tokens + j++)] = t;
    plan.count[static_cast<std::size_t>(bh)] = j;
  }
  return plan;
}

/// Moments agree: counts exactly, means and co-moments within rel * max(|x|, 0.1 * the head's largest |x|): an entry
/// of C sums products of centred rows in another order than the CPU's GEMM, so its error scales with the head's
/// magnitude, not its own (cancellation).
void require_moments_close(kc::Moments const& gpu, kc::Moments const& cpu, kc::Case const& c, float rel) {
  Index const dk = c.e.dim, dv = c.dim_v > 0 ? c.dim_v : dk;
  CHECK(gpu.count == cpu.count);
  INFO("key means");
  require_close_in_head(gpu.key_mean, cpu.key_mean, dk, rel, 1e-1f);
  INFO("value means");
  require_close_in_head(gpu.value_mean, cpu.value_mean, dv, rel, 1e-1f);
  INFO("co-moments");
  require_close_in_head(gpu.comoment, cpu.comoment, dk * dv, rel, 1e-1f);
}

/// Relative tolerance of a stored moment: fp32 1e-5; a 16-bit store may round the other way (one ulp).
float moment_rel(kc::Dtype d) {
  return d == kc::Dtype::f32 ? 1e-5f : (d == kc::Dtype::f16 ? 2e-3f : 1.6e-2f);
}

}  // namespace

TEST_CASE(
    "cuda: MomentKV's fold (on_evict) matches the CPU: fp32/fp16 caches, fp32/fp16/bf16 moments, d_k != d_v, "
    "several row ranges, an empty eviction",
    "[cuda][moment_kv]") {
  KVC_REQUIRE_DEVICE();
  kvc::MomentKVScorer<> const params{};
  for (auto dtype : {kc::Dtype::f32, kc::Dtype::f16})
    for (auto mdtype : {kc::Dtype::f32, kc::Dtype::f16, kc::Dtype::bf16})
      for (auto layout : {kc::Layout::bhtd, kc::Layout::paged}) {
        // 600 slots over 4 heads: three row ranges per head; 64 x 80 = 5120 entries: two passes per range.
        auto c = moment_case({2, 2, 600, 64}, 80, 4, 4, 31);
        c.dtype = dtype;
        c.layout = layout;
        INFO("dtype " << static_cast<int>(dtype) << " moments " << static_cast<int>(mdtype) << " layout "
                      << static_cast<int>(layout));
        kc::Moments m = zero_moments(c, mdtype);
        kc::Residuals none;
        // Fold 1 into empty moments (head 3 evicts nothing); fold 2 merges a second block into the CPU's result.
        for (int round = 0; round < 2; ++round) {
          auto const plan = round == 0 ? moment_plan(c, 5, 3, 3) : moment_plan(c, 6, 2);
          kc::Moments gpu = m;
          kc::Residuals r;
          REQUIRE(kc::moment_evict(c, params, gpu, r, plan.index, plan.count, c.e.tokens) == "");
          kc::Moments const cpu = cpu_evict(c, params, m, none, plan);
          INFO("round " << round);
          require_moments_close(gpu, cpu, c, moment_rel(mdtype));
          if (round == 0)
            CHECK(cpu.count[3] == 0);
          m = cpu;
        }
      }
}

TEST_CASE(
    "cuda: MomentKV's fold drops evicted rows with a NaN or Inf in K or V, as the CPU (a head whose evicted rows are "
    "all non-finite merges nothing)",
    "[cuda][moment_kv][range]") {
  KVC_REQUIRE_DEVICE();
  constexpr float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  kvc::MomentKVScorer<> const params{};
  for (auto dtype : {kc::Dtype::f32, kc::Dtype::f16})
    for (auto layout : {kc::Layout::bhtd, kc::Layout::paged}) {
      auto c = moment_case({2, 2, 600, 64}, 80, 4, 4, 43);
      c.dtype = dtype;
      c.layout = layout;
      INFO("dtype " << static_cast<int>(dtype) << " layout " << static_cast<int>(layout));
      for (Index bh = 0; bh < 4; ++bh)
        for (Index t = 1; t < c.e.tokens; ++t) {
          if (bh == 3 || t % 7 == 3)  // head (1, 1): every row but slot 0 (always kept) is non-finite
            c.k[static_cast<std::size_t>((bh * c.e.tokens + t) * c.e.dim + t % c.e.dim)] = t % 2 == 0 ? nan : inf;
          else if (t % 11 == 5)
            c.v[static_cast<std::size_t>((bh * c.e.tokens + t) * c.dim_v + t % c.dim_v)] = t % 2 == 0 ? -inf : nan;
        }
      auto const plan = moment_plan(c, 5, 3);
      kc::Moments const zero = zero_moments(c, kc::Dtype::f32);
      kc::Moments gpu = zero;
      kc::Residuals none, r;
      REQUIRE(kc::moment_evict(c, params, gpu, r, plan.index, plan.count, c.e.tokens) == "");
      kc::Moments const cpu = cpu_evict(c, params, zero, none, plan);
      for (Index bh = 0; bh < 4; ++bh) {  // the oracle: only the finite evicted rows are counted
        Index finite = 0;
        for (Index t = 0, j = 0; t < c.lengths[static_cast<std::size_t>(bh)]; ++t) {
          if (j < plan.count[static_cast<std::size_t>(bh)] &&
              plan.index[static_cast<std::size_t>(bh * c.e.tokens + j)] == t) {
            ++j;
            continue;
          }
          finite += bh != 3 && t % 7 != 3 && t % 11 != 5 ? 1 : 0;
        }
        CHECK(cpu.count[static_cast<std::size_t>(bh)] == finite);
      }
      CHECK(cpu.count[3] == 0);
      kc::Moments const& folded = gpu;
      for (auto const* v :
           {&cpu.key_mean, &cpu.value_mean, &cpu.comoment, &folded.key_mean, &folded.value_mean, &folded.comoment})
        for (float x : *v)
          REQUIRE(std::isfinite(x));
      require_moments_close(gpu, cpu, c, moment_rel(kc::Dtype::f32));
    }
}

TEST_CASE(
    "cuda: MomentKV's MI scores match the CPU (SnapKV chunk-mean base or a fixed base with 0, +inf and NaN or Inf "
    "values, n = 0 head, clamp, fp32/fp16/bf16 caches, 16-bit moments, layouts)",
    "[cuda][moment_kv]") {
  KVC_REQUIRE_DEVICE();
  for (auto dtype : {kc::Dtype::f32, kc::Dtype::f16, kc::Dtype::bf16})
    for (auto mdtype : {kc::Dtype::f32, kc::Dtype::f16})
      for (auto layout : {kc::Layout::bhtd, kc::Layout::bthd, kc::Layout::paged})
        for (int variant = 0; variant < 3; ++variant) {  // 0: SnapKV base; 1: clamp; 2: fixed base with 0 and +inf
          auto c = moment_case({2, 2, 160, 32}, 24, 4, 8, 41);
          c.dtype = dtype;
          c.layout = layout;
          INFO("dtype " << static_cast<int>(dtype) << " moments " << static_cast<int>(mdtype) << " layout "
                        << static_cast<int>(layout) << " variant " << variant);
          kvc::MomentKVScorer<> params{};
          params.base.window_size = 8;
          kc::Residuals none;
          kc::Moments m = cpu_evict(c, params, zero_moments(c, mdtype), none, moment_plan(c, 9, 2, 2));
          REQUIRE(m.count[2] == 0);  // head (1, 0) scores ‖v_j‖
          if (variant == 1) {        // a clamp that zeroes about half of C's entries
            std::vector<float> mag;
            for (float x : m.comoment)
              mag.push_back(std::abs(x));
            std::nth_element(mag.begin(), mag.begin() + static_cast<std::ptrdiff_t>(mag.size() / 2), mag.end());
            params.clamp_tau = mag[mag.size() / 2];
          }
          std::vector<float> fixed;
          if (variant == 2) {
            kvc::tools::Rng rng(3);
            fixed.resize(static_cast<std::size_t>(c.e.rows()));
            for (float& x : fixed) {
              auto const r = rng.next() % 10;
              x = r == 0 ? 0.0f : (r == 1 ? std::numeric_limits<float>::infinity() : static_cast<float>(rng.uniform()));
            }
            params.scale = 0.3f;
          }
          // Variant 2, after the moments are taken: a NaN in a slot's value makes its residual NaN (-inf unless the
          // base protects it, a zero base included), an Inf makes it +inf (+inf, or 0 for a zero base); every second
          // NaN slot and every second Inf slot gets a zero base, in every head (three of them have evicted rows: the
          // residual path with C).
          if (variant == 2)
            for (Index bh = 0; bh < c.e.batch * c.e.heads; ++bh)
              for (Index t = 3; t < c.e.tokens; t += 13) {
                c.v[static_cast<std::size_t>((bh * c.e.tokens + t) * c.dim_v + t % c.dim_v)] =
                    t % 2 == 0 ? std::numeric_limits<float>::quiet_NaN() : std::numeric_limits<float>::infinity();
                if (t % 4 == 0 || t % 4 == 1)
                  fixed[static_cast<std::size_t>(bh * c.e.tokens + t)] = 0.0f;
              }
          std::vector<float> gpu;
          REQUIRE(kc::moment_scores(c, params, m, none, fixed, gpu) == "");
          auto const cpu = cpu_moment_scores(c, params, m, none, fixed);
          for (std::size_t i = 0; i < cpu.size(); ++i)
            if (cpu[i] == std::numeric_limits<float>::infinity() || cpu[i] == 0.0f)
              REQUIRE(gpu[i] == cpu[i]);  // protected and zero bases stay exactly
          require_close_in_head(gpu, cpu, c.e.tokens, dtype == kc::Dtype::f32 ? 1e-5f : 1e-4f, 1e-3f);
        }
}

TEST_CASE(
    "cuda: MomentKV's u_j cache (update, cached scores, rank-1 and full row updates, refresh) and compaction with "
    "a TokenRows extra match the CPU",
    "[cuda][moment_kv][pipeline]") {
  KVC_REQUIRE_DEVICE();
  for (auto mdtype : {kc::Dtype::f32, kc::Dtype::f16}) {
    INFO("moments " << static_cast<int>(mdtype));
    auto c = moment_case({2, 2, 120, 32}, 40, 4, 8, 51);
    c.positions.resize(static_cast<std::size_t>(c.e.rows()));
    for (std::size_t i = 0; i < c.positions.size(); ++i)
      c.positions[i] = static_cast<Index>(i) % c.e.tokens;
    Index const dv = 40, heads = 4;
    kvc::MomentKVScorer<> params{};
    params.base.window_size = 8;
    params.clamp_tau = 0.0f;  // cached rows are not clamped: compare like with like
    kc::Residuals none;
    kc::Moments m = cpu_evict(c, params, zero_moments(c, mdtype), none, moment_plan(c, 13, 2));
    kc::Residuals r;
    r.rows.assign(static_cast<std::size_t>(c.e.rows() * dv), 0.0f);
    r.tracked = {0, 5, 0, -3};  // 5: only the new slots are filled; -3: outside [0, n), all are
    r.age.assign(static_cast<std::size_t>(heads), 0);
    r.refresh = 3;
    auto compare_rows = [&](kc::Residuals const& gpu, kc::Residuals const& cpu) {
      CHECK(gpu.tracked == cpu.tracked);
      CHECK(gpu.age == cpu.age);
      require_close_in_head(gpu.rows, cpu.rows, c.e.tokens * dv, 1e-5f, 1e-1f);  // u = C k: as C (cancellation)
    };
    auto cpu_update = [&](kc::Residuals& cr) {
      with_dtypes(c.dtype, m.dtype, [&](auto tag, auto mtag) {
        using MT = decltype(mtag);
        auto const h = host_cache<decltype(tag)>(c);
        HostMoments<MT> hm(c, m);
        auto const s = host_moment_scorer(params, hm, host_residuals(c, cr));
        kvc::test::OwnedWorkspace ws(kvc::update_workspace_bytes(kvc::Cpu{}, s, c.e, kvc::NoObservations{}));
        REQUIRE(kvc::update(kvc::Cpu{}, s, h.view(), kvc::NoObservations{}, ws.get()).ok());
      });
    };
    // update: rows of the new slots, then tracked = n.
    kc::Residuals gpu_r = r, cpu_r = r;
    REQUIRE(kc::moment_update(c, params, m, gpu_r) == "");
    cpu_update(cpu_r);
    compare_rows(gpu_r, cpu_r);
    r = cpu_r;
    // Scores from the cached rows (every head tracked), and from C k_j when a head's rows are not all valid.
    for (Index untracked : {Index{-1}, Index{1}}) {
      kc::Residuals rr = r;
      if (untracked >= 0)
        rr.tracked[static_cast<std::size_t>(untracked)] = 7;
      std::vector<float> gpu;
      REQUIRE(kc::moment_scores(c, params, m, rr, {}, gpu) == "");
      require_close_in_head(gpu, cpu_moment_scores(c, params, m, rr, {}), c.e.tokens, 1e-5f, 1e-3f);
    }
    // Evictions, each followed by the CPU's compaction (cache, positions and rows) checked against the GPU's:
    //   one slot per head (rank-1 updates), three slots (full), then one slot three times (rank-1, then the refresh
    //   at age 2 recomputes). Rows with a NaN are evicted, never folded:
    //   - step 0: head 1 (tracked 9) evicts slot 3, whose key holds a NaN: nothing is folded (m = 0), its moments and
    //     age stay, and only the 8 kept slots below 9 stay tracked;
    //   - step 1: head 0 evicts slots 7, 8, 9 and slot 8's key holds a NaN: two rows are folded, and all the kept
    //     slots (n - 3, not n - 2) stay tracked.
    std::vector<Index> const runs = {1, 3, 1, 1, 1};
    for (std::size_t step = 0; step < runs.size(); ++step) {
      INFO("step " << step);
      if (step == 0) {
        r.tracked[1] = 9;
        c.k[static_cast<std::size_t>((1 * c.e.tokens + 3) * c.e.dim + 5)] = std::numeric_limits<float>::quiet_NaN();
      }
      if (step == 1)
        c.k[static_cast<std::size_t>((0 * c.e.tokens + 8) * c.e.dim + 1)] = std::numeric_limits<float>::quiet_NaN();
      auto const plan = evict_run(c, 2 + static_cast<Index>(step) * 5, runs[step]);
      kc::Moments gm = m, cm = m;
      kc::Residuals gr = r, cr = r;
      REQUIRE(kc::moment_evict(c, params, gm, gr, plan.index, plan.count, c.e.tokens) == "");
      cm = cpu_evict(c, params, m, cr, plan);
      require_moments_close(gm, cm, c, moment_rel(mdtype));
      compare_rows(gr, cr);
      if (step == 0) {
        CHECK(cr.age == std::vector<Index>{1, 0, 1, 1});
        CHECK(cr.tracked[1] == 8);
        CHECK(cm.count[1] == m.count[1]);  // the NaN row was not folded
      }
      if (step == 1) {
        CHECK(cm.count[0] == m.count[0] + 2);  // slots 7 and 9; not slot 8
        CHECK(cr.tracked[0] == c.lengths[0] - 3);
      }
      if (step == 4)
        CHECK(cr.age == std::vector<Index>{0, 0, 0, 0});
      // Compact: the CPU's cache and rows, against the GPU's with the rows as a TokenRows extra.
      auto host = host_cache<float>(c);
      kvc::KVExtents const re{c.e.batch, c.e.heads, c.e.tokens, dv};
      kvc::TokenRows<float, kvc::StridedLayout> const rows(cr.rows.data(), kvc::bhtd_layout(re));
      kc::Case gpu_case = c;
      std::vector<float> gpu_rows = cr.rows;
      REQUIRE(kc::compact_rows(gpu_case, plan.index, plan.count, c.e.tokens, gpu_rows) == "");
      REQUIRE(kvc::compact(kvc::Cpu{}, plan.plan, host.view(), rows).ok());
      CHECK(gpu_case.lengths == host.lengths);
      CHECK(gpu_case.positions == host.positions);
      for (Index bh = 0; bh < heads; ++bh)
        for (Index j = 0; j < host.lengths[static_cast<std::size_t>(bh)]; ++j)
          for (Index a = 0; a < dv; ++a) {
            auto const at = static_cast<std::size_t>((bh * c.e.tokens + j) * dv + a);
            REQUIRE(gpu_rows[at] == cr.rows[at]);
            REQUIRE(gpu_case.v[at] == host.v[at]);
          }
      c.k = host.k;
      c.v = host.v;
      c.lengths = host.lengths;
      c.positions = host.positions;
      m = cm;
      r = cr;
      // The scores after the step read the kept rows (tracked == n), or C k_j (head 1 after step 0).
      std::vector<float> gpu;
      REQUIRE(kc::moment_scores(c, params, m, r, {}, gpu) == "");
      require_close_in_head(gpu, cpu_moment_scores(c, params, m, r, {}), c.e.tokens, 1e-5f, 1e-3f);
    }
    // A TokenRows extra with null data is skipped.
    std::vector<float> absent;
    auto const plan = moment_plan(c, 77, 2);
    kc::Case gpu_case = c;
    REQUIRE(kc::compact_rows(gpu_case, plan.index, plan.count, c.e.tokens, absent) == "");
    auto host = host_cache<float>(c);
    REQUIRE(kvc::compact(kvc::Cpu{}, plan.plan, host.view(),
                         kvc::TokenRows<float, kvc::StridedLayout>(nullptr, kvc::bhtd_layout({2, 2, 120, dv})))
                .ok());
    CHECK(gpu_case.lengths == host.lengths);
    CHECK(gpu_case.k == host.k);
  }
}

TEST_CASE(
    "cuda: MomentKV's corrected attention matches the CPU (GQA, d_k != d_v, an n = 0 head, first and zeroth "
    "order, clamp, 16-bit caches and moments)",
    "[cuda][moment_kv][attention]") {
  KVC_REQUIRE_DEVICE();
  for (auto dtype : {kc::Dtype::f32, kc::Dtype::f16})
    for (auto mdtype : {kc::Dtype::f32, kc::Dtype::f16})
      for (int variant = 0; variant < 3; ++variant) {  // 0: first order; 1: zeroth; 2: first, clamp, scale 0.2
        auto c = moment_case({2, 2, 150, 32}, 24, 4, 5, 61);
        c.dtype = dtype;
        c.layout = variant == 1 ? kc::Layout::paged : kc::Layout::bhtd;
        INFO("dtype " << static_cast<int>(dtype) << " moments " << static_cast<int>(mdtype) << " variant " << variant);
        kc::Residuals none;
        kc::Moments const m =
            cpu_evict(c, kvc::MomentKVScorer<>{}, zero_moments(c, mdtype), none, moment_plan(c, 19, 2, 1));
        REQUIRE(m.count[1] == 0);  // head (0, 1): its query heads 2 and 3 get the plain attention
        kvc::CorrectedAttention op{};
        if (variant == 1)
          op.order = kvc::MomentOrder::zeroth;
        if (variant == 2) {
          op.clamp_tau = 0.5f;
          op.attention.scale = 0.2f;
        }
        std::vector<float> out, lse;
        REQUIRE(kc::attend_corrected(c, op, m, out, lse) == "");
        with_dtypes(dtype, mdtype, [&](auto tag, auto mtag) {
          using T = decltype(tag);
          using MT = decltype(mtag);
          auto const h = host_cache<T>(c);
          HostMoments<MT> hm(c, m);
          std::vector<T> q(c.queries.size());
          for (std::size_t i = 0; i < q.size(); ++i)
            q[i] = kvc::from_float<T>(c.queries[i]);
          kvc::AttendQueries<T> const aq{
              kvc::TokenRows<T const, kvc::StridedLayout>(q.data(), kvc::bhtd_layout(c.q_ext))};
          std::vector<float> o(out.size()), l(lse.size());
          kvc::test::OwnedWorkspace ws(kvc::attend_corrected_workspace_bytes(kvc::Cpu{}, op, aq, h.view(), hm.view()));
          REQUIRE(kvc::attend_corrected(kvc::Cpu{}, op, aq, h.view(), hm.view(), {o.data(), l.data()}, ws.get()).ok());
          require_close(out, o, 1e-5f, 1e-5f);
          require_close(lse, l, 1e-5f, 1e-5f);
        });
      }
}

TEST_CASE("cuda: the MomentKV prefill driver runs on the device and keeps the CPU's slots, with moments within 1e-5",
          "[cuda][moment_kv][pipeline]") {
  KVC_REQUIRE_DEVICE();
  for (auto dtype : {kc::Dtype::f32, kc::Dtype::f16})
    for (Index rounds : {Index{1}, Index{3}}) {
      auto c = moment_case({2, 2, 160, 32}, 24, 4, 8, 71);
      c.dtype = dtype;
      c.positions.resize(static_cast<std::size_t>(c.e.rows()));
      for (std::size_t i = 0; i < c.positions.size(); ++i)
        c.positions[i] = static_cast<Index>(i) % c.e.tokens;
      INFO("dtype " << static_cast<int>(dtype) << " rounds " << rounds);
      kvc::MomentKVScorer<> params{};
      params.base.window_size = 8;
      params.prefill_rounds = rounds;
      kc::Moments gpu_m = zero_moments(c, kc::Dtype::f32);
      kc::Case gpu = c;
      REQUIRE(kc::moment_kv_prefill(gpu, params, gpu_m, 48, 1, 8) == "");
      kc::Moments cpu_m;
      with_dtypes(dtype, kc::Dtype::f32, [&](auto tag, auto) {
        using T = decltype(tag);
        auto h = host_cache<T>(c);
        HostMoments<float> hm(c, zero_moments(c, kc::Dtype::f32));
        auto const s = host_moment_scorer(params, hm, {});
        std::vector<T> q(c.queries.size());
        for (std::size_t i = 0; i < q.size(); ++i)
          q[i] = kvc::from_float<T>(c.queries[i]);
        auto const obs = kvc::observe(
            kvc::WindowQueries<T>{kvc::TokenRows<T const, kvc::StridedLayout>(q.data(), kvc::bhtd_layout(c.q_ext))});
        kvc::TopKSelector const sel{kvc::FixedBudget{48}, 1, 8};
        kvc::test::OwnedWorkspace ws(kvc::moment_kv_prefill_workspace_bytes(kvc::Cpu{}, s, sel, c.e, obs));
        REQUIRE(kvc::moment_kv_prefill(kvc::Cpu{}, s, sel, h.view(), obs, ws.get()).ok());
        CHECK(gpu.lengths == h.lengths);
        for (Index bh = 0; bh < c.e.batch * c.e.heads; ++bh) {
          INFO("head " << bh);
          auto const first = static_cast<std::ptrdiff_t>(bh * c.e.tokens);
          auto const n = static_cast<std::ptrdiff_t>(h.lengths[static_cast<std::size_t>(bh)]);
          CHECK(std::vector<Index>(gpu.positions.begin() + first, gpu.positions.begin() + first + n) ==
                std::vector<Index>(h.positions.begin() + first, h.positions.begin() + first + n));
        }
        cpu_m = hm.get(kc::Dtype::f32);
      });
      require_moments_close(gpu_m, cpu_m, c, 1e-5f);
      for (Index n : cpu_m.count)
        CHECK(n > 0);
    }
}

// --- RDKV (issue 13): packed attention and the bit allocator. The device wrappers live in cuda_kernels.cu; they are
// declared here, beside their only callers.
namespace kvc::test::cuda {
std::string attend_packed(kvc::PackedKV const& kv, Dtype dtype, kvc::KVExtents q_ext, std::vector<float> const& queries,
                          std::vector<Index> const& positions, bool causal, std::vector<float>& out,
                          std::vector<float>& lse);
std::string allocate_bits(kvc::RDKVAllocator const& a, kvc::KVExtents e, std::vector<float> const& token_weights,
                          std::vector<Index> const& lengths, std::vector<float> const& channel_weights,
                          std::vector<std::int8_t>& v_bits, std::vector<std::int8_t>& k_bits);
std::string rdkv_scores(Case const& c, Index kernel, std::vector<float>& out);
std::string think_scores(Case const& c, std::vector<float>& out);
}  // namespace kvc::test::cuda

namespace {

/// A bit plan [B, H, N] / [B, H, d_k] for the packed-attention cases. mix 0: every width, evicted tokens (V 0) and
/// pruned channels (K 0), segment counts that need pads; 1: KIVI's uniform 2 bits; 2: V all 16 (zone B only), K 8 and
/// 16. Padding slots (t >= the head's length) get 0.
struct PackedPlan {
  std::vector<std::int8_t> v, k;
  kvc::BitPlan<> plan;
  PackedPlan(kvc::KVExtents e, std::vector<Index> const& lengths, int mix)
      : v(static_cast<std::size_t>(e.rows())), k(static_cast<std::size_t>(e.batch * e.heads * e.dim)) {
    static constexpr std::int8_t v_mix[10] = {2, 4, 0, 8, 2, 16, 4, 2, 0, 8};
    static constexpr std::int8_t k_mix[9] = {2, 4, 8, 16, 0, 2, 4, 2, 8};
    for (Index b = 0; b < e.batch; ++b)
      for (Index h = 0; h < e.heads; ++h) {
        Index const n = lengths[static_cast<std::size_t>(b * e.heads + h)];
        for (Index t = 0; t < e.tokens; ++t) {
          std::int8_t bits = mix == 0 ? v_mix[(t * 7 + h * 3 + b) % 10] : (mix == 1 ? 2 : 16);
          v[static_cast<std::size_t>((b * e.heads + h) * e.tokens + t)] = t < n ? bits : 0;
        }
        for (Index c = 0; c < e.dim; ++c)
          k[static_cast<std::size_t>((b * e.heads + h) * e.dim + c)] =
              mix == 0 ? k_mix[(c * 5 + h + b) % 9] : (mix == 1 ? 2 : (c % 3 == 0 ? 16 : 8));
      }
    plan = {v.data(), k.data(), e.batch, e.heads, e.tokens, e.dim};
  }
};

/// Packs a random cache of element type T with the plan and the options, then compares kvc::attend_packed on the
/// device with the CPU kernel: outputs and LSEs within 1e-5 relative (1e-5 absolute near 0). Not bit-identical: the
/// device factors and sums the dot products in another order, its exp differs from the CPU's by an ulp or two and
/// nvcc fuses multiply-adds (backend/cuda/attention/packed.cuh).
/// [2, 2, tokens, dim] with per-head lengths {tokens, tokens - 43, 19/30 of tokens, tokens}.
template <class T>
void check_packed_attention(kc::Dtype dtype, Index gqa, Index dim_v, Index group, kvc::ZeroPoint zp, int mix,
                            bool given_positions, std::uint64_t seed, Index tokens = 300, Index dim = 64) {
  kvc::KVExtents const e{2, 2, tokens, dim};
  auto cache = kvc::tools::HostCache<T>::random(e, seed, dim_v);
  cache.per_head = true;
  cache.lengths = {tokens, tokens - 43, tokens * 19 / 30, tokens};
  cache.positions.resize(static_cast<std::size_t>(e.rows()));
  for (std::size_t i = 0; i < cache.positions.size(); ++i)
    cache.positions[i] = static_cast<Index>(i) % e.tokens + 3;  // a context that started before the cache
  PackedPlan const plan(e, cache.lengths, mix);
  kvc::PackOptions opt;
  opt.zero_point = zp;
  opt.v_group = group;
  opt.k_group = group;
  kvc::PackedKV kv;
  REQUIRE(kvc::pack(cache.view(), plan.plan, opt, kv).ok());

  kvc::KVExtents const q_ext{e.batch, e.heads * gqa, 5, e.dim};
  auto queries = kvc::tools::HostCache<float>::random(q_ext, seed + 1).k;
  for (float& x : queries)
    x *= 1.5f;
  std::vector<Index> positions;
  if (given_positions)
    positions = {2, 100, 180, 250, 400, 0, 50, 170, 299, 303};  // [B, n]: rows that see nothing, some, everything
  std::vector<float> out, lse;
  REQUIRE(kc::attend_packed(kv, dtype, q_ext, queries, positions, true, out, lse) == "");

  std::vector<T> q(queries.size());
  for (std::size_t i = 0; i < q.size(); ++i)
    q[i] = kvc::from_float<T>(queries[i]);
  kvc::AttendQueries<T> const aq{kvc::TokenRows<T const, kvc::StridedLayout>(q.data(), kvc::bhtd_layout(q_ext)),
                                 positions.empty() ? nullptr : positions.data()};
  std::vector<float> o(out.size()), l(lse.size());
  kvc::test::OwnedWorkspace ws(kvc::attend_packed_workspace_bytes(kvc::Cpu{}, kvc::Attention{}, aq, kv.view()));
  REQUIRE(kvc::attend_packed(kvc::Cpu{}, kvc::Attention{}, aq, kv.view(), {o.data(), l.data()}, ws.get()).ok());
  require_close(out, o, 1e-5f, 1e-5f);
  require_close(lse, l, 1e-5f, 1e-5f);
}

}  // namespace

TEST_CASE("cuda: packed attention matches the CPU (bit mixes, evictions, pruned channels, groups, zero points, GQA)",
          "[cuda][attention][rdkv]") {
  KVC_REQUIRE_DEVICE();
  std::uint64_t seed = 900;
  for (int mix : {0, 1, 2})
    for (Index gqa : {Index{1}, Index{4}})
      for (Index group : {Index{0}, Index{32}})
        for (auto zp : {kvc::ZeroPoint::float_min, kvc::ZeroPoint::integer}) {
          INFO("mix " << mix << " gqa " << gqa << " group " << group << " zero point " << static_cast<int>(zp));
          Index const dim_v = gqa == 4 ? 38 : 64;  // d_v != d_k, with pads in the 2- and 4-bit V rows
          check_packed_attention<float>(kc::Dtype::f32, gqa, dim_v, group, zp, mix, group == 0, ++seed);
          check_packed_attention<kvc::half>(kc::Dtype::f16, gqa, dim_v, group, zp, mix, group != 0, ++seed);
        }
}

TEST_CASE("cuda: packed attention with K groups spanning many chunks of 32 tokens (300 and 384, 700 tokens, d = 128)",
          "[cuda][attention][rdkv]") {
  // Groups that end inside a warp's chunk of 32 tokens (group 300: tokens 288-319), so one chunk reads two groups'
  // parameters (the previous kernel staged a 256-token chunk's groups and once staged only the first).
  KVC_REQUIRE_DEVICE();
  std::uint64_t seed = 950;
  for (Index group : {Index{300}, Index{384}})
    for (int mix : {0, 2}) {
      INFO("group " << group << " mix " << mix);
      check_packed_attention<float>(kc::Dtype::f32, 4, 128, group, kvc::ZeroPoint::float_min, mix, true, ++seed, 700,
                                    128);
      check_packed_attention<kvc::half>(kc::Dtype::f16, 1, 96, group, kvc::ZeroPoint::integer, mix, false, ++seed, 700,
                                        128);
    }
}

namespace {

/// Weights that stress the order of the exact solver and the Lagrangian's tests: a wide dynamic range (e^N(0, 2)),
/// many exact ties (every 3rd weight rounded to one of 4 values), zeros (every 11th), -inf on padding slots.
std::vector<float> rdkv_weights(Index rows, Index tokens, std::vector<Index> const& lengths, std::uint64_t seed) {
  kvc::tools::Rng rng(seed);
  std::vector<float> w(static_cast<std::size_t>(rows * tokens));
  for (Index r = 0; r < rows; ++r)
    for (Index t = 0; t < tokens; ++t) {
      float x = std::exp(2.0f * rng.normal());
      if (t % 3 == 0)
        x = static_cast<float>(1 + static_cast<int>(x * 7.0f) % 4) * 0.25f;
      if (t % 11 == 0)
        x = 0.0f;
      Index const n = lengths.empty() ? tokens : lengths[static_cast<std::size_t>(r)];
      w[static_cast<std::size_t>(r * tokens + t)] = t < n ? x : -std::numeric_limits<float>::infinity();
    }
  return w;
}

void check_rdkv_allocation(kvc::RDKVAllocator const& a, kvc::KVExtents e, std::vector<Index> const& lengths,
                           std::uint64_t seed) {
  auto tw = rdkv_weights(e.batch * e.heads, e.tokens, lengths, seed);
  auto cw = rdkv_weights(e.batch * e.heads, e.dim, {}, seed + 1);
  std::vector<std::int8_t> gpu_v, gpu_k;
  REQUIRE(kc::allocate_bits(a, e, tw, lengths, cw, gpu_v, gpu_k) == "");

  std::vector<Index> len = lengths;
  kvc::ScoreSpan<> const span{tw.data(), e.batch, e.heads, e.tokens,
                              len.empty() ? kvc::Lengths{} : kvc::head_lengths(len.data(), e.heads)};
  std::vector<std::int8_t> v(static_cast<std::size_t>(e.rows())),
      k(static_cast<std::size_t>(e.batch * e.heads * e.dim));
  kvc::BitPlan<> const plan{v.data(), k.data(), e.batch, e.heads, e.tokens, e.dim};
  kvc::test::OwnedWorkspace ws(kvc::allocate_bits_workspace_bytes(kvc::Cpu{}, a, e.batch, e.heads, e.tokens, e.dim));
  REQUIRE(kvc::allocate_bits(kvc::Cpu{}, a, span, cw.data(), plan, ws.get()).ok());
  REQUIRE(gpu_v.size() == v.size());
  REQUIRE(gpu_k.size() == k.size());
  for (std::size_t i = 0; i < v.size(); ++i) {
    INFO("v_bits entry " << i);
    REQUIRE(int{gpu_v[i]} == int{v[i]});
  }
  for (std::size_t i = 0; i < k.size(); ++i) {
    INFO("k_bits entry " << i);
    REQUIRE(int{gpu_k[i]} == int{k[i]});
  }
}

}  // namespace

TEST_CASE("cuda: the RDKV allocation equals the CPU's bit for bit (both solvers, budgets, scopes, long heads)",
          "[cuda][selector][rdkv]") {
  KVC_REQUIRE_DEVICE();
  std::uint64_t seed = 1300;
  for (auto solver : {kvc::BitSolver::exact, kvc::BitSolver::lagrangian})
    for (auto scope : {kvc::RDKVBudgetScope::head, kvc::RDKVBudgetScope::layer})
      for (Index budget : {Index{0}, Index{8}, Index{64}, Index{128}, Index{1000}, Index{30000}})
        for (Index residual : {Index{0}, Index{16}}) {
          INFO("solver " << static_cast<int>(solver) << " scope " << static_cast<int>(scope) << " budget " << budget
                         << " residual " << residual);
          kvc::RDKVAllocator a;
          a.solver = solver;
          a.scope = scope;
          a.budget_tokens = budget;
          a.residual = residual;
          check_rdkv_allocation(a, {2, 3, 300, 64}, {300, 257, 190, 300, 0, 17}, ++seed);
          a.eps_v = kvc::EpsilonTable::default_v();  // the authors' built-in tables, and a skewed K/V split
          a.eps_k = kvc::EpsilonTable::default_k();
          a.k_budget_ratio = 0.3;
          check_rdkv_allocation(a, {1, 2, 20000, 128}, {20000, 13001}, ++seed);
        }
  SECTION("ratio budgets, no eviction, an off-hull table") {
    kvc::RDKVAllocator a;
    for (auto solver : {kvc::BitSolver::exact, kvc::BitSolver::lagrangian}) {
      a.solver = solver;
      a.ratio = 0.9;
      check_rdkv_allocation(a, {2, 2, 4000, 128}, {4000, 3999, 1, 2500}, ++seed);
      a.ratio = -1.0;
      a.budget_tokens = 2000;  // >= 2 bits per unit everywhere: allowed without eviction
      a.options.evict = false;
      check_rdkv_allocation(a, {2, 2, 4000, 128}, {}, ++seed);
      a.options.evict = true;
      a.budget_tokens = 200;
      a.eps_v = {{1.0, 0.5, 0.2, 0.15, 0.0}};  // 8 bits above the hull's chord 4 -> 16: never chosen
      check_rdkv_allocation(a, {1, 2, 5000, 128}, {5000, 4321}, ++seed);
    }
  }
}

namespace {

/// RDKV's token weights (kernel `kernel`) or, with `think`, ThinK's channel weights, on the CPU for the case.
template <class T>
std::vector<float> cpu_rdkv_scores(kc::Case const& c, Index kernel, bool think) {
  auto const h = host_cache<T>(c);
  std::vector<T> q(c.queries.size());
  for (std::size_t i = 0; i < q.size(); ++i)
    q[i] = kvc::from_float<T>(c.queries[i]);
  kvc::test::OwnedRope const rope(kc::test_rope_spec(c.rope_style), c.e.dim, kc::test_rope_positions);
  kvc::WindowQueries<T> wq{kvc::TokenRows<T const, kvc::StridedLayout>(q.data(), kvc::bhtd_layout(c.q_ext))};
  if (c.pre_rope)
    wq.rope = rope.table;
  if (!c.query_positions.empty())
    wq.positions = c.query_positions.data();
  auto const obs = kvc::observe(wq);
  if (think) {
    kvc::ThinKChannelScorer const s{c.q_ext.tokens};
    std::vector<float> out(static_cast<std::size_t>(c.e.batch * c.e.heads * c.e.dim));
    kvc::test::OwnedWorkspace ws(kvc::channel_score_workspace_bytes(kvc::Cpu{}, s, c.e, obs));
    REQUIRE(kvc::score_channels(kvc::Cpu{}, s, h.view(), obs, out.data(), ws.get()).ok());
    return out;
  }
  kvc::RDKVTokenScorer s;
  s.window_size = c.q_ext.tokens;
  s.kernel_size = kernel;
  kvc::test::OwnedScores out(c.e.batch, c.e.heads, c.e.tokens);
  kvc::test::OwnedWorkspace ws(kvc::score_workspace_bytes(kvc::Cpu{}, s, c.e, obs));
  REQUIRE(kvc::score(kvc::Cpu{}, s, h.view(), obs, out.span, ws.get()).ok());
  return out.data;
}

}  // namespace

TEST_CASE("cuda: RDKV token weights (attn_linear) and ThinK channel weights match the CPU (fp32 1e-5, 16-bit 1e-4)",
          "[cuda][scorers][rdkv]") {
  KVC_REQUIRE_DEVICE();
  for (auto dtype : {kc::Dtype::f32, kc::Dtype::f16, kc::Dtype::bf16})
    for (auto layout : {kc::Layout::bhtd, kc::Layout::paged})
      for (bool pre_rope : {false, true})
        for (Index kernel : {Index{1}, Index{5}}) {
          auto c = random_case({2, 2, 300, 64}, 4, 8, true, 31);
          c.dtype = dtype;
          c.layout = layout;
          c.pre_rope = pre_rope;
          INFO("dtype " << static_cast<int>(dtype) << " layout " << static_cast<int>(layout) << " pre_rope " << pre_rope
                        << " kernel " << kernel);
          float const rel = dtype == kc::Dtype::f32 ? 1e-5f : 1e-4f;
          auto cpu = [&](bool think) {
            return dtype == kc::Dtype::f32   ? cpu_rdkv_scores<float>(c, kernel, think)
                   : dtype == kc::Dtype::f16 ? cpu_rdkv_scores<kvc::half>(c, kernel, think)
                                             : cpu_rdkv_scores<kvc::bfloat16>(c, kernel, think);
          };
          std::vector<float> gpu;
          REQUIRE(kc::rdkv_scores(c, kernel, gpu) == "");
          require_close(gpu, cpu(false), rel, rel);
          REQUIRE(kc::think_scores(c, gpu) == "");
          require_close(gpu, cpu(true), rel, rel);
        }
}

TEST_CASE(
    "cuda: ThinK's channel weights leave keys with a NaN or Inf element out of the mean, as the CPU (fp32 and bf16, "
    "d = 64 and 160: one and two channel chunks, a head of non-finite keys only)",
    "[cuda][scorers][rdkv][range]") {
  KVC_REQUIRE_DEVICE();
  constexpr float nan = std::numeric_limits<float>::quiet_NaN(), inf = std::numeric_limits<float>::infinity();
  for (auto dtype : {kc::Dtype::f32, kc::Dtype::bf16})
    for (Index d : {Index{64}, Index{160}}) {
      auto c = random_case({2, 2, 300, d}, 4, 8, true, 47);
      c.dtype = dtype;
      for (Index bh = 0; bh < 4; ++bh)
        for (Index t = 0; t < c.e.tokens; ++t)
          if (bh == 3 || t % 13 == 4)  // head (1, 1): no finite key, every weight 0
            c.k[static_cast<std::size_t>((bh * c.e.tokens + t) * d + (t * 7) % d)] = t % 2 == 0 ? nan : -inf;
      INFO("dtype " << static_cast<int>(dtype) << " d " << d);
      std::vector<float> gpu;
      REQUIRE(kc::think_scores(c, gpu) == "");
      auto const cpu =
          dtype == kc::Dtype::f32 ? cpu_rdkv_scores<float>(c, 1, true) : cpu_rdkv_scores<kvc::bfloat16>(c, 1, true);
      REQUIRE(cpu.size() == static_cast<std::size_t>(4 * d));
      for (std::size_t i = 0; i < cpu.size(); ++i) {  // the oracle: finite, positive, 0 for head (1, 1)
        REQUIRE(std::isfinite(cpu[i]));
        REQUIRE((i >= static_cast<std::size_t>(3 * d) ? cpu[i] == 0.0f : cpu[i] > 0.0f));
      }
      require_close(gpu, cpu, dtype == kc::Dtype::f32 ? 1e-5f : 1e-4f, 1e-6f);
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Issue 22, section 4: d = 128 and batch 3 in every family; the HND and CSR paged, per-head paged and ragged layouts
// in every scorer; heads long enough that the capped grids' grid-stride loops take a second pass; a stream of the
// caller's own; a whole decode step that neither synchronises nor allocates.

namespace {

/// The layouts the first parity cases did not score on (cuda_kernels.hpp, Layout).
constexpr kc::Layout more_layouts[] = {kc::Layout::paged_hnd, kc::Layout::paged_csr, kc::Layout::head_paged,
                                       kc::Layout::ragged};

/// A [3, 2, 120, d] case for the layout cases: lengths whose CSR lists hold 8, 7 and 4 pages of 16 rows (of 8 a
/// padded table would hold), ragged segments of length + i % 3 rows (head 0: all 120), per-head pages of 15 rows.
kc::Case layout_case(Index d, Index query_heads, Index window, bool per_head, std::uint64_t seed, kc::Layout layout,
                     kc::Dtype dtype) {
  auto c = random_case({3, 2, 120, d}, query_heads, window, per_head, seed);
  c.lengths = per_head ? std::vector<Index>{120, 113, 90, 97, 41, 60} : std::vector<Index>{120, 97, 60};
  c.layout = layout;
  c.dtype = dtype;
  return c;
}

/// One dtype per layout, so that the four layouts see the three dtypes.
kc::Dtype layout_dtype(std::size_t i) {
  return i % 3 == 0 ? kc::Dtype::f32 : (i % 3 == 1 ? kc::Dtype::f16 : kc::Dtype::bf16);
}

template <class Fn>
auto by_dtype_value(kc::Dtype d, Fn&& fn) {
  if (d == kc::Dtype::f32)
    return fn(float{});
  if (d == kc::Dtype::f16)
    return fn(kvc::half{});
  return fn(kvc::bfloat16{});
}

}  // namespace

TEST_CASE(
    "cuda: every scorer matches the CPU on the HND and CSR paged, per-head paged and ragged layouts (d = 128, batch "
    "3, fp32/fp16/bf16, 1e-5 / 1e-4 relative)",
    "[cuda][scorers][layouts]") {
  KVC_REQUIRE_DEVICE();
  // The CPU scores the same rows in BHTD: a layout only changes where the device reads them. ObservedAttention at
  // its own tolerance (1e-5 of the head's scale, as its case above).
  for (std::size_t li = 0; li < std::size(more_layouts); ++li) {
    kc::Layout const layout = more_layouts[li];
    kc::Dtype const dtype = layout_dtype(li);
    float const rel = dtype == kc::Dtype::f32 ? 1e-5f : 1e-4f;
    for (char const* policy :
         {"key_diff", "key_diff_raw", "knorm", "streaming_llm", "random", "snap_kv", "snap_kv_kvpress", "snap_kv_chunk",
          "snap_kv_chunk_kvpress", "tova", "tova_kvpress", "observed_attention"}) {
      bool const tova = std::string(policy).rfind("tova", 0) == 0;  // TOVA needs equal lengths within a sequence
      auto c = layout_case(128, 4, 8, !tova, 17, layout, dtype);
      c.pre_rope = std::string(policy) == "snap_kv";
      INFO(policy << " layout " << static_cast<int>(layout) << " dtype " << static_cast<int>(dtype));
      std::vector<float> gpu;
      REQUIRE(kc::scores(policy, c, gpu) == "");
      auto const cpu = by_dtype_value(dtype, [&](auto tag) { return cpu_scores<decltype(tag)>(policy, c); });
      if (std::string(policy) == "observed_attention")
        require_close_in_head(gpu, cpu, c.e.tokens, 1e-5f, 1e-2f);
      else
        require_close(gpu, cpu, rel, rel);
    }
    // RDKV's token weights and ThinK's channel weights.
    auto c = layout_case(128, 4, 8, true, 31, layout, dtype);
    c.pre_rope = true;
    INFO("rdkv / think layout " << static_cast<int>(layout) << " dtype " << static_cast<int>(dtype));
    std::vector<float> gpu;
    REQUIRE(kc::rdkv_scores(c, 5, gpu) == "");
    require_close(gpu, by_dtype_value(dtype, [&](auto tag) { return cpu_rdkv_scores<decltype(tag)>(c, 5, false); }),
                  rel, rel);
    REQUIRE(kc::think_scores(c, gpu) == "");
    require_close(gpu, by_dtype_value(dtype, [&](auto tag) { return cpu_rdkv_scores<decltype(tag)>(c, 5, true); }), rel,
                  rel);
  }
}

TEST_CASE(
    "cuda: ExpectedAttention and MomentKV's MI scores match the CPU on the HND and CSR paged, per-head paged and "
    "ragged layouts (d = 128, batch 3)",
    "[cuda][scorers][layouts][expected_attention][moment_kv]") {
  KVC_REQUIRE_DEVICE();
  // Tolerances as in their cases above: ExpectedAttention 1e-4 of max(|cpu|, 1e-2 * the head's largest), kept sets
  // equal but near-ties; MI scores 1e-5 (fp32) / 1e-4 (16-bit) of max(|cpu|, 1e-3 * the head's largest).
  for (std::size_t li = 0; li < std::size(more_layouts); ++li) {
    kc::Layout const layout = more_layouts[li];
    kc::Dtype const dtype = li % 2 == 0 ? kc::Dtype::f32 : kc::Dtype::f16;
    INFO("layout " << static_cast<int>(layout) << " dtype " << static_cast<int>(dtype));
    {
      auto const c = layout_case(128, 4, 8, true, 37, layout, dtype);
      kc::EAInputs in;
      in.query_heads = 4;
      auto const rows = query_rows({3, 4, 64, 128}, 0.0f, 2.5f, 79);
      cpu_statistics<float>({3, 4, 64, 128}, rows, {}, {.n_sink = 4}, in.mean, in.cov);
      std::vector<float> gpu;
      REQUIRE(kc::expected_attention(c, in, gpu) == "");
      auto const cpu = by_dtype_value(dtype, [&](auto tag) { return cpu_expected_attention<decltype(tag)>(c, in); });
      require_close_in_head(gpu, cpu, c.e.tokens, 1e-4f, 1e-2f);
      require_same_kept(kvc::TopKSelector{kvc::RatioBudget{0.5}}, gpu, cpu, c.e, c.lengths, c.per_head, 1e-4f, 1e-2f);
    }
    {
      auto c = layout_case(128, 4, 8, true, 43, layout, dtype);
      c.dim_v = 96;  // d_v != d_k
      c.v = kvc::tools::HostCache<float>::random({3, 2, 120, 96}, 50).k;
      kvc::MomentKVScorer<> params{};
      params.base.window_size = 8;
      kc::Residuals none;
      kc::Moments const m = cpu_evict(c, params, zero_moments(c, kc::Dtype::f32), none, moment_plan(c, 9, 2, 2));
      std::vector<float> gpu;
      REQUIRE(kc::moment_scores(c, params, m, none, {}, gpu) == "");
      require_close_in_head(gpu, cpu_moment_scores(c, params, m, none, {}), c.e.tokens,
                            dtype == kc::Dtype::f32 ? 1e-5f : 1e-4f, 1e-3f);
    }
  }
}

TEST_CASE(
    "cuda: H2O and UNComp follow the CPU through updates, evictions and compactions on the HND and CSR paged, "
    "per-head paged and ragged layouts (d = 128, batch 3, 1e-5 relative)",
    "[cuda][layouts][h2o][uncomp]") {
  KVC_REQUIRE_DEVICE();
  // Two steps each, no appends (a CSR list or a ragged segment holds only the case's lengths): H2O a 6-row window
  // update then an eviction of every third slot, then the engine's column sums; UNComp a 4-row window update, its
  // own selection (allocation and plan) and eviction, then a 1-row update. Tolerances as in their cases above.
  Index const batch = 3, hkv = 2, hq = 4, n_cap = 120, d = 128;
  for (std::size_t li = 0; li < std::size(more_layouts); ++li) {
    kc::Layout const layout = more_layouts[li];
    kc::Dtype const dtype = li % 2 == 0 ? kc::Dtype::f32 : kc::Dtype::f16;
    INFO("layout " << static_cast<int>(layout) << " dtype " << static_cast<int>(dtype));
    auto c = layout_case(d, hq, 1, true, 47, layout, dtype);
    c.pre_rope = li % 2 == 1;
    c.positions.resize(static_cast<std::size_t>(c.e.rows()));
    for (std::size_t i = 0; i < c.positions.size(); ++i)
      c.positions[i] = static_cast<Index>(i) % n_cap;
    kvc::test::OwnedRope const rope(kc::test_rope_spec(c.rope_style), d, kc::test_rope_positions);
    auto window = [&](kvc::KVExtents qe, std::vector<float> const& queries, auto tag) {
      using T = decltype(tag);
      auto q = std::make_shared<std::vector<T>>(queries.size());
      for (std::size_t i = 0; i < q->size(); ++i)
        (*q)[i] = kvc::from_float<T>(queries[i]);
      kvc::WindowQueries<T> wq{kvc::TokenRows<T const, kvc::StridedLayout>(q->data(), kvc::bhtd_layout(qe))};
      if (c.pre_rope)
        wq.rope = rope.table;
      return std::make_pair(q, wq);
    };
    {  // H2O
      std::vector<kc::H2OStep> steps(2);
      std::vector<kc::H2OResult> want;
      by_host_dtype(dtype, [&](auto tag) {
        auto host = host_cache<decltype(tag)>(c);
        std::vector<float> acc(static_cast<std::size_t>(c.e.rows()), -5.0f);
        std::vector<Index> tracked(static_cast<std::size_t>(batch * hkv), 0);
        kvc::H2OScorer<> const s{{{acc.data(), batch, hkv, n_cap}, tracked.data()}, 5};
        for (std::size_t k = 0; k < steps.size(); ++k) {
          kc::H2OStep& step = steps[k];
          if (k == 0) {
            step.q_ext = {batch, hq, 6, d};
            step.queries = kvc::tools::random_values<float>(step.q_ext.rows() * d, 301, 1.5f);
            auto const [q, wq] = window(step.q_ext, step.queries, tag);
            auto const obs = kvc::observe(wq);
            kvc::test::OwnedWorkspace ws(kvc::update_workspace_bytes(kvc::Cpu{}, s, host.ext, obs));
            REQUIRE(kvc::update(kvc::Cpu{}, s, host.view(), obs, ws.get()).ok());
          } else {
            step.columns = kvc::tools::random_values<float>(batch * hq * n_cap, 302);
            for (float& x : step.columns)
              x = std::abs(x);
            step.column_heads = hq;
            auto const obs = kvc::observe(kvc::AttentionColumnSums<>{step.columns.data(), batch, hq, n_cap, 1});
            REQUIRE(kvc::update(kvc::Cpu{}, s, host.view(), obs, {}).ok());
          }
          kc::H2OResult r;
          r.acc = acc;
          r.tracked = tracked;
          kvc::test::OwnedScores out(batch, hkv, n_cap);
          REQUIRE(kvc::score(kvc::Cpu{}, s, host.view(), out.span, {}).ok());
          r.scores = out.data;
          if (k == 0) {
            step.index.assign(static_cast<std::size_t>(batch * hkv * n_cap), -1);
            step.count.assign(static_cast<std::size_t>(batch * hkv), 0);
            for (Index bh = 0; bh < batch * hkv; ++bh) {
              Index kept = 0;
              for (Index j = 0; j < host.lengths[static_cast<std::size_t>(bh)]; ++j)
                if ((j + bh) % 3 != 0)
                  step.index[static_cast<std::size_t>(bh * n_cap + kept++)] = j;
              step.count[static_cast<std::size_t>(bh)] = kept;
            }
            kvc::KeepPlan<> const plan{step.index.data(), step.count.data(), batch, hkv, n_cap};
            REQUIRE(kvc::on_evict(kvc::Cpu{}, s, host.view(), plan, {}).ok());
            REQUIRE(kvc::compact(kvc::Cpu{}, plan, host.view(), s.state.accumulated).ok());
          }
          r.lengths = host.lengths;
          want.push_back(r);
        }
      });
      std::vector<kc::H2OResult> got;
      REQUIRE(kc::h2o(c, 5, steps, got) == "");
      REQUIRE(got.size() == want.size());
      for (std::size_t k = 0; k < want.size(); ++k) {
        INFO("h2o step " << k);
        CHECK(got[k].tracked == want[k].tracked);
        CHECK(got[k].lengths == want[k].lengths);
        auto valid = [&](std::vector<float> a) {  // slots past a head's length hold stale values: masked
          for (Index bh = 0; bh < batch * hkv; ++bh)
            for (Index j = want[k].tracked[static_cast<std::size_t>(bh)]; j < n_cap; ++j)
              a[static_cast<std::size_t>(bh * n_cap + j)] = -std::numeric_limits<float>::infinity();
          return a;
        };
        require_close_in_head(valid(got[k].acc), valid(want[k].acc), n_cap, 1e-5f, 1e-2f);
        require_close_in_head(got[k].scores, want[k].scores, n_cap, 1e-5f, 1e-2f);
      }
    }
    {  // UNComp
      Index const w = 4;
      std::vector<Index> const budgets = {50, 30};
      kc::UNCompParams const params{w, 3, kvc::Pooling::max, budgets};
      std::vector<kc::UNCompStep> steps(2);
      std::vector<kc::UNCompResult> want;
      by_host_dtype(dtype, [&](auto tag) {
        auto host = host_cache<decltype(tag)>(c);
        std::vector<float> rows(static_cast<std::size_t>(c.e.rows() * w), 9.0f);
        std::vector<Index> tracked(static_cast<std::size_t>(batch * hkv), 0);
        kvc::UNCompScorer<> const s{{{rows.data(), kvc::uncomp_window_layout(c.e, w)}, tracked.data()}, w, 3};
        kvc::UNCompSelector const sel{kvc::HeadBudgets{budgets.data(), hkv}, 0, w};
        for (std::size_t k = 0; k < steps.size(); ++k) {
          kc::UNCompStep& step = steps[k];
          step.q_ext = {batch, hq, k == 0 ? w : 1, d};
          step.queries = kvc::tools::random_values<float>(step.q_ext.rows() * d, 501 + k, 1.5f);
          auto const [q, wq] = window(step.q_ext, step.queries, tag);
          auto const obs = kvc::observe(wq);
          kvc::test::OwnedWorkspace uws(kvc::update_workspace_bytes(kvc::Cpu{}, s, host.ext, obs));
          REQUIRE(kvc::update(kvc::Cpu{}, s, host.view(), obs, uws.get()).ok());
          kc::UNCompResult r;
          r.rows = rows;
          r.tracked = tracked;
          kvc::test::OwnedScores out(batch, hkv, n_cap);
          kvc::test::OwnedWorkspace sws(kvc::score_workspace_bytes(kvc::Cpu{}, s, c.e, kvc::NoObservations{}));
          REQUIRE(kvc::score(kvc::Cpu{}, s, host.view(), out.span, sws.get()).ok());
          r.scores = out.data;
          step.cpu_scores = out.data;
          if (k == 0) {
            std::vector<Index> lengths = host.lengths;
            kvc::ScoreSpan<> const span{out.data.data(), batch, hkv, n_cap, kvc::head_lengths(lengths.data(), hkv)};
            r.table.resize(static_cast<std::size_t>(batch * hkv));
            kvc::test::OwnedWorkspace ws(kvc::select_workspace_bytes(kvc::Cpu{}, sel, batch, hkv, n_cap));
            REQUIRE(kvc::allocate(kvc::Cpu{}, sel, span, r.table.data(), ws.get()).ok());
            kvc::test::OwnedPlan plan(batch, hkv, n_cap);
            REQUIRE(kvc::select(kvc::Cpu{}, sel, span, plan.plan, ws.get()).ok());
            step.index = r.index = plan.index;
            step.count = r.count = plan.count;
            REQUIRE(kvc::on_evict(kvc::Cpu{}, s, host.view(), plan.plan, {}).ok());
            r.evicted_tracked = tracked;
            REQUIRE(kvc::compact(kvc::Cpu{}, plan.plan, host.view(), s.state.window_rows).ok());
          }
          r.lengths = host.lengths;
          want.push_back(r);
        }
      });
      std::vector<kc::UNCompResult> got;
      REQUIRE(kc::uncomp(c, params, steps, got) == "");
      REQUIRE(got.size() == want.size());
      for (std::size_t k = 0; k < want.size(); ++k) {
        INFO("uncomp step " << k);
        CHECK(got[k].tracked == want[k].tracked);
        CHECK(got[k].lengths == want[k].lengths);
        auto valid = [&](std::vector<float> a) {  // rows of untracked slots are stale: masked
          for (Index bh = 0; bh < batch * hkv; ++bh)
            for (Index j = want[k].tracked[static_cast<std::size_t>(bh)] * w; j < n_cap * w; ++j)
              a[static_cast<std::size_t>(bh * n_cap * w + j)] = -std::numeric_limits<float>::infinity();
          return a;
        };
        require_close_in_head(valid(got[k].rows), valid(want[k].rows), n_cap * w, 1e-5f, 1e-2f);
        require_close_in_head(got[k].scores, want[k].scores, n_cap, 1e-5f, 1e-2f);
        if (k == 0) {
          CHECK(got[k].table == want[k].table);
          CHECK(got[k].evicted_tracked == want[k].evicted_tracked);
          require_same_plan(got[k].index_cpu, got[k].count_cpu, want[k].index, want[k].count, n_cap);
        }
      }
    }
  }
}

TEST_CASE(
    "cuda: attention and MomentKV's corrected attention match the CPU at d = 128 with batch 3, on every layout "
    "(1e-4 / 1e-5 relative)",
    "[cuda][attention][layouts]") {
  KVC_REQUIRE_DEVICE();
  // Tolerances as in the attention cases above: outputs 1e-4 (1e-5 absolute), LSEs 1e-5; corrected 1e-5.
  kc::Layout const layouts[] = {kc::Layout::bhtd,      kc::Layout::bthd,       kc::Layout::paged, kc::Layout::paged_hnd,
                                kc::Layout::paged_csr, kc::Layout::head_paged, kc::Layout::ragged};
  for (std::size_t li = 0; li < std::size(layouts); ++li) {
    kc::Dtype const dtype = layout_dtype(li);
    INFO("layout " << static_cast<int>(layouts[li]) << " dtype " << static_cast<int>(dtype));
    auto c = layout_case(128, 4, 5, true, 53, layouts[li], dtype);
    c.positions.resize(static_cast<std::size_t>(c.e.rows()));
    for (std::size_t i = 0; i < c.positions.size(); ++i)  // a context that started before the cache
      c.positions[i] = static_cast<Index>(i) % c.e.tokens + 3;
    std::vector<float> out, lse;
    REQUIRE(kc::attend(c, out, lse) == "");
    by_host_dtype(dtype, [&](auto tag) {
      using T = decltype(tag);
      auto const h = host_cache<T>(c);
      std::vector<T> q(c.queries.size());
      for (std::size_t i = 0; i < q.size(); ++i)
        q[i] = kvc::from_float<T>(c.queries[i]);
      kvc::AttendQueries<T> const aq{kvc::TokenRows<T const, kvc::StridedLayout>(q.data(), kvc::bhtd_layout(c.q_ext))};
      std::vector<float> o(out.size()), l(lse.size());
      kvc::test::OwnedWorkspace ws(kvc::attend_workspace_bytes(kvc::Cpu{}, kvc::Attention{}, aq, h.view()));
      REQUIRE(kvc::attend(kvc::Cpu{}, kvc::Attention{}, aq, h.view(), {o.data(), l.data()}, ws.get()).ok());
      require_close(out, o, 1e-4f, 1e-5f);
      require_close(lse, l, 1e-5f, 1e-5f);
    });
  }
  for (auto layout : {kc::Layout::bhtd, kc::Layout::ragged}) {
    INFO("corrected, layout " << static_cast<int>(layout));
    auto c = layout_case(128, 4, 5, true, 59, layout, kc::Dtype::f32);
    kc::Residuals none;
    kc::Moments const m =
        cpu_evict(c, kvc::MomentKVScorer<>{}, zero_moments(c, kc::Dtype::f32), none, moment_plan(c, 19, 2, 1));
    kvc::CorrectedAttention const op{};
    std::vector<float> out, lse;
    REQUIRE(kc::attend_corrected(c, op, m, out, lse) == "");
    auto const h = host_cache<float>(c);
    HostMoments<float> hm(c, m);
    kvc::AttendQueries<float> const aq{
        kvc::TokenRows<float const, kvc::StridedLayout>(c.queries.data(), kvc::bhtd_layout(c.q_ext))};
    std::vector<float> o(out.size()), l(lse.size());
    kvc::test::OwnedWorkspace ws(kvc::attend_corrected_workspace_bytes(kvc::Cpu{}, op, aq, h.view(), hm.view()));
    REQUIRE(kvc::attend_corrected(kvc::Cpu{}, op, aq, h.view(), hm.view(), {o.data(), l.data()}, ws.get()).ok());
    require_close(out, o, 1e-5f, 1e-5f);
    require_close(lse, l, 1e-5f, 1e-5f);
  }
}

TEST_CASE(
    "cuda: compaction, gather and append produce the CPU's bytes, positions and lengths on every layout with batch 3",
    "[cuda][pipeline][layouts]") {
  KVC_REQUIRE_DEVICE();
  // Exact: every row moves without arithmetic. A CSR list or a ragged segment holds the case's lengths only: the
  // appended 5 tokens land after compacted lengths (about a third of them).
  kc::Layout const layouts[] = {kc::Layout::bhtd,      kc::Layout::bthd,       kc::Layout::paged, kc::Layout::paged_hnd,
                                kc::Layout::paged_csr, kc::Layout::head_paged, kc::Layout::ragged};
  Index const batch = 3, heads = 2, n = 120, d = 32;
  for (std::size_t li = 0; li < std::size(layouts); ++li) {
    kc::Dtype const dtype = layout_dtype(li);
    INFO("layout " << static_cast<int>(layouts[li]) << " dtype " << static_cast<int>(dtype));
    auto c = layout_case(d, 2, 4, true, 3, layouts[li], dtype);
    c.positions.resize(static_cast<std::size_t>(c.e.rows()));
    for (std::size_t i = 0; i < c.positions.size(); ++i)
      c.positions[i] = 3 * (static_cast<Index>(i) % n) + 1;
    kvc::tools::Rng rng(4);
    kvc::test::OwnedPlan plan(batch, heads, n);
    for (Index bh = 0; bh < batch * heads; ++bh) {
      Index j = 0;
      for (Index t = 0; t < c.lengths[static_cast<std::size_t>(bh)]; ++t)
        if (rng.next() % 3 == 0)
          plan.index[static_cast<std::size_t>(bh * n + j++)] = t;
      plan.count[static_cast<std::size_t>(bh)] = j;
    }
    auto valid_equal = [&](kc::Case const& gpu, auto const& host) {
      for (Index bh = 0; bh < batch * heads; ++bh)
        for (Index j = 0; j < host.lengths[static_cast<std::size_t>(bh)]; ++j) {
          auto const at = static_cast<std::size_t>(bh * n + j);
          INFO("head " << bh << " slot " << j);
          REQUIRE(gpu.positions[at] == host.positions[at]);
          for (Index i = 0; i < d; ++i) {
            REQUIRE(gpu.k[at * d + static_cast<std::size_t>(i)] ==
                    kvc::to_float(host.k[at * d + static_cast<std::size_t>(i)]));
            REQUIRE(gpu.v[at * d + static_cast<std::size_t>(i)] ==
                    kvc::to_float(host.v[at * d + static_cast<std::size_t>(i)]));
          }
        }
    };
    by_host_dtype(dtype, [&](auto tag) {
      using T = decltype(tag);
      auto src = host_cache<T>(c);  // gather (from the uncompacted cache), then compaction in place, then append
      kvc::tools::HostCache<T> dst({batch, heads, n, d});
      dst.track(0);
      REQUIRE(kvc::gather(kvc::Cpu{}, plan.plan, src.view(), dst.view()).ok());
      kc::Case gathered;
      REQUIRE(kc::gather(c, plan.index, plan.count, n, gathered) == "");
      CHECK(gathered.lengths == dst.lengths);
      valid_equal(gathered, dst);
      auto host = host_cache<T>(c);
      REQUIRE(kvc::compact(kvc::Cpu{}, plan.plan, host.view()).ok());
      kc::Case gpu = c;
      REQUIRE(kc::compact(gpu, plan.index, plan.count, n) == "");
      CHECK(gpu.lengths == host.lengths);
      valid_equal(gpu, host);
      auto const fresh = random_case({batch, heads, 5, d}, 2, 1, false, 8);
      auto host_src = host_cache<T>(fresh);
      host_src.lengths.clear();
      REQUIRE(kvc::append(kvc::Cpu{}, host.view(), host_src.view()).ok());
      kc::Case fresh_gpu = fresh;
      fresh_gpu.lengths.clear();
      fresh_gpu.dtype = dtype;
      gpu.room = c.lengths;  // the tables the compaction ran on
      REQUIRE(kc::append(gpu, fresh_gpu, 0, 5) == "");
      CHECK(gpu.lengths == host.lengths);
      valid_equal(gpu, host);
    });
  }
}

TEST_CASE("cuda: top-k, AdaKV and UNComp select exactly the CPU's slots with batch 3 to 5 (one- and multi-block top-k)",
          "[cuda][selectors]") {
  KVC_REQUIRE_DEVICE();
  kvc::tools::Rng rng(12);
  // Top-k: batch 5 on the one-block path, batch 3 on the multi-block path (> 16384 slots per head).
  for (auto [batch, heads, tokens] : {std::tuple<Index, Index, Index>{5, 2, 700}, {3, 1, 16500}}) {
    INFO("top-k batch " << batch << " tokens " << tokens);
    std::vector<float> scores(static_cast<std::size_t>(batch * heads * tokens));
    for (float& x : scores)
      x = static_cast<float>(rng.next() % 200);  // ties
    std::vector<Index> lengths;
    for (Index i = 0; i < batch * heads; ++i)
      lengths.push_back(tokens - static_cast<Index>(rng.next() % 300));
    kvc::TopKSelector const sel{kvc::FixedBudget{tokens / 3}, 2, 5};
    kvc::ScoreSpan<> const span{scores.data(), batch, heads, tokens, kvc::head_lengths(lengths.data(), heads)};
    kvc::test::OwnedPlan cpu(batch, heads, tokens);
    kvc::test::OwnedWorkspace ws(kvc::select_workspace_bytes(kvc::Cpu{}, sel, batch, heads, tokens));
    REQUIRE(kvc::select(kvc::Cpu{}, sel, span, cpu.plan, ws.get()).ok());
    std::vector<Index> index, count;
    REQUIRE(kc::top_k(-1, tokens / 3, 2, 5, batch, heads, tokens, scores, lengths, true, tokens, index, count) == "");
    require_same_plan(index, count, cpu.index, cpu.count, tokens);
  }
  {  // AdaKV, batch 3
    kc::AdaKVCase c;
    c.batch = 3;
    c.heads = 2;
    c.tokens = 500;
    c.fixed = 120;
    c.n_sink = 2;
    c.n_recent = 3;
    for (float x : kvc::tools::random_values<float>(c.batch * c.heads * c.tokens, 19, 1.0f))
      c.scores.push_back(std::round(std::abs(x) * 8.0f) / 8.0f);
    for (Index i = 0; i < c.batch * c.heads; ++i)
      c.lengths.push_back(c.tokens - 37 * i);
    std::vector<Index> table, index, count;
    REQUIRE(kc::ada_kv(c, table, index, count) == "");
    kvc::AdaKVSelector const sel{kvc::FixedBudget{c.fixed}, c.alpha, kvc::Reference::authors, c.n_sink, c.n_recent};
    std::vector<Index> lengths = c.lengths;
    kvc::ScoreSpan<> const span{c.scores.data(), c.batch, c.heads, c.tokens,
                                kvc::head_lengths(lengths.data(), c.heads)};
    std::vector<Index> cpu_table(static_cast<std::size_t>(c.batch * c.heads));
    kvc::test::OwnedWorkspace ws(kvc::select_workspace_bytes(kvc::Cpu{}, sel, c.batch, c.heads, c.tokens));
    REQUIRE(kvc::allocate(kvc::Cpu{}, sel, span, cpu_table.data(), ws.get()).ok());
    kvc::test::OwnedPlan plan(c.batch, c.heads, c.tokens);
    REQUIRE(kvc::select(kvc::Cpu{}, sel, span, plan.plan, ws.get()).ok());
    INFO("AdaKV");
    CHECK(table == cpu_table);
    require_same_plan(index, count, plan.index, plan.count, c.tokens);
  }
  {  // UNComp, batch 4
    Index const batch = 4, heads = 2, tokens = 300;
    std::vector<Index> const budgets = {70, 9};
    std::vector<float> scores;
    for (float x : kvc::tools::random_values<float>(batch * heads * tokens, 23, 1.0f))
      scores.push_back(std::round(std::abs(x) * 8.0f) / 8.0f);
    std::vector<Index> lengths;
    for (Index i = 0; i < batch * heads; ++i)
      lengths.push_back(tokens - 29 * i);
    std::vector<Index> table, index, count;
    REQUIRE(kc::uncomp_select(budgets, 8, batch, heads, tokens, scores, lengths, table, index, count) == "");
    kvc::UNCompSelector const sel{kvc::HeadBudgets{budgets.data(), heads}, 0, 8};
    std::vector<Index> host_lengths = lengths;
    kvc::ScoreSpan<> const span{scores.data(), batch, heads, tokens, kvc::head_lengths(host_lengths.data(), heads)};
    std::vector<Index> cpu_table(static_cast<std::size_t>(batch * heads));
    kvc::test::OwnedWorkspace ws(kvc::select_workspace_bytes(kvc::Cpu{}, sel, batch, heads, tokens));
    REQUIRE(kvc::allocate(kvc::Cpu{}, sel, span, cpu_table.data(), ws.get()).ok());
    kvc::test::OwnedPlan plan(batch, heads, tokens);
    REQUIRE(kvc::select(kvc::Cpu{}, sel, span, plan.plan, ws.get()).ok());
    INFO("UNComp");
    CHECK(table == cpu_table);
    require_same_plan(index, count, plan.index, plan.count, tokens);
  }
}

TEST_CASE("cuda: Knorm past 32,768 tokens takes a second pass of its capped grid-stride loop (1e-5 relative)",
          "[cuda][scorers][long]") {
  KVC_REQUIRE_DEVICE();
  // knorm_kernel: grid x = min(ceil(N / 8), 4096) blocks of 8 warps, one row per warp: a stride of 32,768 rows,
  // so blocks 0-28 score rows 32,768-32,999 on a second pass.
  auto const c = random_case({1, 2, 33000, 16}, 2, 1, true, 91);  // lengths 33000 and 32993
  std::vector<float> gpu;
  REQUIRE(kc::scores("knorm", c, gpu) == "");
  require_close(gpu, cpu_scores<float>("knorm", c), 1e-5f, 1e-5f);
}

namespace {

/// A case's fp8 form for the device's fp8 wrappers: K and V scales per (sequence, KV head) (the values span up to
/// ~1,000 stored units), and the dequantised case, load(store(x, s), s) of every value (Scenario::stored).
struct Fp8Case {
  std::vector<float> k_scales, v_scales;
  kc::Case dequantised;
};
Fp8Case fp8_case(kc::Case const& c, kvc::test::CacheFormat format) {
  Fp8Case f;
  for (Index i = 0; i < c.e.batch * c.e.heads; ++i) {
    f.k_scales.push_back(0.004f * static_cast<float>(1 + i));
    f.v_scales.push_back(0.003f * static_cast<float>(2 + i));
  }
  kvc::test::Scenario sc;
  sc.format = format;
  f.dequantised = c;
  f.dequantised.k = sc.stored<float>(c.k, f.k_scales);
  f.dequantised.v = sc.stored<float>(c.v, f.v_scales);
  return f;
}

}  // namespace

TEST_CASE(
    "cuda: every scorer reads an fp8 cache (E4M3, E5M2, a scale per sequence and KV head) as its dequantised fp32 "
    "cache, bit for bit",
    "[cuda][scorers][fp8]") {
  // Scores, not only kept sets: a per-head scale leaves Knorm's and KeyDiff's ranking unchanged (and
  // ExpectedAttention's V norms scale within a head alike), so a kernel that forgot it would keep the same tokens.
  KVC_REQUIRE_DEVICE();
  for (auto const format : {kvc::test::CacheFormat::e4m3, kvc::test::CacheFormat::e5m2}) {
    char const* const name = format == kvc::test::CacheFormat::e4m3 ? " e4m3" : " e5m2";
    for (char const* policy :
         {"key_diff", "key_diff_raw", "knorm", "streaming_llm", "snap_kv", "tova", "observed_attention"}) {
      bool const tova = std::string(policy) == "tova";
      auto const c = random_case({2, 2, 300, 64}, 4, 8, !tova, 19);
      Fp8Case const f = fp8_case(c, format);
      INFO(policy << name);
      REQUIRE(f.dequantised.k != c.k);  // quantisation changed the keys: the check below can fail
      std::vector<float> fp8, plain;
      REQUIRE(kc::fp8_scores(policy, c, format, f.k_scales, f.v_scales, fp8) == "");
      REQUIRE(kc::scores(policy, f.dequantised, plain) == "");
      CHECK(fp8 == plain);
    }
    // ExpectedAttention with its V norms (the one scorer reading V's scales), statistics given.
    auto const c = random_case({2, 2, 300, 64}, 4, 8, true, 29);
    Fp8Case const f = fp8_case(c, format);
    kc::EAInputs in;
    in.query_heads = 4;
    REQUIRE(in.scorer.use_vnorm);
    cpu_statistics<float>({2, 4, 32, 64}, query_rows({2, 4, 32, 64}, 0.0f, 2.5f, 31), {}, {.n_sink = 4}, in.mean,
                          in.cov);
    INFO("expected_attention" << name);
    std::vector<float> fp8, plain;
    REQUIRE(kc::fp8_expected_attention(c, format, f.k_scales, f.v_scales, in, fp8) == "");
    REQUIRE(kc::expected_attention(f.dequantised, in, plain) == "");
    CHECK(fp8 == plain);
  }
}

TEST_CASE(
    "cuda: ExpectedAttention past 8,192 tokens matches the CPU (every score warp and the softmax block loop many "
    "times, 1e-4 relative, kept sets equal but near-ties)",
    "[cuda][expected_attention][long]") {
  KVC_REQUIRE_DEVICE();
  // ea_score_kernel: grid x = min(ceil(N / 256), 1024) = 34 blocks of 8 warps, so every warp takes about 31 slots
  // (its 1024-block cap binds only past 262,144 tokens); ea_softmax_kernel: 1024 threads stride 9 times over the
  // head; ea_logits_kernel's grid is not capped (one 64-key tile per block, no second pass).
  auto const c = random_case({1, 1, 8500, 64}, 2, 8, true, 95);
  kc::EAInputs in;
  in.query_heads = 2;
  in.next_position = {2000};  // t0 inside the 4096-row RoPE table (the context's end, 8500, is past it)
  auto const rows = query_rows({1, 2, 128, 64}, 0.0f, 2.5f, 97);
  cpu_statistics<float>({1, 2, 128, 64}, rows, {}, {.n_sink = 4}, in.mean, in.cov);
  std::vector<float> gpu;
  REQUIRE(kc::expected_attention(c, in, gpu) == "");
  auto const cpu = cpu_expected_attention<float>(c, in);
  require_close_in_head(gpu, cpu, c.e.tokens, 1e-4f, 1e-2f);
  require_same_kept(kvc::TopKSelector{kvc::RatioBudget{0.5}}, gpu, cpu, c.e, c.lengths, c.per_head, 1e-4f, 1e-2f);
}

namespace {

/// Appends a wrapper's outputs to a digest (every value a double: exact for fp32, indices and bit widths).
template <class T>
void digest(std::vector<double>& d, std::vector<T> const& x) {
  d.push_back(static_cast<double>(x.size()));
  for (T const& v : x)
    d.push_back(static_cast<double>(v));
}

}  // namespace

TEST_CASE(
    "cuda: every entry point runs on a stream of the caller's own (kvc::Cuda{stream}), queues nothing on the default "
    "stream and gives the default stream's results",
    "[cuda][stream]") {
  KVC_REQUIRE_DEVICE();
  // Each job runs one or more wrappers and digests their outputs; the kernels are deterministic (integer atomics
  // only), so a job on the stream must give exactly its default-stream digest. Under the emulator, the operations
  // each job queued (launches, async copies and sets) are counted: none may reach the legacy default stream.
  using Job = std::pair<char const*, std::function<std::vector<double>()>>;
  auto base = random_case({2, 2, 64, 32}, 4, 6, true, 81);
  base.dtype = kc::Dtype::f16;
  base.positions.resize(static_cast<std::size_t>(base.e.rows()));
  for (std::size_t i = 0; i < base.positions.size(); ++i)
    base.positions[i] = static_cast<Index>(i) % 64;
  kc::Case paged = base;
  paged.layout = kc::Layout::paged_hnd;
  kc::Case ragged = base;
  ragged.layout = kc::Layout::ragged;
  kc::Case pre = base;
  pre.pre_rope = true;
  auto const plan = moment_plan(base, 7, 2);
  auto moment = moment_case({2, 2, 64, 32}, 24, 4, 6, 83);
  kvc::MomentKVScorer<> params{};
  params.base.window_size = 6;
  kc::Residuals none;
  kc::Moments const m =
      cpu_evict(moment, params, zero_moments(moment, kc::Dtype::f32), none, moment_plan(moment, 9, 2));
  std::vector<float> scores(2 * 2 * 20000);
  for (std::size_t i = 0; i < scores.size(); ++i)
    scores[i] = static_cast<float>((i * 7919) % 1009);
  std::vector<Index> const long_lengths = {20000, 19000, 18000, 17000};
  std::vector<Job> jobs;
  for (char const* policy :
       {"key_diff", "knorm", "streaming_llm", "random", "snap_kv_chunk", "tova", "observed_attention"})
    jobs.emplace_back(policy, [&, policy] {
      std::vector<float> out;
      REQUIRE(kc::scores(policy, std::string(policy) == "tova" ? base : paged, out) == "");
      std::vector<double> d;
      digest(d, out);
      return d;
    });
  jobs.emplace_back("snap_kv (pre-RoPE)", [&] {
    std::vector<float> out;
    REQUIRE(kc::scores("snap_kv", pre, out) == "");
    std::vector<double> d;
    digest(d, out);
    return d;
  });
  jobs.emplace_back("expected_attention", [&] {
    kc::EAInputs in;
    in.query_heads = 4;
    cpu_statistics<float>({2, 4, 32, 32}, query_rows({2, 4, 32, 32}, 0.0f, 2.5f, 5), {}, {.n_sink = 4}, in.mean,
                          in.cov);
    std::vector<float> out;
    REQUIRE(kc::expected_attention(ragged, in, out) == "");
    std::vector<double> d;
    digest(d, out);
    return d;
  });
  jobs.emplace_back("attend", [&] {
    std::vector<float> out, lse;
    REQUIRE(kc::attend(ragged, out, lse) == "");
    std::vector<double> d;
    digest(d, out);
    digest(d, lse);
    return d;
  });
  jobs.emplace_back("top_k (one- and multi-block), per-head budgets", [&] {
    std::vector<Index> index, count;
    std::vector<double> d;
    REQUIRE(kc::top_k(-1, 5000, 2, 3, 2, 2, 20000, scores, long_lengths, true, 20000, index, count) == "");
    digest(d, index);
    digest(d, count);
    std::vector<float> const few(scores.begin(), scores.begin() + 2 * 2 * 300);
    REQUIRE(kc::top_k(0.3, 0, 1, 1, 2, 2, 300, few, {}, false, 300, index, count) == "");
    digest(d, index);
    digest(d, count);
    REQUIRE(kc::top_k_per_head({5, 0, 100, 17}, 2, 2, 300, few, index, count) == "");
    digest(d, index);
    digest(d, count);
    return d;
  });
  jobs.emplace_back("ada_kv, uncomp selection", [&] {
    kc::AdaKVCase c;
    c.batch = 2;
    c.heads = 2;
    c.tokens = 300;
    c.fixed = 60;
    c.scores.assign(scores.begin(), scores.begin() + 2 * 2 * 300);
    std::vector<Index> table, index, count;
    REQUIRE(kc::ada_kv(c, table, index, count) == "");
    std::vector<double> d;
    digest(d, table);
    digest(d, index);
    REQUIRE(kc::uncomp_select({40, 7}, 4, 2, 2, 300, c.scores, {300, 250, 200, 150}, table, index, count) == "");
    digest(d, table);
    digest(d, index);
    return d;
  });
  jobs.emplace_back("compact, gather, append, ragged store", [&] {
    std::vector<double> d;
    kc::Case gathered, compacted = paged;
    REQUIRE(kc::gather(paged, plan.index, plan.count, 64, gathered) == "");
    digest(d, gathered.k);
    digest(d, gathered.positions);
    REQUIRE(kc::compact(compacted, plan.index, plan.count, 64) == "");
    digest(d, compacted.v);
    auto fresh = random_case({2, 2, 3, 32}, 4, 1, false, 85);
    fresh.lengths.clear();
    fresh.dtype = kc::Dtype::f16;
    REQUIRE(kc::append(compacted, fresh, 0, 3) == "");
    digest(d, compacted.k);
    digest(d, compacted.lengths);
    kc::Case extra = random_case({2, 2, 1, 32}, 4, 3, true, 6);
    extra.dtype = kc::Dtype::f16;
    extra.lengths = {1, 1, 1, 1};
    extra.positions = {64, 64, 64, 64};
    kc::RaggedResult r;
    REQUIRE(kc::ragged(base, plan.index, plan.count, 64, 2, extra, r) == "");
    digest(d, r.k);
    digest(d, r.out);
    return d;
  });
  jobs.emplace_back("blockwise, query statistics", [&] {
    std::vector<Index> lengths, positions;
    kc::Case c = base;
    c.dtype = kc::Dtype::f32;
    c.lengths = {64, 50};
    c.per_head = false;
    REQUIRE(kc::blockwise_key_diff(c, 20, 16, lengths, positions) == "");
    std::vector<double> d;
    digest(d, positions);
    std::vector<float> mean, cov;
    REQUIRE(kc::query_statistics(kc::Dtype::f16, {2, 4, 40, 32}, query_rows({2, 4, 40, 32}, 0.0f, 1.0f, 3), true, {},
                                 {.n_sink = 4}, true, mean, cov) == "");
    digest(d, mean);
    digest(d, cov);
    return d;
  });
  jobs.emplace_back("h2o, uncomp", [&] {
    std::vector<kc::H2OStep> steps(1);
    steps[0].q_ext = {2, 4, 5, 32};
    steps[0].queries = kvc::tools::random_values<float>(steps[0].q_ext.rows() * 32, 87, 1.5f);
    steps[0].index = plan.index;
    steps[0].count = plan.count;
    std::vector<kc::H2OResult> got;
    REQUIRE(kc::h2o(base, 7, steps, got) == "");
    std::vector<double> d;
    digest(d, got[0].acc);
    digest(d, got[0].lengths);
    std::vector<kc::UNCompStep> usteps(1);
    usteps[0].q_ext = {2, 4, 4, 32};
    usteps[0].queries = steps[0].queries;
    usteps[0].queries.resize(static_cast<std::size_t>(usteps[0].q_ext.rows() * 32));
    usteps[0].cpu_scores.assign(static_cast<std::size_t>(base.e.rows()), 1.0f);
    usteps[0].index = plan.index;
    usteps[0].count = plan.count;
    std::vector<kc::UNCompResult> ugot;
    REQUIRE(kc::uncomp(base, {4, 3, kvc::Pooling::max, {40, 30}}, usteps, ugot) == "");
    digest(d, ugot[0].rows);
    digest(d, ugot[0].scores);
    digest(d, ugot[0].index);
    return d;
  });
  jobs.emplace_back("moment_kv (scores, update, on_evict, corrected attention, prefill)", [&] {
    std::vector<double> d;
    std::vector<float> out, lse;
    REQUIRE(kc::moment_scores(moment, params, m, none, {}, out) == "");
    digest(d, out);
    kc::Residuals r;
    r.rows.assign(static_cast<std::size_t>(moment.e.rows() * 24), 0.0f);
    r.tracked = {0, 0, 0, 0};
    r.age = {0, 0, 0, 0};
    REQUIRE(kc::moment_update(moment, params, m, r) == "");
    digest(d, r.rows);
    kc::Moments mm = m;
    auto const evict = evict_run(moment, 3, 1);
    REQUIRE(kc::moment_evict(moment, params, mm, r, evict.index, evict.count, 64) == "");
    digest(d, mm.comoment);
    digest(d, r.rows);
    REQUIRE(kc::attend_corrected(moment, kvc::CorrectedAttention{}, m, out, lse) == "");
    digest(d, out);
    kc::Case c = moment;
    kc::Moments pm = zero_moments(moment, kc::Dtype::f32);
    c.positions.resize(static_cast<std::size_t>(c.e.rows()));
    for (std::size_t i = 0; i < c.positions.size(); ++i)
      c.positions[i] = static_cast<Index>(i) % 64;
    REQUIRE(kc::moment_kv_prefill(c, params, pm, 24, 1, 6) == "");
    digest(d, c.positions);
    digest(d, pm.key_mean);
    return d;
  });
  jobs.emplace_back("rdkv (packed attention, bit allocation, token and channel weights)", [&] {
    std::vector<double> d;
    kvc::KVExtents const e{2, 2, 64, 32};
    auto cache = kvc::tools::HostCache<float>::random(e, 89);
    cache.per_head = true;
    cache.lengths = {64, 50, 40, 64};
    PackedPlan const bits(e, cache.lengths, 0);
    kvc::PackedKV kv;
    REQUIRE(kvc::pack(cache.view(), bits.plan, kvc::PackOptions{}, kv).ok());
    std::vector<float> out, lse;
    REQUIRE(kc::attend_packed(kv, kc::Dtype::f32, {2, 4, 3, 32}, kvc::tools::random_values<float>(2 * 4 * 3 * 32, 90),
                              {}, true, out, lse) == "");
    digest(d, out);
    digest(d, lse);
    kvc::RDKVAllocator a;
    a.budget_tokens = 20;
    std::vector<std::int8_t> v_bits, k_bits;
    REQUIRE(kc::allocate_bits(a, e, rdkv_weights(4, 64, {64, 50, 40, 64}, 91), {64, 50, 40, 64},
                              rdkv_weights(4, 32, {}, 92), v_bits, k_bits) == "");
    digest(d, v_bits);
    digest(d, k_bits);
    REQUIRE(kc::rdkv_scores(paged, 5, out) == "");
    digest(d, out);
    REQUIRE(kc::think_scores(paged, out) == "");
    digest(d, out);
    return d;
  });
  std::vector<std::vector<double>> plain;
  for (auto const& [name, job] : jobs) {
    INFO(name << " (default stream)");
    plain.push_back(job());
  }
  kc::StreamScope const scope;
  REQUIRE(scope.ok());
  for (std::size_t i = 0; i < jobs.size(); ++i) {
    INFO(jobs[i].first << " (own stream)");
    kc::reset_op_counts();
    auto const got = jobs[i].second();
    auto const n = kc::op_counts();
    CHECK(got == plain[i]);
    if (!n.available)
      continue;  // a real GPU: no counters (the results above are checked)
    INFO("launches " << n.launches << ", default-stream ops " << n.default_stream_ops << ", other-stream ops "
                     << n.other_stream_ops);
    CHECK(n.launches > 0);
    CHECK(n.default_stream_ops == 0);
    CHECK(n.other_stream_ops >= n.launches);
  }
}

namespace {

/// The CPU's run of kc::decode (same scorers and selection, same buffer, a BHTD host cache of element type T).
template <class T>
kc::DecodeResult cpu_decode(kc::Case const& c, kc::DecodeRun const& run) {
  kc::DecodeResult out;
  auto h = host_cache<T>(c);
  kvc::KVExtents const e = c.e;
  Index const heads = e.batch * e.heads, w = 4;
  std::vector<T> q(run.queries.size());
  for (std::size_t i = 0; i < q.size(); ++i)
    q[i] = kvc::from_float<T>(run.queries[i]);
  std::vector<Index> qpos = run.query_positions;
  kvc::QueryBuffer<T> buf{q.data(),         qpos.data(),   run.q_ext.batch, run.q_ext.heads,
                          run.q_ext.tokens, run.q_ext.dim, run.buffered,    0};
  kvc::DecodeCounter counter;
  kvc::test::OwnedRope const rope(kc::test_rope_spec(c.rope_style), e.dim, kc::test_rope_positions);
  bool const h2o = run.policy == "h2o", uncomp = run.policy == "uncomp";
  std::vector<float> state(static_cast<std::size_t>(h2o ? e.rows() : (uncomp ? e.rows() * w : 0)), 0.0f);
  std::vector<Index> tracked(static_cast<std::size_t>(heads), 0);
  HostMoments<float> hm(c, zero_moments(c, kc::Dtype::f32));
  auto steps = [&](auto const& scorer, auto const& selector) {
    kvc::test::OwnedWorkspace ws(kvc::decode_workspace_bytes(kvc::Cpu{}, scorer, selector, run.schedule, e, buf));
    for (Index step = 0; step < run.steps; ++step) {
      REQUIRE(buf.push(1).ok());
      bool compressed = false;
      auto const st = kvc::decode_step(kvc::Cpu{}, scorer, selector, run.schedule, h.view(), buf, counter, rope.table,
                                       ws.get(), &compressed);
      INFO(st.message());
      REQUIRE(st.ok());
      out.compressed.push_back(compressed ? 1 : 0);
    }
  };
  auto const top_k = run.schedule.selector();
  if (run.policy == "knorm")
    steps(kvc::KnormScorer{}, top_k);
  else if (run.policy == "snap_kv")
    steps(kvc::SnapKVScorer{.window_size = w, .kernel_size = 3}, top_k);
  else if (run.policy == "tova")
    steps(kvc::TOVAScorer{}, top_k);
  else if (run.policy == "expected_attention")
    steps(kvc::ExpectedAttentionScorer{}, top_k);
  else if (h2o)
    steps(kvc::H2OScorer<>{{{state.data(), e.batch, e.heads, e.tokens}, tracked.data()}, 5}, top_k);
  else if (run.policy == "moment_kv")
    steps(host_moment_scorer(kvc::MomentKVScorer<>{}, hm, {}).decode(), top_k);
  else if (uncomp)
    steps(kvc::UNCompScorer<>{{{state.data(), kvc::uncomp_window_layout(e, w)}, tracked.data()}, w, 3},
          kvc::UNCompSelector{kvc::HeadBudgets{run.budgets.data(), e.heads}, 0, w});
  else
    FAIL("unknown policy " << run.policy);
  out.cache = c;
  out.cache.k.assign(h.k.size(), 0.0f);
  for (std::size_t i = 0; i < h.k.size(); ++i)
    out.cache.k[i] = kvc::to_float(h.k[i]);
  out.cache.lengths = h.lengths;
  out.cache.positions = h.positions;
  if (h2o || uncomp) {
    out.state = state;
    out.tracked = tracked;
  }
  if (run.policy == "moment_kv") {
    out.tracked = hm.count;
    out.key_mean = hm.get(kc::Dtype::f32).key_mean;
  }
  return out;
}

}  // namespace

TEST_CASE(
    "cuda: a whole decode step neither synchronises with the host nor allocates, queues nothing on the default "
    "stream, and leaves the CPU's cache and scorer state (Knorm, SnapKV, TOVA, ExpectedAttention, H2O, MomentKV, "
    "UNComp; batch 3, several layouts)",
    "[cuda][decode][stream]") {
  KVC_REQUIRE_DEVICE();
  // What an engine needs to capture a decode step into a CUDA graph. Per scorer, 3 steps of kvc::decode_step on a
  // stream of their own (interval 2: the second compresses to 40 tokens per head, or UNComp's budgets 40 and 30),
  // each with one fresh buffered query row (H2O and UNComp fold it in every step); the emulator's counters are reset
  // right before each kvc::decode_step call and read right after it. Then the device's cache equals the CPU's run
  // exactly (lengths, kept positions and keys: the same selection of near-identical scores, as the prefill driver
  // case above) and the scorer state within 1e-5 (H2O's accumulator, UNComp's rows: as their cases above; MomentKV's
  // key means: as its fold).
  struct Policy {
    char const* name;
    kc::Layout layout;
  };
  Policy const policies[] = {{"knorm", kc::Layout::paged_hnd}, {"snap_kv", kc::Layout::paged_csr},
                             {"tova", kc::Layout::bthd},       {"expected_attention", kc::Layout::bhtd},
                             {"h2o", kc::Layout::head_paged},  {"moment_kv", kc::Layout::paged},
                             {"uncomp", kc::Layout::ragged}};
  Index const batch = 3, hkv = 2, hq = 4, n = 64, d = 32, rows = 8;
  for (auto const& [name, layout] : policies) {
    std::string const policy = name;
    INFO(policy << " layout " << static_cast<int>(layout));
    auto c = random_case({batch, hkv, n, d}, hq, 1, true, 71);
    c.lengths =
        policy == "tova" ? std::vector<Index>{64, 64, 57, 57, 60, 60} : std::vector<Index>{64, 57, 60, 50, 62, 55};
    c.positions.resize(static_cast<std::size_t>(c.e.rows()));
    for (std::size_t i = 0; i < c.positions.size(); ++i)
      c.positions[i] = static_cast<Index>(i) % n;
    c.pre_rope = true;  // the RoPE table the driver rotates the buffered queries with
    c.layout = layout;
    kc::DecodeRun run;
    run.policy = policy;
    run.schedule.compression_interval = 2;
    run.schedule.target_size = 40;
    run.schedule.hidden_states_buffer_size = 4;
    run.schedule.n_sink = 2;
    run.schedule.n_recent = 3;
    run.q_ext = {batch, hq, rows, d};
    run.queries = kvc::tools::random_values<float>(run.q_ext.rows() * d, 73, 1.5f);
    for (Index b = 0; b < batch; ++b)
      for (Index i = 0; i < rows; ++i)
        run.query_positions.push_back(n + i);
    run.buffered = 5;
    run.steps = 3;
    run.budgets = {40, 30};
    kc::DecodeResult got;
    REQUIRE(kc::decode(c, run, true, got) == "");
    auto const want = cpu_decode<float>(c, run);
    CHECK(got.compressed == std::vector<int>{0, 1, 0});
    CHECK(want.compressed == got.compressed);
    REQUIRE(got.counts.size() == 3);
    for (std::size_t s = 0; s < got.counts.size(); ++s) {
      kc::OpCounts const& k = got.counts[s];
      if (!k.available)
        break;  // a real GPU: no counters
      INFO("step " << s << ": launches " << k.launches << ", synchronizations " << k.synchronizations
                   << ", allocations " << k.allocations << ", default-stream ops " << k.default_stream_ops);
      CHECK(k.synchronizations == 0);
      CHECK(k.allocations == 0);
      CHECK(k.default_stream_ops == 0);
      if (got.compressed[s] != 0)
        CHECK(k.launches > 0);
    }
    CHECK(got.cache.lengths == want.cache.lengths);
    for (Index bh = 0; bh < batch * hkv; ++bh)
      for (Index j = 0; j < want.cache.lengths[static_cast<std::size_t>(bh)]; ++j) {
        auto const at = static_cast<std::size_t>(bh * n + j);
        INFO("head " << bh << " slot " << j);
        REQUIRE(got.cache.positions[at] == want.cache.positions[at]);
        for (std::size_t i = 0; i < static_cast<std::size_t>(d); ++i)
          REQUIRE(got.cache.k[at * static_cast<std::size_t>(d) + i] ==
                  want.cache.k[at * static_cast<std::size_t>(d) + i]);
      }
    CHECK(got.tracked == want.tracked);
    if (policy == "h2o" || policy == "uncomp") {
      Index const width = policy == "h2o" ? 1 : 4;
      auto valid = [&](std::vector<float> a) {  // slots past a head's tracked count hold stale values: masked
        for (Index bh = 0; bh < batch * hkv; ++bh)
          for (Index j = want.tracked[static_cast<std::size_t>(bh)] * width; j < n * width; ++j)
            a[static_cast<std::size_t>(bh * n * width + j)] = -std::numeric_limits<float>::infinity();
        return a;
      };
      require_close_in_head(valid(got.state), valid(want.state), n * width, 1e-5f, 1e-2f);
    }
    if (policy == "moment_kv")
      require_close_in_head(got.key_mean, want.key_mean, d, 1e-5f, 1e-1f);
  }
}

TEST_CASE(
    "cuda: MomentKV past 8,192 tokens takes a second pass of its capped slot grid (scores from C k_j and from the "
    "cached rows, u_j rows, rank-1 row updates; 1e-5 relative)",
    "[cuda][moment_kv][long]") {
  // Last in the file: under the emulator, a violation leaves a sticky error that fails every later launch of the
  // process (ctest runs each case on its own).
  KVC_REQUIRE_DEVICE();
  // moment_slot_grid: grid x = min(ceil(N / 8), 1024) blocks of 8 warps, one slot per warp: a stride of 8,192
  // slots, so blocks 0-38 take slots 8,192-8,499 on a second pass, in moment_residual_kernel (scores, from C k_j
  // and from the cached rows), moment_fill_kernel (kvc::update) and moment_rows_kernel (kvc::on_evict: 8,499
  // kept slots get the rank-1 update).
  auto c = moment_case({1, 1, 8500, 32}, 24, 2, 8, 93);  // length 8500
  kvc::MomentKVScorer<> params{};
  params.base.window_size = 8;
  params.clamp_tau = 0.0f;  // cached rows are not clamped: compare like with like
  kc::Residuals none;
  kc::Moments m = cpu_evict(c, params, zero_moments(c, kc::Dtype::f32), none, moment_plan(c, 5, 3));
  std::vector<float> gpu;
  REQUIRE(kc::moment_scores(c, params, m, none, {}, gpu) == "");
  require_close_in_head(gpu, cpu_moment_scores(c, params, m, none, {}), c.e.tokens, 1e-5f, 1e-3f);
  kc::Residuals r;
  r.rows.assign(static_cast<std::size_t>(c.e.rows() * 24), 0.0f);
  r.tracked = {0};
  r.age = {0};
  kc::Residuals gr = r, cr = r;
  REQUIRE(kc::moment_update(c, params, m, gr) == "");
  with_dtypes(c.dtype, m.dtype, [&](auto tag, auto mtag) {
    auto const h = host_cache<decltype(tag)>(c);
    HostMoments<decltype(mtag)> hm(c, m);
    auto const s = host_moment_scorer(params, hm, host_residuals(c, cr));
    kvc::test::OwnedWorkspace ws(kvc::update_workspace_bytes(kvc::Cpu{}, s, c.e, kvc::NoObservations{}));
    REQUIRE(kvc::update(kvc::Cpu{}, s, h.view(), kvc::NoObservations{}, ws.get()).ok());
  });
  CHECK(gr.tracked == cr.tracked);
  require_close_in_head(gr.rows, cr.rows, c.e.tokens * 24, 1e-5f, 1e-1f);
  REQUIRE(kc::moment_scores(c, params, m, cr, {}, gpu) == "");  // every row tracked: the cached path
  require_close_in_head(gpu, cpu_moment_scores(c, params, m, cr, {}), c.e.tokens, 1e-5f, 1e-3f);
  auto const plan = evict_run(c, 4000, 1);  // one slot: the rank-1 row update of the 8,499 kept
  kc::Moments gm = m;
  kc::Residuals grr = cr, crr = cr;
  REQUIRE(kc::moment_evict(c, params, gm, grr, plan.index, plan.count, c.e.tokens) == "");
  kc::Moments const cm = cpu_evict(c, params, m, crr, plan);
  require_moments_close(gm, cm, c, 1e-5f);
  CHECK(grr.age == crr.age);
  require_close_in_head(grr.rows, crr.rows, c.e.tokens * 24, 1e-5f, 1e-1f);
}

namespace {

/// The device's session equals the CPU's: the schedule's compressions, the kept sets (lengths, each head's kept
/// positions) and rows, the packed stores (empty for the other policies), attention within the fp32 tolerance of
/// attend; under the emulator, no decode() call synchronises or allocates (a decode step is capturable into a graph).
void check_same_session(kvc::test::ScenarioResult const& cpu, kvc::test::ScenarioResult const& gpu,
                        kvc::Index capacity) {
  CHECK(gpu.compressions == cpu.compressions);
  CHECK(gpu.prefill_lengths == cpu.prefill_lengths);
  CHECK(gpu.lengths == cpu.lengths);
  for (std::size_t head = 0; head < cpu.lengths.size(); ++head) {
    auto const first = static_cast<std::ptrdiff_t>(head) * capacity;
    CHECK(std::equal(cpu.prefill_positions.begin() + first,
                     cpu.prefill_positions.begin() + first + cpu.prefill_lengths[head],
                     gpu.prefill_positions.begin() + first));
    CHECK(std::equal(cpu.positions.begin() + first, cpu.positions.begin() + first + cpu.lengths[head],
                     gpu.positions.begin() + first));
  }
  CHECK(gpu.keys == cpu.keys);
  CHECK(gpu.pack_error == cpu.pack_error);
  CHECK(gpu.packed_tokens == cpu.packed_tokens);
  CHECK(gpu.packed_bits == cpu.packed_bits);
  CHECK(gpu.packed_positions == cpu.packed_positions);
  CHECK(gpu.packed_keys == cpu.packed_keys);
  CHECK(gpu.packed_values == cpu.packed_values);
  if (gpu.decode_synchronizations >= 0) {
    CHECK(gpu.decode_synchronizations == 0);
    CHECK(gpu.decode_allocations == 0);
  }
  REQUIRE(gpu.attention.size() == cpu.attention.size());
  for (std::size_t i = 0; i < cpu.attention.size(); ++i)
    REQUIRE(std::fabs(gpu.attention[i] - cpu.attention[i]) <= 1e-5f + 1e-4f * std::fabs(cpu.attention[i]));
}

/// The CPU's session with `name` (any scenario policy) on a cache of element type CT.
template <class CT = float>
kvc::test::ScenarioResult cpu_session(std::string const& name, kvc::test::Scenario const& sc) {
  kvc::test::HostMemory mem;
  kvc::test::ScenarioResult r;
  std::string const err =
      kvc::test::with_any_scenario_policy<kvc::HostSpace>(name, sc, mem, [&](auto const& policy, auto const& options) {
        return kvc::test::run_scenario<CT>(kvc::Cpu{}, mem, policy, options, sc, r);
      });
  INFO(err);
  REQUIRE(err.empty());
  return r;
}

}  // namespace

TEST_CASE("parity: every policy's session through the layer compressor", "[cuda][parity][compressor]") {
  // One engine path for all: prefill after the prompt, then attend and decode per token, on each backend.
  KVC_REQUIRE_DEVICE();
  for (std::string const& name : kvc::test::scenario_policies()) {
    INFO(name);
    kvc::test::Scenario const sc;
    kvc::test::ScenarioResult const cpu = cpu_session(name, sc);
    kvc::test::ScenarioResult gpu;
    std::string const device_err = kc::compressor_scenario(name, gpu);
    INFO(device_err);
    REQUIRE(device_err.empty());
    check_same_session(cpu, gpu, sc.capacity);
  }
}

TEST_CASE("parity: every policy's decode steps replayed from two CUDA graphs equal the CPU's session",
          "[cuda][parity][compressor][graph]") {
  // An engine captures its decode forward once per kind of step (a plain one, a compressing one: compresses_next())
  // and replays it (replayed() counts the step on the host). Every step's kernels must then read what changes from
  // step to step from device memory: the query buffer's fill, the step's query rows. The session (17 steps, a
  // compression every 8 or every step) must equal the CPU's, which calls decode() every step.
  KVC_REQUIRE_DEVICE();
  std::vector<std::string> const names = kvc::test::all_scenario_policies();
  for (std::string const& name : names) {
    INFO(name);
    kvc::test::Scenario const sc;
    kvc::test::ScenarioResult const cpu = cpu_session(name, sc);
    kvc::test::ScenarioResult gpu;
    std::string const device_err = kc::compressor_scenario(name, gpu, kvc::test::CacheFormat::fp32, false, true);
    INFO(device_err);
    REQUIRE(device_err.empty());
    check_same_session(cpu, gpu, sc.capacity);
  }
}

TEST_CASE("parity: every policy's session on an fp8 cache (E4M3 and E5M2, a scale per sequence and KV head)",
          "[cuda][parity][compressor][fp8]") {
  // The device reads an fp8 cache through its view's accessor, as the CPU does: the session equals the CPU's on the
  // same fp8 cache; and on the device itself it equals bit for bit the session on the dequantised fp32 cache (each
  // element is read as decode(byte) * scale: an exact decode and one rounding), packed stores included.
  KVC_REQUIRE_DEVICE();
  std::vector<std::string> const names = kvc::test::all_scenario_policies();
  for (auto const format : {kvc::test::CacheFormat::e4m3, kvc::test::CacheFormat::e5m2}) {
    kvc::test::Scenario sc;
    sc.format = format;
    for (std::string const& name : names) {
      INFO(name << (format == kvc::test::CacheFormat::e4m3 ? " e4m3" : " e5m2"));
      kvc::test::ScenarioResult const cpu = format == kvc::test::CacheFormat::e4m3
                                                ? cpu_session<kvc::float8_e4m3>(name, sc)
                                                : cpu_session<kvc::float8_e5m2>(name, sc);
      kvc::test::ScenarioResult gpu, dequantised;
      std::string device_err = kc::compressor_scenario(name, gpu, format);
      INFO(device_err);
      REQUIRE(device_err.empty());
      device_err = kc::compressor_scenario(name, dequantised, format, true);
      REQUIRE(device_err.empty());
      check_same_session(cpu, gpu, sc.capacity);
      CHECK(gpu.lengths == dequantised.lengths);
      CHECK(gpu.positions == dequantised.positions);
      CHECK(gpu.keys == dequantised.keys);
      CHECK(gpu.attention == dequantised.attention);
      CHECK(gpu.packed_keys == dequantised.packed_keys);
      CHECK(gpu.packed_values == dequantised.packed_values);
    }
  }
}

TEST_CASE("parity: a packed store too small for the prompt leaves every head empty and sets the error word",
          "[cuda][parity][compressor]") {
  // The CPU's prefill returns out_of_capacity; the device cannot return it without a synchronisation, so it writes
  // the compressor's error word and packs nothing (attention then reads the tail alone).
  KVC_REQUIRE_DEVICE();
  kvc::test::ScenarioResult gpu;
  std::string const device_err = kc::compressor_scenario("kivi_small_store", gpu);
  INFO(device_err);
  REQUIRE(device_err.empty());
  CHECK(gpu.pack_error == 1);
  CHECK(!gpu.packed_tokens.empty());
  CHECK(gpu.packed_tokens == std::vector<kvc::Index>(gpu.packed_tokens.size(), 0));
  for (float x : gpu.attention)
    REQUIRE(std::isfinite(x));
}

TEST_CASE("parity: the packed policies' session through the layer compressor", "[cuda][parity][compressor]") {
  // RDKV (its own weights, SnapKV's with the authors' preset) and KIVI: the device plans, splits the tail and packs
  // (kvc::pack_into) with the same per-value functions as the CPU, so the packed stores are equal byte for byte where
  // it matters (dequantised contents, positions, accounting); attention over packed store + tail within fp32
  // tolerance.
  KVC_REQUIRE_DEVICE();
  for (std::string const& name : kvc::test::scenario_packed_policies()) {
    INFO(name);
    kvc::test::Scenario const sc;
    kvc::test::ScenarioResult const cpu = cpu_session(name, sc);
    kvc::test::ScenarioResult gpu;
    std::string const device_err = kc::compressor_scenario(name, gpu);
    INFO(device_err);
    REQUIRE(device_err.empty());
    CHECK(cpu.pack_error == 0);
    CHECK(gpu.prefill_positions == cpu.prefill_positions);
    check_same_session(cpu, gpu, sc.capacity);
  }
}
