// SPDX-License-Identifier: MIT
#pragma once

/// Chief's state as it is set, taken over and ended (declared in client/chief.hpp, which
/// includes this header after the class): the first values sent and read back
/// (initialize_and_save, initial_values, send_initial), a lost chief's job taken over
/// (ps_serving, adopt), and the end of training (end, resume_all).

#include "pulley/client/chief.hpp"

namespace pulley {

template <Transport T>
ModelState Chief<T>::initialize_and_save(std::span<const VariableSpec> variables,
                                         std::span<const TableSpec> tables) {
  try {
    send_initial(variables, initial_values(variables), tables, true);
  } catch (const Error&) {
    resume_all();  // the ps tasks that were initialized, and so paused, go on
    throw;
  }
  return read_state(client_);  // resumes every ps, whatever happens
}

template <Transport T>
bool Chief<T>::ps_serving() {
  try {
    (void)client_.learn_membership();  // a ps its predecessor let go is not waited for
    const auto replies = client_.template broadcast<StatsReply>(
        [](std::size_t) { return GetStats{}; }, timeouts().request_timeout, "look at the ps tasks");
    for (const StatsReply& r : replies)
      client_.set_workers(r.workers);  // as its predecessor left them
    return std::all_of(replies.begin(), replies.end(), [&](const StatsReply& r) {
      return r.ready && r.epoch == replies.front().epoch;
    });
  } catch (const Error&) {
    return false;
  }
}

template <Transport T>
std::int64_t Chief<T>::adopt(std::span<const VariableSpec> variables,
                             std::span<const TableSpec> tables) {
  client_.wait_ready(variables, tables);
  return client_.wait_for_step(0);
}

template <Transport T>
std::vector<std::vector<float>> Chief<T>::initial_values(
    std::span<const VariableSpec> variables) const {
  std::vector<std::vector<float>> values;
  values.reserve(variables.size());
  for (const VariableSpec& spec : variables) {
    values.emplace_back(spec.size());
    pulley::initialize(spec, seed_, values.back());
  }
  return values;
}

template <Transport T>
const Placement& Chief<T>::send_initial(std::span<const VariableSpec> variables,
                                        std::span<const std::vector<float>> values,
                                        std::span<const TableSpec> tables, bool hold) {
  if (values.size() != variables.size()) {
    throw Error(ErrorCode::kInvalidArgument, "initialize needs one value vector per variable");
  }
  for (std::size_t v = 0; v < variables.size(); ++v) {
    if (values[v].size() != variables[v].size()) {
      throw Error(ErrorCode::kInvalidArgument, "initial value of '" + variables[v].name + "' has " +
                                                   std::to_string(values[v].size()) +
                                                   " elements, expected " +
                                                   std::to_string(variables[v].size()));
    }
    if (!detail::all_finite(values[v])) {
      throw Error(ErrorCode::kInvalidArgument,
                  "initial value of '" + variables[v].name + "' is not finite (NaN or Inf)");
    }
  }
  client_.register_model(variables, tables, seed_);
  const Placement& placement = client_.placement();
  std::vector<Initialize> messages(client_.num_ps());
  for (Initialize& m : messages) m.hold = hold;
  for (const Part& part : placement.parts) {
    const std::size_t row_size = variables[part.variable].row_size();
    messages[part.ps].parts.push_back(
        {static_cast<std::uint32_t>(&part - placement.parts.data()),
         std::span<const float>(values[part.variable])
             .subspan(part.rows.begin * row_size, part.rows.size() * row_size)});
  }
  client_.template broadcast<Ack>([&](std::size_t ps) { return std::move(messages[ps]); },
                                  timeouts().request_timeout, "initialize");
  return placement;
}

template <Transport T>
void Chief<T>::resume_all() noexcept {
  try {
    client_.template broadcast<Ack>([](std::size_t) { return Resume{}; },
                                    timeouts().request_timeout, "resume the ps tasks");
  } catch (const Error&) {  // a ps that is gone resumes when the chief's link closes
  }
}

template <Transport T>
void Chief<T>::end(const Shutdown& message) {
  using Clock = std::chrono::steady_clock;
  const auto answer_by = Clock::now() + timeouts().request_timeout;
  const auto retry_until = Clock::now() + std::min(timeouts().request_timeout, kEndPatience);
  // What a ps that ended already answers: finished, or (to an abort) either end.
  const auto ended = [&](ErrorCode code) {
    return code == ErrorCode::kOutOfRange || (message.aborted && code == ErrorCode::kAborted);
  };
  std::vector<std::uint32_t> left(client_.members().begin(), client_.members().end());
  std::vector<std::string> why;
  while (!left.empty()) {
    std::vector<PendingCall> calls;
    for (const std::uint32_t ps : left)
      calls.push_back(client_.transport().call(ps, Request{message}, {}));
    std::vector<std::uint32_t> again;
    why.clear();
    for (std::size_t k = 0; k < calls.size(); ++k) {
      const std::string ps = "ps " + std::to_string(left[k]);
      if (!calls[k].wait_until(answer_by)) {
        calls[k].cancel();
        throw Error(ErrorCode::kDeadlineExceeded,
                    "shutdown: " + ps + ": no answer within " +
                        std::to_string(timeouts().request_timeout.count()) + " ms");
      }
      const Response answer = calls[k].take();
      const auto* error = std::get_if<ErrorReply>(&answer);
      if (error == nullptr || ended(error->code)) continue;
      if (error->code != ErrorCode::kUnavailable)
        throw Error(error->code, "shutdown: " + ps + ": " + error->message);
      again.push_back(left[k]);
      why.push_back(ps + ": " + error->message);
    }
    left = std::move(again);
    if (left.empty() || message.aborted || Clock::now() + kEndRetry >= retry_until) break;
    std::this_thread::sleep_for(kEndRetry);
  }
  if (!left.empty()) {
    std::string reasons;
    for (const std::string& w : why) reasons += (reasons.empty() ? "" : "; ") + w;
    log(LogLevel::kWarning, "chief: the ps tasks " + describe_members(left) +
                                " could not be told that training " +
                                (message.aborted ? "was aborted" : "finished") + " (" + reasons +
                                "): each ended with its answer lost, or is gone");
  }
  // A ps that left the job and lives on (cut off for a while, or started again) ends too.
  client_.tell_others(Request{message},
                      std::min(timeouts().request_timeout, std::chrono::milliseconds(2000)));
}

}  // namespace pulley
