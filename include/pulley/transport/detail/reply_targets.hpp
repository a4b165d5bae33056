// SPDX-License-Identifier: MIT
#pragma once

#include <algorithm>
#include <cstddef>
#include <span>

#include "pulley/protocol/messages.hpp"

namespace pulley::detail {

/// True if the reply's tensors match `targets` one for one, in number and size.
inline bool fits(Response& reply, std::span<const std::span<float>> targets) {
  std::size_t i = 0;
  bool fit = true;
  for_each_tensor(reply, [&](std::span<const float>& t) {
    fit = fit && i < targets.size() && targets[i].size() == t.size();
    ++i;
  });
  return fit && i == targets.size();
}

/// Points the reply's tensors at `targets`, which hold their values (they were received
/// there).
inline void point_at(Response& reply, std::span<const std::span<float>> targets) {
  std::size_t i = 0;
  for_each_tensor(reply, [&](std::span<const float>& t) { t = targets[i++]; });
}

/// Copies the reply's tensors into the caller's targets (one per tensor, in order) and
/// points the reply's views at them; false, copying nothing, when the reply does not fit.
inline bool copy_into(Response& reply, std::span<const std::span<float>> targets) {
  if (!fits(reply, targets)) return false;
  std::size_t i = 0;
  for_each_tensor(reply, [&](std::span<const float>& t) {
    std::copy(t.begin(), t.end(), targets[i].begin());
    t = targets[i++];
  });
  return true;
}

}  // namespace pulley::detail
