// SPDX-License-Identifier: Apache-2.0
// tools/eval/calibrate.cpp: UNComp's calibration on a model (calibrate.hpp): windows of a text, query entropies, head
// groups.
#include "eval/calibrate.hpp"

#include <kvc/calibration/head_groups.hpp>
#include <kvc/calibration/matrix_entropy.hpp>

#include "common/policies.hpp"
#include "common/uncomp.hpp"
#include "eval/calibration_text.hpp"
#include "eval/engine.hpp"
#include "eval/model.hpp"

#include <cmath>
#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace kvc::eval {

std::vector<std::vector<std::int32_t>> calibration_windows(std::span<std::int32_t const> text,
                                                           CalibrationOptions const& o, std::int32_t bos,
                                                           std::string const& source) {
  Index const per = o.tokens - (bos >= 0 ? 1 : 0);
  if (per < 1)
    tools::fail(tools::exit_invalid, "--tokens " + std::to_string(o.tokens) +
                                         ": a window holds the BOS token and at least one text token (expected >= 2)");
  if (static_cast<Index>(text.size()) < o.samples * per)
    tools::fail(tools::exit_invalid, source + ": " + std::to_string(text.size()) + " tokens, but " +
                                         std::to_string(o.samples) + " windows of " + std::to_string(per) +
                                         " text tokens need " + std::to_string(o.samples * per) +
                                         " (pass a longer --text, or fewer --samples or --tokens)");
  std::vector<std::vector<std::int32_t>> windows;
  for (Index s = 0; s < o.samples; ++s) {
    std::vector<std::int32_t> w;
    if (bos >= 0)
      w.push_back(bos);
    w.insert(w.end(), text.begin() + s * per, text.begin() + (s + 1) * per);
    windows.push_back(std::move(w));
  }
  return windows;
}

tools::Calibration calibrate(Model const& model, std::vector<std::vector<std::int32_t>> const& windows,
                             CalibrationOptions const& o, std::string const& model_name, std::string const& text_name) {
  ModelConfig const& c = model.config;
  Index const layers = c.layers, hq = c.heads, hkv = c.kv_heads, d = c.head_dim, group = hq / hkv;
  auto check = [](Status const& st, std::string const& what) {
    if (!st.ok())
      tools::fail(tools::exit_invalid, "calibration: " + what + ": " + st.message());
  };
  if (windows.empty())
    tools::fail(tools::exit_invalid, "calibration: no calibration windows");
  tools::Calibration cal;
  cal.model = model_name;
  cal.layers = layers;
  cal.heads = hq;
  cal.kv_heads = hkv;
  cal.head_dim = d;
  cal.top_k = resolved_top_k(o.entropy, d);  // the k used (auto: d / 4)
  cal.normalize_rows = o.entropy.normalize_rows;
  cal.renormalize_topk = o.entropy.renormalize_topk;
  cal.ridge = o.entropy.ridge;
  cal.samples = static_cast<Index>(windows.size());
  cal.tokens = static_cast<Index>(windows.front().size());
  cal.text = text_name;
  cal.groups = o.groups;
  cal.rule = o.rule;

  EntropyCalibration queries(layers, hq, o.groups), kv(layers, hkv, o.groups);
  MatrixEntropySolver solver(d, o.entropy);
  std::vector<MatrixEntropy> per_head(static_cast<std::size_t>(hq)), per_kv(static_cast<std::size_t>(hkv));
  for (std::size_t s = 0; s < windows.size(); ++s) {
    std::vector<std::int32_t> const& w = windows[s];
    Index const n = static_cast<Index>(w.size());
    auto session = make_session(model, {CacheType::f32, CacheLayout::dense}, n);
    RowMatrix logits;
    ForwardTrace trace;
    trace.projections = true;
    check(session->forward(w, logits, &trace), "window " + std::to_string(s));
    for (Index l = 0; l < layers; ++l) {
      std::vector<float> const& q = trace.qkv[static_cast<std::size_t>(l)].queries;  // [Hq, n, d] post-RoPE
      for (Index h = 0; h < hq; ++h)
        check(solver.compute(q.data() + h * n * d, n, d, per_head[static_cast<std::size_t>(h)]),
              "window " + std::to_string(s) + ", layer " + std::to_string(l) + ", query head " + std::to_string(h));
      check(queries.add(l, per_head.data()), "layer " + std::to_string(l));
      // Each KV head: the mean erank_k of its query heads, in every unit (H_k = ln erank_k).
      for (Index g = 0; g < hkv; ++g) {
        double erank = 0, full = 0;
        for (Index i = 0; i < group; ++i) {
          erank += per_head[static_cast<std::size_t>(g * group + i)].erank;
          full += per_head[static_cast<std::size_t>(g * group + i)].full;
        }
        MatrixEntropy& e = per_kv[static_cast<std::size_t>(g)];
        e.erank = erank / static_cast<double>(group);
        e.truncated = std::log(e.erank);
        e.full = full / static_cast<double>(group);
        e.normalized = d > 1 ? e.truncated / std::log(static_cast<double>(d)) : 0.0;
        e.k = per_head[static_cast<std::size_t>(g * group)].k;
      }
      check(kv.add(l, per_kv.data()), "layer " + std::to_string(l));
    }
  }

  auto const lh = static_cast<std::size_t>(layers * hq), lg = static_cast<std::size_t>(layers * hkv);
  cal.normalized.resize(lh);
  cal.erank.resize(lh);
  cal.truncated.resize(lh);
  cal.query_group.resize(lh);
  cal.kv_erank.resize(lg);
  cal.kv_group.resize(lg);
  cal.layer_score.resize(static_cast<std::size_t>(layers));
  bool const vote = o.rule == tools::GroupRule::majority_vote;
  for (Index l = 0; l < layers; ++l) {
    auto const q0 = static_cast<std::size_t>(l * hq), g0 = static_cast<std::size_t>(l * hkv);
    double score = 0;
    for (Index h = 0; h < hq; ++h) {
      cal.normalized[q0 + static_cast<std::size_t>(h)] = queries.mean_normalized(l, h);
      cal.erank[q0 + static_cast<std::size_t>(h)] = queries.mean_erank(l, h);
      cal.truncated[q0 + static_cast<std::size_t>(h)] = queries.mean_truncated(l, h);
      score += queries.mean_erank(l, h);
    }
    cal.layer_score[static_cast<std::size_t>(l)] = score / static_cast<double>(hq);
    check(queries.groups(l, vote, cal.query_group.data() + q0), "the groups of layer " + std::to_string(l));
    check(reduce_to_kv_heads(cal.erank.data() + q0, hq, hkv, cal.kv_erank.data() + g0),
          "the KV heads of layer " + std::to_string(l));
    if (vote)
      check(kv.groups(l, true, cal.kv_group.data() + g0), "the KV-head groups of layer " + std::to_string(l));
    else
      check(group_heads(cal.kv_erank.data() + g0, hkv, o.groups, cal.kv_group.data() + g0),
            "the KV-head groups of layer " + std::to_string(l));
  }
  return cal;
}

}  // namespace kvc::eval
