// SPDX-License-Identifier: MIT
#pragma once

/// EmbeddingTable's state for a checkpoint (declared in ps/embedding_table.hpp, which
/// includes this header after the class): a checkpoint's cut (begin_cut, keep_for_cut,
/// end_cut), the rows and admission counts it reads (read_rows, read_row,
/// rows_touched_since, read_candidates, for_each_row), the eviction log (log_eviction,
/// read_evicted, forget_evictions_before) and a restore (clear, restore_row,
/// restore_candidate).

#include "pulley/ps/embedding_table.hpp"

namespace pulley {

template <RowWiseOptimizer O>
void EmbeddingTable<O>::read_rows(std::size_t begin, std::size_t n, std::vector<std::uint64_t>& ids,
                                  std::vector<float>& rows,
                                  std::vector<std::uint32_t>& touched) const {
  n = std::min(n, rows_ - std::min(begin, rows_));
  detail::reserve_on_huge_pages(rows, rows.size() + n * stride_);
  for (std::size_t k = 0; k < n; ++k)
    read_row(static_cast<std::uint32_t>(begin + k), ids, rows, touched);
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::rows_touched_since(std::int64_t since,
                                           std::vector<std::uint32_t>& out) const {
  const std::uint32_t from = clamp_step(since);
  for (std::uint32_t row = 0; row < rows_; ++row) {
    if (touched_step(row) >= from) out.push_back(row);
  }
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::read_rows(std::span<const std::uint32_t> numbers,
                                  std::vector<std::uint64_t>& ids, std::vector<float>& rows,
                                  std::vector<std::uint32_t>& touched) const {
  detail::reserve_on_huge_pages(rows, rows.size() + numbers.size() * stride_);
  for (const std::uint32_t row : numbers) read_row(row, ids, rows, touched);
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::read_evicted(std::int64_t since, std::vector<std::uint64_t>& out) const {
  for (const auto& [id, step] : evicted_) {
    if (static_cast<std::int64_t>(step) >= since) out.push_back(id);
  }
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::forget_evictions_before(std::int64_t step) {
  if (step <= evictions_since_) return;
  std::erase_if(evicted_,
                [&](const auto& e) { return static_cast<std::int64_t>(e.second) < step; });
  evictions_since_ = step;
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::read_candidates(std::vector<std::uint64_t>& ids,
                                        std::vector<std::uint32_t>& counts,
                                        std::vector<std::uint32_t>& steps) const {
  for (const auto& [id, c] : candidates_) {
    ids.push_back(id);
    counts.push_back(c.count);
    steps.push_back(c.last);
  }
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::begin_cut() {
  end_cut();
  frozen_ = true;
  cut_rows_ = rows_;
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::end_cut() noexcept {
  frozen_ = false;
  cut_rows_ = 0;
  kept_at_.clear();
  std::vector<float>().swap(kept_);
  std::vector<std::uint32_t>().swap(kept_touched_);
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::clear(std::int64_t step) noexcept {
  chunks_.clear();
  index_.clear();
  rows_ = 0;
  candidates_.clear();
  scratch_rows_.clear();
  in_place_rows_.clear();
  pending_ = Pending{};
  unproven_ = 0;
  evicted_.clear();
  evictions_since_ = step;
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::restore_row(std::uint64_t id, std::span<const float> row,
                                    std::uint32_t touched) {
  std::uint32_t r = find(id);
  if (r == kNone) {
    r = create(id, true);
    --stats_.rows_created;  // restored, not created
  } else if (row.size() < stride_) {
    optimizer_.init_row(std::span<float>(at(r) + spec_.dim, stride_ - spec_.dim));
  }
  std::copy(row.begin(), row.begin() + static_cast<std::ptrdiff_t>(std::min(row.size(), stride_)),
            at(r));
  set_touched(r, clamp_step(touched));
  prove_as_held(r);
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::restore_candidate(std::uint64_t id, std::uint32_t count,
                                          std::uint32_t step) {
  if (spec_.admit_after <= 1 || find(id) != kNone) return;
  candidates_[id] = Candidate{std::min(count, spec_.admit_after - 1), clamp_step(step)};
}

template <RowWiseOptimizer O>
template <class F>
void EmbeddingTable<O>::for_each_row(F&& f) const {
  const std::size_t d = spec_.dim;
  for (std::uint32_t row = 0; row < rows_; ++row) {
    const float* r = at(row);
    f(id_of(row), std::span<const float>(r, d), std::span<const float>(r + d, stride_ - d));
  }
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::keep_for_cut(std::uint32_t row) {
  const auto [it, fresh] = kept_at_.try_emplace(row, kept_touched_.size());
  if (!fresh) return;
  kept_.insert(kept_.end(), at(row), at(row) + stride_);
  kept_touched_.push_back(touched_step(row));
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::read_row(std::uint32_t row, std::vector<std::uint64_t>& ids,
                                 std::vector<float>& rows,
                                 std::vector<std::uint32_t>& touched) const {
  ids.push_back(id_of(row));
  if (!kept_at_.empty()) {
    if (const auto it = kept_at_.find(row); it != kept_at_.end()) {
      const float* from = kept_.data() + it->second * stride_;
      rows.insert(rows.end(), from, from + stride_);
      touched.push_back(kept_touched_[it->second]);
      return;
    }
  }
  rows.insert(rows.end(), at(row), at(row) + stride_);
  touched.push_back(touched_step(row));
}

template <RowWiseOptimizer O>
void EmbeddingTable<O>::log_eviction(std::uint64_t id, std::int64_t step) {
  if (evicted_.size() >= std::max(kMaxEvictionLog, rows_)) {  // too many: a full checkpoint is next
    evicted_.clear();
    evictions_since_ = step + 1;
    return;
  }
  evicted_.emplace_back(id, clamp_step(step));
}

}  // namespace pulley
