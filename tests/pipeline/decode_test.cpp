// SPDX-License-Identifier: Apache-2.0
// tests/pipeline/decode_test.cpp mirrors include/kvc/pipeline/decode.hpp: kvpress's DecodingPress properties
// (kvpress_reference.md §2.12: each layer's length stays within [target, target + interval - 1]; one driver serves
// sequences of different lengths; compressed memory below 0.6 of full), for every scorer kvc has, and key
// re-rotation. The oracle comparisons of the driver (H2O's decode simulation, ExpectedAttention's decode
// statistics) are in tests/reference/stateful_oracle_test.cpp.
#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/pipeline/query_statistics.hpp>
#include <kvc/backend/cpu/pipeline/rerotate.hpp>
#include <kvc/backend/cpu/scorers/expected_attention.hpp>
#include <kvc/backend/cpu/scorers/h2o.hpp>
#include <kvc/backend/cpu/scorers/key_diff.hpp>
#include <kvc/backend/cpu/scorers/knorm.hpp>
#include <kvc/backend/cpu/scorers/random.hpp>
#include <kvc/backend/cpu/scorers/snap_kv.hpp>
#include <kvc/backend/cpu/scorers/streaming_llm.hpp>
#include <kvc/backend/cpu/scorers/tova.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/pipeline/decode.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"

#include <algorithm>
#include <string>
#include <vector>

using kvc::Index;

namespace {

/// A stream of tokens (K, V and pre-RoPE queries at positions 0..total-1) decoded one token per forward into a
/// working cache under the driver, per sequence starting at its own prompt length.
struct Generation {
  kvc::KVExtents src_ext;
  Index hq;
  kvc::tools::HostCache<float> src;  ///< every token's post-RoPE K and V
  std::vector<float> queries;        ///< [B, Hq, total, d] pre-RoPE
  kvc::test::OwnedRope rope;

  Generation(Index batch, Index hkv, Index query_heads, Index total, Index d, std::uint64_t seed)
      : src_ext{batch, hkv, total, d},
        hq(query_heads),
        src(kvc::tools::HostCache<float>::random(src_ext, seed)),
        queries(kvc::tools::random_values<float>(batch * query_heads * total * d, seed + 1, 1.5f)),
        rope(kvc::RopeSpec{}, d, total + 600) {
    for (Index b = 0; b < batch; ++b)
      for (Index h = 0; h < hkv; ++h)
        for (Index t = 0; t < total; ++t)
          rope.table.rotate(src.key(b, h, t), t);
  }
};

struct Trace {
  std::vector<Index> max_length;  ///< per step, the longest head after the step
  Index compressions = 0;
  kvc::tools::HostCache<float> work;
};

/// Prefills `prompt[b]` tokens of each sequence (no compression), then decodes one token per step up to `total`,
/// calling decode_step after each. Every sequence appends its own next token, so their lengths differ throughout.
template <class S>
Trace run(Generation const& g, S scorer, kvc::DecodeSchedule const& sch, std::vector<Index> const& prompt,
          std::vector<float>* accumulator = nullptr) {
  kvc::KVExtents const e = g.src_ext;
  Index const longest = *std::max_element(prompt.begin(), prompt.end());
  Index const cap = std::max(sch.target_size, longest) + sch.compression_interval + 1;  // the peak before a compression
  kvc::tools::HostCache<float> work({e.batch, e.heads, cap, e.dim});
  work.track(0);
  std::vector<float> acc(static_cast<std::size_t>(e.batch * e.heads * cap));
  std::vector<Index> tracked(static_cast<std::size_t>(e.batch * e.heads), 0);
  if constexpr (kvc::StatefulScorer<S>)
    scorer.state = {{acc.data(), e.batch, e.heads, cap}, tracked.data()};
  Index const rows = std::max(sch.compression_interval, longest);
  std::vector<float> qdata(static_cast<std::size_t>(e.batch * g.hq * rows * e.dim));
  std::vector<Index> qpos(static_cast<std::size_t>(e.batch * rows));
  kvc::QueryBuffer<float> buf{qdata.data(), qpos.data(), e.batch, g.hq, rows, e.dim};
  kvc::DecodeCounter counter;
  kvc::test::OwnedWorkspace ws(kvc::decode_workspace_bytes(kvc::Cpu{}, scorer, sch, work.ext, buf));
  Trace trace;
  std::vector<Index> next(prompt);  // each sequence's next position
  auto push = [&](Index b, Index t, Index row) {
    for (Index q = 0; q < g.hq; ++q)
      std::copy_n(g.queries.data() + ((b * g.hq + q) * e.tokens + t) * e.dim, e.dim, buf.row(b, q, row));
    qpos[static_cast<std::size_t>(b * rows + row)] = t;
  };
  // Prefill: every sequence's prompt in one forward (sequences with shorter prompts pad their query rows with
  // their last row: the driver only reads the buffer at a compression and through update's causal mask).
  for (Index b = 0; b < e.batch; ++b)
    for (Index t = 0; t < longest; ++t)
      push(b, std::min(t, prompt[static_cast<std::size_t>(b)] - 1), t);
  auto append_upto = [&](std::vector<Index> const& upto, Index begin, Index count) {
    auto src = g.src;
    src.lengths = upto;  // per sequence: clip each sequence's append at its own length
    src.per_head = false;
    REQUIRE(kvc::append(kvc::Cpu{}, work.view(), src.view(), begin, count).ok());
  };
  append_upto(prompt, 0, longest);
  if constexpr (kvc::StatefulScorer<S>) {  // prefill is not a decode step: the engine updates the state itself
    auto const obs = kvc::observe(kvc::WindowQueries<float>{buf.rows(0, longest), g.rope.table, qpos.data()});
    kvc::test::OwnedWorkspace uws(kvc::update_workspace_bytes(kvc::Cpu{}, scorer, work.ext, obs));
    REQUIRE(kvc::update(kvc::Cpu{}, scorer, work.view(), obs, uws.get()).ok());
  }
  for (Index step = 0;; ++step) {
    bool any = false;
    std::vector<Index> upto(next);
    for (Index b = 0; b < e.batch; ++b)
      if (next[static_cast<std::size_t>(b)] < e.tokens) {
        upto[static_cast<std::size_t>(b)] = next[static_cast<std::size_t>(b)] + 1;
        any = true;
      }
    if (!any)
      break;
    // Each sequence appends its own next token: one call per sequence with a window [next_b, next_b + 1).
    for (Index b = 0; b < e.batch; ++b) {
      std::vector<Index> only(static_cast<std::size_t>(e.batch), 0);
      only[static_cast<std::size_t>(b)] = upto[static_cast<std::size_t>(b)];
      if (next[static_cast<std::size_t>(b)] < e.tokens)
        append_upto(only, next[static_cast<std::size_t>(b)], 1);
      push(b, std::min(next[static_cast<std::size_t>(b)], e.tokens - 1), buf.count);
    }
    REQUIRE(buf.push(1).ok());
    bool compressed = false;
    auto const st =
        kvc::decode_step(kvc::Cpu{}, scorer, sch, work.view(), buf, counter, g.rope.table, ws.get(), &compressed);
    INFO(st.message());
    REQUIRE(st.ok());
    for (Index b = 0; b < e.batch; ++b)
      next[static_cast<std::size_t>(b)] = std::min(e.tokens, next[static_cast<std::size_t>(b)] + 1);
    Index longest_now = 0;
    for (Index v : work.lengths)
      longest_now = std::max(longest_now, v);
    trace.max_length.push_back(longest_now);
  }
  trace.compressions = counter.compressions;
  if (accumulator)
    *accumulator = acc;
  trace.work = std::move(work);
  return trace;
}

}  // namespace

TEST_CASE("decode: every head stays within [target, target + interval - 1] once it reaches target") {
  Generation const g(1, 2, 4, 260, 16, 1);
  for (Index target : {32, 48, 52, 56, 64})
    for (Index interval : {3, 4, 5}) {
      kvc::DecodeSchedule sch;
      sch.compression_interval = interval;
      sch.target_size = target;
      sch.hidden_states_buffer_size = 16;
      Trace const t = run(g, kvc::KnormScorer{}, sch, {20});
      INFO("target " << target << " interval " << interval);
      for (std::size_t s = 0; s < t.max_length.size(); ++s) {
        Index const len = t.max_length[s];
        if (20 + static_cast<Index>(s) + 1 >= target) {  // reached
          CHECK(len >= target);
          CHECK(len <= target + interval - 1);
        }
      }
      for (Index len : t.work.lengths)  // every head, at the end
        CHECK((len >= target && len <= target + interval - 1));
      CHECK(t.compressions == 240 / interval);
    }
}

TEST_CASE("decode: one driver serves sequences of different lengths, within 0.6 of the full memory") {
  Generation const g(2, 2, 4, 400, 16, 2);
  kvc::DecodeSchedule sch;
  sch.compression_interval = 8;
  sch.target_size = 64;
  sch.hidden_states_buffer_size = 32;
  Trace const t = run(g, kvc::StreamingLLMScorer{}, sch, {40, 150});
  Index const peak = *std::max_element(t.max_length.begin(), t.max_length.end());
  CHECK(peak <= 64 + 8 - 1 + 110);  // the longer prompt is larger than the target until its first compression
  CHECK(static_cast<double>(t.work.lengths[0] + t.work.lengths[2]) / (2.0 * 400.0) < 0.6);
  // StreamingLLM keeps sinks and the most recent tokens, whatever each sequence's length.
  for (Index b = 0; b < 2; ++b) {
    auto const pos = t.work.head_positions(b, 0);
    CHECK(pos[0] == 0);
    CHECK(pos[3] == 3);
    CHECK(pos.back() == 399);
    CHECK(pos[4] == 399 - static_cast<Index>(pos.size()) + 5);
  }
}

TEST_CASE("decode: the driver runs every scorer kvc has") {
  Generation const g(2, 2, 4, 120, 16, 3);
  kvc::DecodeSchedule sch;
  sch.compression_interval = 6;
  sch.target_size = 40;
  sch.hidden_states_buffer_size = 24;
  auto check = [&](auto scorer, char const* name) {
    Trace const t = run(g, scorer, sch, {30, 50});
    INFO(name);
    CHECK(t.compressions > 0);
    for (Index len : t.work.lengths)
      CHECK((len >= 40 && len <= 45));
    for (Index b = 0; b < 2; ++b)
      for (Index h = 0; h < 2; ++h) {
        auto const pos = t.work.head_positions(b, h);
        CHECK(std::is_sorted(pos.begin(), pos.end()));
        CHECK(std::adjacent_find(pos.begin(), pos.end()) == pos.end());
      }
  };
  check(kvc::KnormScorer{}, "knorm");
  check(kvc::KeyDiffScorer{}, "key_diff");
  check(kvc::StreamingLLMScorer{}, "streaming_llm");
  check(kvc::RandomScorer{7}, "random");
  kvc::SnapKVScorer snap;
  snap.window_size = 4;  // at most the rows an interval buffers (6)
  check(snap, "snap_kv");
  check(kvc::TOVAScorer{}, "tova");
  check(kvc::ExpectedAttentionScorer{}, "expected_attention");
  kvc::ExpectedAttentionScorer ea_kv;
  ea_kv.reference = kvc::Reference::kvpress;
  check(ea_kv, "expected_attention reference=kvpress");
  check(kvc::H2OScorer<>{}, "h2o");
  check(kvc::ObservedAttentionScorer{}, "h2o reference=kvpress");
}

TEST_CASE("decode: H2O's accumulator holds exactly the attention each kept token received") {
  // interval 1, target hh + recent, recent protected: the authors' per-step eviction. With no compression ever
  // (target above the total) the accumulator equals the column sums of every query over every key.
  Generation const g(1, 1, 2, 30, 8, 4);
  kvc::DecodeSchedule sch;
  sch.compression_interval = 1;
  sch.target_size = 100;
  std::vector<float> acc;
  Trace const t = run(g, kvc::H2OScorer<>{}, sch, {10}, &acc);
  CHECK(t.work.lengths[0] == 30);
  // Reference: causal softmax of RoPE'd queries, column sums, group mean, in double.
  for (Index j = 0; j < 30; ++j) {
    double want = 0.0;
    for (Index q = 0; q < 2; ++q)
      for (Index i = j; i < 30; ++i) {
        std::vector<float> qi(g.queries.begin() + (q * 30 + i) * 8, g.queries.begin() + (q * 30 + i + 1) * 8);
        g.rope.table.rotate(qi.data(), i);
        std::vector<double> logit(static_cast<std::size_t>(i + 1));
        double peak = -1e300, total = 0.0;
        for (Index k = 0; k <= i; ++k) {
          double dot = 0.0;
          for (Index c = 0; c < 8; ++c)
            dot += double{qi[static_cast<std::size_t>(c)]} * g.src.k[static_cast<std::size_t>(k * 8 + c)];
          logit[static_cast<std::size_t>(k)] = dot / std::sqrt(8.0);
          peak = std::max(peak, logit[static_cast<std::size_t>(k)]);
        }
        for (double l : logit)
          total += std::exp(l - peak);
        want += std::exp(logit[static_cast<std::size_t>(j)] - peak) / total / 2.0;
      }
    CHECK(std::abs(acc[static_cast<std::size_t>(j)] - want) <= 1e-5 * std::max(1.0, want));
  }
}

TEST_CASE("decode: key re-rotation leaves cache-relative positions and rotated keys") {
  Generation const g(1, 2, 2, 80, 8, 5);
  kvc::DecodeSchedule sch;
  sch.compression_interval = 10;
  sch.target_size = 24;
  sch.rerotate_keys = true;
  Trace const t = run(g, kvc::StreamingLLMScorer{}, sch, {20});
  // The last compression ran at the final step: slot j holds position j, and its key is the source key of the
  // token it came from rotated to j. StreamingLLM keeps sinks 0..3 and the most recent tokens, so slot 4 came
  // from token 80 - 20 = 60 (24 kept: 4 sinks + 20 recent).
  REQUIRE(t.work.lengths[0] == 24);
  CHECK(t.work.head_positions(0, 0)[4] == 4);
  std::vector<float> want(g.src.k.begin() + 60 * 8, g.src.k.begin() + 61 * 8);
  g.rope.table.rotate(want.data(), 60, true);
  g.rope.table.rotate(want.data(), 4);
  for (Index c = 0; c < 8; ++c)
    CHECK(std::abs(t.work.k[static_cast<std::size_t>(4 * 8 + c)] - want[static_cast<std::size_t>(c)]) <= 1e-5f);
}

TEST_CASE("decode: bad schedules, buffers and workspaces are refused") {
  Generation const g(1, 1, 2, 10, 8, 6);
  kvc::tools::HostCache<float> work({1, 1, 16, 8});
  work.track(0);
  std::vector<float> q(2 * 4 * 8);
  std::vector<Index> pos(4);
  kvc::QueryBuffer<float> buf{q.data(), pos.data(), 1, 2, 4, 8};
  kvc::DecodeCounter counter;
  kvc::DecodeSchedule sch;
  kvc::test::OwnedWorkspace ws(kvc::decode_workspace_bytes(kvc::Cpu{}, kvc::KnormScorer{}, sch, work.ext, buf));
  sch.compression_interval = 0;
  CHECK(
      kvc::decode_step(kvc::Cpu{}, kvc::KnormScorer{}, sch, work.view(), buf, counter, g.rope.table, ws.get()).code() ==
      kvc::Errc::invalid_argument);
  sch = {};
  CHECK(buf.push(5).code() == kvc::Errc::out_of_capacity);  // more rows than the buffer holds
  kvc::QueryBuffer<float> wrong = buf;
  wrong.dim = 4;
  CHECK(kvc::decode_step(kvc::Cpu{}, kvc::KnormScorer{}, sch, work.view(), wrong, counter, g.rope.table, ws.get())
            .code() == kvc::Errc::invalid_argument);
  CHECK(kvc::decode_step(kvc::Cpu{}, kvc::KnormScorer{}, sch, work.view(), buf, counter, g.rope.table,
                         kvc::Workspace{ws.bytes.data(), 8})
            .code() == kvc::Errc::out_of_capacity);
}

namespace {

/// A full 16-token cache with a per-head length table, and a query buffer holding 3 rows of which the last one is
/// fresh: a compressing step reads rows and positions from row 2 on (the last hidden_states_buffer_size = 1 rows),
/// and H2O's update reads them from row count - fresh = 2 on.
struct NullBufferCase {
  Generation g{1, 1, 2, 16, 8, 6};
  kvc::tools::HostCache<float> work{g.src};
  std::vector<float> q = std::vector<float>(2 * 4 * 8, 0.5f);
  std::vector<Index> pos = {13, 14, 15, 0};
  kvc::QueryBuffer<float> buf{q.data(), pos.data(), 1, 2, 4, 8, 3, 1};
  kvc::DecodeSchedule sch{1, 4, 1};
  kvc::DecodeCounter counter;

  NullBufferCase() {
    work.lengths = {16};
    work.per_head = true;
  }
  kvc::Status step(kvc::TOVAScorer const& s) {
    kvc::test::OwnedWorkspace ws(kvc::decode_workspace_bytes(kvc::Cpu{}, s, sch, work.ext, buf));
    return kvc::decode_step(kvc::Cpu{}, s, sch, work.view(), buf, counter, g.rope.table, ws.get());
  }
};

}  // namespace

TEST_CASE("decode: a null QueryBuffer::positions is refused before any offset") {
  NullBufferCase c;
  c.buf.positions = nullptr;
  kvc::Status const st = c.step(kvc::TOVAScorer{});
  CHECK(st.code() == kvc::Errc::invalid_argument);
  CHECK(std::string(st.message()).find("`positions`") != std::string::npos);
  CHECK(c.work.lengths[0] == 16);  // nothing moved
  CHECK(c.buf.fresh == 1);
}

TEST_CASE("decode: a null QueryBuffer::data is refused before any offset") {
  NullBufferCase c;
  c.buf.data = nullptr;
  kvc::Status const st = c.step(kvc::TOVAScorer{});
  CHECK(st.code() == kvc::Errc::invalid_argument);
  CHECK(std::string(st.message()).find("`data`") != std::string::npos);
  CHECK(c.work.lengths[0] == 16);
  // The same buffer with its pointers compresses the head to the target.
  NullBufferCase ok;
  REQUIRE(ok.step(kvc::TOVAScorer{}).ok());
  CHECK(ok.work.lengths[0] == 4);
}

TEST_CASE("decode: a cache without a per-head length table is refused before anything moves") {
  // Without a table compaction cannot record the kept count: the cache would still claim 16 tokens, 12 of them
  // stale copies. A per-sequence table cannot record per-head counts of several heads either.
  NullBufferCase c;
  c.work.lengths.clear();
  kvc::Status const st = c.step(kvc::TOVAScorer{});
  CHECK(st.code() == kvc::Errc::invalid_argument);
  CHECK(std::string(st.message()).find("per-head length table") != std::string::npos);
  CHECK(c.counter.steps == 0);
  CHECK(c.work.k == c.g.src.k);  // no row moved
  Generation const g2(1, 2, 2, 16, 8, 7);
  kvc::tools::HostCache<float> two(g2.src);
  two.lengths = {16};  // per sequence, two heads
  kvc::DecodeCounter counter;
  kvc::test::OwnedWorkspace ws(kvc::decode_workspace_bytes(kvc::Cpu{}, kvc::TOVAScorer{}, c.sch, two.ext, c.buf));
  CHECK(kvc::decode_step(kvc::Cpu{}, kvc::TOVAScorer{}, c.sch, two.view(), c.buf, counter, g2.rope.table, ws.get())
            .code() == kvc::Errc::invalid_argument);
}
