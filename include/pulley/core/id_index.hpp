// SPDX-License-Identifier: MIT
#pragma once

#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <utility>
#include <vector>

#include "pulley/core/initializers.hpp"

namespace pulley::detail {

/// The positions of distinct 64-bit ids, numbered in the order they were added, in about
/// one probe per id: an open-addressing table kept at most half full and reused from batch
/// to batch (emptied by a generation count, not by clearing it). Its hash is keyed with
/// `key`: where ids come from a peer, give a random key, so that chosen ids cannot pile
/// onto one slot (std::unordered_map hashes a 64-bit id to itself).
class IdIndex {
 public:
  static constexpr std::size_t npos = std::numeric_limits<std::size_t>::max();

  explicit IdIndex(std::uint64_t key = 0) : key_(key) {}

  /// Forgets every id; keeps the memory.
  void clear() noexcept {
    size_ = 0;
    if (++generation_ == 0) {  // wrapped: forget every old mark
      for (Slot& s : slots_) s.generation = 0;
      generation_ = 1;
    }
  }

  /// Room for `n` ids without growing.
  void reserve(std::size_t n) {
    if (2 * n > slots_.size()) rehash(n);
  }

  /// The ids held.
  [[nodiscard]] std::size_t size() const noexcept { return size_; }

  /// The position of `id`, and true if it was added now (its position is then size() - 1).
  std::pair<std::size_t, bool> insert(std::uint64_t id) {
    if (2 * (size_ + 1) > slots_.size()) rehash(2 * (size_ + 1));  // full: room for twice as many
    for (std::size_t at = home(id);; at = (at + 1) & mask_) {
      Slot& s = slots_[at];
      if (s.generation != generation_) {
        s = Slot{id, size_, generation_};
        return {size_++, true};
      }
      if (s.id == id) return {s.position, false};
    }
  }

  /// The position of `id`, or npos.
  [[nodiscard]] std::size_t find(std::uint64_t id) const noexcept {
    if (slots_.empty()) return npos;
    for (std::size_t at = home(id);; at = (at + 1) & mask_) {
      const Slot& s = slots_[at];
      if (s.generation != generation_) return npos;
      if (s.id == id) return s.position;
    }
  }

  /// The first id of `ids` that comes twice, or nullptr; the index then holds `ids` up to
  /// it (all of them when none comes twice).
  const std::uint64_t* first_duplicate(std::span<const std::uint64_t> ids) {
    clear();
    reserve(ids.size());
    for (const std::uint64_t& id : ids) {
      if (!insert(id).second) return &id;
    }
    return nullptr;
  }

 private:
  struct Slot {
    std::uint64_t id = 0;
    std::size_t position = 0;
    std::uint32_t generation = 0;  ///< the slot is taken when this is the index's
  };

  [[nodiscard]] std::size_t home(std::uint64_t id) const noexcept {
    return static_cast<std::size_t>(mix_id(id ^ key_)) & mask_;
  }

  /// Room for `n` ids: at least 2n slots, a power of two; the ids held move over.
  void rehash(std::size_t n) {
    std::size_t capacity = 16;
    while (capacity < 2 * n) capacity *= 2;
    std::vector<Slot> old(capacity);
    old.swap(slots_);
    const std::uint32_t live = generation_;
    generation_ = 1;
    mask_ = capacity - 1;
    for (const Slot& s : old) {
      if (s.generation != live) continue;
      std::size_t at = home(s.id);
      while (slots_[at].generation == generation_) at = (at + 1) & mask_;
      slots_[at] = Slot{s.id, s.position, generation_};
    }
  }

  std::uint64_t key_;
  std::uint32_t generation_ = 1;  ///< slots start at 0: empty
  std::size_t size_ = 0;
  std::size_t mask_ = 0;
  std::vector<Slot> slots_;
};

}  // namespace pulley::detail
