// SPDX-License-Identifier: Apache-2.0
// kvc/scorers/reference.hpp: which implementation a policy reproduces where the paper's authors and kvpress differ.
#pragma once

#include <cstdint>

namespace kvc {

/// Which implementation's behaviour a policy reproduces where the paper's authors and kvpress differ (the CLI's
/// `--param reference=authors|kvpress`).
enum class Reference : std::uint8_t {
  authors,  ///< the paper and its authors' code (the default)
  kvpress,  ///< NVIDIA kvpress
};

}  // namespace kvc
