// SPDX-License-Identifier: Apache-2.0
// tests/scorers/window_no_malloc_test.cpp: the CPU window-attention kernel never allocates (Eigen's products pack
// their operands on the stack only while they fit its limit; the kernel chunks them so they always do).
#define EIGEN_RUNTIME_NO_MALLOC  // Eigen asserts on any heap allocation while set_is_malloc_allowed(false)
#include <kvc/backend/cpu/scorers/snap_kv.hpp>

#include "common/synthetic.hpp"
#include "support/catch.hpp"
#include "support/helpers.hpp"

#include <Eigen/Core>

#include <cmath>
#include <vector>

using kvc::Index;

TEST_CASE("window attention: no heap allocation for large groups, windows and head dims", "[scorers][snap_kv]") {
  struct Shape {
    Index group, window, dim;
  };
  for (Shape const s : {Shape{4, 32, 128}, Shape{8, 64, 256}, Shape{16, 128, 256}, Shape{1, 1, 512}}) {
    kvc::KVExtents const e{1, 1, 300, s.dim};
    auto const cache = kvc::tools::HostCache<kvc::half>::random(e, 3);
    auto const q = kvc::tools::HostCache<float>::random({1, s.group, s.window, s.dim}, 4);
    auto const obs = kvc::observe(kvc::WindowQueries<float>{
        kvc::TokenRows<float const, kvc::StridedLayout>(q.k.data(), kvc::bhtd_layout({1, s.group, s.window, s.dim}))});
    kvc::SnapKVScorer const scorer{.window_size = s.window};
    kvc::test::OwnedScores out(1, 1, 300);
    kvc::test::OwnedWorkspace ws(kvc::score_workspace_bytes(kvc::Cpu{}, scorer, e, obs));
    Eigen::internal::set_is_malloc_allowed(false);
    kvc::Status const st = kvc::score(kvc::Cpu{}, scorer, cache.view(), obs, out.span, ws.get());
    Eigen::internal::set_is_malloc_allowed(true);
    INFO("group " << s.group << " window " << s.window << " dim " << s.dim);
    REQUIRE(st.ok());
    for (Index t = 0; t < 300; ++t)
      CHECK(std::isfinite(out.data[static_cast<std::size_t>(t)]));
  }
}
