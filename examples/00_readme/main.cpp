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
  kvc::KVExtents const ext{1, 8, 4096, 128};  // [batch, kv_heads, tokens, head_dim], Hugging Face BHTD layout
  std::vector<kvc::half> k(ext.rows() * ext.dim, kvc::half(0.5f)), v(k.size());  // the engine's cache
  auto cache = kvc::dense_cache(k.data(), v.data(), ext);                        // a view: no copy

  kvc::Press press{kvc::KeyDiffScorer{}, kvc::TopKSelector{kvc::RatioBudget{0.5}}};  // drop half of each head
  std::vector<std::byte> ws(kvc::compress_workspace_bytes(kvc::Cpu{}, press, ext));  // caller-owned scratch
  std::vector<kvc::Index> index(ext.rows()), count(ext.batch * ext.heads);
  kvc::KeepPlan<> plan{index.data(), count.data(), ext.batch, ext.heads, ext.tokens};

  kvc::Status st = kvc::compress(kvc::Cpu{}, press, cache, plan, {ws.data(), ws.size()});  // score + select
  if (st.ok())
    st = kvc::compact(kvc::Cpu{}, plan, cache);  // kept rows move to the front of each head, in place
  std::printf("%s: head 0 keeps %lld tokens\n", st.message(), static_cast<long long>(count[0]));
  return st.ok() ? 0 : 1;
}
// example-end readme
