// SPDX-License-Identifier: Apache-2.0
// kvc/backend/cpu/selectors/top_k.hpp: the CPU kernel of TopKSelector (in detail/, since AdaKV's and UNComp's
// selections (selectors/allocated_top_k.hpp) run it after their allocation).
#pragma once

#include <kvc/backend/cpu/detail/top_k.hpp>
