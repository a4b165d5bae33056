// SPDX-License-Identifier: MIT
#pragma once

/// ParameterServer's answers, refusals and failure (declared in ps/parameter_server.hpp,
/// which includes this header after the class): what every handler replies with, and the
/// checks of a request's sender, epoch and readiness.

#include "pulley/ps/parameter_server.hpp"

namespace pulley {

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::reject(Responder& reply, ErrorCode code,
                                         const std::string& message) {
  ++stats_.requests_rejected;
  std::string line = name_ + ": " + message;
  rejections_(LogLevel::kWarning, line);
  respond(reply, ErrorReply{code, std::move(line)});
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
bool ParameterServer<S, O, P, T>::refused(Responder& reply, std::optional<ErrorReply>&& refusal) {
  if (!refusal) return false;
  reject(reply, refusal->code, refusal->message);
  return true;
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::settle(Responder& reply, ErrorCode code, const char* what,
                                         std::string_view request) noexcept {
  try {
    if (!changing_) {
      if (reply) reject(reply, code, std::string(request) + " refused: " + what);
      return;
    }
    fail("a policy threw while applying a " + std::string(request) + ": " + what);
    if (reply) respond(reply, ErrorReply{*end_});
  } catch (...) {  // no memory even for the message
    end_ = ErrorReply{ErrorCode::kInternal, {}};
    if (reply) respond(reply, ErrorReply{ErrorCode::kInternal, {}});
  }
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::fail(const std::string& reason) {
  end_ = ErrorReply{ErrorCode::kInternal, name_ + " failed: " + reason};
  log(LogLevel::kError, end_->message);
  answer_all_waiting(*end_);
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::fail_quietly(const std::string& reason) noexcept {
  try {
    fail(reason);
  } catch (...) {  // no memory even for the message
    end_ = ErrorReply{ErrorCode::kInternal, {}};
  }
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
void ParameterServer<S, O, P, T>::answer_all_waiting(const ErrorReply& answer) {
  registration_.answer_all(answer);
  pacing_.answer_all(answer);
  pulls_.answer_all(answer);
  row_pulls_.answer_all(answer);
  cut_.answer_all(answer);
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
bool ParameterServer<S, O, P, T>::is_sender(std::uint32_t worker, const RequestContext& context,
                                            Responder& reply, std::string_view what) {
  if (context.peer && context.peer->index != worker) {
    reject(reply, ErrorCode::kPermissionDenied,
           "refused " + std::string(what) + " for worker " + std::to_string(worker) + " from " +
               context.peer->name());
    return false;
  }
  if (worker >= JobWorkers::kMaxIndex) {
    reject(reply, ErrorCode::kInvalidArgument,
           "worker index " + std::to_string(worker) + " is too large");
    return false;
  }
  return true;
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
std::optional<ErrorReply> ParameterServer<S, O, P, T>::of_epoch(std::optional<ErrorReply> problem,
                                                                std::uint64_t epoch,
                                                                std::string_view what) const {
  if (problem && epoch < registration_.epoch()) return registration_.check_epoch(epoch, what);
  return problem;
}

template <Sharding S, Optimizer O, SyncPolicy P, TablesOrNone T>
bool ParameterServer<S, O, P, T>::is_ready(Responder& reply, std::string_view what) {
  if (registration_.ready()) return true;
  reject(reply, ErrorCode::kFailedPrecondition, std::string(what) + " before initialization");
  return false;
}

}  // namespace pulley
