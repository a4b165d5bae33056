// SPDX-License-Identifier: MIT
#pragma once

/// EmbeddingTable's rows (declared in ps/embedding_table.hpp, which includes this header
/// after the class): a pull (pull: admit, make_room, create), the index's lookups
/// (for_each_found), a row touched (touch), rows removed (evict, erase) and admission
/// counts forgotten (forget_oldest_candidates), and the counters (stats).

#include "pulley/ps/embedding_table.hpp"

namespace pulley {

template <RowWiseOptimizer O>
void EmbeddingTable<O>::pull(std::span<const std::uint64_t> ids, std::span<float> out,
                             std::int64_t step, bool create, std::uint64_t* headroom) {
  const std::size_t d = spec_.dim;
  headroom_ = headroom;
  struct Reset {  // whatever happens (a failed allocation throws), the pointer goes
    std::uint64_t*& headroom;
    ~Reset() { headroom = nullptr; }
  } reset{headroom_};
  const bool read = !out.empty();
  for_each_found(ids, [&](std::size_t i, std::uint32_t row) {
    if (row == kNone && create && admit(ids[i], step) && make_room(step))
      row = this->create(ids[i]);
    if (row != kNone && create) touch(row, step);
    if (!read) return;
    const std::span<float> into = out.subspan(i * d, d);
    if (row == kNone) {
      initialize_row(spec_, seed_, ids[i], into);
      return;
    }
    const float* values = at(row);
    std::copy(values, values + d, into.begin());
  });
}

template <RowWiseOptimizer O>
std::size_t EmbeddingTable<O>::evict(std::int64_t step) {
  if (spec_.evict_after_steps <= 0 || frozen_) return 0;  // (no row goes during a cut)
  const std::int64_t before = step - spec_.evict_after_steps;
  if (before <= 0) return 0;
  std::size_t removed = 0;
  for (std::uint32_t row = 0; row < rows_;) {
    if (static_cast<std::int64_t>(touched_step(row)) < before) {
      log_eviction(id_of(row), step);
      erase(row);  // the last row moves here: look at this row again
      ++removed;
    } else {
      ++row;
    }
  }
  std::erase_if(candidates_,
                [&](const auto& c) { return static_cast<std::int64_t>(c.second.last) < before; });
  stats_.rows_evicted += removed;
  return removed;
}

template <RowWiseOptimizer O>
TableStats EmbeddingTable<O>::stats() const noexcept {
  TableStats s = stats_;
  s.rows = rows_;
  s.candidates = candidates_.size();
  s.bytes = chunks_.size() * kChunkRows * record_ * sizeof(float) + index_.bytes() +
            candidates_.size() * (sizeof(std::uint64_t) + sizeof(Candidate) + 2 * sizeof(void*));
  return s;
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::touch(std::uint32_t row, std::int64_t step) {
  const std::uint32_t now = clamp_step(step);
  if (now <= touched_step(row)) return;
  if (frozen_ && row < cut_rows_) keep_for_cut(row);  // the cut reads the step it saw
  set_touched(row, now);
}

template <RowWiseOptimizer O>
template <class F>
void EmbeddingTable<O>::for_each_found(std::span<const std::uint64_t> ids, F&& f) {
  constexpr std::size_t kIndexAhead = 16;
  constexpr std::size_t kRecordAhead = 8;
  const std::size_t n = ids.size();
  for (std::size_t i = 0; i < n; ++i) {
    if (i + kIndexAhead < n) index_.prefetch(ids[i + kIndexAhead]);
    if (i + kRecordAhead < n) {
      const std::uint32_t row = index_.first_entry(ids[i + kRecordAhead]);
      if (row != kNone) prefetch_record(row);
    }
    f(i, find(ids[i]));
  }
}

template <RowWiseOptimizer O>
bool EmbeddingTable<O>::admit(std::uint64_t id, std::int64_t step) {
  if (spec_.admit_after <= 1) return true;
  if (!candidates_.contains(id)) {
    if (spec_.max_rows > 0 && candidates_.size() >= spec_.max_rows) forget_oldest_candidates();
    if (headroom_ != nullptr && *headroom_ < kCandidateBytes) {
      const std::size_t before = candidates_.size();
      if (before > 0) forget_oldest_candidates();
      *headroom_ += (before - candidates_.size()) * kCandidateBytes;
      if (*headroom_ < kCandidateBytes) {
        ++stats_.rows_capped;  // not even its count fits: it is not counted
        return false;
      }
    }
    if (headroom_ != nullptr) *headroom_ -= kCandidateBytes;
  }
  Candidate& c = candidates_[id];
  ++c.count;
  c.last = clamp_step(step);
  return c.count >= spec_.admit_after;  // its count goes once its row exists (create)
}

template <RowWiseOptimizer O>
bool EmbeddingTable<O>::make_room(std::int64_t step) {
  const std::uint64_t cap = spec_.max_rows;
  auto fits = [&] {
    return (cap == 0 || rows_ < cap) && (headroom_ == nullptr || *headroom_ >= budget_row_bytes());
  };
  if (fits()) return true;
  const std::uint32_t now = clamp_step(step);
  if (!frozen_ && full_at_ != now && rows_ > 0) {  // one fruitless pass per step is enough
    std::vector<std::uint32_t> steps(rows_);
    for (std::uint32_t row = 0; row < rows_; ++row) steps[row] = touched_step(row);
    const std::size_t k = std::max<std::size_t>(1, rows_ / 8) - 1;
    std::nth_element(steps.begin(), steps.begin() + static_cast<std::ptrdiff_t>(k), steps.end());
    const std::uint32_t oldest = steps[k];  // an eighth of the rows were touched at or before it
    // Those touched before it, then those touched at it, up to an eighth in all.
    std::size_t removed = 0;
    for (const bool ties : {false, true}) {
      for (std::uint32_t row = 0; row < rows_ && removed <= k;) {
        const std::uint32_t touched = touched_step(row);
        if (touched < now && (ties ? touched == oldest : touched < oldest)) {
          log_eviction(id_of(row), now);
          erase(row);  // the last row moves here: look at this row again
          ++removed;
        } else {
          ++row;
        }
      }
    }
    stats_.rows_capped += removed;
    if (headroom_ != nullptr) *headroom_ += removed * budget_row_bytes();
    if (removed == 0) full_at_ = now;
  }
  if (fits()) return true;
  ++stats_.rows_capped;  // nothing could go: this row is not created
  return false;
}

template <RowWiseOptimizer O>
std::uint32_t EmbeddingTable<O>::create(std::uint64_t id, bool values_only) {
  if (rows_ >= kNone - 1) {
    throw Error(ErrorCode::kResourceExhausted,
                "table '" + spec_.name + "' holds 2^32 - 2 rows on this ps");
  }
  if (rows_ == chunks_.size() * kChunkRows) {
    chunks_.push_back(Chunk{std::vector<float>(kChunkRows * record_)});
  }
  const auto row = static_cast<std::uint32_t>(rows_);
  float* r = at(row);
  if (!values_only) initialize_row(spec_, seed_, id, std::span<float>(r, spec_.dim));
  optimizer_.init_row(std::span<float>(r + spec_.dim, stride_ - spec_.dim));
  set_id(row, id);
  set_touched(row, 0);
  const std::uint32_t not_proven = 0;  // (a fresh chunk's records hold 0; a reused one's may not)
  std::memcpy(record(row) + 3, &not_proven, sizeof not_proven);
  index_.insert(row, ids());  // (a failed allocation leaves the row unused)
  ++rows_;
  ++unproven_;
  if (!values_only) prove_as_held(row);  // (a restore proves it once its values are in)
  if (headroom_ != nullptr) *headroom_ -= std::min(*headroom_, budget_row_bytes());
  ++stats_.rows_created;
  if (spec_.admit_after > 1 && candidates_.erase(id) > 0 && headroom_ != nullptr) {
    *headroom_ += kCandidateBytes;  // admitted: its count is done
  }
  return row;
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::forget_oldest_candidates() {
  std::vector<std::uint32_t> last;
  last.reserve(candidates_.size());
  for (const auto& entry : candidates_) last.push_back(entry.second.last);
  const auto middle = last.begin() + static_cast<std::ptrdiff_t>(last.size() / 2);
  std::nth_element(last.begin(), middle, last.end());
  const std::uint32_t keep_after = *middle;
  std::erase_if(candidates_, [&](const auto& c) { return c.second.last <= keep_after; });
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::erase(std::uint32_t row) {
  if (!proven(row)) --unproven_;
  index_.erase(row, ids());
  const auto last = static_cast<std::uint32_t>(rows_ - 1);
  if (row != last) {
    index_.renumber(last, row, ids());
    std::copy(record(last), record(last) + record_, record(row));
  }
  --rows_;
  const std::size_t needed = (rows_ + kChunkRows - 1) / kChunkRows;
  while (chunks_.size() > needed + 1) chunks_.pop_back();  // one spare chunk at most
}

}  // namespace pulley
