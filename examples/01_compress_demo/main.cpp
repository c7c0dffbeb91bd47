// SPDX-License-Identifier: Apache-2.0
// examples/01_compress_demo/main.cpp: the main demo. Compresses a KV cache with every implemented policy (and a
// random-eviction baseline) at a few ratios and prints, per (policy, ratio): tokens kept, memory saved, the relative
// L2 error of attention outputs against the full cache (lower is better), and the time to score + select.
//
//   kvc_demo                     # the documented synthetic cache (tools/common/synthetic.hpp, docs/demo.md)
//   kvc_demo --dump DIR          # real data: DIR/keys.npy values.npy [B, Hkv, N, d], queries.npy [B, H, Nq, d]
//                                # (post-RoPE), or DIR/layer*/ with those files (`kvc-eval dump` writes it)
//   kvc_demo --tokens 8192 --ratios 0.5,0.9
#include <kvc/backend/cpu/attention/attend.hpp>
#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/scorers/key_diff.hpp>
#include <kvc/backend/cpu/scorers/knorm.hpp>
#include <kvc/backend/cpu/scorers/random.hpp>
#include <kvc/backend/cpu/scorers/snap_kv.hpp>
#include <kvc/backend/cpu/scorers/streaming_llm.hpp>
#include <kvc/backend/cpu/scorers/tova.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/core/validate.hpp>
#include <kvc/pipeline/press.hpp>

#include "common/attention_error.hpp"
#include "common/synthetic.hpp"
#include "io/npy.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

namespace {

using kvc::Index;

/// One cache to compress: keys/values [B, Hkv, N, d] and the queries that will attend it.
struct Workload {
  std::string name;
  kvc::tools::HostCache<float> cache;
  std::vector<float> queries;  // [B, H, Nq, d]
  kvc::KVExtents query_ext;
  bool causal = false;  // queries from the prompt itself (its last positions) attend causally
};

[[noreturn]] void die(std::string const& message) {
  std::fprintf(stderr, "kvc_demo: error: %s\n", message.c_str());
  std::exit(3);
}

kvc::NpyArray load(std::string const& path) {
  kvc::NpyArray a;
  std::string error;
  if (!kvc::read_npy(path, a, error))
    die(path + ": " + error);
  if (a.dtype != kvc::NpyDtype::f32 || a.shape.size() != 4)
    die(path + ": expected a 4-D float32 array");
  return a;
}

Workload load_dump(std::string const& dir, std::string const& name) {
  auto const k = load(dir + "/keys.npy"), v = load(dir + "/values.npy"), q = load(dir + "/queries.npy");
  kvc::KVExtents const e{k.shape[0], k.shape[1], k.shape[2], k.shape[3]};
  if (v.shape != k.shape)
    die(dir + "/values.npy: shape must equal keys.npy's");
  if (q.shape[0] != e.batch || q.shape[3] != e.dim || q.shape[1] % e.heads != 0)
    die(dir + "/queries.npy: expected [batch, query_heads (a multiple of kv_heads), n, head_dim]");
  Workload w{name, kvc::tools::HostCache<float>(e), {}, {}};
  std::copy_n(k.as<float>(), w.cache.k.size(), w.cache.k.begin());
  std::copy_n(v.as<float>(), w.cache.v.size(), w.cache.v.begin());
  if (auto const st = kvc::validate(w.cache.view(), {.check_finite = true}); !st.ok())
    die(dir + ": " + st.message());
  // Keep the last (up to) 16 queries; when they are prompt positions, attend causally.
  Index const nq = std::min<Index>(16, q.shape[2]);
  w.query_ext = {e.batch, q.shape[1], nq, e.dim};
  for (Index b = 0; b < e.batch; ++b)
    for (Index h = 0; h < q.shape[1]; ++h) {
      float const* src = q.as<float>() + ((b * q.shape[1] + h) * q.shape[2] + q.shape[2] - nq) * e.dim;
      w.queries.insert(w.queries.end(), src, src + nq * e.dim);
    }
  w.causal = q.shape[2] == e.tokens;
  return w;
}

template <class Scorer>
void run_policy(Workload const& w, char const* name, Scorer scorer, std::vector<double> const& ratios) {
  kvc::KVExtents const e = w.cache.ext;
  kvc::TokenRows<float const, kvc::StridedLayout> const rows(w.queries.data(), kvc::bhtd_layout(w.query_ext));
  kvc::AttendQueries<float> const queries{rows};                   // positions: the context's last (kvc::context_end)
  auto const obs = kvc::observe(kvc::WindowQueries<float>{rows});  // post-RoPE: no table
  double const full_bytes = 2.0 * static_cast<double>(e.rows() * e.dim) * sizeof(kvc::half);  // fp16 K + V
  for (double ratio : ratios) {
    kvc::Press const press{scorer, kvc::TopKSelector{kvc::RatioBudget{ratio}}};
    std::vector<std::byte> ws(kvc::compress_workspace_bytes(kvc::Cpu{}, press, e, obs));
    std::vector<Index> index(static_cast<std::size_t>(e.rows())), count(static_cast<std::size_t>(e.batch * e.heads));
    kvc::KeepPlan<> const plan{index.data(), count.data(), e.batch, e.heads, e.tokens};
    std::vector<double> times;
    for (int rep = 0; rep < 5; ++rep) {
      auto const t0 = std::chrono::steady_clock::now();
      if (auto const st = kvc::compress(kvc::Cpu{}, press, w.cache.view(), obs, plan, {ws.data(), ws.size()}); !st.ok())
        die(st.message());
      times.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    }
    std::sort(times.begin(), times.end());
    auto compressed = w.cache;  // compact a copy (positions and per-head lengths move too); the full cache stays
    compressed.track(e.tokens);
    if (auto const st = kvc::compact(kvc::Cpu{}, plan, compressed.view()); !st.ok())
      die(st.message());
    double error = 0;
    if (auto const st =
            kvc::tools::attention_error(queries, w.cache.view(), compressed.view(), error, {.causal = w.causal});
        !st.ok())
      die(st.message());
    Index kept = 0;
    for (Index c : count)
      kept += c;
    double const kept_bytes = 2.0 * static_cast<double>(kept * e.dim) * sizeof(kvc::half);
    std::printf("%-14s %5.2f %10.1f %9.1f%% %12.2f %26.4f %9.3f\n", name, ratio,
                static_cast<double>(kept) / static_cast<double>(e.batch * e.heads),
                100.0 * (1 - kept_bytes / full_bytes), (full_bytes - kept_bytes) / 1024.0, error,
                1e3 * times[times.size() / 2]);
  }
}

void report(Workload const& w, std::vector<double> const& ratios) {
  kvc::KVExtents const e = w.cache.ext;
  std::printf("\n%s: batch %lld, kv_heads %lld, query_heads %lld, tokens %lld, head_dim %lld, %lld queries%s\n",
              w.name.c_str(), static_cast<long long>(e.batch), static_cast<long long>(e.heads),
              static_cast<long long>(w.query_ext.heads), static_cast<long long>(e.tokens),
              static_cast<long long>(e.dim), static_cast<long long>(w.query_ext.tokens),
              w.causal ? " (causal, last prompt positions)" : "");
  std::printf("%-14s %5s %10s %10s %12s %26s %9s\n", "policy", "ratio", "kept/head", "saved", "saved KiB",
              "attn err (lower is better)", "time ms");
  Index const window = std::min<Index>(32, w.query_ext.tokens);
  run_policy(w, "random", kvc::RandomScorer{7}, ratios);
  run_policy(w, "streaming_llm", kvc::StreamingLLMScorer{4}, ratios);
  run_policy(w, "knorm", kvc::KnormScorer{}, ratios);
  run_policy(w, "key_diff", kvc::KeyDiffScorer{}, ratios);
  run_policy(w, "snap_kv", kvc::SnapKVScorer{.window_size = window}, ratios);
  run_policy(w, "tova", kvc::TOVAScorer{}, ratios);
  std::printf("(snap_kv and tova observe the same queries the error is measured on: their rows are optimistic)\n");
}

}  // namespace

int main(int argc, char** argv) {
  std::string dump;
  Index tokens = 4096;
  std::vector<double> ratios = {0.25, 0.5, 0.75, 0.9};
  for (int i = 1; i < argc; ++i) {
    std::string const a = argv[i];
    if (a == "--dump" && i + 1 < argc) {
      dump = argv[++i];
    } else if (a == "--tokens" && i + 1 < argc) {
      tokens = std::atoll(argv[++i]);
      if (tokens < 8)
        die("--tokens must be >= 8");
    } else if (a == "--ratios" && i + 1 < argc) {
      ratios.clear();
      for (char* p = argv[++i]; *p;) {
        char* end = nullptr;
        double const r = std::strtod(p, &end);
        if (end == p || !(r >= 0 && r <= 1))
          die("--ratios: expected comma-separated numbers in [0, 1]");
        ratios.push_back(r);
        p = *end == ',' ? end + 1 : end;
      }
    } else {
      std::fprintf(stderr, "usage: kvc_demo [--dump DIR] [--tokens N] [--ratios r1,r2,...]\n");
      return 2;
    }
  }
  std::printf(
      "kvc demo: ratio = fraction of tokens removed per head (kept = floor(N * (1 - ratio)));\n"
      "memory counts fp16 K+V; attention error = ||O_compressed - O_full|| / ||O_full|| over all queries:\n"
      "0 means the compressed cache answers those queries exactly, about 1 means nothing of the output is left;\n"
      "random is the baseline a policy must beat.\n");
  if (dump.empty()) {
    auto s = kvc::tools::make_synthetic({1, 4, tokens, 64}, 16, 16, 2026);
    report({"synthetic cache (docs/demo.md)", std::move(s.cache), std::move(s.queries), s.query_ext, false}, ratios);
    return 0;
  }
  std::vector<std::string> dirs;
  if (std::filesystem::exists(dump + "/keys.npy"))
    dirs.push_back(dump);
  else if (std::filesystem::is_directory(dump))
    for (auto const& entry : std::filesystem::directory_iterator(dump))
      if (std::filesystem::exists(entry.path() / "keys.npy"))
        dirs.push_back(entry.path().string());
  if (dirs.empty())
    die(dump + ": no keys.npy (expected DIR/keys.npy or DIR/*/keys.npy)");
  std::sort(dirs.begin(), dirs.end());
  for (auto const& d : dirs)
    report(load_dump(d, d), ratios);
  return 0;
}
