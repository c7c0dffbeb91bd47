// SPDX-License-Identifier: Apache-2.0
// tools/kvc/job.cpp: what score and compress share about a job: the options --threads, --k-scale and --v-scale, the
// option checks, reading the job's keys, values and queries, the workspaces, and the policies with paths of their
// own (moment_kv, uncomp).

#include "internal.hpp"

#include <cmath>
#include <cstdlib>
#include <new>

namespace kvc::cli {

namespace {

/// Usage checks of --queries, --positions and --rope against the policy (before any file is read). With --dump the
/// queries come from the dump folder (those options are refused there before this runs).
void check_query_options(PolicyInfo const& policy, Options const& o, Params const& p) {
  if (!policy.reads_queries) {
    for (char const* opt : {"--queries", "--positions", "--rope"})
      if (o.has(opt))
        fail(exit_usage, std::string(opt) + " given, but policy " + policy.name +
                             " does not read queries (the policies that do: " + policy_names(true) + ")");
    return;
  }
  if (!o.has("--queries") && !o.has("--dump"))
    fail(exit_usage, std::string("policy ") + policy.name +
                         " reads queries: pass --queries Q.npy (the context's last w queries, [B, Hq, w, d])");
  if (o.has("--rope") && p.at("queries") == "post_rope")
    fail(exit_usage, "--rope given, but --param queries=post_rope: post-RoPE queries are used as given");
}

}  // namespace

kvc::Index thread_count(Options const& o) {
  kvc::Index const n = o.has("--threads") ? parse_count(o.get("--threads"), "--threads", 1) : 1;
  if (n > 1024)
    fail(exit_invalid, "--threads " + o.get("--threads") + ": expected at most 1024");
  return n;
}

std::optional<float> scale_option(Options const& o, char const* name) {
  if (!o.has(name))
    return std::nullopt;
  std::string const& text = o.get(name);
  char* end = nullptr;
  float const s = std::strtof(text.c_str(), &end);
  if (text.empty() || *end != '\0' || !std::isfinite(s) || !(s > 0.0f))
    fail(exit_invalid, std::string(name) + " '" + text + "': expected a finite number > 0 (the fp8 tensor's scale)");
  return s;
}

void set_scale(Input& in, std::optional<float> scale, char const* name, char const* role) {
  if (!scale)
    return;
  if (!in.fp8())
    fail(exit_invalid, std::string(name) + " given, but " + role + " file " + in.path + " holds " +
                           in.array.dtype_text + ": a scale applies to F8_E4M3 and F8_E5M2 tensors only");
  in.scale = *scale;
}

void check_status(kvc::Status st, std::string const& context) {
  if (!st.ok())
    fail(exit_invalid, context + ": " + st.message());
}

JobFiles option_files(Options const& o) {
  return {o.get("--keys"), o.get("--values"), o.get("--queries"), o.get("--positions")};
}

void check_job(Options const& o, bool compress, Job& job) {
  job.params = resolve_params(job.policy, o.params, compress);
  check_query_options(job.policy, o, job.params);
  job.k_scale = scale_option(o, "--k-scale");
  job.v_scale = scale_option(o, "--v-scale");
  if (o.has("--rope"))
    job.rope = parse_rope(o.get("--rope"));
  job.rotate = job.policy.reads_queries && pre_rope(job.params);
  if (builds_scorer(job.policy))  // its parameters, checked before any file is read (the composites': their configs)
    with_policy(job.policy, job.params, [](auto const&, Selection) {});
}

void load_job(JobFiles const& files, Job& job) {
  job.keys = load_tensor(files.keys, "keys", kv_dims, /*fp8=*/true);
  set_scale(job.keys, job.k_scale, "--k-scale", "keys");
  if (!files.values.empty()) {
    job.values = load_tensor(files.values, "values", kv_dims, /*fp8=*/true);
    set_scale(*job.values, job.v_scale, "--v-scale", "values");
  } else if (job.v_scale) {
    fail(exit_invalid, "--v-scale given without --values");
  }
  kvc::KVExtents const keys_ext = extents_of(job.keys);
  if (job.policy.reads_queries)
    load_queries(files.queries, files.positions, &keys_ext, job.keys.path, job.rotate, job.rope, job.queries);
}

Scratch workspace(std::size_t bytes, std::string const& what) {
  std::size_t const available = memory_bytes();
  if (bytes > available)
    fail(exit_invalid,
         what + " needs " +
             (bytes == SIZE_MAX ? std::string("more than 2^64 bytes") : bytes_text(static_cast<double>(bytes))) +
             ", more than the memory available (" + bytes_text(static_cast<double>(available)) + ")");
  Scratch s{std::unique_ptr<std::byte[]>(new (std::nothrow) std::byte[bytes == 0 ? 1 : bytes]), bytes};
  if (!s.data)
    fail(exit_invalid, "out of memory: " + what + " needs " + bytes_text(static_cast<double>(bytes)));
  return s;
}

Scratch workspace(std::size_t bytes, Job const& job) {
  return workspace(bytes, "the workspace of policy " + std::string(job.policy.name) + " over " + job.context());
}

bool is_moment_kv(PolicyInfo const& policy) {
  return std::string_view(policy.name) == "moment_kv";
}

bool is_uncomp(PolicyInfo const& policy) {
  return std::string_view(policy.name) == "uncomp";
}

void expand_heads(Input& in, kvc::Index hq) {
  auto const& s = in.array.shape;
  kvc::Index const b = s[0], hkv = s[1], per_head = s[2] * s[3] * in.array.itemsize(), g = hq / hkv;
  std::vector<std::byte> out =
      buffer<std::byte>(static_cast<std::size_t>(b * hq * per_head), "the per-query-head copy of " + in.path);
  for (kvc::Index i = 0; i < b; ++i)
    for (kvc::Index q = 0; q < hq; ++q)
      std::copy_n(in.array.data.data() + (i * hkv + q / g) * per_head, per_head, out.data() + (i * hq + q) * per_head);
  in.array.data = std::move(out);
  in.array.shape[1] = hq;
}

}  // namespace kvc::cli
