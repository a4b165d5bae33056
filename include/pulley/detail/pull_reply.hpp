// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>

#include "pulley/messages.hpp"

namespace pulley::detail {

/// Copies a pull reply's values into the caller's targets (one per slice, in order) and
/// points the reply's views at them; false, copying nothing, when the reply does not fit.
inline bool copy_into(PullReply& pull, std::span<const std::span<float>> targets) {
  if (pull.values.size() != targets.size()) return false;
  for (std::size_t i = 0; i < targets.size(); ++i) {
    if (pull.values[i].size() != targets[i].size()) return false;
  }
  for (std::size_t i = 0; i < targets.size(); ++i) {
    std::copy(pull.values[i].begin(), pull.values[i].end(), targets[i].begin());
    pull.values[i] = targets[i];
  }
  return true;
}

}  // namespace pulley::detail
