// SPDX-License-Identifier: MIT
#pragma once

#include <cstddef>
#include <cstdint>
#include <span>
#include <vector>

#include "pulley/initializers.hpp"

namespace pulley::detail {

/// Tells whether a list of 64-bit ids holds one twice, in about one probe per id: an
/// open-addressing set reused from list to list (emptied by a generation count, not by
/// clearing it), its hash keyed with a random number so that chosen ids cannot pile onto
/// one slot.
class IdSet {
 public:
  explicit IdSet(std::uint64_t key) : key_(key) {}

  /// The first id of `ids` that comes twice, or nullptr.
  const std::uint64_t* first_duplicate(std::span<const std::uint64_t> ids) {
    if (++generation_ == 0) {  // wrapped: forget every old mark
      for (Slot& s : slots_) s.generation = 0;
      generation_ = 1;
    }
    std::size_t capacity = slots_.size();
    if (capacity < 2 * ids.size() || capacity < 16) {
      capacity = 16;
      while (capacity < 2 * ids.size()) capacity *= 2;
      slots_.assign(capacity, Slot{});
      generation_ = 1;
    }
    const std::size_t mask = capacity - 1;
    for (const std::uint64_t& id : ids) {
      for (std::size_t at = static_cast<std::size_t>(mix_id(id ^ key_)) & mask;; at = (at + 1) & mask) {
        Slot& s = slots_[at];
        if (s.generation != generation_) {
          s = Slot{id, generation_};
          break;
        }
        if (s.id == id) return &id;
      }
    }
    return nullptr;
  }

 private:
  struct Slot {
    std::uint64_t id = 0;
    std::uint32_t generation = 0;
  };
  std::uint64_t key_;
  std::uint32_t generation_ = 0;
  std::vector<Slot> slots_;
};

}  // namespace pulley::detail
