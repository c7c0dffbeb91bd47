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
void accumulate(Accumulator& acc, Reference const& ref, RowMatrix const& logits, ForwardTrace const& trace,
                std::span<std::int32_t const> targets, Held const& bytes, double seconds);

Record finish(Accumulator const& acc, std::string policy, double ratio);

/// Runs `tokens` one forward call each (decode steps), stacking the logits [n, vocab] and every layer's attention
/// output [n, Hq * d]; `after(t)` runs after step t.
Status forward_each(Session& session, std::span<std::int32_t const> tokens, RowMatrix& logits, ForwardTrace& trace,
                    std::function<void(Index)> const& after = {});

/// UNComp's stage plan of a row (spec §2.9): stages from the calibration's layer scores (a drop above stage_epsilon
/// starts a stage, or the stage_count - 1 largest drops), and the row's hidden-state parameters. Exit 3 when the
/// calibration cannot be partitioned so.
HiddenStatePlan uncomp_stage_plan(tools::UNCompConfig const& cfg, tools::Calibration const& cal);

/// Whether a row is UNComp's stage variant (its prefill prunes hidden states: it cannot share the prefilled cache).
bool staged(PolicyRun const& run);

/// The session a row compresses: a clone of the shared prefilled one, or for UNComp's stage variant its own prefill
/// of `prompt` with hidden-state pruning (`last`, when given, receives that prefill's last logits row). With the
/// row's calibration (or `fallback`).
std::unique_ptr<Session> row_session(Model const& model, CacheOptions const& cache, Index capacity,
                                     Session const& prefilled, PolicyRun const& run,
                                     std::shared_ptr<tools::Calibration const> const& fallback,
                                     std::span<std::int32_t const> prompt, RowMatrix* last = nullptr);

/// Whether a row's memory does not follow the ratio (kivi: its bits set it): it runs once, at the first ratio.
bool fixed_memory(PolicyRun const& run);

/// The ratios a prefill row runs at.
std::vector<double> row_ratios(PolicyRun const& run, std::vector<double> const& ratios);

/// Called before each compressed run: (done, total, policy name, ratio).
using Progress = std::function<void(Index, Index, std::string const&, double)>;

/// Measures every (policy, ratio) of `options` on `samples` (each prompt_tokens + continuation + 1 tokens).
/// Throws tools::Failure (exit 3) when a kvc call refuses (the message names the policy and the call).
std::vector<Record> evaluate(Model const& model, RunOptions const& options,
                             std::vector<std::vector<std::int32_t>> const& samples, Progress const& progress = {});

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
std::vector<std::int32_t> sample_tokens(Model const& model, CacheOptions const& cache, Index length, std::int32_t first,
                                        std::uint64_t seed, std::vector<std::int32_t> const& banned);

/// Greedy generation of `count` tokens after the prompt already in `session` whose last logits row is `last`.
std::vector<std::int32_t> greedy(Session& session, RowMatrix last, Index count);

}  // namespace kvc::eval
