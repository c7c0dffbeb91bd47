// SPDX-License-Identifier: Apache-2.0
// tools/kvc/score.cpp: `kvc score`: one policy's token scores (MomentKV's and UNComp's before any eviction, RDKV's
// token and channel weights) or uncomp_entropy's per-head entropies.

#include <kvc/backend/cpu/scorers/uncomp.hpp>

#include "common/moment_kv.hpp"
#include "common/rdkv.hpp"
#include "common/uncomp.hpp"
#include "internal.hpp"

namespace kvc::cli {

namespace {

/// Calls fn(obs) with MomentKV's window queries (its base score reads the last window_size rows), after the checks
/// kvc's other window policies get (with_observations).
template <class C, class Fn>
void with_moment_observations(kvc::SnapKVScorer const& base, C const& cache, Queries const& q,
                              std::string const& keys_path, Fn&& fn, char const* policy = "moment_kv") {
  check_rows_used(base.window_size, policy, cache.keys.extents().tokens, q, keys_path);
  kvc::WindowQueries<float> const wq{
      kvc::TokenRows<float const, kvc::StridedLayout>(q.rows.data(), kvc::bhtd_layout(q.ext)), q.rope,
      q.positions.empty() ? nullptr : q.positions.data()};
  fn(kvc::observe(wq));
}

/// The largest head dim uncomp_entropy accepts: its solver holds d x d fp64 matrices and solves them in O(d^3).
constexpr kvc::Index max_entropy_head_dim = 1024;

/// `kvc score --policy uncomp_entropy`: UNComp's truncated matrix entropy (kvc::MatrixEntropySolver) of each
/// (sequence, query head)'s rows of --queries, rotated to their positions first when pre-RoPE (default positions
/// 0 .. w - 1: a shift of every position is a rotation of the features, which leaves the entropy unchanged), written
/// as [B, Hq] float64 or float32 in the unit asked. It reads no keys.
int cmd_score_entropy(Options const& o) {
  Job job(find_policy(o.get("--policy")));
  for (char const* opt : {"--keys", "--values"})
    if (o.has(opt))
      fail(exit_usage, std::string(opt) + " given, but policy " + job.policy.name +
                           " reads only --queries (it writes each query head's entropy, [B, Hq])");
  if (!o.has("--queries") || !o.has("--out"))
    fail(exit_usage, std::string("score --policy ") + job.policy.name + " needs --queries and --out");
  check_job(o, false, job);
  kvc::tools::EntropyConfig const cfg = kvc::tools::entropy_config(job.params);  // exit 3 before any file is read
  check_outputs(option_inputs(o), {o.get("--out")}, "--out");
  kvc::Index const threads = thread_count(o);
  Queries& q = job.queries;
  load_queries(o.get("--queries"), o.get("--positions"), nullptr, std::string(), job.rotate, job.rope, q);
  if (q.ext.dim > max_entropy_head_dim)
    fail(exit_invalid, "queries file " + q.path + ": field 'shape': head_dim (shape[3]) is " +
                           std::to_string(q.ext.dim) + ", expected at most " + std::to_string(max_entropy_head_dim) +
                           " (the entropy solves a head_dim x head_dim eigenproblem)");
  kvc::Index const heads = q.ext.batch * q.ext.heads, w = q.ext.tokens, d = q.ext.dim;
  std::vector<double> values = buffer<double>(static_cast<std::size_t>(heads), "the entropies of " + q.path);
  kvc::MatrixEntropySolver solver(d, cfg.options);
  auto once = [&] {
    for (kvc::Index bh = 0; bh < heads; ++bh) {
      kvc::Index const b = bh / q.ext.heads;
      kvc::MatrixEntropy e;
      check_status(solver.compute(q.rows.data() + bh * w * d, w, d, e, q.rope,
                                  q.positions.empty() ? nullptr : q.positions.data() + b * w),
                   "queries file " + q.path + ": sequence " + std::to_string(b) + ", query head " +
                       std::to_string(bh % q.ext.heads));
      values[static_cast<std::size_t>(bh)] = cfg.value(e);
    }
  };
  once();
  if (o.time)
    print_time("score", job.policy, "", std::nullopt,
               {median_seconds(timing_repeats, once), -1, 0, threads, q.file_bytes, std::nullopt});
  std::vector<float> narrow;
  if (!cfg.float64) {
    narrow = buffer<float>(values.size(), "the entropies of " + q.path);
    std::transform(values.begin(), values.end(), narrow.begin(), [](double x) { return static_cast<float>(x); });
  }
  write_outputs({{o.get("--out"),
                  cfg.float64 ? kvc::NpyDtype::f64 : kvc::NpyDtype::f32,
                  {q.ext.batch, q.ext.heads},
                  cfg.float64 ? static_cast<void const*>(values.data()) : static_cast<void const*>(narrow.data())}});
  return 0;
}

// ---------------------------------------------------------------------------------------------------------------
// RDKV (tools/common/rdkv.hpp): token and channel weights (its bit plan and packed store: compress_packed.cpp).

/// Whether RDKV's token weights of `cfg` read the values: weight=derived (var(v_t)), or a weight policy that does.
bool rdkv_reads_values(kvc::tools::RDKVConfig const& cfg) {
  if (!cfg.weight_policy.empty())
    return find_policy(cfg.weight_policy).reads_values;
  return cfg.press.scorer.weight == kvc::RDKVTokenWeight::derived;
}

/// RDKV's token weights of a loaded job into `tokens` [B, Hkv, N] and, when `channels` is not null, ThinK's channel
/// weights into `channels` [B, Hkv, d], over `cache` (the job's typed view). The window queries are checked as for
/// the window policies. weight=NAME: that policy's scores (its default parameters), each head's shifted to >= 0
/// (kvc::scores_as_weights). Returns the largest workspace used.
template <class C>
std::size_t rdkv_weights(Job const& job, kvc::tools::RDKVConfig const& cfg, kvc::Cpu const& cpu, C const& cache,
                         float* tokens, float* channels) {
  kvc::KVExtents const e = cache.keys.extents();
  std::size_t used = 0;
  kvc::SnapKVScorer window;  // only its window_size: the checks of the rows the weights read
  window.window_size = cfg.press.scorer.window_size;
  with_moment_observations(
      window, cache, job.queries, job.keys.path,
      [&](auto const& obs) {
        if (cfg.weight_policy.empty()) {
          Scratch const ws = workspace(kvc::score_workspace_bytes(cpu, cfg.press.scorer, e, obs), job);
          kvc::ScoreSpan<> span{tokens, e.batch, e.heads, e.tokens, cache.lengths};
          check_status(kvc::score(cpu, cfg.press.scorer, cache, obs, span, ws.span()), job.context());
          used = std::max(used, ws.size);
        }
        if (channels) {
          Scratch const ws = workspace(kvc::channel_score_workspace_bytes(cpu, cfg.press.channels, cache, obs), job);
          check_status(kvc::score_channels(cpu, cfg.press.channels, cache, obs, channels, ws.span()), job.context());
          used = std::max(used, ws.size);
        }
      },
      "rdkv");
  if (cfg.weight_policy.empty())
    return used;
  PolicyInfo const& inner = find_policy(cfg.weight_policy);
  with_policy(inner, resolve_params(inner, {}, false), [&](auto const& scorer, Selection) {
    auto score_with = [&](auto const& live, auto const& obs) {
      Scratch const ws = workspace(kvc::score_workspace_bytes(cpu, live, e, obs), job);
      kvc::ScoreSpan<> span{tokens, e.batch, e.heads, e.tokens, cache.lengths};
      check_status(kvc::score(cpu, live, cache, obs, span, ws.span()),
                   job.context() + " (rdkv weight=" + cfg.weight_policy + ")");
      used = std::max(used, ws.size);
    };
    using S = std::remove_cvref_t<decltype(scorer)>;
    if constexpr (kvc::has_need(S::needs, kvc::Needs::window_queries) ||
                  kvc::has_need(S::needs, kvc::Needs::query_statistics) || kvc::StatefulScorer<S>)
      with_observations(scorer, cache, job.queries, job.keys.path, job.rope, score_with);
    else
      score_with(scorer, kvc::NoObservations{});
  });
  for (kvc::Index bh = 0; bh < e.batch * e.heads; ++bh)
    kvc::scores_as_weights(tokens + bh * e.tokens, cache.lengths.at(bh / e.heads, bh % e.heads, e.tokens));
  return used;
}

/// `kvc score --policy rdkv`: the token weights (--out) and, with --channel-out, the channel weights.
int cmd_score_rdkv(Options const& o, Job& job) {
  kvc::tools::RDKVConfig const cfg = kvc::tools::rdkv_config(job.policy, job.params);  // exit 3 before reading
  if (rdkv_reads_values(cfg) && !o.has("--values"))
    fail(exit_usage, "policy rdkv with --param weight=" + job.params.at("weight") +
                         " reads the values (derived: var(v_t); a policy that weights by ||v||): pass --values V.npy");
  std::vector<std::string> outs = {o.get("--out")};
  if (o.has("--channel-out"))
    outs.push_back(o.get("--channel-out"));
  check_outputs(option_inputs(o), outs, o.has("--channel-out") ? "output file" : "--out");
  load_job(option_files(o), job);
  kvc::KVExtents const e = extents_of(job.keys);
  kvc::Index const threads = thread_count(o);
  kvc::ThreadPool pool(threads);
  kvc::Cpu const cpu = threads > 1 ? pool.cpu() : kvc::Cpu{};
  std::vector<float> tokens = buffer<float>(static_cast<std::size_t>(e.rows()), "the weights of " + job.context());
  std::vector<float> channels;
  if (o.has("--channel-out"))
    channels = buffer<float>(static_cast<std::size_t>(e.batch * e.heads * e.dim), "the weights of " + job.context());
  with_cache(job.keys, job.values ? &*job.values : nullptr, KeyRange::logits, [&](auto const& cache) {
    std::size_t ws = 0;
    auto once = [&] {
      ws = rdkv_weights(job, cfg, cpu, cache, tokens.data(), channels.empty() ? nullptr : channels.data());
    };
    once();
    if (o.time)
      print_time("score", job.policy, "", std::nullopt,
                 {median_seconds(timing_repeats, once), -1, ws, threads, job.bytes_read(), std::nullopt});
  });
  std::vector<Output> files = {{o.get("--out"), kvc::NpyDtype::f32, {e.batch, e.heads, e.tokens}, tokens.data()}};
  if (o.has("--channel-out"))
    files.push_back({o.get("--channel-out"), kvc::NpyDtype::f32, {e.batch, e.heads, e.dim}, channels.data()});
  write_outputs(files);
  return 0;
}

}  // namespace

int cmd_score(Options const& o) {
  if (o.has("--policy") && !find_policy(o.get("--policy")).token_scores)
    return cmd_score_entropy(o);
  if (!o.has("--policy") || !o.has("--keys") || !o.has("--out"))
    fail(exit_usage, "score needs --policy, --keys and --out");
  Job job(find_policy(o.get("--policy")));
  if (std::string_view(job.policy.name) == "kivi")
    fail(exit_usage,
         "policy kivi quantizes every token alike: it has no scores (`kvc compress --policy kivi` "
         "writes its bit plan)");
  if (o.has("--channel-out") && std::string_view(job.policy.name) != "rdkv")
    fail(exit_usage, "--channel-out goes with --policy rdkv (ThinK's channel weights)");
  check_job(o, false, job);
  if (std::string_view(job.policy.name) == "rdkv")
    return cmd_score_rdkv(o, job);
  bool const moment_kv = is_moment_kv(job.policy);
  if (moment_kv && job.params.at("mi") != "false" && !o.has("--values"))
    fail(exit_usage,
         "policy moment_kv weights scores by the norms of the values' residuals: pass --values V.npy "
         "(or --param mi=false for the base score alone)");
  if (!moment_kv && job.policy.reads_values && !o.has("--values") && job.params.at("use_vnorm") != "false")
    fail(exit_usage, std::string("policy ") + job.policy.name +
                         " weights scores by the value norms: pass --values V.npy (or --param use_vnorm=false)");
  std::optional<MomentKVConfig> const moment_config =
      moment_kv ? std::optional(moment_kv_config(job.params)) : std::nullopt;  // bad values exit 3 before reading
  std::optional<kvc::tools::UNCompConfig> const uncomp =
      is_uncomp(job.policy) ? std::optional(kvc::tools::uncomp_config(job.params)) : std::nullopt;
  check_outputs(option_inputs(o), {o.get("--out")}, "--out");
  load_job(option_files(o), job);
  kvc::KVExtents e = extents_of(job.keys);  // (uncomp with gqa=expand scores Hq heads)
  kvc::Index const threads = thread_count(o);
  kvc::ThreadPool pool(threads);
  kvc::Cpu const cpu = threads > 1 ? pool.cpu() : kvc::Cpu{};
  std::vector<float> scores = buffer<float>(static_cast<std::size_t>(e.rows()), "the scores of " + job.context());
  auto score_with = [&](auto const& scorer, auto const& cache, auto const& obs) {
    Scratch const ws = workspace(kvc::score_workspace_bytes(cpu, scorer, e, obs), job);
    kvc::ScoreSpan<> out{scores.data(), e.batch, e.heads, e.tokens};
    auto once = [&] { check_status(kvc::score(cpu, scorer, cache, obs, out, ws.span()), job.context()); };
    once();
    if (o.time)
      print_time("score", job.policy, "", std::nullopt,
                 {median_seconds(timing_repeats, once), -1, ws.size, threads, job.bytes_read(), std::nullopt});
  };
  if (moment_kv) {
    // MomentKV's score before any eviction (spec §4): empty moments, so r_j = v_j and the score is the base
    // score times ||v_j|| (mi=false: the base score alone). The moments' storage does not change it.
    MomentKVConfig const& cfg = *moment_config;
    with_cache(job.keys, job.values ? &*job.values : nullptr, KeyRange::logits, [&](auto const& cache) {
      with_moment_observations(cfg.scorer.base, cache, job.queries, job.keys.path, [&](auto const& obs) {
        if (!cfg.scorer.mi) {
          score_with(cfg.scorer.base, cache, obs);
          return;
        }
        kvc::Index const dv = job.values->array.shape[3];
        check_moment_memory<float>(e, dv, job.context());
        HostMoments<float> const m(e.batch, e.heads, e.dim, dv);
        kvc::MomentKVScorer<> scorer = cfg.scorer;
        scorer.state = m.view;
        score_with(scorer, cache, obs);
      });
    });
    write_outputs({{o.get("--out"), kvc::NpyDtype::f32, {e.batch, e.heads, e.tokens}, scores.data()}});
    return 0;
  }
  if (uncomp) {
    // UNComp's score before any eviction: kvc::update with the queries' last window_size rows, then kvc::score (the
    // pooled window attention of each prefix slot, summed over its query group; window slots above every prefix
    // score). gqa=expand scores each query head's copy of its KV head: [B, Hq, N].
    if (uncomp->gqa == kvc::tools::UNCompGqa::expand && job.queries.ext.heads != e.heads) {
      expand_heads(job.keys, job.queries.ext.heads);
      scores = buffer<float>(static_cast<std::size_t>(extents_of(job.keys).rows()), "the scores of " + job.context());
    }
    kvc::KVExtents const x = extents_of(job.keys);
    kvc::Index const w = uncomp->scorer.window_size;
    std::vector<float> rows = buffer<float>(kvc::bytes_product(x.rows(), w), "UNComp's state");
    std::vector<kvc::Index> tracked = buffer<kvc::Index>(static_cast<std::size_t>(x.batch * x.heads), "UNComp's state");
    kvc::UNCompScorer<> scorer = uncomp->scorer;
    scorer.state = {{rows.data(), kvc::uncomp_window_layout(x, w)}, tracked.data()};
    kvc::SnapKVScorer window;
    window.window_size = w;
    with_cache(job.keys, nullptr, KeyRange::logits, [&](auto const& cache) {
      with_moment_observations(
          window, cache, job.queries, job.keys.path,
          [&](auto const& obs) {
            Scratch const ws = workspace(kvc::update_workspace_bytes(cpu, scorer, x, obs), job);
            check_status(kvc::update(cpu, scorer, cache, obs, ws.span()), job.context());
            kvc::Index const heads_e = e.heads;
            e.heads = x.heads;  // the scores' shape (gqa=expand: per query head)
            score_with(scorer, cache, kvc::NoObservations{});
            e.heads = heads_e;
          },
          "uncomp");
    });
    write_outputs({{o.get("--out"), kvc::NpyDtype::f32, {x.batch, x.heads, x.tokens}, scores.data()}});
    return 0;
  }
  job.run([&](auto const& scorer, Selection, auto const& cache, auto const& obs) { score_with(scorer, cache, obs); });
  write_outputs({{o.get("--out"), kvc::NpyDtype::f32, {e.batch, e.heads, e.tokens}, scores.data()}});
  return 0;
}

}  // namespace kvc::cli
