// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/scorers/tova.hpp: CPU kernel of TOVAScorer (defined with SnapKV's, which shares the window
// attention).
#pragma once

#include <kvc/backend/cpu/scorers/snap_kv.hpp>
