// SPDX-License-Identifier: Apache-2.0
// tools/eval/run.hpp: kvc-eval's measurement, without files or printing (the tests call it directly).
//
// Per sample: a sequence of prompt_tokens + continuation + 1 tokens (sampled from the full model, or cut from a
// text). Schedule::decode: the prompt is prefilled whole, then each policy decodes the continuation one token per
// forward call under the decode driver (kvc::decode_step on every layer) and is compared with the full cache on the
// same tokens. Schedule::prefill: the prompt is prefilled once; the prefilled session is cloned for the full cache and
// for every (policy, ratio), which compresses it after prefill; then the first `continuation` tokens after the prompt
// are teacher-forced in one call (causal attention over the cache by position equals `continuation` decode steps). Each
// of those `continuation` rows predicts the next token with the (compressed) cache; the prompt's own last row is
// made before compression and is the same for every policy, so it is not counted.
//
// A policy with an allocator (`snap_kv+ada_kv`, `key_diff+pyramid_kv`, ...) compresses with the allocator's selection
// and continues on a ragged per-head store (eval/engine.hpp). Memory is measured from the stores after compression
// (kvc::store_report): the K + V of the valid tokens, and what the stores hold (StoreBytes). A `moment_kv` row
// (eval/moment_kv.hpp) also holds its moments: Record::moment_bytes, from Session::moment_bytes.
//
// `rdkv` rows pack each layer at a budget of floor(n (1 - ratio)) fp16-equivalent tokens per (layer, KV head): the
// same memory as the eviction rows at that ratio, measured from the packed store (payload + overhead bits) and the
// fp16 tail. `kivi` rows have the memory their bits give: they run once (at the first ratio) and their `ratio` is
// the measured one, 1 - kv_bytes / kv_bytes_full, like the decode runs'.
#pragma once

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

/// When compression runs: once after the prompt (prefill), or while decoding (the decode driver: every
/// `compression_interval` tokens, each head back to `target_size` tokens).
enum class Schedule : std::uint8_t { prefill, decode };

struct PolicyRun {
  tools::PolicyInfo const* policy = nullptr;  ///< the scorer's entry of the policy table
  tools::Params params;                       ///< the scorer's and the allocators' parameters
  tools::AllocatorChoice alloc{};             ///< ada_kv, pyramid_kv, both or none
  /// The row's own parameters as written in --policies, `NAME=VALUE,...` inside parentheses (empty: none), e.g.
  /// `mi=false,correction=true` for the row moment_kv(mi=false,correction=true)+ada_kv.
  std::string inline_params{};
  /// UNComp's calibration for this row (`uncomp` rows; null: RunOptions::calibration).
  std::shared_ptr<tools::Calibration const> calibration{};
  /// The row's name: the scorer's, its inline parameters in parentheses, then `+allocator` (e.g.
  /// snap_kv+pyramid_kv+ada_kv, moment_kv(mi=false)+ada_kv).
  std::string label() const {
    std::string s = policy->name;
    if (!inline_params.empty()) {
      s += '(';
      s += inline_params;
      s += ')';
    }
    if (alloc.any()) {
      s += '+';
      s += alloc.name();
    }
    return s;
  }
};

struct RunOptions {
  std::vector<PolicyRun> policies;
  std::vector<double> ratios;
  Index prompt_tokens = 256;
  Index continuation = 64;
  CacheOptions cache;
  /// The element type of the full cache every row is measured against (KL, top-1, the full perplexity and bytes) and
  /// prompts are sampled with: `cache`'s unless given (e.g. fp8 rows against an fp16 full cache: quantisation and
  /// compression together).
  std::optional<CacheType> reference_type;
  CacheOptions reference_cache() const {
    CacheOptions c = cache;
    c.type = reference_type.value_or(cache.type);
    return c;
  }
  /// The cache prompts are sampled with: the reference's, fp16 for an fp8 one (sampling feeds one token per call, so
  /// an fp8 session would take its scales from the first token alone).
  CacheOptions sampling_cache() const {
    CacheOptions c = reference_cache();
    if (c.type == CacheType::f8_e4m3 || c.type == CacheType::f8_e5m2)
      c.type = CacheType::f16;
    return c;
  }
  Schedule schedule = Schedule::prefill;
  DecodeSchedule decode{};  ///< Schedule::decode: interval, target and buffer (protections come from the policy)
  bool relayout_on_compress = false;  ///< Schedule::decode: ragged stores are also re-laid out after compressions
  std::uint64_t seed = 0;             ///< with the sample's index, salts the random baseline (Session::compress)
  /// UNComp's calibration, which `uncomp` rows take their head groups from (Session::set_calibration) unless the row
  /// has its own (PolicyRun::calibration).
  std::shared_ptr<tools::Calibration const> calibration;
};

/// One (policy, ratio) row, averaged over samples.
struct Record {
  std::string policy;
  double ratio = 0;
  double kl = 0;                  ///< mean KL(full || compressed) per predicted token, nats
  double top1 = 0;                ///< fraction of predicted tokens whose argmax equals the full cache's
  double perplexity = 0;          ///< exp(mean NLL of the continuation's tokens) with the compressed cache
  double perplexity_full = 0;     ///< the same with the full cache
  double kv_bytes = 0;            ///< K + V bytes held after compression (all layers), mean over samples
  double kv_bytes_full = 0;       ///< K + V bytes of the full prompt cache
  double kv_held_bytes = 0;       ///< bytes the stores hold after compression (StoreBytes::held)
  double kv_held_bytes_full = 0;  ///< the same for the full cache
  double kept_min = 0;            ///< fewest tokens of one (layer, KV head) after compression, mean over samples
  double kept_max = 0;            ///< most tokens of one (layer, KV head) after compression, mean over samples
  double seconds = 0;             ///< compression wall time per sample (score + select + compact, all layers)
  double moment_bytes = 0;        ///< MomentKV: bytes of the moments held (all layers), mean over samples
  double payload_bytes = 0;   ///< rdkv, kivi: the packed store's payload bits / 8 + the fp16 tail (all layers), mean
  double overhead_bytes = 0;  ///< rdkv, kivi: the packed store's overhead bits / 8 (scales, offsets, pads, permutation)
  std::vector<double> layer_error;     ///< [layers] ||O_c - O_full|| / ||O_full|| of attention outputs (continuation)
  std::vector<double> kv_bytes_steps;  ///< Schedule::decode: K + V bytes after each decode step, mean over samples
  Index samples = 0;
};

/// The per-sample sums a Record is averaged from.
struct Accumulator {
  double kl = 0, top1 = 0, nll = 0, nll_full = 0, kv_bytes = 0, kv_bytes_full = 0, seconds = 0;
  double held = 0, held_full = 0, kept_min = 0, kept_max = 0, moment_bytes = 0, payload = 0, overhead = 0;
  Index tokens = 0, samples = 0;
  std::vector<double> layer_error, kv_bytes_steps;
};

/// Full-cache results of one sample, which every policy is compared with.
struct Reference {
  RowMatrix logits;    ///< [continuation, vocab]
  ForwardTrace trace;  ///< attention outputs of the continuation
  double nll = 0;      ///< summed over the continuation
  double kv_bytes = 0;
  double held = 0;  ///< StoreBytes::held of the full cache
};

/// What a compressed run held: K + V of the valid tokens and the stores' bytes (decode runs: means over the steps),
/// and the fewest and most tokens of one (layer, KV head).
struct Held {
  double kv = 0, held = 0;
  double moments = 0;  ///< MomentKV's moments (Session::moment_bytes)
  Index min_count = 0, max_count = 0;
  double payload = 0, overhead = 0;  ///< packed layers: payload and overhead bytes (StoreBytes bits / 8)
};

/// Adds one compressed run of a sample to `acc`.
inline void accumulate(Accumulator& acc, Reference const& ref, RowMatrix const& logits, ForwardTrace const& trace,
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

inline Record finish(Accumulator const& acc, std::string policy, double ratio) {
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

/// Runs `tokens` one forward call each (decode steps), stacking the logits [n, vocab] and every layer's attention
/// output [n, Hq * d]; `after(t)` runs after step t.
inline Status forward_each(Session& session, std::span<std::int32_t const> tokens, RowMatrix& logits,
                           ForwardTrace& trace, std::function<void(Index)> const& after = {}) {
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

/// UNComp's stage plan of a row (spec §2.9): stages from the calibration's layer scores (a drop above stage_epsilon
/// starts a stage, or the stage_count - 1 largest drops), and the row's hidden-state parameters. Exit 3 when the
/// calibration cannot be partitioned so.
inline HiddenStatePlan uncomp_stage_plan(tools::UNCompConfig const& cfg, tools::Calibration const& cal) {
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
  plan.window = cfg.window_size;
  return plan;
}

/// Whether a row is UNComp's stage variant (its prefill prunes hidden states: it cannot share the prefilled cache).
inline bool staged(PolicyRun const& run) {
  return std::string_view(run.policy->name) == "uncomp" && tools::uncomp_config(run.params).stages;
}

/// The session a row compresses: a clone of the shared prefilled one, or for UNComp's stage variant its own prefill
/// of `prompt` with hidden-state pruning (`last`, when given, receives that prefill's last logits row). With the
/// row's calibration (or `fallback`).
inline std::unique_ptr<Session> row_session(Model const& model, CacheOptions const& cache, Index capacity,
                                            Session const& prefilled, PolicyRun const& run,
                                            std::shared_ptr<tools::Calibration const> const& fallback,
                                            std::span<std::int32_t const> prompt, RowMatrix* last = nullptr) {
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

/// Whether a row's memory does not follow the ratio (kivi: its bits set it): it runs once, at the first ratio.
inline bool fixed_memory(PolicyRun const& run) {
  return std::string_view(run.policy->name) == "kivi";
}

/// The ratios a prefill row runs at.
inline std::vector<double> row_ratios(PolicyRun const& run, std::vector<double> const& ratios) {
  if (fixed_memory(run) && !ratios.empty())
    return {ratios.front()};
  return ratios;
}

/// Called before each compressed run: (done, total, policy name, ratio).
using Progress = std::function<void(Index, Index, std::string const&, double)>;

/// Measures every (policy, ratio) of `options` on `samples` (each prompt_tokens + continuation + 1 tokens).
/// Throws tools::Failure (exit 3) when a kvc call refuses (the message names the policy and the call).
inline std::vector<Record> evaluate(Model const& model, RunOptions const& options,
                                    std::vector<std::vector<std::int32_t>> const& samples,
                                    Progress const& progress = {}) {
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

/// A deterministic 64-bit generator (splitmix64): the same stream on every platform and compiler.
struct SplitMix64 {
  std::uint64_t state;
  std::uint64_t next() noexcept {
    std::uint64_t z = (state += 0x9E3779B97F4A7C15ull);
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
  }
  double uniform() noexcept { return static_cast<double>(next() >> 11) * 0x1p-53; }  // [0, 1)
};

/// Samples `length` tokens from the full model, starting with `first` (BOS), at temperature 1, never sampling the
/// ids in `banned` (BOS/EOS, so a sample stays one text). Deterministic for a seed.
inline std::vector<std::int32_t> sample_tokens(Model const& model, CacheOptions const& cache, Index length,
                                               std::int32_t first, std::uint64_t seed,
                                               std::vector<std::int32_t> const& banned) {
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

/// Greedy generation of `count` tokens after the prompt already in `session` whose last logits row is `last`.
inline std::vector<std::int32_t> greedy(Session& session, RowMatrix last, Index count) {
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
