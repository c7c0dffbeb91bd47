// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/attention/attend.hpp: the CPU attention kernel (in detail/, since corrected and packed attention
// build on it).
#pragma once

#include <kvc/backend/cpu/detail/attend.hpp>
