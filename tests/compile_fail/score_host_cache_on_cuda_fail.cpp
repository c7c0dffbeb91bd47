// SPDX-License-Identifier: Apache-2.0
// Compile-fail twin: builds as-is ("ok"); with KVC_SHOULD_FAIL ("ko") it must fail with the message below.
// EXPECT: kvc::score: the cache lives in a memory space this backend cannot read
#include <kvc/backend/cpu/scorers/knorm.hpp>

#include <vector>

int main() {
  std::vector<float> k(8), v(8), out(2);
  auto const cache = kvc::dense_cache(k.data(), v.data(), {1, 1, 2, 4});  // host memory
#if defined(KVC_SHOULD_FAIL)
  kvc::Cuda const backend{};  // a host cache handed to the CUDA backend
  kvc::ScoreSpan<kvc::DeviceSpace> const span{out.data(), 1, 1, 2};
#else
  kvc::Cpu const backend{};
  kvc::ScoreSpan<> const span{out.data(), 1, 1, 2};
#endif
  return kvc::score(backend, kvc::KnormScorer{}, cache, span, {}).ok() ? 0 : 1;
}
