// SPDX-License-Identifier: MIT
#pragma once

/// The checkpoint format's constants (the format is described in checkpoint/format.hpp):
/// the index's magic and format versions, and how the data file lays out its tensors and
/// the tables' arrays. The format is little-endian, so big-endian hosts are refused here.

#include <bit>
#include <cstddef>
#include <cstdint>

static_assert(std::endian::native == std::endian::little,
              "pulley's checkpoint format is little-endian; big-endian hosts are not supported");

namespace pulley::checkpoint {

inline constexpr char kMagic[8] = {'P', 'U', 'L', 'L', 'E', 'Y', 'C', 'K'};
inline constexpr std::uint32_t kFormatVersion = 3;  ///< bumped on any incompatible change
inline constexpr std::uint32_t kOldestVersion = 1;  ///< the oldest version read
inline constexpr std::size_t kChunkBytes = std::size_t{64} << 20U;  ///< of a table's arrays
inline constexpr std::size_t kAlignment = 64;  ///< of each tensor in the data file

}  // namespace pulley::checkpoint
