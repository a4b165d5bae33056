// SPDX-License-Identifier: MIT
#pragma once

#include <cstdint>
#include <utility>
#include <vector>

#include "pulley/concepts/service.hpp"
#include "pulley/protocol/messages.hpp"

namespace pulley {

/// Requests parked until the ps's global step reaches theirs: a Pull or PullRows with a
/// `min_step` ahead (a worker holding a token reads parameters that include every update
/// its token requires), a Pause for a step to come. Each is answered the moment its step
/// completes, before the ps handles anything else, in the order it came.
///
/// @tparam R what is kept of each request until it is answered
template <class R>
class StepGate {
 public:
  /// Parks `request` (with its reply) until global step `step`.
  void park(std::int64_t step, R request, Responder& reply) {
    Waiting& w = waiting_.emplace_back(Waiting{step, std::move(request), nullptr});
    w.reply = std::exchange(reply, nullptr);
  }

  /// Calls `answer(request, reply)` for every request whose step `global_step` reached, in
  /// the order they came, and forgets them.
  template <class Answer>
  void release(std::int64_t global_step, Answer&& answer) {
    std::erase_if(waiting_, [&](Waiting& w) {
      if (global_step < w.step) return false;
      answer(w.request, w.reply);
      return true;
    });
  }

  /// Answers every parked request with `error`.
  void answer_all(const ErrorReply& error) {
    for (Waiting& w : std::exchange(waiting_, {})) respond(w.reply, ErrorReply{error});
  }

  /// Requests parked now.
  [[nodiscard]] std::size_t size() const noexcept { return waiting_.size(); }

 private:
  struct Waiting {
    std::int64_t step;
    R request;
    Responder reply;
  };
  std::vector<Waiting> waiting_;
};

}  // namespace pulley
