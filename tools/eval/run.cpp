// SPDX-License-Identifier: Apache-2.0
// tools/eval/run.cpp: the measurement (run.hpp): sessions per row, compression at each ratio or while decoding, the
// records; prompt sampling and greedy generation.
#include "eval/run.hpp"

#include <kvc/pipeline/layer_stages.hpp>

#include "common/policies.hpp"
#include "common/uncomp.hpp"
#include "eval/engine.hpp"
#include "eval/metrics.hpp"
#include "eval/model.hpp"

#include <cmath>
#include <cstdint>
#include <functional>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace kvc::eval {

void accumulate(Accumulator& acc, Reference const& ref, RowMatrix const& logits, ForwardTrace const& trace,
                std::span<std::int32_t const> targets, Held const& bytes, double seconds) {
  Index const m = logits.rows(), vocab = logits.cols();
  double kl = 0, top1 = 0, nll = 0;
  std::vector<double> lp, lq;  // one log-softmax per row and cache, shared by KL and NLL
  for (Index r = 0; r < m; ++r) {
    float const* p = ref.logits.row(r).data();
    float const* q = logits.row(r).data();
    log_softmax(p, vocab, lp);
    log_softmax(q, vocab, lq);
    kl += kl_from_log_probs(lp, lq);
    top1 += argmax(p, vocab) == argmax(q, vocab) ? 1.0 : 0.0;
    nll -= lq[static_cast<std::size_t>(targets[static_cast<std::size_t>(r)])];
  }
  acc.kl += kl / static_cast<double>(m);
  acc.top1 += top1 / static_cast<double>(m);
  acc.nll += nll;
  acc.nll_full += ref.nll;
  acc.tokens += m;
  acc.kv_bytes += bytes.kv;
  acc.kv_bytes_full += ref.kv_bytes;
  acc.held += bytes.held;
  acc.held_full += ref.held;
  acc.kept_min += static_cast<double>(bytes.min_count);
  acc.kept_max += static_cast<double>(bytes.max_count);
  acc.seconds += seconds;
  acc.moment_bytes += bytes.moments;
  acc.payload += bytes.payload;
  acc.overhead += bytes.overhead;
  acc.layer_error.resize(trace.attention.size(), 0.0);
  for (std::size_t l = 0; l < trace.attention.size(); ++l)
    acc.layer_error[l] += relative_error(trace.attention[l], ref.trace.attention[l]);
  ++acc.samples;
}

Record finish(Accumulator const& acc, std::string policy, double ratio) {
  Record r;
  r.policy = std::move(policy);
  r.ratio = ratio;
  double const s = static_cast<double>(std::max<Index>(acc.samples, 1));
  r.kl = acc.kl / s;
  r.top1 = acc.top1 / s;
  r.perplexity = std::exp(acc.nll / static_cast<double>(std::max<Index>(acc.tokens, 1)));
  r.perplexity_full = std::exp(acc.nll_full / static_cast<double>(std::max<Index>(acc.tokens, 1)));
  r.kv_bytes = acc.kv_bytes / s;
  r.kv_bytes_full = acc.kv_bytes_full / s;
  r.kv_held_bytes = acc.held / s;
  r.kv_held_bytes_full = acc.held_full / s;
  r.kept_min = acc.kept_min / s;
  r.kept_max = acc.kept_max / s;
  r.seconds = acc.seconds / s;
  r.moment_bytes = acc.moment_bytes / s;
  r.payload_bytes = acc.payload / s;
  r.overhead_bytes = acc.overhead / s;
  for (double e : acc.layer_error)
    r.layer_error.push_back(e / s);
  for (double b : acc.kv_bytes_steps)
    r.kv_bytes_steps.push_back(b / s);
  r.samples = acc.samples;
  return r;
}

Status forward_each(Session& session, std::span<std::int32_t const> tokens, RowMatrix& logits, ForwardTrace& trace,
                    std::function<void(Index)> const& after) {
  Index const n = static_cast<Index>(tokens.size());
  RowMatrix row;
  ForwardTrace step;
  for (Index t = 0; t < n; ++t) {
    KVC_RETURN_IF_ERROR(session.forward(tokens.subspan(static_cast<std::size_t>(t), 1), row, &step));
    if (t == 0) {
      logits.resize(n, row.cols());
      trace.attention.resize(step.attention.size());
      for (std::size_t l = 0; l < step.attention.size(); ++l)
        trace.attention[l].resize(n, step.attention[l].cols());
    }
    logits.row(t) = row.row(0);
    for (std::size_t l = 0; l < step.attention.size(); ++l)
      trace.attention[l].row(t) = step.attention[l].row(0);
    if (after)
      after(t);
  }
  return {};
}

HiddenStatePlan uncomp_stage_plan(tools::UNCompConfig const& cfg, tools::Calibration const& cal) {
  HiddenStatePlan plan;
  plan.stage_of_layer.resize(static_cast<std::size_t>(cal.layers));
  Status st;
  if (cfg.stage_count > 0) {
    plan.stages = cfg.stage_count;
    st = partition_layers_count(cal.layer_score.data(), cal.layers, cfg.stage_count, plan.stage_of_layer.data());
  } else {
    st = partition_layers(cal.layer_score.data(), cal.layers, cfg.stage_epsilon, plan.stage_of_layer.data(),
                          plan.stages);
  }
  if (!st.ok())
    tools::fail(tools::exit_invalid, "uncomp stages (--param stage_count / stage_epsilon over the calibration's " +
                                         std::to_string(cal.layers) + " layer scores): " + st.message());
  plan.min_tokens = cfg.hs_min_tokens;
  plan.step = cfg.hs_step;
  plan.window = cfg.scorer.window_size;
  return plan;
}

bool staged(PolicyRun const& run) {
  return std::string_view(run.policy->name) == "uncomp" && tools::uncomp_config(run.params).stages;
}

std::unique_ptr<Session> row_session(Model const& model, CacheOptions const& cache, Index capacity,
                                     Session const& prefilled, PolicyRun const& run,
                                     std::shared_ptr<tools::Calibration const> const& fallback,
                                     std::span<std::int32_t const> prompt, RowMatrix* last) {
  auto const& calibration = run.calibration ? run.calibration : fallback;
  if (!staged(run)) {
    auto session = prefilled.clone();
    if (run.calibration)
      session->set_calibration(run.calibration);
    return session;
  }
  if (!calibration)
    tools::fail(tools::exit_invalid, run.label() + ": uncomp's stages need a calibration");
  auto session = make_session(model, cache, capacity);
  session->set_calibration(calibration);
  session->set_hidden_state_plan(uncomp_stage_plan(tools::uncomp_config(run.params), *calibration));
  RowMatrix logits;
  if (Status const st = session->forward(prompt, logits); !st.ok())
    tools::fail(tools::exit_invalid, "prefill with hidden-state pruning (" + run.label() + "): " + st.message());
  if (last)  // the prompt's last row (always kept), from this prefill
    *last = logits.bottomRows(1);
  return session;
}

bool fixed_memory(PolicyRun const& run) {
  return std::string_view(run.policy->name) == "kivi";
}

std::vector<double> row_ratios(PolicyRun const& run, std::vector<double> const& ratios) {
  if (fixed_memory(run) && !ratios.empty())
    return {ratios.front()};
  return ratios;
}

std::vector<Record> evaluate(Model const& model, RunOptions const& options,
                             std::vector<std::vector<std::int32_t>> const& samples, Progress const& progress) {
  Index const n = options.prompt_tokens, m = options.continuation;
  bool const decode = options.schedule == Schedule::decode;
  std::size_t slots = 0;
  for (PolicyRun const& run : options.policies)
    slots += decode ? 1 : row_ratios(run, options.ratios).size();
  std::vector<Accumulator> acc(slots);
  Index const total = static_cast<Index>(samples.size() * acc.size());
  Index done = 0;
  auto check = [](Status const& st, std::string const& what) {
    if (!st.ok())
      tools::fail(tools::exit_invalid, what + ": " + st.message());
  };
  for (std::size_t sample = 0; sample < samples.size(); ++sample) {
    std::span<std::int32_t const> const all(samples[sample]);
    std::span<std::int32_t const> const prompt = all.subspan(0, static_cast<std::size_t>(n));
    std::span<std::int32_t const> const fed = all.subspan(static_cast<std::size_t>(n), static_cast<std::size_t>(m));
    std::span<std::int32_t const> const targets =
        all.subspan(static_cast<std::size_t>(n + 1), static_cast<std::size_t>(m));
    auto prefilled = make_session(model, options.cache, n + m);
    prefilled->set_calibration(options.calibration);
    RowMatrix logits;
    check(prefilled->forward(prompt, logits), "prefill");
    std::unique_ptr<Session> other;  // the reference's own prefill when its cache type differs
    if (options.reference_cache().type != options.cache.type) {
      other = make_session(model, options.reference_cache(), n + m);
      check(other->forward(prompt, logits), "reference prefill");
    }
    Session const& reference = other ? *other : *prefilled;
    Reference ref;
    StoreBytes const prompt_bytes = reference.store_bytes();
    ref.kv_bytes = static_cast<double>(prompt_bytes.kv);
    ref.held = static_cast<double>(prompt_bytes.held);
    {
      auto full = reference.clone();
      if (decode) {  // token by token, as the decode runs go: the same fp32 arithmetic, so no eviction = exactly equal
        // Memory: means over the steps of what the full cache holds, its store sized by the decode runs' rule.
        full->set_reserve(options.decode.compression_interval);
        ref.kv_bytes = ref.held = 0;
        check(forward_each(*full, fed, ref.logits, ref.trace,
                           [&](Index) {
                             StoreBytes const b = full->store_bytes();
                             ref.kv_bytes += static_cast<double>(b.kv) / static_cast<double>(m);
                             ref.held += static_cast<double>(b.held) / static_cast<double>(m);
                           }),
              "full-cache continuation");
      } else {
        check(full->forward(fed, ref.logits, &ref.trace), "full-cache continuation");
      }
      for (Index r = 0; r < m; ++r)
        ref.nll +=
            negative_log_likelihood(ref.logits.row(r).data(), ref.logits.cols(), targets[static_cast<std::size_t>(r)]);
    }
    std::size_t slot = 0;
    if (options.schedule == Schedule::decode) {
      // Each policy decodes the continuation one token per forward call under the decode driver; the reference
      // is the same tokens with the full cache. Memory is the mean over the steps of the bytes held; the token
      // counts are the last step's.
      for (PolicyRun const& run : options.policies) {
        if (progress)
          progress(done, total, run.label(), 0.0);
        auto session = row_session(model, options.cache, n + m, *prefilled, run, options.calibration, prompt);
        std::uint64_t const salt = options.seed * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(sample);
        check(session->begin_decode(*run.policy, run.params, options.decode, salt, run.alloc,
                                    options.relayout_on_compress),
              std::string("decode with ") + run.label());
        ForwardTrace trace;
        Accumulator& a = acc[slot++];
        a.kv_bytes_steps.resize(static_cast<std::size_t>(m), 0.0);
        Held bytes;
        check(forward_each(*session, fed, logits, trace,
                           [&](Index t) {
                             StoreBytes const b = session->store_bytes();
                             a.kv_bytes_steps[static_cast<std::size_t>(t)] += static_cast<double>(b.kv);
                             bytes.kv += static_cast<double>(b.kv) / static_cast<double>(m);
                             bytes.held += static_cast<double>(b.held) / static_cast<double>(m);
                             bytes.moments = static_cast<double>(session->moment_bytes());  // fixed size
                             bytes.payload += static_cast<double>(b.payload_bits) / 8.0 / static_cast<double>(m);
                             bytes.overhead += static_cast<double>(b.overhead_bits) / 8.0 / static_cast<double>(m);
                             bytes.min_count = b.min_count;
                             bytes.max_count = b.max_count;
                           }),
              std::string("decode with ") + run.label());
        accumulate(a, ref, logits, trace, targets, bytes, session->decode_seconds());
        ++done;
      }
      continue;
    }
    for (PolicyRun const& run : options.policies)
      for (double ratio : row_ratios(run, options.ratios)) {
        if (progress)
          progress(done, total, run.label(), ratio);
        auto session = row_session(model, options.cache, n + m, *prefilled, run, options.calibration, prompt);
        double seconds = 0;
        check(session->compress(*run.policy, run.params, ratio, seconds,
                                options.seed * 0x9E3779B97F4A7C15ull + static_cast<std::uint64_t>(sample), run.alloc),
              std::string("compress with ") + run.label());
        StoreBytes const b = session->store_bytes();
        Held const bytes{static_cast<double>(b.kv),
                         static_cast<double>(b.held),
                         static_cast<double>(session->moment_bytes()),
                         b.min_count,
                         b.max_count,
                         static_cast<double>(b.payload_bits) / 8.0,
                         static_cast<double>(b.overhead_bits) / 8.0};
        ForwardTrace trace;
        check(session->forward(fed, logits, &trace), "continuation");
        accumulate(acc[slot++], ref, logits, trace, targets, bytes, seconds);
        ++done;
      }
  }
  if (progress)
    progress(done, total, "", 0);
  std::vector<Record> records;
  std::size_t slot = 0;
  for (PolicyRun const& run : options.policies) {
    if (decode) {  // the ratio a decode run reaches: 1 - mean bytes held / the full cache's mean
      Record r = finish(acc[slot++], run.label(), 0.0);
      r.ratio = r.kv_bytes_full > 0 ? 1.0 - r.kv_bytes / r.kv_bytes_full : 0.0;
      records.push_back(std::move(r));
      continue;
    }
    for (double ratio : row_ratios(run, options.ratios)) {
      Record r = finish(acc[slot++], run.label(), ratio);
      if (fixed_memory(run))  // the ratio its bits reach
        r.ratio = r.kv_bytes_full > 0 ? 1.0 - r.kv_bytes / r.kv_bytes_full : 0.0;
      records.push_back(std::move(r));
    }
  }
  return records;
}

std::vector<std::int32_t> sample_tokens(Model const& model, CacheOptions const& cache, Index length, std::int32_t first,
                                        std::uint64_t seed, std::vector<std::int32_t> const& banned) {
  auto session = make_session(model, cache, length);
  SplitMix64 rng{seed};
  std::vector<std::int32_t> tokens{first};
  RowMatrix logits;
  std::vector<double> lp;
  while (static_cast<Index>(tokens.size()) < length) {
    std::int32_t const last = tokens.back();
    if (auto const st = session->forward(std::span(&last, 1), logits); !st.ok())
      tools::fail(tools::exit_invalid, std::string("sampling a prompt: ") + st.message());
    log_softmax(logits.row(0).data(), logits.cols(), lp);
    for (std::int32_t b : banned)
      if (b >= 0 && b < logits.cols())
        lp[static_cast<std::size_t>(b)] = -std::numeric_limits<double>::infinity();
    double total = 0;
    for (double l : lp)
      total += std::exp(l);
    double u = rng.uniform() * total, cumulative = 0;
    std::int32_t pick = 0;
    for (std::size_t i = 0; i < lp.size(); ++i) {
      double const p = std::exp(lp[i]);
      if (p == 0)
        continue;
      pick = static_cast<std::int32_t>(i);
      cumulative += p;
      if (u < cumulative)
        break;
    }
    tokens.push_back(pick);
  }
  return tokens;
}

std::vector<std::int32_t> greedy(Session& session, RowMatrix last, Index count) {
  std::vector<std::int32_t> out;
  for (Index i = 0; i < count; ++i) {
    std::int32_t const next = static_cast<std::int32_t>(argmax(last.row(last.rows() - 1).data(), last.cols()));
    out.push_back(next);
    if (i + 1 < count) {
      if (auto const st = session.forward(std::span(&next, 1), last); !st.ok())
        tools::fail(tools::exit_invalid, std::string("greedy generation: ") + st.message());
    }
  }
  return out;
}

}  // namespace kvc::eval
