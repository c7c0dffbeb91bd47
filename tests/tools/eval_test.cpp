// SPDX-License-Identifier: Apache-2.0
// tests/tools/eval_test.cpp: kvc-eval's measurement (tools/eval/): metrics against hand-computed values, the
// guarantees of a run on the real models (ratio 0 is exactly lossless, runs are deterministic for a seed, paged and
// dense caches give identical numbers, compression costs quality), rows with an allocator (AdaKV, PyramidKV) on a
// ragged per-head store (lossless at ratio 0, equal to the uniform rows when AdaKV is uniform, the memory measured
// from the store, PyramidKV's per-layer schedule, decoding), the outputs' format, the model loader's checks on
// damaged files, and the program's exit codes.
#include <kvc/selectors/pyramid_kv.hpp>

#include "common/isa.hpp"
#include "common/rdkv.hpp"
#include "common/uncomp.hpp"
#include "eval/calibrate.hpp"
#include "eval/calibration_file.hpp"
#include "eval/correction.hpp"
#include "eval/engine.hpp"
#include "eval/metrics.hpp"
#include "eval/model.hpp"
#include "eval/report.hpp"
#include "eval/run.hpp"
#include "eval/tokenizer.hpp"
#include "io/json.hpp"
#include "io/npy.hpp"
#include "support/catch.hpp"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <utility>
#include <vector>

namespace {

using kvc::Index;
using namespace kvc::eval;
namespace fs = std::filesystem;

std::string const tinystories = std::string(KVC_SHARED_DIR) + "/models/tinystories-656k";
std::string const stories260k = std::string(KVC_SHARED_DIR) + "/models/stories260k";

bool have(std::string const& dir) {
  if (fs::exists(dir))
    return true;
  WARN("SKIPPED: " << dir << " is absent (the shared models folder)");
  return false;
}

Model load(std::string const& path) {
  Model m;
  std::string error;
  bool const loaded = Model::load(path, m, error);
  INFO(error);
  REQUIRE(loaded);
  return m;
}

RunOptions options_for(std::vector<std::string> const& names, std::vector<double> const& ratios, CacheOptions cache) {
  RunOptions o;
  for (auto const& n : names) {
    auto const& info = kvc::tools::find_policy(n);
    o.policies.push_back({&info, kvc::tools::resolve_params(info, {}, true)});
  }
  o.ratios = ratios;
  o.prompt_tokens = 48;
  o.continuation = 16;
  o.cache = cache;
  return o;
}

Record const& record_of(std::vector<Record> const& records, std::string const& policy, double ratio) {
  for (Record const& r : records)
    if (r.policy == policy && r.ratio == ratio)
      return r;
  FAIL("no record " << policy << " at " << ratio);
  return records.front();
}

/// A row `scorer+allocators` with `given` parameters (as kvc-eval's --policies and --param build it).
PolicyRun allocator_run(std::string const& scorer, std::string const& allocators,
                        std::vector<std::string> const& given = {}) {
  auto const& info = kvc::tools::find_policy(scorer);
  auto const alloc = kvc::tools::parse_allocators(allocators);
  return {&info, kvc::tools::resolve_params(kvc::tools::with_allocators(info, alloc), given, true), alloc};
}

/// A row `scorer(inline)+allocators` (as kvc-eval's --policies writes it: the inline parameters are the row's own).
PolicyRun inline_run(std::string const& scorer, std::string const& allocators, std::string const& inline_params,
                     std::vector<std::string> given = {}) {
  auto const& info = kvc::tools::find_policy(scorer);
  kvc::tools::AllocatorChoice alloc;
  if (!allocators.empty())
    alloc = kvc::tools::parse_allocators(allocators);
  std::vector<std::string> params;
  for (std::size_t start = 0; !inline_params.empty() && start <= inline_params.size();) {
    std::size_t const comma = std::min(inline_params.find(',', start), inline_params.size());
    params.push_back(inline_params.substr(start, comma - start));
    start = comma + 1;
  }
  params.insert(params.end(), given.begin(), given.end());
  return {&info, kvc::tools::resolve_params(kvc::tools::with_allocators(info, alloc), params, true), alloc,
          inline_params};
}

std::string work_dir(char const* name) {
  std::string const dir = std::string(KVC_EVAL_WORK) + "/" + name;
  fs::remove_all(dir);
  fs::create_directories(dir);
  return dir;
}

void write_bytes(std::string const& path, std::string const& bytes) {
  std::ofstream(path, std::ios::binary).write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
}

std::string read_text(std::string const& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), {}};
}

/// Runs a shell command; returns its exit code and (in `output`) its stdout + stderr.
int run_command(std::string const& command, std::string& output) {
  output.clear();
  std::FILE* p = popen((command + " 2>&1").c_str(), "r");
  REQUIRE(p != nullptr);
  char buf[4096];
  while (std::size_t n = std::fread(buf, 1, sizeof buf, p))
    output.append(buf, n);
  int const status = pclose(p);
  return WIFEXITED(status) ? WEXITSTATUS(status) : -1;
}

}  // namespace

TEST_CASE("metrics: KL, argmax and NLL against hand computation") {
  // p = softmax(0, ln 3) = (1/4, 3/4); q = softmax(0, 0) = (1/2, 1/2).
  float const p[2] = {0.0f, static_cast<float>(std::log(3.0))}, q[2] = {0.0f, 0.0f};
  double const expected = 0.25 * std::log(0.5) + 0.75 * std::log(1.5);  // sum p log(p / q)
  CHECK(std::abs(kl_divergence(p, q, 2) - expected) < 1e-7);
  CHECK(kl_divergence(p, p, 2) == 0.0);
  CHECK(std::abs(negative_log_likelihood(p, 2, 0) - std::log(4.0)) < 1e-7);
  float const tie[3] = {1.0f, 2.0f, 2.0f};
  CHECK(argmax(tie, 3) == 1);  // ties keep the lower index
  Eigen::MatrixXf a(1, 2), b(1, 2);
  a << 3, 4;
  b << 0, 5;
  CHECK(std::abs(relative_error(a, b) - std::sqrt(10.0) / 5.0) < 1e-12);
}

TEST_CASE("report: side-by-side columns and wrapping keep every word") {
  auto const lines = wrap("the cat sat on the mat", 7);
  CHECK(lines == std::vector<std::string>{"the cat", "sat on", "the mat"});
  CHECK(wrap("abcdefghij k\n\nx", 4) == std::vector<std::string>{"abcd", "efgh", "ij k", "", "x"});
  CHECK(wrap("\xc3\xa9t\xc3\xa9 ok", 3) == std::vector<std::string>{"\xc3\xa9t\xc3\xa9", "ok"});  // code points
  std::string const s = side_by_side("full", "a b", "policy", "c", 5);
  CHECK(s == "full  | policy\n------+------\na b   | c\n");
}

TEST_CASE("ratio 0 is exactly lossless, compression costs quality, runs repeat exactly") {
  if (!have(tinystories))
    return;
  Model const model = load(tinystories);
  auto const cache = CacheOptions{CacheType::f16, CacheLayout::dense};
  std::vector<std::vector<std::int32_t>> samples;
  for (std::uint64_t s = 0; s < 2; ++s)
    samples.push_back(sample_tokens(model, cache, 48 + 16 + 1, 1, 11 + s, {1, 2}));
  CHECK(samples[0] == sample_tokens(model, cache, 65, 1, 11, {1, 2}));  // the same seed, the same prompt
  CHECK(samples[0] != samples[1]);
  for (auto const& s : samples)
    for (std::int32_t t : std::vector<std::int32_t>(s.begin() + 1, s.end()))
      CHECK((t != 1 && t != 2));  // BOS and EOS are never sampled

  auto const opts = options_for({"key_diff", "snap_kv", "streaming_llm", "random"}, {0.0, 0.75}, cache);
  auto const records = evaluate(model, opts, samples);
  REQUIRE(records.size() == 8);
  for (Record const& r : records) {
    INFO(r.policy << " at " << r.ratio);
    CHECK(r.samples == 2);
    REQUIRE(r.layer_error.size() == 2);
    if (r.ratio == 0.0) {
      CHECK(r.kl == 0.0);
      CHECK(r.top1 == 1.0);
      CHECK(r.perplexity == r.perplexity_full);
      CHECK(r.kv_bytes == r.kv_bytes_full);
      CHECK(r.layer_error[0] == 0.0);
    } else {
      CHECK(r.kl > 0.0);
      CHECK(r.layer_error[0] > 0.0);
      // 48 prompt tokens per head at ratio 0.75 keep 12: a quarter of the bytes (fp16 K + V, 2 layers x 4 heads).
      CHECK(r.kv_bytes == 2 * 4 * 12 * 2 * 16 * 2);
      CHECK(r.kv_bytes_full == 2 * 4 * 48 * 2 * 16 * 2);
      // Held: a uniform store of the kept tokens + the continuation's 16 slots per head; a row is K + V + its
      // position (2 x 16 x 2 + 8 bytes).
      CHECK(r.kv_held_bytes == 2 * 4 * (12 + 16) * 72);
      CHECK(r.kv_held_bytes_full == 2 * 4 * (48 + 16) * 72);
      CHECK(r.kept_min == 12);
      CHECK(r.kept_max == 12);
    }
  }
  auto const again = evaluate(model, opts, samples);
  for (std::size_t i = 0; i < records.size(); ++i) {
    CHECK(again[i].kl == records[i].kl);
    CHECK(again[i].top1 == records[i].top1);
  }
  // Paged storage changes where rows live, not what attention computes: identical numbers.
  auto const paged =
      evaluate(model, options_for({"key_diff", "snap_kv"}, {0.75}, {CacheType::f16, CacheLayout::paged}), samples);
  CHECK(paged[0].kl == records[1].kl);
  CHECK(paged[1].kl == records[3].kl);
}

TEST_CASE("expected_attention and h2o: ratio 0 is lossless, and compression costs quality") {
  if (!have(tinystories))
    return;
  Model const model = load(tinystories);
  auto const cache = CacheOptions{CacheType::f16, CacheLayout::dense};
  std::vector<std::vector<std::int32_t>> const samples{sample_tokens(model, cache, 65, 1, 5, {1, 2})};
  auto opts = options_for({"expected_attention", "h2o"}, {0.0, 0.75}, cache);
  opts.policies.push_back({&kvc::tools::find_policy("h2o"),
                           kvc::tools::resolve_params(kvc::tools::find_policy("h2o"), {"reference=kvpress"}, true)});
  auto const records = evaluate(model, opts, samples);
  REQUIRE(records.size() == 6);
  for (Record const& r : records) {
    INFO(r.policy << " at " << r.ratio);
    if (r.ratio == 0.0) {
      CHECK(r.kl == 0.0);
      CHECK(r.top1 == 1.0);
    } else {
      CHECK(r.kl > 0.0);
      CHECK(r.kv_bytes == 2 * 4 * 12 * 2 * 16 * 2);
    }
  }
}

TEST_CASE("decode-time runs: the cache follows the driver's sawtooth, a target above the sequence is lossless") {
  if (!have(tinystories))
    return;
  Model const model = load(tinystories);
  auto const cache = CacheOptions{CacheType::f16, CacheLayout::paged};
  Index const prompt = 24, continuation = 80;
  std::vector<std::vector<std::int32_t>> samples;
  for (std::uint64_t s = 0; s < 2; ++s)
    samples.push_back(sample_tokens(model, cache, prompt + continuation + 1, 1, 21 + s, {1, 2}));
  std::vector<std::string> names;
  for (auto const& p : kvc::tools::policies())
    // Algorithm 1 (moment_kv) and UNComp evict every step, UNComp reads a calibration: their own tests below.
    // rdkv and kivi allocate once after the prompt (their own test below).
    if (std::string(p.name) != "moment_kv" && std::string(p.name) != "uncomp" && p.token_scores &&
        !kvc::tools::is_packed_policy(p.name))
      names.push_back(p.name);
  RunOptions opts = options_for(names, {}, cache);
  for (auto& run : opts.policies)
    if (std::string(run.policy->name) == "snap_kv")
      run.params = kvc::tools::resolve_params(*run.policy, {"window_size=4"}, true);
  opts.prompt_tokens = prompt;
  opts.continuation = continuation;
  opts.schedule = Schedule::decode;
  opts.decode.compression_interval = 8;
  opts.decode.target_size = 32;
  opts.decode.hidden_states_buffer_size = 8;
  auto const records = evaluate(model, opts, samples);
  REQUIRE(records.size() == names.size());
  // Every head of every layer holds the same count: 24 after the prompt, +1 per step, back to 32 at every 8th step
  // once longer. 512 bytes per token: fp16 K + V, 2 layers x 4 KV heads x d 16.
  std::vector<double> expect;
  for (Index step = 1, held = prompt; step <= continuation; ++step) {
    held += 1;
    if (step % 8 == 0 && held > 32)
      held = 32;
    expect.push_back(static_cast<double>(held) * 512.0);
  }
  for (Record const& r : records) {
    INFO(r.policy);
    CHECK(r.kv_bytes_steps == expect);
    CHECK(r.kl > 0.0);
    CHECK(r.ratio > 0.3);  // the mean bytes held: ~36 tokens against the full cache's mean of 64.5
  }
  opts.decode.target_size = prompt + continuation + 1;  // never evicts: exactly the full cache's numbers
  for (Record const& r : evaluate(model, opts, samples)) {
    INFO(r.policy);
    CHECK(r.kl == 0.0);
    CHECK(r.top1 == 1.0);
    CHECK(r.perplexity == r.perplexity_full);
  }
}

TEST_CASE("compression keeps the tokens the policy names, in every layer, and random draws anew per layer") {
  if (!have(tinystories))
    return;
  Model const model = load(tinystories);
  auto const tokens = sample_tokens(model, {CacheType::f16, CacheLayout::paged}, 48, 1, 5, {1, 2});
  auto const& streaming = kvc::tools::find_policy("streaming_llm");
  auto const& random = kvc::tools::find_policy("random");
  for (CacheLayout layout : {CacheLayout::dense, CacheLayout::paged}) {
    auto prefilled = make_session(model, {CacheType::f16, layout}, 64);
    RowMatrix logits;
    REQUIRE(prefilled->forward(tokens, logits).ok());
    auto s = prefilled->clone();
    double seconds = 0;
    REQUIRE(s->compress(streaming, kvc::tools::resolve_params(streaming, {}, true), 0.75, seconds).ok());
    // 48 tokens at ratio 0.75 keep 12: the 4 sinks (n_sink = 4) and the 8 newest, in position order.
    std::vector<Index> expected = {0, 1, 2, 3, 40, 41, 42, 43, 44, 45, 46, 47};
    for (Index l = 0; l < 2; ++l)
      for (Index h = 0; h < 4; ++h) {
        REQUIRE(s->length(l, h) == 12);
        std::vector<Index> kept;
        for (Index t = 0; t < 12; ++t)
          kept.push_back(s->slot_position(l, h, t));
        CHECK(kept == expected);
      }
    CHECK(prefilled->length(0, 0) == 48);  // the clone is deep: the prefilled session is untouched
    // The next token goes after the kept ones, at position 48.
    std::int32_t const next = 5;
    REQUIRE(s->forward(std::span(&next, 1), logits).ok());
    CHECK(s->slot_position(1, 3, 12) == 48);

    auto r = prefilled->clone();
    REQUIRE(r->compress(random, kvc::tools::resolve_params(random, {}, true), 0.5, seconds, 7).ok());
    std::vector<Index> layer0, layer1;
    for (Index t = 0; t < 24; ++t) {
      layer0.push_back(r->slot_position(0, 0, t));
      layer1.push_back(r->slot_position(1, 0, t));
    }
    CHECK(layer0 != layer1);
  }
}

TEST_CASE("allocator rows: ratio 0 is exactly lossless, and the compressed cache is a ragged per-head store") {
  if (!have(tinystories))
    return;
  Model const model = load(tinystories);
  auto const cache = CacheOptions{CacheType::f16, CacheLayout::dense};
  std::vector<std::vector<std::int32_t>> const samples{sample_tokens(model, cache, 65, 1, 13, {1, 2})};
  RunOptions opts = options_for({}, {0.0, 0.5}, cache);
  for (auto const& [scorer, alloc] : std::vector<std::pair<std::string, std::string>>{
           {"snap_kv", "ada_kv"}, {"snap_kv", "pyramid_kv"}, {"key_diff", "pyramid_kv+ada_kv"}})
    opts.policies.push_back(allocator_run(scorer, alloc, {"window_size=8"}));  // the window below the budget
  auto const records = evaluate(model, opts, samples);
  REQUIRE(records.size() == 6);
  CHECK(records[0].policy == "snap_kv+ada_kv");
  CHECK(records[4].policy == "key_diff+pyramid_kv+ada_kv");
  for (Record const& r : records) {
    INFO(r.policy << " at " << r.ratio);
    if (r.ratio == 0.0) {
      CHECK(r.kl == 0.0);
      CHECK(r.top1 == 1.0);
      CHECK(r.perplexity == r.perplexity_full);
      CHECK(r.layer_error[0] == 0.0);
      CHECK(r.kv_bytes == r.kv_bytes_full);
      CHECK(r.kv_held_bytes == r.kv_held_bytes_full);  // every head: 48 tokens + 16 reserve
    } else {
      CHECK(r.kl > 0.0);
      CHECK(r.kept_min < r.kept_max);  // heads (ada_kv) or layers (pyramid_kv) keep different counts
    }
  }
  // The session's layers are ragged stores after compression with an allocator, and hold what store_report says:
  // every head its count + the reserve (the 16 tokens the session can still take), K + V + position per row.
  auto prefilled = make_session(model, cache, 64);
  RowMatrix logits;
  REQUIRE(prefilled->forward(std::span(samples[0]).subspan(0, 48), logits).ok());
  auto s = prefilled->clone();
  double seconds = 0;
  auto const ada = allocator_run("snap_kv", "ada_kv", {"window_size=8"});
  REQUIRE(s->compress(*ada.policy, ada.params, 0.5, seconds, 0, ada.alloc).ok());
  std::size_t expected_held = 0;
  for (Index l = 0; l < 2; ++l) {
    CHECK(s->ragged(l));
    CHECK_FALSE(prefilled->ragged(l));
    Index total = 0;
    for (Index h = 0; h < 4; ++h) {
      total += s->length(l, h);
      expected_held += static_cast<std::size_t>((s->length(l, h) + 16) * 72);
      for (Index t = 1; t < s->length(l, h); ++t)
        CHECK(s->slot_position(l, h, t) > s->slot_position(l, h, t - 1));
      CHECK(s->slot_position(l, h, s->length(l, h) - 1) == 47);  // SnapKV's window is kept
    }
    CHECK(std::abs(total - 4 * 24) <= 2);  // the layer's budget, up to the authors' rounding
  }
  StoreBytes const b = s->store_bytes();
  CHECK(b.held == expected_held);
  CHECK(b.min_count < b.max_count);
  // The continuation appends after each head's own length, at the next position.
  std::int32_t const next = 5;
  REQUIRE(s->forward(std::span(&next, 1), logits).ok());
  CHECK(s->slot_position(1, 2, s->length(1, 2) - 1) == 48);
}

TEST_CASE("AdaKV at alpha 1 on the ragged store gives exactly the uniform row's logits") {
  if (!have(tinystories))
    return;
  Model const model = load(tinystories);
  for (CacheLayout layout : {CacheLayout::dense, CacheLayout::paged}) {
    auto const cache = CacheOptions{CacheType::f16, layout};
    std::vector<std::vector<std::int32_t>> samples;
    for (std::uint64_t s = 0; s < 2; ++s)
      samples.push_back(sample_tokens(model, cache, 65, 1, 31 + s, {1, 2}));
    // alpha = 1: every head keeps exactly its uniform share, so the kept sets are the uniform row's (the window,
    // which the allocator protects, is SnapKV's top score anyway when the budget holds it).
    RunOptions opts = options_for({}, {0.25, 0.5, 0.75}, cache);
    auto const& snap = kvc::tools::find_policy("snap_kv");
    opts.policies.push_back({&snap, kvc::tools::resolve_params(snap, {"window_size=8"}, true)});
    opts.policies.push_back(allocator_run("snap_kv", "ada_kv", {"window_size=8", "alpha_safeguard=1"}));
    auto const records = evaluate(model, opts, samples);
    REQUIRE(records.size() == 6);
    for (std::size_t i = 0; i < 3; ++i) {
      Record const &u = records[i], &a = records[i + 3];
      INFO(a.policy << " at " << a.ratio);
      CHECK(a.policy == "snap_kv+ada_kv");
      CHECK(a.kl == u.kl);
      CHECK(a.top1 == u.top1);
      CHECK(a.perplexity == u.perplexity);
      CHECK(a.layer_error == u.layer_error);
      CHECK(a.kv_bytes == u.kv_bytes);
      CHECK(a.kv_held_bytes == u.kv_held_bytes);  // equal counts: the ragged store holds what a uniform one does
      CHECK(a.kept_min == a.kept_max);
    }
    // Logits of a continuation after compression, compared bit for bit.
    auto prefilled = make_session(model, cache, 64);
    RowMatrix logits, uniform_logits, ragged_logits;
    REQUIRE(prefilled->forward(std::span(samples[0]).subspan(0, 48), logits).ok());
    auto u = prefilled->clone(), a = prefilled->clone();
    double seconds = 0;
    REQUIRE(u->compress(*opts.policies[0].policy, opts.policies[0].params, 0.5, seconds).ok());
    REQUIRE(
        a->compress(*opts.policies[1].policy, opts.policies[1].params, 0.5, seconds, 0, opts.policies[1].alloc).ok());
    CHECK(a->ragged(0));
    CHECK_FALSE(u->ragged(0));
    std::span<std::int32_t const> const fed = std::span(samples[0]).subspan(48, 16);
    REQUIRE(u->forward(fed, uniform_logits).ok());
    REQUIRE(a->forward(fed, ragged_logits).ok());
    CHECK(ragged_logits == uniform_logits);
  }
}

TEST_CASE("AdaKV rows hold at most the uniform rows' bytes, plus the authors' rounding") {
  if (!have(stories260k))
    return;
  Model const model = load(stories260k);
  auto const cache = CacheOptions{CacheType::f16, CacheLayout::dense};
  std::vector<std::vector<std::int32_t>> const samples{sample_tokens(model, cache, 65, 1, 17, {1, 2})};
  RunOptions opts = options_for({"snap_kv", "key_diff"}, {0.25, 0.5, 0.75, 0.9}, cache);
  opts.policies.push_back(allocator_run("snap_kv", "ada_kv"));
  opts.policies.push_back(allocator_run("key_diff", "ada_kv", {"reference=kvpress"}));
  auto const records = evaluate(model, opts, samples);
  REQUIRE(records.size() == 16);
  double const row = 2 * 8 * 2 + 8;  // fp16 K + V (d 8) and the position
  for (std::size_t i = 0; i < 4; ++i) {
    Record const &snap = records[i], &key_diff = records[4 + i], &authors = records[8 + i], &kvpress = records[12 + i];
    INFO("ratio " << snap.ratio);
    // The authors keep the window (32) on top of the budget and round each head's share: at most half a token per
    // head over the budget, or the window where the budget is below it.
    double const budget = std::max(snap.kv_held_bytes, 5 * 4 * (32 + 16) * row);
    CHECK(authors.kv_held_bytes <= budget + 5 * 4 * row);
    // kvpress: exactly the layer's budget, so the ragged store holds what the uniform store does.
    CHECK(kvpress.kv_bytes == key_diff.kv_bytes);
    CHECK(kvpress.kv_held_bytes == key_diff.kv_held_bytes);
    CHECK(kvpress.kept_min < kvpress.kept_max);
  }
}

TEST_CASE("PyramidKV rows keep per layer what the schedule says") {
  if (!have(stories260k))
    return;
  Model const model = load(stories260k);
  auto const cache = CacheOptions{CacheType::f32, CacheLayout::paged};
  auto const tokens = sample_tokens(model, cache, 96, 1, 23, {1, 2});
  auto prefilled = make_session(model, cache, 112);
  RowMatrix logits;
  REQUIRE(prefilled->forward(tokens, logits).ok());
  for (char const* reference : {"authors", "kvpress"})
    for (double ratio : {0.25, 0.5, 0.75}) {
      auto const run = allocator_run("snap_kv", "pyramid_kv", {std::string("reference=") + reference});
      auto s = prefilled->clone();
      double seconds = 0;
      REQUIRE(s->compress(*run.policy, run.params, ratio, seconds, 0, run.alloc).ok());
      std::vector<Index> kept;
      for (Index l = 0; l < 5; ++l) {
        INFO(reference << " at " << ratio << ", layer " << l);
        kvc::PyramidKVBudget budget;
        budget.layer = l;
        budget.num_layers = 5;
        budget.window_size = std::string(reference) == "kvpress" ? 64 : 8;
        budget.reference = std::string(reference) == "kvpress" ? kvc::Reference::kvpress : kvc::Reference::authors;
        budget.compression_ratio = ratio;
        Index expected = budget.keep(0, 0, 96);
        if (std::string(reference) == "authors")  // the window is protected on top
          expected = std::max<Index>(expected, 8);
        CHECK(s->ragged(l));
        for (Index h = 0; h < 4; ++h)
          CHECK(s->length(l, h) == expected);
        kept.push_back(expected);
      }
      if (std::string(reference) == "authors" && ratio == 0.5)  // a real pyramid: lower layers keep more
        CHECK(kept == std::vector<Index>{86, 67, 48, 29, 10});
    }
}

TEST_CASE("decode-time runs with ada_kv: the ragged store grows and compresses, alpha 1 equals the uniform row") {
  if (!have(tinystories))
    return;
  Model const model = load(tinystories);
  auto const cache = CacheOptions{CacheType::f16, CacheLayout::dense};
  Index const prompt = 24, continuation = 80;
  std::vector<std::vector<std::int32_t>> samples;
  for (std::uint64_t s = 0; s < 2; ++s)
    samples.push_back(sample_tokens(model, cache, prompt + continuation + 1, 1, 41 + s, {1, 2}));
  RunOptions opts = options_for({}, {}, cache);
  auto const& snap = kvc::tools::find_policy("snap_kv");
  opts.policies.push_back({&snap, kvc::tools::resolve_params(snap, {"window_size=4"}, true)});
  opts.policies.push_back(allocator_run("snap_kv", "ada_kv", {"window_size=4", "alpha_safeguard=1"}));
  opts.policies.push_back(allocator_run("snap_kv", "ada_kv", {"window_size=4"}));
  opts.policies.push_back(allocator_run("key_diff", "ada_kv", {"reference=kvpress"}));
  opts.policies.push_back(allocator_run("snap_kv", "pyramid_kv", {"window_size=4"}));
  opts.prompt_tokens = prompt;
  opts.continuation = continuation;
  opts.schedule = Schedule::decode;
  opts.decode.compression_interval = 8;
  opts.decode.target_size = 32;
  opts.decode.hidden_states_buffer_size = 8;
  auto const records = evaluate(model, opts, samples);
  REQUIRE(records.size() == 5);
  Record const &uniform = records[0], &alpha1 = records[1], &authors = records[2], &kvpress = records[3];
  // alpha = 1 keeps the uniform sets at every compression, across the store's re-layouts: the same numbers.
  CHECK(alpha1.kl == uniform.kl);
  CHECK(alpha1.top1 == uniform.top1);
  CHECK(alpha1.layer_error == uniform.layer_error);
  CHECK(alpha1.kv_bytes_steps == uniform.kv_bytes_steps);
  CHECK(authors.kl > 0.0);
  CHECK(authors.kept_min < authors.kept_max);
  // kvpress keeps the layer's budget (each head's share is min(its length, target)): never more than the uniform
  // sawtooth of valid bytes, in unequal heads.
  REQUIRE(kvpress.kv_bytes_steps.size() == uniform.kv_bytes_steps.size());
  for (std::size_t t = 0; t < uniform.kv_bytes_steps.size(); ++t)
    CHECK(kvpress.kv_bytes_steps[t] <= uniform.kv_bytes_steps[t]);
  CHECK(kvpress.kept_min < kvpress.kept_max);
  CHECK(records[4].kl > 0.0);
  // Re-laying the ragged stores out after every compression too frees the slots compaction emptied: the same
  // numbers, less memory held where heads shrink unevenly (ada_kv; the uniform rows are not ragged: unchanged).
  // Heads that keep every token (alpha 1 and pyramid_kv below the target) only get their reserve a step earlier.
  opts.relayout_on_compress = true;
  auto const relaid = evaluate(model, opts, samples);
  for (std::size_t i = 0; i < records.size(); ++i) {
    INFO(records[i].policy);
    CHECK(relaid[i].kl == records[i].kl);
    CHECK(relaid[i].kv_bytes == records[i].kv_bytes);
  }
  CHECK(relaid[0].kv_held_bytes == records[0].kv_held_bytes);
  CHECK(relaid[2].kv_held_bytes < records[2].kv_held_bytes);
  CHECK(relaid[3].kv_held_bytes < records[3].kv_held_bytes);
  opts.relayout_on_compress = false;
  // A target above the sequence never evicts: exactly the full cache's numbers, through the ragged store.
  opts.decode.target_size = prompt + continuation + 1;
  for (Record const& r : evaluate(model, opts, samples)) {
    INFO(r.policy);
    CHECK(r.kl == 0.0);
    CHECK(r.top1 == 1.0);
    CHECK(r.kv_bytes == r.kv_bytes_full);
  }
  // H2O's per-token state does not follow a re-layout: refused with a message.
  auto session = make_session(model, cache, 64);
  RowMatrix logits;
  REQUIRE(session->forward(std::span(samples[0]).subspan(0, 24), logits).ok());
  auto const h2o = allocator_run("h2o", "ada_kv");
  kvc::Status const st = session->begin_decode(*h2o.policy, h2o.params, opts.decode, 0, h2o.alloc);
  CHECK_FALSE(st.ok());
  CHECK(std::string(st.message()).find("stateful") != std::string::npos);
}

TEST_CASE("an fp16 cache moves the numbers by what its rounding implies") {
  if (!have(tinystories))
    return;
  Model const model = load(tinystories);
  std::vector<std::vector<std::int32_t>> samples{sample_tokens(model, {CacheType::f32}, 65, 1, 9, {1, 2})};
  // StreamingLLM keeps the same tokens whatever the precision, so only the rounding of K and V differs.
  auto const f32 = evaluate(model, options_for({"streaming_llm"}, {0.5}, {CacheType::f32}), samples);
  auto const f16 = evaluate(model, options_for({"streaming_llm"}, {0.5}, {CacheType::f16}), samples);
  CHECK(f16[0].kl != f32[0].kl);
  CHECK(std::abs(f16[0].kl - f32[0].kl) <= 1e-3 * f32[0].kl);                          // measured 3e-4
  CHECK(std::abs(f16[0].perplexity - f32[0].perplexity) <= 1e-4 * f32[0].perplexity);  // measured 1.5e-5
}

TEST_CASE("fp8 caches: half the bytes of fp16, their own full cache is exact at ratio 0, the quantisation's KL") {
  if (!have(tinystories))
    return;
  Model const model = load(tinystories);
  auto const fp16 = CacheOptions{CacheType::f16, CacheLayout::dense};
  std::vector<std::vector<std::int32_t>> const samples{sample_tokens(model, fp16, 65, 1, 21, {1, 2})};
  double kl[2] = {};
  for (CacheType type : {CacheType::f8_e4m3, CacheType::f8_e5m2})
    for (CacheLayout layout : {CacheLayout::dense, CacheLayout::paged}) {
      INFO(cache_type_name(type) << (layout == CacheLayout::dense ? " dense" : " paged"));
      // Every engine path on an fp8 cache: uniform, ragged (AdaKV), MomentKV's moments, packed (RDKV, KIVI).
      RunOptions opts = options_for({"streaming_llm", "snap_kv", "h2o", "expected_attention", "moment_kv", "rdkv"},
                                    {0.0, 0.5}, {type, layout});
      opts.policies.push_back(allocator_run("key_diff", "ada_kv"));
      auto const own = evaluate(model, opts, samples);
      for (Record const& r : own) {
        INFO(r.policy << " at " << r.ratio);
        CHECK(std::isfinite(r.kl));
        CHECK(std::isfinite(r.perplexity));
        if (r.ratio == 0.0 && r.policy != "rdkv")  // rdkv packs at 16 bits: not the fp8 values
          CHECK(r.kl == 0.0);
        if (r.ratio > 0.0)
          CHECK(r.kl > 0.0);
      }
      // 2 layers x 4 KV heads x 48 prompt tokens x (K + V) x d 16, one byte each; at 0.5, 24 tokens.
      Record const& full = record_of(own, "streaming_llm", 0.0);
      CHECK(full.kv_bytes == 2 * 4 * 48 * 2 * 16);
      CHECK(record_of(own, "streaming_llm", 0.5).kv_bytes == 2 * 4 * 24 * 2 * 16);
      // Against a full fp16 cache: ratio 0 measures the quantisation alone, twice the bytes in the reference.
      opts.reference_type = CacheType::f16;
      auto const against_fp16 = evaluate(model, opts, samples);
      Record const& q = record_of(against_fp16, "streaming_llm", 0.0);
      CHECK(q.kv_bytes_full == 2 * full.kv_bytes);
      CHECK(q.kl > 0.0);
      CHECK(q.kl < 0.05);
      kl[type == CacheType::f8_e5m2] = q.kl;
    }
  CHECK(kl[1] > kl[0]);  // E5M2 keeps 2 mantissa bits, E4M3 3: four times the squared rounding error
}

TEST_CASE("fp8 caches: each layer's scales are the prompt's K and V amax over the format's largest value") {
  if (!have(tinystories))
    return;
  Model const model = load(tinystories);
  std::vector<std::int32_t> const prompt = sample_tokens(model, {CacheType::f32}, 40, 1, 23, {1, 2});
  RowMatrix logits;
  auto const amax = [](std::vector<float> const& x) {
    float m = 0.0f;
    for (float v : x)
      m = std::max(m, std::abs(v));
    return m;
  };
  for (auto const& [type, largest] : {std::pair{CacheType::f8_e4m3, 448.0f}, std::pair{CacheType::f8_e5m2, 57344.0f}})
    for (CacheLayout layout : {CacheLayout::dense, CacheLayout::paged}) {
      // The session's own post-RoPE K and V of the prompt, recorded before they are stored (layers past the first
      // see the quantised cache's attention, so an fp32 session's would differ).
      auto fp8 = make_session(model, {type, layout}, 64);
      ForwardTrace trace;
      trace.projections = true;
      REQUIRE(fp8->forward(prompt, logits, &trace).ok());
      REQUIRE(fp8->forward(std::vector<std::int32_t>{prompt[1]}, logits).ok());  // a later call keeps them
      REQUIRE(trace.qkv.size() == 2);
      for (std::size_t li = 0; li < trace.qkv.size(); ++li) {
        INFO(cache_type_name(type) << " layer " << li);
        auto const [k_scale, v_scale] = fp8->kv_scales(li);
        CHECK(k_scale == amax(trace.qkv[li].keys) / largest);
        CHECK(v_scale == amax(trace.qkv[li].values) / largest);
        CHECK(k_scale != v_scale);
      }
    }
  CHECK(make_session(model, {CacheType::f16, CacheLayout::dense}, 64)->kv_scales(0) == std::pair{1.0f, 1.0f});
}

TEST_CASE("a llama2.c checkpoint runs through the same engine, and compression at ratio 0 changes nothing") {
  if (!have(stories260k))
    return;
  Model const model = load(stories260k);
  CHECK(model.config.format == "llama2.c");
  CHECK(model.config.layers == 5);
  CHECK(model.config.kv_heads == 4);
  CHECK(model.owned_bytes() == 0);  // float32 weights used in place from the mapping
  auto const cache = CacheOptions{CacheType::f32, CacheLayout::paged};
  std::vector<std::vector<std::int32_t>> samples{sample_tokens(model, cache, 40, 1, 3, {1, 2})};
  auto opts = options_for({"tova", "knorm"}, {0.0, 0.5}, cache);
  opts.prompt_tokens = 24;
  opts.continuation = 15;
  auto const records = evaluate(model, opts, samples);
  CHECK(records[0].kl == 0.0);
  CHECK(records[1].kl > 0.0);
  CHECK(records[2].top1 == 1.0);
}

TEST_CASE("results.json holds every field docs/eval.md lists") {
  Record r;
  r.policy = "snap_kv";
  r.ratio = 0.5;
  r.kl = 0.125;
  r.top1 = 0.75;
  r.perplexity = 3;
  r.perplexity_full = 2.5;
  r.kv_bytes = 1024;
  r.kv_bytes_full = 2048;
  r.seconds = 0.001;
  r.layer_error = {0.5, std::nan("")};
  r.samples = 4;
  auto const& info = kvc::tools::find_policy("snap_kv");
  std::vector<PolicyRun> const runs{{&info, kvc::tools::resolve_params(info, {}, true)}};
  std::string const text =
      results_json({r}, runs, RunInfo{"m\"odel", "fp8_e4m3", "fp16", "dense", 256, 64, 7, "sampled"});
  kvc::json::Value v;
  std::string error;
  REQUIRE(kvc::json::parse(text, v, error));
  REQUIRE(v.items().size() == 1);
  kvc::json::Value const& rec = v.items()[0];
  for (char const* field : {"policy",
                            "ratio",
                            "kl",
                            "top1",
                            "perplexity",
                            "perplexity_full",
                            "kv_bytes",
                            "kv_bytes_full",
                            "kv_held_bytes",
                            "kv_held_bytes_full",
                            "kept_min",
                            "kept_max",
                            "seconds",
                            "moment_bytes",
                            "payload_bytes",
                            "overhead_bytes",
                            "layer_error",
                            "params",
                            "model",
                            "cache",
                            "reference_cache",
                            "layout"})
    CHECK(rec.find(field) != nullptr);
  CHECK(rec.find("kl")->as_double() == 0.125);
  CHECK(rec.find("model")->as_string() == "m\"odel");
  CHECK(rec.find("cache")->as_string() == "fp8_e4m3");
  CHECK(rec.find("reference_cache")->as_string() == "fp16");
  CHECK(rec.find("isa") != nullptr);
  CHECK(rec.find("layer_error")->items()[0].as_double() == 0.5);
  CHECK(rec.find("layer_error")->items()[1].is_null());                                 // NaN is not JSON: null
  CHECK(text.find("{\"policy\": \"snap_kv\", \"ratio\": 0.5, ") != std::string::npos);  // one record a line
  CHECK(results_csv({r}).rfind(
            "policy,ratio,kl,top1,perplexity,perplexity_full,kv_bytes,kv_bytes_full,seconds,"
            "samples,kv_held_bytes,kv_held_bytes_full,kept_min,kept_max,moment_bytes,payload_bytes,overhead_bytes,"
            "layer_error_0,"
            "layer_error_1\nsnap_kv,0.5,0.125,0.75,3,2.5,1024,2048,",
            0) == 0);
  r.policy = "moment_kv(mi=false,correction=true)+ada_kv";  // a comma in the name: the field is quoted
  CHECK(results_csv({r}).find("\n\"moment_kv(mi=false,correction=true)+ada_kv\",0.5,") != std::string::npos);
}

TEST_CASE("the model loader refuses damaged checkpoints and configs with a message naming the file and field") {
  std::string const dir = work_dir("damaged");
  auto const refused = [](std::string const& path, std::string const& expected) {
    Model m;
    std::string error;
    INFO(path);
    bool const loaded = Model::load(path, m, error);
    INFO(error);
    CHECK_FALSE(loaded);
    CHECK(error.find(expected) != std::string::npos);
  };
  std::int32_t header[7] = {64, 172, 5, 8, 4, 512, 512};
  auto const header_bytes = [&] { return std::string(reinterpret_cast<char const*>(header), sizeof header); };
  write_bytes(dir + "/short.bin", "abc");
  refused(dir + "/short.bin", "shorter than a llama2.c checkpoint header");
  write_bytes(dir + "/truncated.bin", header_bytes() + std::string(1000, '\0'));
  refused(dir + "/truncated.bin", "but the header");
  header[3] = 7;  // 64 is not a multiple of 7
  write_bytes(dir + "/heads.bin", header_bytes());
  refused(dir + "/heads.bin", "must be a multiple of n_heads");
  header[3] = 8;
  header[0] = -64;
  write_bytes(dir + "/negative.bin", header_bytes());
  refused(dir + "/negative.bin", "header field dim = -64");
  header[0] = 64;
  header[2] = 1 << 30;
  write_bytes(dir + "/huge.bin", header_bytes());
  refused(dir + "/huge.bin", "n_layers");
  refused(dir + "/absent.bin", "no such file");

  fs::create_directories(dir + "/hf");
  write_bytes(dir + "/hf/config.json", "{\"model_type\": \"llama\", \"hidden_size\": 128");
  refused(dir + "/hf", "config.json");
  write_bytes(dir + "/hf/config.json",
              R"({"model_type": "llama", "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
                  "num_attention_heads": 8, "num_key_value_heads": 3, "vocab_size": 2048,
                  "max_position_embeddings": 512, "rms_norm_eps": 1e-6})");
  refused(dir + "/hf", "must be a multiple of KV heads");
  write_bytes(dir + "/hf/config.json",
              R"({"model_type": "llama", "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
                  "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 2048,
                  "max_position_embeddings": 512, "rms_norm_eps": 1e-6, "rope_scaling": {"type": "yarn",
                  "factor": 4.0}})");
  refused(dir + "/hf", "rope_scaling type 'yarn' is not supported");
  write_bytes(dir + "/hf/config.json",
              R"({"model_type": "llama", "hidden_size": 128, "intermediate_size": 384, "num_hidden_layers": 2,
                  "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 2048,
                  "max_position_embeddings": 512, "rms_norm_eps": 1e-6})");
  refused(dir + "/hf", "model.safetensors");  // absent
  if (have(tinystories)) {
    // The real weights under a config that disagrees with them: the first tensor whose shape differs is named.
    fs::copy_file(tinystories + "/model.safetensors", dir + "/hf/model.safetensors");
    write_bytes(dir + "/hf/config.json",
                R"({"model_type": "llama", "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
                    "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 2048,
                    "max_position_embeddings": 512, "rms_norm_eps": 1e-6})");
    refused(dir + "/hf", "tensor \"model.layers.0.mlp.gate_proj.weight\" has shape [384, 128], expected [256, 128]");
    // The real config over a truncated weights file: the safetensors reader names the file.
    fs::copy_file(tinystories + "/config.json", dir + "/hf/config.json", fs::copy_options::overwrite_existing);
    fs::resize_file(dir + "/hf/model.safetensors", 100000);
    refused(dir + "/hf", "model.safetensors: ");
  }
}

TEST_CASE("config.json: tie_word_embeddings and eos_token_id as the Hugging Face fields mean them") {
  std::string const base = R"({"model_type": "llama", "hidden_size": 128, "intermediate_size": 384,
      "num_hidden_layers": 2, "num_attention_heads": 8, "num_key_value_heads": 4, "vocab_size": 2048,
      "max_position_embeddings": 512, "rms_norm_eps": 1e-6)";
  ModelConfig c;
  std::string error;
  REQUIRE(parse_config(base + R"(, "eos_token_id": [7, 9], "bos_token_id": 1})", "config.json", c, error));
  CHECK(c.eos == 7);  // a list (Llama 3 Instruct): the first
  CHECK(c.bos == 1);
  CHECK_FALSE(c.tied_embeddings);  // transformers' default
  REQUIRE(parse_config(base + R"(, "tie_word_embeddings": true})", "config.json", c, error));
  CHECK(c.tied_embeddings);
  CHECK_FALSE(parse_config(base + R"(, "attention_bias": "no"})", "config.json", c, error));
  CHECK(error == "config.json: field \"attention_bias\" must be true or false");
}

TEST_CASE("kvc-eval: exit codes 2 (usage) and 3 (invalid input), logits and dump write whole files") {
  std::string const eval = KVC_EVAL;
  std::string out;
  CHECK(run_command(eval, out) == 2);
  CHECK(out.find("missing command") != std::string::npos);
  CHECK(run_command(eval + " frobnicate", out) == 2);
  CHECK(out.find("unknown command 'frobnicate'") != std::string::npos);
  CHECK(run_command(eval + " run --model x", out) == 2);  // --out-dir missing
  CHECK(out.find("kvc-eval run: error: --out-dir is required") != std::string::npos);
  CHECK(out.find("kvc-eval run --help") != std::string::npos);
  // Options through CLI11: --name=value as --name value, one value each, a repeated option or a missing value named.
  CHECK(run_command(eval + " run --model x --out-dir y --model z", out) == 2);
  CHECK(out.find("--model given twice") != std::string::npos);
  CHECK(run_command(eval + " run --model x --out-dir y --no-progress --no-progress", out) == 2);
  CHECK(out.find("--no-progress given twice") != std::string::npos);
  CHECK(run_command(eval + " run --model x --out-dir y --seed", out) == 2);
  CHECK(out.find("--seed: 1 required X missing") != std::string::npos);
  CHECK(run_command(eval + " run --model x --out-dir y --bogus=1", out) == 2);
  CHECK(out.find("unknown option '--bogus' for kvc-eval run") != std::string::npos);
  CHECK(run_command(eval + " run --model x y --out-dir z", out) == 2);
  CHECK(out.find("unexpected argument 'y'") != std::string::npos);
  CHECK(run_command(eval + " run --model=/nonexistent --out-dir=y --samples=0", out) == 3);
  CHECK(out.find("--samples = 0: expected an integer >= 1") != std::string::npos);
  CHECK(run_command(eval + " run --model=/nonexistent --out-dir=y --no-progress", out) == 3);
  CHECK(out.find("/nonexistent") != std::string::npos);
  // --help: the command's options and explanations, exit 0; the program's commands.
  REQUIRE(run_command(eval + " run --help", out) == 0);
  for (char const* needle : {"Usage: kvc-eval run [OPTIONS]", "--model DIR REQUIRED", "--param POLICY.NAME=VALUE",
                             "POLICY(NAME=VALUE,...)", "--decode interval=I,target=T"})
    CHECK(out.find(needle) != std::string::npos);
  REQUIRE(run_command(eval + " --help", out) == 0);
  for (char const* command : {"run", "logits", "dump", "correction", "calibrate"})
    CHECK(out.find(command) != std::string::npos);
  REQUIRE(run_command(eval + " calibrate --help", out) == 0);
  CHECK(out.find("--rule mean|majority_vote") != std::string::npos);
  CHECK(run_command(eval + " run --model x --out-dir y --schedule decode", out) == 2);
  CHECK(out.find("pass --decode interval=I,target=T") != std::string::npos);
  CHECK(run_command(eval + " run --model x --out-dir y --decode interval=8", out) == 2);  // no target
  CHECK(out.find("both interval and target") != std::string::npos);
  CHECK(run_command(eval + " run --model x --out-dir y --decode interval=8,target=4 --ratios 0.5", out) == 2);
  CHECK(out.find("neither --schedule nor --ratios") != std::string::npos);
  CHECK(run_command(eval + " run --model x --out-dir y --decode interval=0,target=4", out) == 3);
  CHECK(run_command(eval + " run --model x --out-dir y --decode interval=8,target=4,relayout=never", out) == 2);
  CHECK(out.find("relayout=fill|compress") != std::string::npos);
  CHECK(out.find("run `kvc-eval run --help` for the options") != std::string::npos);  // where the syntax is
  // Allocators: unknown or repeated names, bad parameters, and the per-layer parameters kvc-eval sets itself.
  CHECK(run_command(eval + " run --model x --out-dir y --policies snap_kv+foo_kv", out) == 2);
  CHECK(out.find("unknown allocator 'foo_kv' (expected ada_kv, pyramid_kv or pyramid_kv+ada_kv)") != std::string::npos);
  CHECK(run_command(eval + " run --model x --out-dir y --policies snap_kv+ada_kv+ada_kv", out) == 2);
  CHECK(out.find("allocator 'ada_kv' named twice") != std::string::npos);
  CHECK(run_command(eval + " run --model x --out-dir y --policies snap_kv+ --no-progress", out) == 2);
  CHECK(out.find("unknown allocator ''") != std::string::npos);
  CHECK(run_command(
            eval + " run --model x --out-dir y --policies snap_kv+ada_kv --param snap_kv+ada_kv.alpha_safeguard=2",
            out) == 3);
  CHECK(out.find("alpha_safeguard") != std::string::npos);
  CHECK(
      run_command(eval + " run --model x --out-dir y --policies snap_kv+pyramid_kv --param snap_kv+pyramid_kv.layer=1",
                  out) == 2);
  CHECK(out.find("sets pyramid_kv's layer and num_layers per layer") != std::string::npos);
  CHECK(run_command(eval + " run --model x --out-dir y --policies snap_kv+ada_kv,snap_kv+ada_kv", out) == 2);
  CHECK(out.find("snap_kv+ada_kv listed twice") != std::string::npos);
  CHECK(run_command(eval + " logits --model /nonexistent --tokens t.npy --out l.npy", out) == 3);
  CHECK(out.find("/nonexistent") != std::string::npos);
  if (have(stories260k)) {  // two llama2.c tokenizers beside a checkpoint: which one belongs to it is unknown
    std::string const two = work_dir("two_tokenizers");
    fs::copy_file(stories260k + "/stories260K.bin", two + "/stories260K.bin");
    fs::copy_file(stories260k + "/tok512.bin", two + "/tok512.bin");
    fs::copy_file(stories260k + "/tok512.bin", two + "/tok4096.bin");
    CHECK(run_command(eval + " run --model " + two + " --out-dir " + two + "/out --samples 1", out) == 3);
    CHECK(out.find("2 llama2.c tokenizers (tok*.bin)") != std::string::npos);
  }
  if (!have(tinystories))
    return;
  std::string const dir = work_dir("cli");
  std::int64_t const bad[3] = {1, 5, 2048};
  Index const shape[1] = {3};
  std::string error;
  REQUIRE(kvc::write_npy(dir + "/bad.npy", kvc::NpyDtype::i64, shape, bad, error));
  CHECK(run_command(eval + " logits --model " + tinystories + " --tokens " + dir + "/bad.npy --out " + dir + "/l.npy",
                    out) == 3);
  CHECK(out.find("token 2 is 2048, outside the vocabulary [0, 2048)") != std::string::npos);
  CHECK_FALSE(fs::exists(dir + "/l.npy"));
  std::int64_t const good[3] = {1, 5, 7};
  REQUIRE(kvc::write_npy(dir + "/good.npy", kvc::NpyDtype::i64, shape, good, error));
  REQUIRE(
      run_command(eval + " logits --model " + tinystories + " --tokens " + dir + "/good.npy --out " + dir + "/l.npy",
                  out) == 0);
  kvc::NpyArray logits;
  REQUIRE(kvc::read_npy(dir + "/l.npy", logits, error));
  CHECK(logits.shape == std::vector<Index>{3, 2048});
  REQUIRE(
      run_command(eval + " dump --model " + tinystories + " --tokens " + dir + "/good.npy --out-dir " + dir + "/dump",
                  out) == 0);
  kvc::NpyArray keys;
  REQUIRE(kvc::read_npy(dir + "/dump/layer1/keys.npy", keys, error));
  CHECK(keys.shape == std::vector<Index>{1, 4, 3, 16});
  CHECK(fs::exists(dir + "/dump/meta.json"));
  // A short run end to end: every output appears.
  REQUIRE(run_command(eval + " run --model " + tinystories + " --out-dir " + dir +
                          "/run --policies snap_kv,snap_kv+ada_kv --ratios 0,0.5 --prompt-tokens 32 --continuation 8 "
                          "--samples 1 --generate 8 --show snap_kv+ada_kv@0.5 --no-progress",
                      out) == 0);
  for (char const* f : {"results.json", "results.csv", "kl.svg", "top1.svg", "generation.txt"})
    CHECK(fs::exists(dir + "/run/" + f));
  CHECK(read_text(dir + "/run/generation.txt").find("snap_kv+ada_kv at ratio 0.50") != std::string::npos);
  kvc::json::Value v;
  REQUIRE(kvc::json::parse(read_text(dir + "/run/results.json"), v, error));
  REQUIRE(v.items().size() == 6);  // snap_kv, snap_kv+ada_kv and random at two ratios
  CHECK(v.items()[2].find("policy")->as_string() == "snap_kv+ada_kv");
  CHECK(v.items()[2].find("params")->as_string().find("alpha_safeguard=0.2") != std::string::npos);
  CHECK(v.items()[0].find("isa")->as_string() == kvc::tools::compiled_isa());  // built with kvc-eval's flags
  // dump's meta.json reads back with the strict reader, as kvc's --dump reads it.
  REQUIRE(kvc::json::parse(read_text(dir + "/dump/meta.json"), v, error));
  CHECK(v.find("layers")->as_double() == 2);
  CHECK(v.find("rope")->find("style")->as_string() == "neox");
}

// ---------------------------------------------------------------------------------------------------------------
// MomentKV rows (eval/moment_kv.hpp): prefill compression with its moments, corrected attention, Algorithm 1.

TEST_CASE("moment_kv rows: ratio 0 is exactly lossless, and the moments' bytes are moment_state_bytes") {
  if (!have(tinystories))
    return;
  Model const model = load(tinystories);
  auto const cache = CacheOptions{CacheType::f16, CacheLayout::dense};
  std::vector<std::vector<std::int32_t>> const samples{sample_tokens(model, cache, 96 + 16 + 1, 1, 31, {1, 2})};
  RunOptions opts = options_for({}, {0.0, 0.5}, cache);
  opts.prompt_tokens = 96;
  opts.policies = {inline_run("moment_kv", "", ""), inline_run("moment_kv", "ada_kv", ""),
                   inline_run("moment_kv", "", "storage=fp16"), inline_run("moment_kv", "", "mi=false,order=zeroth")};
  CHECK(opts.policies[1].label() == "moment_kv+ada_kv");
  CHECK(opts.policies[3].label() == "moment_kv(mi=false,order=zeroth)");
  auto const records = evaluate(model, opts, samples);
  REQUIRE(records.size() == 8);
  // 2 layers x 4 KV heads of (d_v d_k + d_k + d_v) = 288 elements + an 8-byte count.
  std::size_t const fp32 = 2 * kvc::moment_state_bytes<float>(1, 4, 16, 16);
  std::size_t const fp16 = 2 * kvc::moment_state_bytes<kvc::half>(1, 4, 16, 16);
  CHECK(fp32 == 2 * 4 * (288 * 4 + 8));
  CHECK(fp16 == 2 * 4 * (288 * 2 + 8));
  for (Record const& r : records) {
    INFO(r.policy << " at " << r.ratio);
    CHECK(r.moment_bytes == static_cast<double>(r.policy == "moment_kv(storage=fp16)" ? fp16 : fp32));
    if (r.ratio == 0.0) {  // nothing evicted: n = 0 everywhere, the corrected attention is the plain one
      CHECK(r.kl == 0.0);
      CHECK(r.top1 == 1.0);
      CHECK(r.perplexity == r.perplexity_full);
      CHECK(r.kv_bytes == r.kv_bytes_full);
      CHECK(r.layer_error == std::vector<double>{0.0, 0.0});
    } else {
      CHECK(r.kl > 0.0);
      CHECK(r.kv_bytes < r.kv_bytes_full);
    }
  }
  // The session reports the moments of its compressed layers only.
  auto prefilled = make_session(model, cache, 112);
  RowMatrix logits;
  REQUIRE(prefilled->forward(std::span(samples[0]).subspan(0, 96), logits).ok());
  CHECK(prefilled->moment_bytes() == 0);
  auto session = prefilled->clone();
  double seconds = 0;
  REQUIRE(session->compress(*opts.policies[0].policy, opts.policies[0].params, 0.5, seconds).ok());
  CHECK(session->moment_bytes() == fp32);
  CHECK(session->clone()->moment_bytes() == fp32);  // a clone copies the moments
}

TEST_CASE("moment_kv with mi=false and correction=false selects exactly what snap_kv selects") {
  if (!have(tinystories))
    return;
  Model const model = load(tinystories);
  auto const cache = CacheOptions{CacheType::f16, CacheLayout::dense};
  std::vector<std::vector<std::int32_t>> samples;
  for (std::uint64_t s = 0; s < 2; ++s)
    samples.push_back(sample_tokens(model, cache, 128 + 16 + 1, 1, 41 + s, {1, 2}));
  // The same base parameters: SnapKV's window 32 and max pooling of 7, the sink and the window protected.
  std::string const base = "pooling=max,kernel_size=7";
  RunOptions opts = options_for({}, {0.5, 0.75}, cache);
  opts.prompt_tokens = 128;
  opts.policies = {inline_run("snap_kv", "", "", {"n_sink=1", "n_recent=32"}),
                   inline_run("moment_kv", "", "mi=false,correction=false," + base),
                   inline_run("snap_kv", "ada_kv", "", {"n_sink=1"}),
                   inline_run("moment_kv", "ada_kv", "mi=false,correction=false," + base),
                   inline_run("moment_kv", "ada_kv", "mi=false,correction=true," + base)};
  auto const records = evaluate(model, opts, samples);
  REQUIRE(records.size() == 10);
  for (std::size_t pair : {0u, 4u}) {
    for (std::size_t i = pair; i < pair + 2; ++i) {
      Record const& snap = records[i];
      Record const& moment = records[i + 2];
      INFO(snap.policy << " against " << moment.policy << " at " << snap.ratio);
      CHECK(moment.kl == snap.kl);
      CHECK(moment.top1 == snap.top1);
      CHECK(moment.perplexity == snap.perplexity);
      CHECK(moment.layer_error == snap.layer_error);
      CHECK(moment.kv_bytes == snap.kv_bytes);
      CHECK(moment.kv_held_bytes == snap.kv_held_bytes);
      CHECK(moment.kept_min == snap.kept_min);
      CHECK(moment.kept_max == snap.kept_max);
    }
  }
  // The correction on the same kept set changes the numbers (and the selection is the same: same bytes).
  CHECK(records[8].kl != records[6].kl);
  CHECK(records[8].kv_bytes == records[6].kv_bytes);
  // Token by token: every (layer, KV head) keeps the same positions in the same order.
  auto prefilled = make_session(model, cache, 144);
  RowMatrix logits;
  REQUIRE(prefilled->forward(std::span(samples[0]).subspan(0, 128), logits).ok());
  for (std::size_t pair : {0u, 2u}) {
    auto a = prefilled->clone(), b = prefilled->clone();
    double seconds = 0;
    REQUIRE(a->compress(*opts.policies[pair].policy, opts.policies[pair].params, 0.75, seconds, 0,
                        opts.policies[pair].alloc)
                .ok());
    REQUIRE(b->compress(*opts.policies[pair + 1].policy, opts.policies[pair + 1].params, 0.75, seconds, 0,
                        opts.policies[pair + 1].alloc)
                .ok());
    for (Index l = 0; l < 2; ++l)
      for (Index h = 0; h < 4; ++h) {
        REQUIRE(a->length(l, h) == b->length(l, h));
        for (Index t = 0; t < a->length(l, h); ++t)
          CHECK(a->slot_position(l, h, t) == b->slot_position(l, h, t));
      }
  }
}

TEST_CASE("moment_kv: the correction with zero evictions changes nothing, and Algorithm 1 holds each head's budget") {
  if (!have(tinystories))
    return;
  Model const model = load(tinystories);
  auto const cache = CacheOptions{CacheType::f16, CacheLayout::paged};
  Index const prompt = 48, continuation = 24;
  std::vector<std::vector<std::int32_t>> const samples{
      sample_tokens(model, cache, prompt + continuation + 1, 1, 51, {1, 2})};
  // Ratio 0: the corrected and the plain rows give bit-identical logits (n = 0 returns the retained output).
  auto prefilled = make_session(model, cache, prompt + continuation);
  RowMatrix logits, plain, corrected;
  REQUIRE(prefilled->forward(std::span(samples[0]).subspan(0, prompt), logits).ok());
  auto const continuation_tokens = std::span(samples[0]).subspan(static_cast<std::size_t>(prompt), 8);
  for (auto [name, out] : {std::pair{"correction=false", &plain}, std::pair{"correction=true", &corrected}}) {
    PolicyRun const row = inline_run("moment_kv", "", name);
    auto s = prefilled->clone();
    double seconds = 0;
    REQUIRE(s->compress(*row.policy, row.params, 0.0, seconds).ok());
    REQUIRE(s->forward(continuation_tokens, *out).ok());
  }
  CHECK(plain == corrected);

  // Decoding: the prompt compressed to the target, then one eviction per step keeps every head at 40 tokens
  // (512 bytes a token: fp16 K + V, 2 layers x 4 KV heads x d 16); the moments keep their size. (The sink and the
  // window, 33 tokens, are always kept: a target below them keeps them.)
  RunOptions opts = options_for({}, {}, cache);
  opts.prompt_tokens = prompt;
  opts.continuation = continuation;
  opts.schedule = Schedule::decode;
  opts.decode.compression_interval = 8;  // MomentKV runs Algorithm 1: interval 1 whatever the schedule says
  opts.decode.target_size = 40;
  opts.policies = {inline_run("moment_kv", "", ""), inline_run("moment_kv", "ada_kv", ""),
                   inline_run("moment_kv", "", "decode_evict=false")};
  auto const records = evaluate(model, opts, samples);
  REQUIRE(records.size() == 3);
  CHECK(records[0].kv_bytes_steps == std::vector<double>(static_cast<std::size_t>(continuation), 40 * 512.0));
  CHECK(records[0].kept_min == 40);
  CHECK(records[0].kept_max == 40);
  CHECK(records[1].kv_bytes_steps.back() == records[1].kv_bytes_steps.front());  // each head back to its L_h
  CHECK(records[1].kept_min < records[1].kept_max);
  CHECK(records[2].kv_bytes_steps.back() == (40 + continuation) * 512.0);  // prefill only: the cache grows
  for (Record const& r : records) {
    INFO(r.policy);
    CHECK(r.kl > 0.0);
    CHECK(r.moment_bytes == static_cast<double>(2 * kvc::moment_state_bytes<float>(1, 4, 16, 16)));
  }
  opts.decode.target_size = prompt + continuation + 1;  // never evicts: exactly the full cache's numbers
  for (Record const& r : evaluate(model, opts, samples)) {
    INFO(r.policy);
    CHECK(r.kl == 0.0);
    CHECK(r.top1 == 1.0);
    CHECK(r.perplexity == r.perplexity_full);
  }
}

TEST_CASE("moment_kv on real tinystories K, V and Q: the corrected attention error is below the plain one") {
  // The issue's test: per layer, ||f - f_hat|| / ||f|| against ||f - f_R|| / ||f|| for the same kept set, mean over
  // the query rows of the continuation (eval/correction.hpp), at ratios 0.5 and 0.75. The prompts are those of
  // `kvc-eval correction --model tinystories-656k` (seed 0, 4 samples of 256 + 64 tokens). Measured (docs/eval.md,
  // "MomentKV"), moment_kv defaults (mi=true, first order, uniform budget):
  //   ratio 0.50: layer 0 plain 0.4868 corrected 0.2351 (100.0% of rows lower), layer 1 0.2137 -> 0.1604 (99.2%)
  //   ratio 0.75: layer 0 plain 0.7724 corrected 0.3183 (99.9%),                layer 1 0.4259 -> 0.3108 (99.2%)
  // The correction is not a theorem (spec §8.10); on this model it lowers the mean error in every layer, and the
  // row-wise error in at least 99% of rows. The assertions state that, with the figures above as ranges of 1e-3.
  // The figures are a baseline (SSE2) build's. kvc-eval's library is built for the build machine (KVC_NATIVE); with
  // other vector widths and FMA the logits round differently, the sampled prompts move, and so do the errors (an
  // AVX-512 build: 0.4826/0.2291, 0.1948/0.1492, 0.7527/0.3112, 0.4118/0.3061); there the figures are ranges of 3e-2.
  double const tolerance = kvc::tools::compiled_isa() == "baseline" ? 1e-3 : 3e-2;
  if (!have(tinystories))
    return;
  Model const model = load(tinystories);
  std::vector<std::vector<std::int32_t>> samples;
  for (std::uint64_t s = 0; s < 4; ++s) {
    samples.push_back(sample_tokens(model, {}, 256 + 64 + 1, model.config.bos, s, {model.config.bos, 2}));
    samples.back().pop_back();
  }
  PolicyRun const row = inline_run("moment_kv", "", "");
  auto const records = correction_errors(model, row.params, row.alloc, {0.5, 0.75}, samples, 256);
  REQUIRE(records.size() == 2);
  double const expected[2][2][2] = {{{0.4868, 0.2351}, {0.2137, 0.1604}}, {{0.7724, 0.3183}, {0.4259, 0.3108}}};
  for (std::size_t r = 0; r < 2; ++r) {
    REQUIRE(records[r].layers.size() == 2);
    CHECK(records[r].rows == 4 * 8 * 64);
    for (std::size_t l = 0; l < 2; ++l) {
      CorrectionLayer const& x = records[r].layers[l];
      INFO("ratio " << records[r].ratio << " layer " << l << ": plain " << x.plain << ", corrected " << x.corrected
                    << ", corrected lower in " << 100 * x.wins << "% of rows, evicted mass " << x.evicted_mass);
      CHECK(x.corrected < x.plain);
      CHECK(x.wins > 0.99);
      CHECK(std::abs(x.plain - expected[r][l][0]) < tolerance);
      CHECK(std::abs(x.corrected - expected[r][l][1]) < tolerance);
      CHECK(x.kept == (r == 0 ? 128 : 64));
    }
  }
}

TEST_CASE("kvc-eval: moment_kv rows and their errors") {
  std::string const eval = KVC_EVAL;
  std::string out;
  std::string const run = eval + " run --model /nonexistent --out-dir y --no-progress ";
  CHECK(run_command(run + "--policies moment_kv+pyramid_kv", out) == 2);
  CHECK(out.find("moment_kv takes the ada_kv allocator (moment_kv+ada_kv), not pyramid_kv") != std::string::npos);
  CHECK(run_command(run + "--policies 'moment_kv(mi=maybe)'", out) == 3);
  CHECK(out.find("--param mi = 'maybe': expected true or false") != std::string::npos);
  CHECK(run_command(run + "--policies 'moment_kv(residual_refresh=4)'", out) == 2);
  CHECK(out.find("without the u_j cache (residual_refresh=0)") != std::string::npos);
  CHECK(run_command(run + "--policies 'moment_kv(mi=false'", out) == 2);
  CHECK(out.find("unbalanced parentheses") != std::string::npos);
  CHECK(run_command(run + "--policies 'moment_kv(mi=false)x'", out) == 2);
  CHECK(out.find("expected POLICY(NAME=VALUE,...)[+ALLOCATOR]") != std::string::npos);
  CHECK(run_command(run + "--policies 'moment_kv(mi=false)' --param 'moment_kv(mi=false).mi=true'", out) == 2);
  CHECK(out.find("'mi' given twice") != std::string::npos);
  CHECK(run_command(run + "--policies 'moment_kv(foo=1)'", out) == 2);
  CHECK(out.find("'foo' is not a parameter of policy moment_kv") != std::string::npos);
  CHECK(run_command(run + "--policies 'moment_kv(window_size=64)' --prompt-tokens 32", out) == 2);
  CHECK(out.find("is longer than --prompt-tokens 32") != std::string::npos);
  CHECK(run_command(run + "--policies moment_kv,moment_kv", out) == 2);
  CHECK(out.find("moment_kv listed twice") != std::string::npos);
  // A row's parentheses may hold dots: --param finds the row's name first; then the missing model exits 3.
  CHECK(run_command(run + "--policies 'moment_kv(clamp_tau=0.5),moment_kv(mi=false)+ada_kv' "
                          "--param 'moment_kv(clamp_tau=0.5).n_sink=2' --param 'moment_kv(mi=false)+ada_kv.n_sink=2'",
                    out) == 3);
  CHECK(out.find("/nonexistent") != std::string::npos);
  CHECK(run_command(eval + " correction --model /nonexistent --policies snap_kv", out) == 2);
  CHECK(out.find("kvc-eval correction measures moment_kv rows only") != std::string::npos);
  if (!have(tinystories))
    return;
  std::string const dir = work_dir("moment_kv");
  CHECK(run_command(eval + " correction --model " + tinystories +
                        " --policies 'moment_kv(order=zeroth)+ada_kv' --samples 1 --prompt-tokens 64 "
                        "--continuation 8 --out " +
                        dir + "/correction.json",
                    out) == 0);
  CHECK(out.find("moment_kv(order=zeroth)+ada_kv") != std::string::npos);
  kvc::json::Value v;
  std::string error;
  REQUIRE(kvc::json::parse(read_text(dir + "/correction.json"), v, error));
  REQUIRE(v.items().size() == 4);  // 2 ratios x 2 layers
  for (char const* field : {"policy", "ratio", "layer", "kept", "evicted_mass", "plain_error", "corrected_error",
                            "corrected_wins", "rows", "samples", "params"})
    CHECK(v.items()[0].find(field) != nullptr);
  CHECK(run_command(eval + " run --model " + tinystories + " --out-dir " + dir +
                        " --policies 'moment_kv(mi=false,correction=true)+ada_kv' --ratios 0.5 --samples 1 "
                        "--prompt-tokens 64 --continuation 8 --generate 0 --no-progress",
                    out) == 0);
  CHECK(out.find("moments KiB") != std::string::npos);
  CHECK(read_text(dir + "/results.csv").find("\n\"moment_kv(mi=false,correction=true)+ada_kv\",0.5,") !=
        std::string::npos);
}

// ---------------------------------------------------------------------------------------------------------------
// UNComp's calibration (eval/calibrate.hpp, tools/common/uncomp.hpp): `kvc-eval calibrate` and the calibration file.

namespace {

/// Reads a calibration file, returning the exit code and message of its refusal (0 and empty when it reads).
std::pair<int, std::string> read_refusal(std::string const& path) {
  try {
    kvc::tools::read_calibration(path);
  } catch (kvc::tools::Failure const& f) {
    return {f.code, f.message};
  }
  return {0, {}};
}

/// Each group label g of one layer's heads ranks below every label g' < g: entropies (erank) non-increasing.
void check_ranked(std::vector<double> const& erank, std::vector<Index> const& group, std::size_t first, Index heads) {
  for (Index a = 0; a < heads; ++a)
    for (Index b = 0; b < heads; ++b) {
      std::size_t const i = first + static_cast<std::size_t>(a), j = first + static_cast<std::size_t>(b);
      if (group[i] < group[j])
        CHECK(erank[i] >= erank[j]);
    }
}

}  // namespace

TEST_CASE("kvc-eval calibrate: a deterministic calibration file that reads back equal, with valid groups") {
  if (!have(tinystories))
    return;
  std::string const eval = KVC_EVAL, dir = work_dir("calibrate");
  std::string out;
  std::string const base = eval + " calibrate --model " + tinystories + " --samples 2 --tokens 96";
  REQUIRE(run_command(base + " --out " + dir + "/a.json", out) == 0);
  CHECK(out.find("2 windows x 96 tokens of the built-in calibration text") != std::string::npos);
  REQUIRE(run_command(base + " --out " + dir + "/b.json", out) == 0);
  std::string const a = read_text(dir + "/a.json");
  CHECK(a == read_text(dir + "/b.json"));  // byte-identical
  kvc::tools::Calibration const c = kvc::tools::read_calibration(dir + "/a.json");
  CHECK(kvc::eval::calibration_json(c) == a);  // reads back exactly
  CHECK(c.model == tinystories);
  CHECK(c.layers == 2);
  CHECK(c.heads == 8);
  CHECK(c.kv_heads == 4);
  CHECK(c.head_dim == 16);
  CHECK(c.top_k == 4);  // auto: d / 4
  CHECK(c.normalize_rows);
  CHECK(c.samples == 2);
  CHECK(c.tokens == 96);
  CHECK(c.text == "built-in");
  CHECK(c.groups == 8);
  CHECK(c.rule == kvc::tools::GroupRule::mean);
  // The same calibration in-process (the runner's fp32 prefill is deterministic), and the file's sums.
  Model const model = load(tinystories);
  kvc::eval::CalibrationOptions opts;
  opts.samples = 2;
  opts.tokens = 96;
  auto const tokenizer_path = tinystories + "/tokenizer.json";
  kvc::eval::Tokenizer tok;
  std::string error;
  REQUIRE(kvc::eval::Tokenizer::load_json(tokenizer_path, tok, error));
  auto const text = tok.encode(kvc::eval::builtin_calibration_text);
  auto const windows = kvc::eval::calibration_windows(text, opts, model.config.bos, "built-in");
  REQUIRE(windows.size() == 2);
  CHECK(windows[1].front() == model.config.bos);
  CHECK(std::vector<std::int32_t>(windows[1].begin() + 1, windows[1].end()) ==
        std::vector<std::int32_t>(text.begin() + 95, text.begin() + 190));  // consecutive windows of 95 text tokens
  CHECK(kvc::eval::calibrate(model, windows, opts, tinystories, "built-in") == c);
  for (Index l = 0; l < c.layers; ++l) {
    auto const q0 = static_cast<std::size_t>(l * c.heads), g0 = static_cast<std::size_t>(l * c.kv_heads);
    double score = 0;
    for (Index h = 0; h < c.heads; ++h) {
      double const e = c.erank[q0 + static_cast<std::size_t>(h)];
      CHECK(e >= 1.0);
      CHECK(e <= 16.0);
      CHECK(c.normalized[q0 + static_cast<std::size_t>(h)] <= 1.0);
      score += e;
    }
    CHECK(c.layer_score[static_cast<std::size_t>(l)] == Approx(score / 8.0).epsilon(1e-12));
    for (Index g = 0; g < c.kv_heads; ++g)  // a KV head: the mean erank of its two query heads
      CHECK(c.kv_erank[g0 + static_cast<std::size_t>(g)] ==
            Approx((c.erank[q0 + static_cast<std::size_t>(2 * g)] + c.erank[q0 + static_cast<std::size_t>(2 * g + 1)]) /
                   2.0)
                .epsilon(1e-12));
    // M = 8 groups of 8 query heads: a permutation, ranked by the mean erank; 4 KV heads take groups 0, 1, 6 and 7
    // (the balanced split's outermost groups).
    std::vector<Index> labels(c.query_group.begin() + static_cast<std::ptrdiff_t>(q0),
                              c.query_group.begin() + static_cast<std::ptrdiff_t>(q0) + 8);
    std::sort(labels.begin(), labels.end());
    CHECK(labels == std::vector<Index>{0, 1, 2, 3, 4, 5, 6, 7});
    check_ranked(c.erank, c.query_group, q0, c.heads);
    std::vector<Index> kv(c.kv_group.begin() + static_cast<std::ptrdiff_t>(g0),
                          c.kv_group.begin() + static_cast<std::ptrdiff_t>(g0) + 4);
    std::sort(kv.begin(), kv.end());
    CHECK(kv == std::vector<Index>{0, 1, 6, 7});
    check_ranked(c.kv_erank, c.kv_group, g0, c.kv_heads);
  }

  // The majority vote: balanced groups (M = 2: four heads each, two KV heads each); with one window it is the mean's.
  REQUIRE(run_command(base + " --groups 2 --rule majority_vote --out " + dir + "/v.json", out) == 0);
  kvc::tools::Calibration const v = kvc::tools::read_calibration(dir + "/v.json");
  CHECK(v.rule == kvc::tools::GroupRule::majority_vote);
  CHECK(v.erank == c.erank);  // the grouping rule changes the labels only
  CHECK(std::count(v.query_group.begin(), v.query_group.end(), 0) == 8);
  CHECK(std::count(v.kv_group.begin(), v.kv_group.end(), 0) == 4);
  std::string const one = eval + " calibrate --model " + tinystories + " --samples 1 --tokens 64 --groups 4";
  REQUIRE(run_command(one + " --out " + dir + "/m1.json", out) == 0);
  REQUIRE(run_command(one + " --rule majority_vote --out " + dir + "/v1.json", out) == 0);
  auto const m1 = kvc::tools::read_calibration(dir + "/m1.json"), v1 = kvc::tools::read_calibration(dir + "/v1.json");
  CHECK(m1.query_group == v1.query_group);
  CHECK(m1.kv_group == v1.kv_group);

  // --text: any text file; the entropy's parameters.
  write_bytes(dir + "/text.txt", std::string(kvc::eval::builtin_calibration_text.substr(2000)));
  REQUIRE(
      run_command(base + " --text " + dir + "/text.txt --param top_k=4 --param ridge=1e-10 --out " + dir + "/t.json",
                  out) == 0);
  kvc::tools::Calibration const t = kvc::tools::read_calibration(dir + "/t.json");
  CHECK(t.text == dir + "/text.txt");
  CHECK(t.top_k == 4);
  CHECK(t.ridge == 1e-10);
  CHECK(t.erank != c.erank);
  // A llama2.c checkpoint (interleaved RoPE, its own tokenizer).
  if (have(stories260k)) {
    REQUIRE(run_command(eval + " calibrate --model " + stories260k + " --samples 2 --tokens 64 --groups 3 --out " +
                            dir + "/s.json",
                        out) == 0);
    auto const s = kvc::tools::read_calibration(dir + "/s.json");
    CHECK(s.layers == 5);
    CHECK(s.head_dim == 8);
  }
}

TEST_CASE("kvc-eval calibrate: bad options and texts exit 2 or 3 with the reason, writing nothing") {
  std::string const eval = KVC_EVAL, dir = work_dir("calibrate_errors");
  std::string out;
  std::string const target = dir + "/c.json";
  auto expect = [&](int code, std::string const& args, std::string const& needle) {
    int const rc = run_command(eval + " calibrate" + args, out);
    INFO(args << "\n" << out);
    CHECK(rc == code);
    CHECK(out.find(needle) != std::string::npos);
    CHECK_FALSE(fs::exists(target));
  };
  expect(2, " --out " + target, "--model is required");
  expect(2, " --model x", "--out is required");
  expect(2, " --model x --out " + target + " --rule vote", "--rule 'vote': expected mean or majority_vote");
  expect(2, " --model x --out " + target + " --param k=32", "'k' is not a parameter of kvc-eval calibrate");
  expect(2, " --model x --out " + target + " --param top_k=3 --param top_k=4", "'top_k' given twice");
  expect(2, " --model x --out " + target + " --bogus 1", "unknown option '--bogus'");
  expect(3, " --model x --out " + target + " --param top_k=0", "--param top_k = 0: expected an integer >= 1");
  expect(3, " --model x --out " + target + " --param normalize_rows=no", "--param normalize_rows = 'no'");
  expect(3, " --model x --out " + target + " --samples 0", "--samples = 0: expected an integer >= 1");
  expect(3, " --model x --out " + target + " --tokens 1", "--tokens = 1: expected an integer >= 2");
  expect(3, " --model x --out " + target + " --groups 0", "--groups = 0: expected an integer >= 1");
  expect(3, " --model /nonexistent --out " + target, "/nonexistent");
  if (!have(tinystories))
    return;
  std::string const m = " --model " + tinystories + " --out " + target;
  write_bytes(dir + "/empty.txt", "");
  expect(3, m + " --text " + dir + "/empty.txt", "--text " + dir + "/empty.txt: the file is empty");
  expect(3, m + " --text " + dir, "--text " + dir + ": ");
  expect(3, m + " --text " + dir + "/absent.txt", "absent.txt");
  write_bytes(dir + "/short.txt", "Once upon a time there was a cat.");
  expect(3, m + " --text " + dir + "/short.txt", "tokens, but 4 windows of 255 text tokens need 1020");
  expect(3, m + " --samples 100", "the built-in calibration text: ");
  expect(3, m + " --tokens 600", "--tokens 600: more than the model's 512 positions");
  fs::create_directories(dir + "/outdir");
  CHECK(run_command(eval + " calibrate" + " --model " + tinystories + " --out " + dir + "/outdir", out) == 3);
  CHECK(out.find("exists and is not a regular file") != std::string::npos);
}

TEST_CASE("the calibration file: damaged or hand-edited files are refused naming the field") {
  std::string const dir = work_dir("calibration_file");
  // A small valid calibration: 2 layers, 4 query heads, 2 KV heads, 2 groups.
  kvc::tools::Calibration c;
  c.model = "m";
  c.layers = 2;
  c.heads = 4;
  c.kv_heads = 2;
  c.head_dim = 8;
  c.samples = 3;
  c.tokens = 64;
  c.text = "built-in";
  c.groups = 2;
  c.normalized = {0.5, 0.6, 0.7, 0.8, 0.4, 0.3, 0.2, 0.1};
  c.truncated = c.normalized;
  c.erank = {2, 3, 4, 5, 4, 3, 2, 1.5};
  c.query_group = {1, 1, 0, 0, 0, 0, 1, 1};
  c.kv_erank = {2.5, 4.5, 3.5, 1.75};
  c.kv_group = {1, 0, 0, 1};
  c.layer_score = {3.5, 2.625};
  kvc::eval::write_calibration(c, dir + "/good.json");
  CHECK(kvc::tools::read_calibration(dir + "/good.json") == c);
  std::string const good = read_text(dir + "/good.json");
  CHECK(good == kvc::eval::calibration_json(c));
  auto edited = [&](std::string const& from, std::string const& to) {
    std::string text = good;
    auto const at = text.find(from);
    REQUIRE(at != std::string::npos);
    text.replace(at, from.size(), to);
    write_bytes(dir + "/bad.json", text);
    return read_refusal(dir + "/bad.json");
  };
  auto refused = [&](std::pair<int, std::string> const& r, std::string const& needle) {
    INFO(r.second);
    CHECK(r.first == 3);
    CHECK(r.second.find("calibration file " + dir + "/bad.json: ") == 0);
    CHECK(r.second.find(needle) != std::string::npos);
  };
  write_bytes(dir + "/bad.json", good.substr(0, good.size() / 2));
  refused(read_refusal(dir + "/bad.json"), "not JSON");
  write_bytes(dir + "/bad.json", "[1, 2]");
  refused(read_refusal(dir + "/bad.json"), "expected a JSON object");
  refused(edited("\"kvc.uncomp.calibration\"", "\"other\""), "field 'format' is not \"kvc.uncomp.calibration\"");
  refused(edited("\"version\": 1", "\"version\": 2"), "field 'version' is not an integer in [1, 1]");
  refused(edited("\"layers\": 2", "\"layers\": 3"), "field 'layer_score' has 2 elements, expected 3");
  refused(edited("\"layers\": 2", "\"layers\": 100000"), "field 'layers' is not an integer in [1, 4096]");
  refused(edited("\"layers\": 2", "\"layers\": 2.0"), "field 'layers' is not an integer");
  refused(edited("\"kv_heads\": 2", "\"kv_heads\": 3"), "field 'kv_heads' (3) does not divide query_heads (4)");
  refused(edited("\"query_heads\": 4", "\"query_heads\": 8"),
          "field 'per_layer[0].normalized' has 4 elements, "
          "expected 8");
  refused(edited("\"model\": \"m\",\n", ""), "field 'model' is missing");
  refused(edited("\"model\": \"m\"", "\"model\": 7"), "field 'model' is not a string");
  refused(edited("\"model\": \"m\"", "\"model\": \"m\", \"extra\": 1"), "unknown field 'extra'");
  refused(edited("\"rule\": \"mean\"", "\"rule\": \"median\""), "field 'rule' is not \"mean\" or \"majority_vote\"");
  refused(edited("\"normalize_rows\": true", "\"normalize_rows\": 1"), "field 'normalize_rows' is not true or false");
  refused(edited("\"ridge\": 0", "\"ridge\": -1"), "field 'ridge' is not a finite number in [0, 0.5]");
  refused(edited("\"erank\": [2.0,", "\"erank\": [0.5,"), "field 'per_layer[0].erank[0]' is not a finite number");
  refused(edited("\"erank\": [2.0,", "\"erank\": [\"2\","), "field 'per_layer[0].erank[0]'");
  refused(edited("\"normalized\": [0.5,", "\"normalized\": [1e999,"), "field 'per_layer[0].normalized[0]'");
  refused(edited("\"groups\": [1,1,0,0]", "\"groups\": [1,1,0,2]"),
          "field 'per_layer[0].groups[3]' is not a group label in [0, 2)");
  refused(edited("\"groups\": [1,1,0,0]", "\"groups\": [1,1,1,0]"),
          "field 'per_layer[0].groups' puts 1 heads in group 0, expected the balanced split of 4 heads into 2 groups");
  refused(edited("\"kv_groups\": [1,0]", "\"kv_groups\": [1,0,0]"),
          "field 'per_layer[0].kv_groups' has 3 elements, expected 2");
  refused(edited("{\"layer\": 1,", "{\"layer\": 0,"), "field 'per_layer[1].layer' is not an integer in [1, 1]");
  refused(edited("\"kv_erank\": [2.5,4.5]", "\"kv_erank\": [2.5,4.5], \"note\": 1"),
          "unknown field 'per_layer[0].note'");
  CHECK(read_refusal(dir + "/absent.json").second.find("absent.json") != std::string::npos);
  CHECK(read_refusal(dir).first == 3);  // a directory
  // A calibration of another model.
  try {
    kvc::tools::check_calibration_fits(c, "x.json", 2, 8, 2, 8, "the model");
    FAIL("a calibration of 4 query heads fits a model of 8");
  } catch (kvc::tools::Failure const& f) {
    CHECK(f.message ==
          "calibration file x.json: field 'query_heads' is 4, but the model has 8 (a calibration of "
          "another model?)");
  }
}

// ---------------------------------------------------------------------------------------------------------------
// uncomp rows: per-head budgets from the calibration's groups, on a ragged store (engine_impl.hpp compress_uncomp).

namespace {

/// The calibration of tinystories on the built-in text (2 windows of 96 tokens, M = 8, rule mean).
std::shared_ptr<kvc::tools::Calibration const> tiny_calibration(Model const& model) {
  kvc::eval::Tokenizer tok;
  std::string error;
  REQUIRE(kvc::eval::Tokenizer::load_json(tinystories + "/tokenizer.json", tok, error));
  kvc::eval::CalibrationOptions opts;
  opts.samples = 2;
  opts.tokens = 96;
  opts.entropy.top_k = 16;  // the full spectrum (auto would be d / 4 = 4): the layer scores then fall by 2 from layer 0
  auto const windows =
      kvc::eval::calibration_windows(tok.encode(kvc::eval::builtin_calibration_text), opts, model.config.bos, "text");
  return std::make_shared<kvc::tools::Calibration const>(
      kvc::eval::calibrate(model, windows, opts, tinystories, "built-in"));
}

}  // namespace

TEST_CASE("uncomp rows: each head keeps its calibrated budget, the window kept, memory from the ragged store") {
  if (!have(tinystories))
    return;
  Model const model = load(tinystories);
  auto const cal = tiny_calibration(model);
  Index const prompt = 48, continuation = 16;
  std::vector<std::vector<std::int32_t>> samples;
  for (std::uint64_t s = 0; s < 2; ++s)
    samples.push_back(sample_tokens(model, {}, prompt + continuation + 1, 1, 40 + s, {1, 2}));

  // One session: at ratio 0.5 (B = 24) every (layer, KV head) holds uncomp_budgets' count, the last 8 positions
  // included, in a ragged store.
  auto const& info = kvc::tools::find_policy("uncomp");
  kvc::tools::Params const params = kvc::tools::resolve_params(info, {}, true);
  auto session = make_session(model, {}, prompt + continuation);
  session->set_calibration(cal);
  RowMatrix logits;
  REQUIRE(session->forward(std::span(samples[0]).subspan(0, prompt), logits).ok());
  double seconds = 0;
  REQUIRE(session->compress(info, params, 0.5, seconds).ok());
  kvc::tools::UNCompConfig const cfg = kvc::tools::uncomp_config(params);
  for (Index l = 0; l < 2; ++l) {
    CHECK(session->ragged(l));
    auto const budgets = kvc::tools::uncomp_budgets(cfg, *cal, "cal", l, 24.0);
    Index total = 0;
    for (Index h = 0; h < 4; ++h) {
      CHECK(session->length(l, h) == budgets[static_cast<std::size_t>(h)]);
      total += budgets[static_cast<std::size_t>(h)];
      Index const n = session->length(l, h);
      for (Index t = 0; t < 8; ++t)
        CHECK(session->slot_position(l, h, n - 8 + t) == prompt - 8 + t);
      // Group 0 (the highest entropy) keeps the most.
      if (cal->kv_group[static_cast<std::size_t>(l * 4 + h)] == 0)
        CHECK(n == *std::max_element(budgets.begin(), budgets.end()));
    }
    CHECK(total == 96);  // the layer's total is 4 x B (nothing clamped at B = 24)
  }
  // A session without a calibration is refused.
  auto bare = make_session(model, {}, prompt);
  REQUIRE(bare->forward(std::span(samples[0]).subspan(0, prompt), logits).ok());
  CHECK_FALSE(bare->compress(info, params, 0.5, seconds).ok());

  // Rows at the same average budget as snap_kv: the same K + V bytes; gqa=expand holds Hq / Hkv = 2 times as much.
  RunOptions opts = options_for({"snap_kv"}, {0.5}, {});
  opts.policies[0].params = kvc::tools::resolve_params(*opts.policies[0].policy, {"window_size=8"}, true);
  opts.policies.push_back(inline_run("uncomp", "", ""));
  opts.policies.push_back(inline_run("uncomp", "", "gqa=expand"));
  opts.prompt_tokens = prompt;
  opts.continuation = continuation;
  opts.calibration = cal;
  auto const records = evaluate(model, opts, samples);
  REQUIRE(records.size() == 3);
  CHECK(records[1].policy == "uncomp");
  CHECK(records[2].policy == "uncomp(gqa=expand)");
  CHECK(records[1].kv_bytes == records[0].kv_bytes);
  CHECK(records[2].kv_bytes == 2 * records[1].kv_bytes);
  CHECK(records[1].kept_min == 8);  // group 7 at the window
  CHECK(records[1].kept_max == 40);
  for (Record const& r : records) {
    INFO(r.policy);
    CHECK(r.kl > 0.0);
    CHECK(std::isfinite(r.kl));
  }
  // Without a calibration the run is refused (exit 3).
  opts.calibration.reset();
  CHECK_THROWS_AS(evaluate(model, opts, samples), kvc::tools::Failure);
}

TEST_CASE("uncomp rows while decoding: one eviction per step keeps every head at its budget") {
  if (!have(tinystories))
    return;
  Model const model = load(tinystories);
  auto const cal = tiny_calibration(model);
  Index const prompt = 40, steps = 12;
  auto const tokens = sample_tokens(model, {}, prompt + steps, 1, 7, {1, 2});
  auto const& info = kvc::tools::find_policy("uncomp");
  for (char const* gqa : {"gqa=kv_heads", "gqa=expand"}) {
    INFO(gqa);
    kvc::tools::Params const params = kvc::tools::resolve_params(info, {gqa}, true);
    kvc::tools::UNCompConfig const cfg = kvc::tools::uncomp_config(params);
    Index const heads = cfg.gqa == kvc::tools::UNCompGqa::expand ? 8 : 4;
    auto session = make_session(model, {CacheType::f32, CacheLayout::paged}, prompt + steps);
    session->set_calibration(cal);
    RowMatrix logits;
    REQUIRE(session->forward(std::span(tokens).subspan(0, prompt), logits).ok());
    kvc::DecodeSchedule schedule;
    schedule.compression_interval = 8;  // ignored: UNComp evicts every step
    schedule.target_size = 16;
    REQUIRE(session->begin_decode(info, params, schedule).ok());
    for (Index t = 0; t < steps; ++t) {
      REQUIRE(session->forward(std::span(tokens).subspan(static_cast<std::size_t>(prompt + t), 1), logits).ok());
      for (Index l = 0; l < 2; ++l) {
        auto const budgets = kvc::tools::uncomp_budgets(cfg, *cal, "cal", l, 16.0);
        REQUIRE(static_cast<Index>(budgets.size()) == heads);
        for (Index h = 0; h < heads; ++h) {
          Index const n = session->length(l, h);
          CHECK(n == budgets[static_cast<std::size_t>(h)]);
          CHECK(session->slot_position(l, h, n - 1) == prompt + t);  // the newest token is kept
          for (Index i = 1; i < n; ++i)                              // positional order (spec §7.18)
            CHECK(session->slot_position(l, h, i - 1) < session->slot_position(l, h, i));
        }
      }
    }
  }
}

TEST_CASE("kvc-eval run: uncomp rows, their calibration, and what they refuse") {
  std::string const eval = KVC_EVAL;
  std::string out;
  std::string const base = eval + " run --model x --out-dir y --no-progress --policies ";
  CHECK(run_command(base + "uncomp+ada_kv", out) == 2);
  CHECK(out.find("uncomp allocates its own per-head budgets (no +allocator)") != std::string::npos);
  CHECK(run_command(base + "'uncomp(schedule=paper)'", out) == 2);
  CHECK(out.find("uncomp rows use schedule=preserving") != std::string::npos);
  CHECK(run_command(base + "'uncomp(gqa=both)'", out) == 3);
  CHECK(out.find("--param gqa = 'both': expected kv_heads or expand") != std::string::npos);
  CHECK(run_command(base + "uncomp_entropy", out) == 2);
  CHECK(out.find("policy uncomp_entropy writes per-head values") != std::string::npos);
  if (!have(tinystories))
    return;
  std::string const dir = work_dir("uncomp_run");
  std::string const m = eval + " run --model " + tinystories + " --out-dir " + dir +
                        "/run --prompt-tokens 48 --continuation 8 --samples 1 --generate 0 --no-progress";
  CHECK(run_command(m + " --policies snap_kv --calibration " + dir + "/c.json", out) == 2);
  CHECK(out.find("--calibration given, but --policies has no uncomp row") != std::string::npos);
  if (have(stories260k)) {  // a calibration of another model
    REQUIRE(
        run_command(eval + " calibrate --model " + stories260k + " --samples 1 --tokens 64 --out " + dir + "/s.json",
                    out) == 0);
    CHECK(run_command(m + " --policies uncomp --calibration " + dir + "/s.json", out) == 3);
    CHECK(out.find("field 'layers' is 5, but the model has 2") != std::string::npos);
  }
  if (have(stories260k)) {  // `all` on a checkpoint without its tokenizer: no built-in calibration, no uncomp row
    fs::create_directories(dir + "/bare");
    fs::copy_file(stories260k + "/stories260K.bin", dir + "/bare/stories260K.bin",
                  fs::copy_options::overwrite_existing);
    REQUIRE(run_command(eval + " run --model " + dir + "/bare/stories260K.bin --out-dir " + dir +
                            "/bare_run --prompt-tokens 32 --continuation 4 --samples 1 --ratios 0.5 --no-progress",
                        out) == 0);
    CHECK(out.find("the uncomp row is left out of `all`: the model has no tokenizer") != std::string::npos);
    CHECK(run_command(eval + " run --model " + dir + "/bare/stories260K.bin --out-dir " + dir +
                          "/bare_run --prompt-tokens 32 --continuation 4 --samples 1 --policies uncomp --no-progress",
                      out) == 3);
    CHECK(out.find("uncomp rows: the model has no tokenizer to encode the built-in calibration text") !=
          std::string::npos);
  }
  REQUIRE(run_command(eval + " calibrate --model " + tinystories + " --samples 1 --tokens 64 --out " + dir + "/t.json",
                      out) == 0);
  CHECK(run_command(m + " --policies 'uncomp(rule=majority_vote)' --calibration " + dir + "/t.json", out) == 2);
  CHECK(out.find("the calibration (" + dir + "/t.json) groups by mean") != std::string::npos);
  CHECK(run_command(m + " --policies 'uncomp(stages=true,stage_count=3)' --ratios 0.5", out) == 3);
  CHECK(out.find("uncomp stages (--param stage_count / stage_epsilon over the calibration's 2 layer scores)") !=
        std::string::npos);
  // The built-in calibration (the evaluation's prompts are sampled from the model), and a file.
  REQUIRE(run_command(m + " --policies uncomp,'uncomp(gqa=expand)' --ratios 0.5", out) == 0);
  CHECK(out.find("uncomp: head groups from the built-in calibration text (4 windows x 256 tokens, 8 groups, mean)") !=
        std::string::npos);
  REQUIRE(run_command(m + " --policies uncomp --ratios 0.5 --calibration " + dir + "/t.json", out) == 0);
  CHECK(out.find("uncomp: head groups from " + dir + "/t.json") != std::string::npos);
  kvc::json::Value v;
  std::string error;
  REQUIRE(kvc::json::parse(read_text(dir + "/run/results.json"), v, error));
  REQUIRE(v.items().size() == 2);  // uncomp and random
  CHECK(v.items()[0].find("policy")->as_string() == "uncomp");
}

TEST_CASE("uncomp's stage variant: hidden states pruned at stage boundaries keep their positions") {
  if (!have(tinystories))
    return;
  Model const model = load(tinystories);
  Index const prompt = 48;
  auto const tokens = sample_tokens(model, {}, prompt + 4, 1, 11, {1, 2});
  std::span<std::int32_t const> const head(tokens.data(), static_cast<std::size_t>(prompt));
  // Two stages (layer 1 starts the second): layer 1 sees 20 rows, the last 8 among them.
  HiddenStatePlan plan;
  plan.stage_of_layer = {0, 1};
  plan.stages = 2;
  plan.min_tokens = 20;
  auto session = make_session(model, {CacheType::f32, CacheLayout::dense}, prompt + 4);
  session->set_hidden_state_plan(plan);
  RowMatrix logits;
  REQUIRE(session->forward(head, logits).ok());
  CHECK(logits.rows() == 20);
  REQUIRE(session->hidden_state_plan());
  CHECK(session->hidden_state_plan()->kept == std::vector<Index>{48, 20});
  CHECK(session->position() == prompt);
  for (Index h = 0; h < 4; ++h) {
    CHECK(session->length(0, h) == prompt);
    REQUIRE(session->length(1, h) == 20);
    for (Index i = 1; i < 20; ++i)
      CHECK(session->slot_position(1, h, i - 1) < session->slot_position(1, h, i));
    for (Index t = 0; t < 8; ++t)
      CHECK(session->slot_position(1, h, 12 + t) == prompt - 8 + t);
  }
  // The next tokens run at their own positions, the plan spent.
  REQUIRE(session->forward(std::span(tokens).subspan(static_cast<std::size_t>(prompt), 4), logits).ok());
  CHECK(logits.rows() == 4);
  CHECK(session->length(1, 0) == 24);
  CHECK(session->slot_position(1, 0, 23) == prompt + 3);
  // One stage prunes nothing: the logits equal an unplanned prefill's, bit for bit.
  HiddenStatePlan one;
  one.stage_of_layer = {0, 0};
  auto a = make_session(model, {CacheType::f32, CacheLayout::dense}, prompt);
  auto b = make_session(model, {CacheType::f32, CacheLayout::dense}, prompt);
  a->set_hidden_state_plan(one);
  RowMatrix la, lb;
  REQUIRE(a->forward(head, la).ok());
  REQUIRE(b->forward(head, lb).ok());
  CHECK(la == lb);
  // The stage plan from a calibration's layer scores (tinystories: the mean erank falls from layer 0 to layer 1).
  auto const cal = tiny_calibration(model);
  REQUIRE(cal->layer_score[0] - cal->layer_score[1] > 1.0);
  auto const& info = kvc::tools::find_policy("uncomp");
  auto config = [&](std::vector<std::string> const& given) {
    return kvc::tools::uncomp_config(kvc::tools::resolve_params(info, given, true));
  };
  CHECK(uncomp_stage_plan(config({"stages=true"}), *cal).stage_of_layer == std::vector<Index>{0, 1});
  CHECK(uncomp_stage_plan(config({"stages=true", "stage_epsilon=100"}), *cal).stages == 1);
  CHECK(uncomp_stage_plan(config({"stages=true", "stage_epsilon=100", "stage_count=2"}), *cal).stages == 2);
  CHECK_THROWS_AS(uncomp_stage_plan(config({"stages=true", "stage_count=3"}), *cal), kvc::tools::Failure);
  // Rows: the stage variant holds less at the same ratio (layer 1 keeps at most its 3/8 of the prompt's rows).
  std::vector<std::vector<std::int32_t>> samples = {sample_tokens(model, {}, prompt + 9, 1, 12, {1, 2})};
  RunOptions opts;
  opts.policies = {inline_run("uncomp", "", ""), inline_run("uncomp", "", "stages=true")};
  opts.ratios = {0.5};
  opts.prompt_tokens = prompt;
  opts.continuation = 8;
  opts.calibration = cal;
  auto const records = evaluate(model, opts, samples);
  REQUIRE(records.size() == 2);
  CHECK(records[1].policy == "uncomp(stages=true)");
  CHECK(records[1].kv_bytes < records[0].kv_bytes);
  CHECK(std::isfinite(records[1].kl));
}

// ---------------------------------------------------------------------------------------------------------------
// RDKV and KIVI rows: the packed compressor's store (kvc::pack_into) attended by kvc::attend_packed, merged with
// the fp16 tail.

TEST_CASE("rdkv rows: ratio 0 is lossless through the packed path, and the payload fits the eviction rows' memory") {
  if (!have(tinystories))
    return;
  Model const model = load(tinystories);
  for (CacheLayout layout : {CacheLayout::dense, CacheLayout::paged}) {
    auto const cache = CacheOptions{CacheType::f16, layout};
    std::vector<std::vector<std::int32_t>> samples;
    for (std::uint64_t s = 0; s < 2; ++s)
      samples.push_back(sample_tokens(model, cache, 65, 1, 40 + s, {1, 2}));
    RunOptions opts = options_for({"snap_kv", "rdkv"}, {0.0, 0.5, 0.75}, cache);
    opts.policies.push_back(inline_run("rdkv", "", "reference=authors"));
    auto const records = evaluate(model, opts, samples);
    REQUIRE(records.size() == 9);
    INFO((layout == CacheLayout::dense ? "dense" : "paged"));
    // Ratio 0: a budget of every token, so every token and channel at 16 bits, K stored lossless (S3): the
    // packed attention merged with the (continuation's) tail is the full cache's attention up to fp32 rounding.
    Record const& lossless = record_of(records, "rdkv", 0.0);
    CHECK(lossless.kl < 1e-6);
    CHECK(lossless.top1 == 1.0);
    CHECK(lossless.payload_bytes == lossless.kv_bytes_full);  // 48 tokens of fp16 K and V per head
    CHECK(lossless.kept_min == 48);
    CHECK(lossless.kept_max == 48);
    // reference=authors clamps K at 16 bits to 8: not lossless, but close.
    Record const& authors = record_of(records, "rdkv(reference=authors)", 0.0);
    CHECK(authors.kl > 0.0);
    CHECK(authors.kl < 0.05);
    CHECK(authors.payload_bytes < authors.kv_bytes_full);
    for (double ratio : {0.5, 0.75}) {
      INFO("ratio " << ratio);
      Record const& rd = record_of(records, "rdkv", ratio);
      Record const& snap = record_of(records, "snap_kv", ratio);
      // The exact solver never exceeds floor(n (1 - ratio)) fp16 tokens' worth of bits: what snap_kv keeps.
      CHECK(rd.payload_bytes <= snap.kv_bytes);
      CHECK(rd.payload_bytes > 0.9 * snap.kv_bytes);
      CHECK(rd.kv_bytes == std::ceil(rd.kv_bytes));  // whole bytes per layer
      CHECK(rd.kv_bytes >= rd.payload_bytes + rd.overhead_bytes - 2);
      CHECK(rd.kl > 0.0);
    }
  }
}

TEST_CASE("kivi rows: the memory is the hand formula, measured from the packed store and the fp16 tail") {
  if (!have(tinystories))
    return;
  Model const model = load(tinystories);
  ModelConfig const& c = model.config;
  auto const cache = CacheOptions{CacheType::f16, CacheLayout::dense};
  std::vector<std::vector<std::int32_t>> const samples{sample_tokens(model, cache, 65, 1, 7, {1, 2})};
  RunOptions opts = options_for({}, {0.25, 0.5, 0.75}, cache);
  opts.policies.push_back(inline_run("kivi", "", "bits=2,residual=16"));
  opts.policies.push_back(inline_run("kivi", "", "bits=4,residual=16"));
  auto const records = evaluate(model, opts, samples);
  REQUIRE(records.size() == 2);  // once each: their memory does not follow the ratio
  Index const d = c.head_dim, m = 48 - 16, heads = c.kv_heads;
  auto const layers = static_cast<double>(c.layers);
  for (Record const& r : records) {
    int const bits = r.policy == "kivi(bits=2,residual=16)" ? 2 : 4;
    INFO(r.policy);
    // Per head: m = 32 tokens of K and V at `bits`; a (scale, offset) pair of fp16 per V token (d <= 32: one
    // group), per K channel and group of 32 tokens (one), and a 16-bit permutation entry per channel; the 16
    // newest tokens in fp16 in the tail. Per layer the packed bits are rounded up to bytes.
    double const payload = static_cast<double>(heads * 2 * m * d * bits);
    double const overhead = static_cast<double>(heads * (m * 32 + d * 32 + d * 16));
    double const tail = static_cast<double>(heads * 16 * 2 * d * 2);
    CHECK(r.payload_bytes == layers * (payload / 8 + tail));
    CHECK(r.overhead_bytes == layers * overhead / 8);
    CHECK(r.kv_bytes == layers * (std::ceil((payload + overhead) / 8) + tail));
    CHECK(r.kv_bytes_full == static_cast<double>(c.layers * heads * 48 * 2 * d * 2));
    CHECK(r.ratio == Approx(1.0 - r.kv_bytes / r.kv_bytes_full));
    CHECK(r.kl > 0.0);
    CHECK(r.kept_min == 48);
  }
  CHECK(records[0].kl > records[1].kl);  // 2 bits lose more than 4
}

TEST_CASE("a packed cache decodes: one token per call equals the teacher-forced continuation") {
  if (!have(tinystories))
    return;
  Model const model = load(tinystories);
  for (CacheLayout layout : {CacheLayout::dense, CacheLayout::paged}) {
    auto const cache = CacheOptions{CacheType::f16, layout};
    auto const tokens = sample_tokens(model, cache, 64, 1, 9, {1, 2});
    std::span<std::int32_t const> const all(tokens);
    auto prefilled = make_session(model, cache, 64);
    RowMatrix logits;
    REQUIRE(prefilled->forward(all.subspan(0, 48), logits).ok());
    for (PolicyRun const& row : {inline_run("rdkv", "", ""), inline_run("kivi", "", "residual=16")}) {
      INFO(row.label());
      auto a = prefilled->clone();
      double seconds = 0;
      REQUIRE(a->compress(*row.policy, row.params, 0.5, seconds).ok());
      auto b = a->clone();  // shares the packed store
      RowMatrix teacher, stepped;
      ForwardTrace trace;
      REQUIRE(a->forward(all.subspan(48, 16), teacher).ok());
      REQUIRE(forward_each(*b, all.subspan(48, 16), stepped, trace).ok());
      REQUIRE(teacher.rows() == 16);
      CHECK((teacher - stepped).cwiseAbs().maxCoeff() < 1e-3f);
      // The tail holds what came after packing, at positions continuing from the prompt (KIVI: after its residual
      // window, which sits first).
      bool const kivi = row.label() != "rdkv";
      for (Index l = 0; l < model.config.layers; ++l)
        for (Index h = 0; h < model.config.kv_heads; ++h) {
          REQUIRE(b->length(l, h) == (kivi ? 32 : 16));
          CHECK(b->slot_position(l, h, 0) == (kivi ? 32 : 48));
          CHECK(b->slot_position(l, h, b->length(l, h) - 1) == 63);
        }
    }
  }
  // The decode schedule: one allocation after the prompt (rdkv at the target), then every token in fp16.
  auto const cache = CacheOptions{CacheType::f16, CacheLayout::dense};
  std::vector<std::vector<std::int32_t>> const samples{sample_tokens(model, cache, 65, 1, 11, {1, 2})};
  RunOptions opts = options_for({"rdkv"}, {}, cache);
  opts.schedule = Schedule::decode;
  opts.decode.compression_interval = 8;
  opts.decode.target_size = 24;
  opts.decode.hidden_states_buffer_size = 8;
  auto const records = evaluate(model, opts, samples);
  REQUIRE(records.size() == 1);
  auto const& steps = records[0].kv_bytes_steps;
  REQUIRE(steps.size() == 16);
  double const token = static_cast<double>(model.config.layers * model.config.kv_heads * 2 * model.config.head_dim * 2);
  for (std::size_t t = 1; t < steps.size(); ++t)
    CHECK(steps[t] - steps[t - 1] == token);  // each decoded token lands in the fp16 tail
  // The payload, a mean over the steps: at most the budget of 24 tokens plus the tail's mean of 8.5 tokens.
  CHECK(records[0].payload_bytes <= (24 + 8.5) * token);
  CHECK(records[0].kl > 0.0);
}

TEST_CASE("kvc-eval run: rdkv and kivi rows, and what they refuse") {
  if (!have(tinystories))
    return;
  std::string const dir = work_dir("rdkv_run");
  std::string out;
  std::string const base = std::string(KVC_EVAL) + " run --model " + tinystories + " --out-dir " + dir +
                           " --prompt-tokens 48 --continuation 8 --samples 1 --generate 0 --no-progress";
  REQUIRE(run_command(base + " --policies 'snap_kv,rdkv,rdkv(reference=authors),kivi(bits=2),kivi(bits=4)' --ratios "
                             "0.5,0.75",
                      out) == 0);
  INFO(out);
  std::string const json = read_text(dir + "/results.json");
  for (char const* row : {"\"rdkv\"", "\"rdkv(reference=authors)\"", "\"kivi(bits=2)\"", "\"kivi(bits=4)\""})
    CHECK(json.find(std::string("\"policy\": ") + row) != std::string::npos);
  CHECK(read_text(dir + "/kl.svg").find("kivi(bits=4)") != std::string::npos);  // one plot with the eviction rows
  CHECK(run_command(base + " --policies rdkv+ada_kv", out) == 2);
  CHECK(out.find("allocate their own bits") != std::string::npos);
  CHECK(run_command(base + " --policies 'rdkv(k_budget_ratio=2)'", out) == 3);
  CHECK(out.find("k_budget_ratio") != std::string::npos);
  CHECK(run_command(base + " --policies 'rdkv(window_size=64)'", out) == 2);
}
