// SPDX-License-Identifier: MIT
#pragma once

#include <cstdint>
#include <string_view>

namespace pulley {

/// pulley's hashes, each defined once: what seeds initial values, spreads table rows over
/// the ps tasks, keys id indexes and names a cluster. They depend only on their input, so
/// every process computes the same value.

/// FNV-1a (64 bits) of `text`, continuing from `hash` (the offset basis by default): mixes
/// a variable's name into its seed, so its initial values do not change when other
/// variables are added or reordered.
constexpr std::uint64_t name_hash(std::string_view text,
                                  std::uint64_t hash = 0xCBF29CE484222325ULL) noexcept {
  for (const char c : text) {
    hash ^= static_cast<unsigned char>(c);
    hash *= 0x100000001B3ULL;
  }
  return hash;
}

/// The SplitMix64 finalizer: neighbouring 64-bit ids give unrelated values.
constexpr std::uint64_t mix_id(std::uint64_t id) noexcept {
  id = (id ^ (id >> 30U)) * 0xBF58476D1CE4E5B9ULL;
  id = (id ^ (id >> 27U)) * 0x94D049BB133111EBULL;
  return id ^ (id >> 31U);
}

}  // namespace pulley
