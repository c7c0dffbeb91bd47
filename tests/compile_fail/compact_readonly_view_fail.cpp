// SPDX-License-Identifier: Apache-2.0
// Compile-fail twin: in-place compaction of a read-only view is rejected at compile time.
// EXPECT: in-place compaction needs writable K and V views
#include <kvc/backend/cpu/pipeline/compact.hpp>

#include <vector>

int main() {
  std::vector<float> k(8), v(8);
  std::vector<kvc::Index> index = {0, 1}, count = {2};
  kvc::KeepPlan<> const plan{index.data(), count.data(), 1, 1, 2};
#if defined(KVC_SHOULD_FAIL)
  float const* kp = k.data();
  float const* vp = v.data();
#else
  float* kp = k.data();
  float* vp = v.data();
#endif
  return kvc::compact(kvc::Cpu{}, plan, kvc::dense_cache(kp, vp, {1, 1, 2, 4})).ok() ? 0 : 1;
}
