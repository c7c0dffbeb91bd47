// SPDX-License-Identifier: Apache-2.0
// kvc/scorers/reference.hpp: which implementation a policy reproduces where the paper's authors and kvpress differ.
#pragma once

#include <kvc/core/params.hpp>

#include <cstdint>

namespace kvc {

/// Which implementation's behaviour a policy reproduces where the paper's authors and kvpress differ (the CLI's
/// `--param reference=authors|kvpress`).
enum class Reference : std::uint8_t {
  authors,  ///< the paper and its authors' code (the default)
  kvpress,  ///< NVIDIA kvpress
};

/// How the tools spell a Reference (`--param reference=authors|kvpress`).
inline constexpr Named<Reference> reference_names[] = {{"authors", Reference::authors},
                                                       {"kvpress", Reference::kvpress}};

}  // namespace kvc
