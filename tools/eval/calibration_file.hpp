// SPDX-License-Identifier: Apache-2.0
// tools/eval/calibration_file.hpp: UNComp's calibration file as `kvc-eval calibrate` writes it (the reader, for
// untrusted files, is kvc::tools::read_calibration in tools/common/uncomp.hpp).
#pragma once

#include "common/uncomp.hpp"

#include <string>

namespace kvc::eval {

/// The calibration as JSON text (nlohmann-json, eval/json_out.hpp): one top-level field per line, one object per
/// layer in "per_layer" on its own line, numbers in their shortest round-trip form (a double always with a point or
/// an exponent). The same calibration always gives the same bytes. Sizes that disagree are a bug (logic_error).
std::string calibration_json(tools::Calibration const& c);

/// Writes calibration_json(c) to `path`, staged beside it and renamed into place once whole (the destination keeps
/// what it held on failure). Errors exit 3 naming the file.
void write_calibration(tools::Calibration const& c, std::string const& path);

}  // namespace kvc::eval
