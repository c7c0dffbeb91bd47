// SPDX-License-Identifier: Apache-2.0
// examples/00_readme/main.cpp: the README's usage example. CI builds and runs it, and checks that the README
// shows exactly the lines between the markers.
#include <cstdio>
#include <vector>

// example-begin readme
#include <kvc/backend/cpu/pipeline/compact.hpp>
#include <kvc/backend/cpu/scorers/key_diff.hpp>
#include <kvc/backend/cpu/selectors/top_k.hpp>
#include <kvc/pipeline/press.hpp>

int main() {
  kvc::KVExtents const ext{1, 8, 4096, 128};  // [batch, kv_heads, token capacity, head_dim], Hugging Face BHTD
  std::vector<kvc::half> k(ext.rows() * ext.dim, kvc::half(0.5f)), v(k.size());  // the engine's cache
  std::vector<kvc::Index> lengths(ext.batch * ext.heads, 3000);  // valid tokens per (sequence, KV head): prefill
  auto cache = kvc::dense_cache(k.data(), v.data(), ext, kvc::head_lengths(lengths.data(), ext.heads));  // no copy

  kvc::Press press{kvc::KeyDiffScorer{}, kvc::TopKSelector{kvc::RatioBudget{0.5}}};  // drop half of each head
  std::vector<std::byte> ws(kvc::compress_workspace_bytes(kvc::Cpu{}, press, ext));  // caller-owned scratch
  std::vector<kvc::Index> index(ext.rows()), count(ext.batch * ext.heads);
  kvc::KeepPlan<> plan{index.data(), count.data(), ext.batch, ext.heads, ext.tokens};

  // Prefill -> compress: score + select, then compact (kept rows move to the front; lengths become the counts).
  kvc::Status st = kvc::compress(kvc::Cpu{}, press, cache, plan, {ws.data(), ws.size()});
  if (st.ok())
    st = kvc::compact(kvc::Cpu{}, plan, cache);
  // Decode -> append: 16 new tokens' K and V go after each head's valid length.
  std::vector<kvc::half> k_new(8 * 16 * 128, kvc::half(1.0f)), v_new(k_new.size());
  if (st.ok())
    st = kvc::append(kvc::Cpu{}, cache, kvc::dense_cache(k_new.data(), v_new.data(), {1, 8, 16, 128}));
  // -> compress again, on the 1516 tokens each head now holds.
  if (st.ok())
    st = kvc::compress(kvc::Cpu{}, press, cache, plan, {ws.data(), ws.size()});
  if (st.ok())
    st = kvc::compact(kvc::Cpu{}, plan, cache);
  std::printf("%s: head 0 holds %lld tokens\n", st.message(), static_cast<long long>(lengths[0]));
  return st.ok() ? 0 : 1;
}
// example-end readme
