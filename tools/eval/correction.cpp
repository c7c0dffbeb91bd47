// SPDX-License-Identifier: Apache-2.0
// tools/eval/correction.cpp: `kvc-eval correction` (correction.hpp), in the kvc_eval_lib library: its MomentKV
// compressors are instantiated here once, not in every translation unit that includes correction.hpp.
#include "eval/correction.hpp"

#include <kvc/backend/cpu/attention/attend.hpp>
#include <kvc/backend/cpu/attention/corrected.hpp>
#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/pipeline/query_statistics.hpp>
#include <kvc/backend/cpu/pipeline/rerotate.hpp>
#include <kvc/backend/cpu/pipeline/state.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/core/rope.hpp>
#include <kvc/engine/layer_compressor.hpp>
#include <kvc/pipeline/press.hpp>

#include "eval/engine.hpp"
#include "eval/model.hpp"
#include "eval/moment_kv.hpp"

#include <cmath>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace kvc::eval {

std::vector<CorrectionRecord> correction_errors(Model const& model, tools::Params const& params,
                                                tools::AllocatorChoice const& alloc, std::vector<double> const& ratios,
                                                std::vector<std::vector<std::int32_t>> const& samples,
                                                Index prompt_tokens) {
  tools::MomentKVConfig const cfg = eval_moment_config(params, alloc, "moment_kv");
  ModelConfig const& c = model.config;
  Index const hq = c.heads, hkv = c.kv_heads, d = c.head_dim, n = prompt_tokens;
  auto check = [](Status const& st, char const* what) {
    if (!st.ok())
      tools::fail(tools::exit_invalid, std::string("correction: ") + what + ": " + st.message());
  };
  std::vector<CorrectionRecord> records(ratios.size());
  for (std::size_t r = 0; r < ratios.size(); ++r) {
    records[r].ratio = ratios[r];
    records[r].layers.resize(static_cast<std::size_t>(c.layers));
  }
  std::vector<std::byte> ws;
  auto grow = [&ws](std::size_t bytes) {
    if (ws.size() < bytes)
      ws.resize(bytes);
  };
  for (auto const& sample : samples) {
    Index const all = static_cast<Index>(sample.size()), m = all - n;
    if (m < 1)
      tools::fail(tools::exit_invalid, "correction: a sample needs continuation tokens after the prompt");
    auto session = make_session(model, {CacheType::f32, CacheLayout::dense}, all);
    RowMatrix logits;
    ForwardTrace trace;
    trace.projections = true;
    check(session->forward(sample, logits, &trace), "forward");
    std::vector<float> rope_storage(static_cast<std::size_t>(rope_table_floats(all, d)));
    RopeTable<> rope;
    check(fill_rope_table(c.rope(), d, all, rope_storage.data(), rope), "RoPE table");
    std::vector<Index> positions(static_cast<std::size_t>(all));
    for (Index t = 0; t < all; ++t)
      positions[static_cast<std::size_t>(t)] = t;
    KVExtents const e{1, hkv, n, d};
    StridedLayout const prompt_rows{{1, hq, n, d}, hq * all * d, all * d, d};
    StridedLayout const later_rows{{1, hq, m, d}, hq * all * d, all * d, d};
    std::size_t const out_size = static_cast<std::size_t>(hq * m * d), lse_size = static_cast<std::size_t>(hq * m);
    std::vector<float> f(out_size), f_r(out_size), f_c(out_size), lse(lse_size), lse_r(lse_size);
    for (std::size_t li = 0; li < trace.qkv.size(); ++li) {
      LayerProjections const& p = trace.qkv[li];
      // The prompt's K and V, [Hkv, n, d], and each slot's position.
      std::vector<float> k(static_cast<std::size_t>(hkv * n * d)), v(k.size());
      std::vector<Index> slot_positions(static_cast<std::size_t>(hkv * n));
      for (Index h = 0; h < hkv; ++h) {
        std::copy_n(p.keys.data() + h * all * d, n * d, k.data() + h * n * d);
        std::copy_n(p.values.data() + h * all * d, n * d, v.data() + h * n * d);
        for (Index t = 0; t < n; ++t)
          slot_positions[static_cast<std::size_t>(h * n + t)] = t;
      }
      AttendQueries<float> const later{TokenRows<float const, StridedLayout>(p.queries.data() + n * d, later_rows),
                                       positions.data() + n};
      std::vector<Index> full_lengths(static_cast<std::size_t>(hkv), n);
      auto const full =
          dense_cache(k.data(), v.data(), e, head_lengths(full_lengths.data(), hkv), slot_positions.data());
      grow(attend_workspace_bytes(Cpu{}, Attention{}, later, full));
      check(attend(Cpu{}, Attention{}, later, full, {f.data(), lse.data()}, {ws.data(), ws.size()}), "full attention");
      LayerQueries<float> const prompt{TokenRows<float const, StridedLayout>(p.queries_prerope.data(), prompt_rows),
                                       positions.data()};
      for (std::size_t r = 0; r < ratios.size(); ++r) {
        std::vector<float> kc = k, vc = v;
        std::vector<Index> lengths = full_lengths, pos = slot_positions;
        auto const cache = dense_cache(kc.data(), vc.data(), e, head_lengths(lengths.data(), hkv), pos.data());
        // The compressor of the row's policy, as kvc-eval's engine runs it: prefill, then its attend() plain and
        // corrected over the moments it kept.
        tools::with_moment_storage(cfg.storage, [&](auto tag) {
          using MT = decltype(tag);
          MomentKVScorer<HostSpace, MT> const scorer = tools::moment_scorer<MT>(cfg);
          tools::with_selection(
              alloc, params, tools::Selection{cfg.n_sink, cfg.n_recent}, ratios[r], 0, n, [&](auto const& selector) {
                LayerCompressor compressor{Cpu{}, Press{scorer, selector}};
                compressor.options.rope = rope;
                compressor.options.attention = cfg.attention();
                check(compressor.plan(cache, QueryShape{hq, n, 1, m}), "MomentKV plan");
                std::vector<std::byte> state(compressor.state_bytes());
                check(compressor.bind(state.data(), state.size()), "MomentKV state");
                check(compressor.reset(), "MomentKV state");
                grow(compressor.workspace_bytes());
                Workspace const w{ws.data(), ws.size()};
                check(compressor.prefill(cache, prompt, w), "MomentKV compression");
                compressor.options.corrected = false;
                check(compressor.attend(later, cache, {f_r.data(), lse_r.data()}, w), "plain attention");
                compressor.options.corrected = true;
                check(compressor.attend(later, cache, {f_c.data()}, w), "corrected attention");
              });
        });
        CorrectionLayer& out = records[r].layers[li];
        for (Index row = 0; row < hq * m; ++row) {
          double full_norm = 0, err_c = 0, err_r = 0;
          for (Index i = 0; i < d; ++i) {
            std::size_t const at = static_cast<std::size_t>(row * d + i);
            full_norm += static_cast<double>(f[at]) * f[at];
            err_c += (static_cast<double>(f[at]) - f_c[at]) * (static_cast<double>(f[at]) - f_c[at]);
            err_r += (static_cast<double>(f[at]) - f_r[at]) * (static_cast<double>(f[at]) - f_r[at]);
          }
          full_norm = std::sqrt(full_norm);
          double const ec = full_norm > 0 ? std::sqrt(err_c) / full_norm : 0.0;
          double const er = full_norm > 0 ? std::sqrt(err_r) / full_norm : 0.0;
          out.corrected += ec;
          out.plain += er;
          out.wins += ec < er ? 1.0 : 0.0;
          out.evicted_mass += 1.0 - std::exp(static_cast<double>(lse_r[static_cast<std::size_t>(row)]) -
                                             lse[static_cast<std::size_t>(row)]);
        }
        for (Index h = 0; h < hkv; ++h)
          out.kept += static_cast<double>(lengths[static_cast<std::size_t>(h)]) * static_cast<double>(hq * m) /
                      static_cast<double>(hkv);
      }
    }
    for (auto& rec : records) {
      rec.rows += hq * m;
      ++rec.samples;
    }
  }
  for (auto& rec : records)
    for (auto& l : rec.layers) {
      double const rows = static_cast<double>(std::max<Index>(rec.rows, 1));
      l.corrected /= rows;
      l.plain /= rows;
      l.wins /= rows;
      l.evicted_mass /= rows;
      l.kept /= rows;
    }
  return records;
}

}  // namespace kvc::eval
