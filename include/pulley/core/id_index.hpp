// SPDX-License-Identifier: MIT
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <limits>
#include <span>
#include <utility>
#include <vector>

#include "pulley/core/hash.hpp"
#include "pulley/core/prefetch.hpp"

namespace pulley {

/// pulley's one hash index of 64-bit ids: open addressing with linear probing over 32-bit
/// buckets, each holding an entry number + 1 (0: empty). It does not store the ids: the
/// caller keeps them where they belong (an embedding table's records, IdPositions' list)
/// and `key_of(entry)` gives an entry's id back, so a bucket costs 4 bytes. Removal shifts
/// entries back (no tombstones), so lookups never slow down with churn.
///
/// Ids are hashed with `mix_id(id ^ key)`: where ids come from a peer, give a random key,
/// so that chosen ids cannot pile onto one bucket (std::unordered_map hashes a 64-bit id to
/// itself). At most 2^32 - 2 entries.
class IdIndex {
 public:
  /// "No entry".
  static constexpr std::uint32_t kNone = std::numeric_limits<std::uint32_t>::max();

  /// @param key            keys the hash (see above)
  /// @param max_load_num   the index grows past `max_load_num / 4` full (2: half, 3: 3/4)
  explicit IdIndex(std::uint64_t key = 0, unsigned max_load_num = 3) noexcept
      : key_(key), max_load_num_(max_load_num) {}

  /// The entry whose id is `id`, or kNone.
  template <class KeyOf>
  [[nodiscard]] std::uint32_t find(std::uint64_t id, KeyOf&& key_of) const noexcept {
    if (buckets_.empty()) return kNone;
    for (std::size_t at = home(id);; at = next(at)) {
      const std::uint32_t bucket = buckets_[at];
      if (bucket == 0) return kNone;
      if (key_of(bucket - 1) == id) return bucket - 1;
    }
  }

  /// Adds `entry`, whose id (`key_of(entry)`) is not in the index yet. Grows first when
  /// full; a failed allocation leaves the index as it was.
  template <class KeyOf>
  void insert(std::uint32_t entry, KeyOf&& key_of) {
    if ((size_ + 1) * 4 > buckets_.size() * max_load_num_) grow(buckets_.size() * 2, key_of);
    place(key_of(entry), entry);
    ++size_;
  }

  /// The entry whose id is `id`, or, when there is none, `entry` added for it (its id must
  /// then be `id`); true if added. One probe either way.
  template <class KeyOf>
  std::pair<std::uint32_t, bool> emplace(std::uint64_t id, std::uint32_t entry, KeyOf&& key_of) {
    if ((size_ + 1) * 4 > buckets_.size() * max_load_num_) grow(buckets_.size() * 2, key_of);
    for (std::size_t at = home(id);; at = next(at)) {
      const std::uint32_t bucket = buckets_[at];
      if (bucket == 0) {
        buckets_[at] = entry + 1;
        ++size_;
        return {entry, true};
      }
      if (key_of(bucket - 1) == id) return {bucket - 1, false};
    }
  }

  /// Removes `entry` (present): the entries after it in its probe run move back into the
  /// hole unless their home lies between.
  template <class KeyOf>
  void erase(std::uint32_t entry, KeyOf&& key_of) noexcept {
    std::size_t hole = bucket_of(entry, key_of);
    for (std::size_t at = next(hole); buckets_[at] != 0; at = next(at)) {
      const std::size_t want = home(key_of(buckets_[at] - 1));
      const bool stays = hole <= at ? (want > hole && want <= at) : (want > hole || want <= at);
      if (!stays) {
        buckets_[hole] = buckets_[at];
        hole = at;
      }
    }
    buckets_[hole] = 0;
    --size_;
  }

  /// Entry `from` is now numbered `to` (its id unchanged; `key_of(from)` still gives it).
  template <class KeyOf>
  void renumber(std::uint32_t from, std::uint32_t to, KeyOf&& key_of) noexcept {
    buckets_[bucket_of(from, key_of)] = to + 1;
  }

  /// Room for `n` entries without growing.
  template <class KeyOf>
  void reserve(std::size_t n, KeyOf&& key_of) {
    if (n * 4 > buckets_.size() * max_load_num_) grow(n * 4 / max_load_num_ + 1, key_of);
  }

  /// Forgets every entry. An index much larger than what it held keeps less memory, so that
  /// one outsized batch does not make every later clear cost its size.
  void clear() noexcept {
    if (buckets_.size() > 64 && size_ * 16 < buckets_.size()) {
      std::vector<std::uint32_t>().swap(buckets_);
    } else {
      std::fill(buckets_.begin(), buckets_.end(), 0U);
    }
    size_ = 0;
  }

  /// Entries held.
  [[nodiscard]] std::size_t size() const noexcept { return size_; }
  /// Bytes of its buckets.
  [[nodiscard]] std::size_t bytes() const noexcept { return buckets_.size() * sizeof(std::uint32_t); }

  /// Asks the cache for the bucket where `id`'s probe starts (a batch's lookups then wait
  /// for memory together, not one after the other).
  void prefetch(std::uint64_t id) const noexcept {
    if (!buckets_.empty()) pulley::prefetch(&buckets_[home(id)]);
  }
  /// The entry in the bucket where `id`'s probe starts (maybe another id's), or kNone: what
  /// to prefetch of the caller's records ahead of `find`.
  [[nodiscard]] std::uint32_t first_entry(std::uint64_t id) const noexcept {
    if (buckets_.empty()) return kNone;
    const std::uint32_t bucket = buckets_[home(id)];
    return bucket == 0 ? kNone : bucket - 1;
  }

 private:
  [[nodiscard]] std::size_t home(std::uint64_t id) const noexcept {
    return static_cast<std::size_t>(mix_id(id ^ key_)) & (buckets_.size() - 1);
  }
  [[nodiscard]] std::size_t next(std::size_t at) const noexcept { return (at + 1) & (buckets_.size() - 1); }

  void place(std::uint64_t id, std::uint32_t entry) noexcept {
    std::size_t at = home(id);
    while (buckets_[at] != 0) at = next(at);
    buckets_[at] = entry + 1;
  }

  template <class KeyOf>
  [[nodiscard]] std::size_t bucket_of(std::uint32_t entry, KeyOf&& key_of) const noexcept {
    std::size_t at = home(key_of(entry));
    while (buckets_[at] != entry + 1) at = next(at);
    return at;
  }

  /// At least `capacity` buckets (a power of two, 16 or more); the entries move over. The new
  /// buckets are allocated before the old ones are let go.
  template <class KeyOf>
  void grow(std::size_t capacity, KeyOf&& key_of) {
    std::vector<std::uint32_t> grown(std::bit_ceil(std::max<std::size_t>(16, capacity)), 0U);
    grown.swap(buckets_);
    for (const std::uint32_t bucket : grown) {
      if (bucket != 0) place(key_of(bucket - 1), bucket - 1);
    }
  }

  std::uint64_t key_;
  unsigned max_load_num_;
  std::size_t size_ = 0;
  std::vector<std::uint32_t> buckets_;
};

/// Distinct 64-bit ids numbered in the order they were added (their positions), found in
/// about one probe: what a worker's batch, a TableBatch and a ps's sparse accumulator look
/// ids up in. Kept at most half full, reused from batch to batch.
class IdPositions {
  /// An entry's id: its place in the list.
  struct KeyOf {
    const std::vector<std::uint64_t>* ids;
    std::uint64_t operator()(std::uint32_t entry) const noexcept { return (*ids)[entry]; }
  };

 public:
  /// "Not there".
  static constexpr std::size_t npos = std::numeric_limits<std::size_t>::max();

  /// @param key keys the hash (see IdIndex): random where ids come from a peer
  explicit IdPositions(std::uint64_t key = 0) noexcept : index_(key, 2) {}

  /// The position of `id`, and true if it was added now (its position is then size() - 1).
  std::pair<std::size_t, bool> insert(std::uint64_t id) {
    ids_.push_back(id);  // taken back below unless it is new
    std::pair<std::uint32_t, bool> placed;
    try {
      placed = index_.emplace(id, static_cast<std::uint32_t>(ids_.size() - 1), key_of());
    } catch (...) {
      ids_.pop_back();
      throw;
    }
    if (!placed.second) ids_.pop_back();
    return {placed.first, placed.second};
  }

  /// The position of `id`, or npos.
  [[nodiscard]] std::size_t find(std::uint64_t id) const noexcept {
    const std::uint32_t found = index_.find(id, key_of());
    return found == IdIndex::kNone ? npos : found;
  }

  /// The first id of `ids` that comes twice, or nullptr; afterwards the positions hold
  /// `ids` up to it (all of them when none comes twice).
  const std::uint64_t* first_duplicate(std::span<const std::uint64_t> ids) {
    clear();
    reserve(ids.size());
    for (const std::uint64_t& id : ids) {
      if (!insert(id).second) return &id;
    }
    return nullptr;
  }

  /// Room for `n` ids without growing.
  void reserve(std::size_t n) {
    ids_.reserve(n);
    index_.reserve(n, key_of());
  }
  /// Forgets every id.
  void clear() noexcept {
    ids_.clear();
    index_.clear();
  }
  /// The ids held.
  [[nodiscard]] std::size_t size() const noexcept { return ids_.size(); }
  /// The ids, by position.
  [[nodiscard]] std::span<const std::uint64_t> ids() const noexcept { return ids_; }

 private:
  [[nodiscard]] KeyOf key_of() const noexcept { return KeyOf{&ids_}; }

  std::vector<std::uint64_t> ids_;
  IdIndex index_;
};

}  // namespace pulley
