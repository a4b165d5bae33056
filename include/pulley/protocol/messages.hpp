// SPDX-License-Identifier: MIT
#pragma once

#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

#include "pulley/core/error.hpp"
#include "pulley/core/node.hpp"
#include "pulley/protocol/messages/checkpoint.hpp"
#include "pulley/protocol/messages/fields.hpp"
#include "pulley/protocol/messages/membership.hpp"
#include "pulley/protocol/messages/monitoring.hpp"
#include "pulley/protocol/messages/training.hpp"

namespace pulley {

// The protocol between clients (workers, the chief, the evaluator) and ps tasks. Every
// transport carries exactly these structs: in-process they are moved, over TCP they are
// encoded. A message is declared once, in the header of its concern under
// protocol/messages/ (training, checkpoint, membership, monitoring; the fields they share
// in fields.hpp; Ack and ErrorReply, which answer any request, here), and listed here in Request or
// Response, whose order gives each message its tag on the wire. A message declares:
//
//   - `kName`, for logs and errors;
//   - `serialize(archive)` lists its fields in wire order, for cereal and for pulley's own
//     walkers. A `std::span<const float>` field is a tensor: its size travels with the
//     other fields, its values in the frame's payload, in field order, so that a sender
//     writes them from its own buffers and a receiver reads them into place;
//   - `kChangesParameters = true` on a request that may change the ps's parameters, by
//     itself or by what it sets off (a push held, a step that waited for a worker found
//     lost): a transport must not let a reply still being sent see them change;
//   - `kSenders`, on a request: the roles whose tasks may send it (the ps refuses it from
//     any other with `kPermissionDenied`): only the chief registers, initializes and ends
//     training, only workers take tokens and push, evaluators only read.
//
// Adding a message is its declaration in the header of its concern, its place in Request
// or Response here (with `wire::kVersion` bumped: the tags change), and its handler in the
// ps (an `on` overload in ps/parameter_server.hpp, which hands it to the part that owns
// what it reads or changes).
//
// Tensors are views, never owned vectors. A view in a request stays valid until its call
// is answered or cancelled. A view in a reply stays valid and unchanged until the service
// handles a request that `changes_parameters` (see Responder, concepts/service.hpp): a
// transport copies it to the caller's destination, or writes it onto the wire, before then.

/// Everything a ps task (or the chief's JoinDesk: Join, Leave, Shape, LostPs) is asked.
using Request = std::variant<Register, Initialize, WaitReady, TakeToken, Pull, Push, GetStats,
                             Shutdown, Pause, ReadState, Resume, Restore, Heartbeat, PullRows,
                             ReadRows, RestoreRows, Join, ChangeWorkers, Leave, Shape, LostPs>;

/// Success with nothing to say.
struct Ack {
  static constexpr std::string_view kName = "Ack";

  template <class Archive>
  void serialize(Archive& /*archive*/) {}
};

/// A refused or failed request.
struct ErrorReply {
  static constexpr std::string_view kName = "ErrorReply";
  ErrorCode code = ErrorCode::kInvalidArgument;
  std::string message;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(code, message);
  }
};

/// Everything a ps task answers.
using Response = std::variant<Ack, ErrorReply, PlacementReply, TokenReply, PullReply, PushReply,
                              StatsReply, PauseReply, StateReply, RowsReply, RowsChunk, JoinReply, LeaveReply,
                              ShapeReply, LostPsReply>;

// ---- what follows from the declarations ---------------------------------------------------

/// True for a message declared with `kChangesParameters = true`.
template <class Message>
inline constexpr bool changes_parameters_v = [] {
  if constexpr (requires { Message::kChangesParameters; }) {
    return Message::kChangesParameters;
  } else {
    return false;
  }
}();

/// The roles that may send `request` (its declared `kSenders`).
inline RoleSet senders(const Request& request) noexcept {
  return std::visit([](const auto& m) { return std::remove_cvref_t<decltype(m)>::kSenders; },
                    request);
}

/// True if handling `request` may change the ps's parameters.
inline bool changes_parameters(const Request& request) noexcept {
  return std::visit(
      [](const auto& m) { return changes_parameters_v<std::remove_cvref_t<decltype(m)>>; },
      request);
}

/// The declared name of the message a Request or Response holds.
template <class Variant>
std::string_view message_name(const Variant& message) noexcept {
  return std::visit([](const auto& m) { return std::remove_cvref_t<decltype(m)>::kName; },
                    message);
}

namespace detail {

/// Walks a message's fields as its `serialize` lists them, calling `f` on each tensor.
template <class F>
class TensorWalker {
 public:
  explicit TensorWalker(F& f) : f_(f) {}

  template <class... Fields>
  void operator()(Fields&... fields) {
    (visit(fields), ...);
  }

 private:
  void visit(std::span<const float>& tensor) { f_(tensor); }
  template <class T, class A>
  void visit(std::vector<T, A>& items) {
    if constexpr (!std::is_arithmetic_v<T> && !std::is_same_v<T, std::string>) {
      for (T& item : items) visit(item);
    }
  }
  template <class T>
  void visit(T& field) {
    if constexpr (requires(TensorWalker& w) { field.serialize(w); }) field.serialize(*this);
  }

  F& f_;
};

}  // namespace detail

/// Calls `f(std::span<const float>&)` on every tensor of `message` (a message struct, a
/// Request or a Response), in wire order. `f` may re-point the views.
template <class Message, class F>
void for_each_tensor(Message& message, F&& f) {
  if constexpr (requires { std::visit([](auto&) {}, message); }) {
    std::visit([&](auto& m) { for_each_tensor(m, f); }, message);
  } else {
    detail::TensorWalker<std::remove_reference_t<F>> walker(f);
    message.serialize(walker);
  }
}

/// Returns the reply of type `T` or throws the Error the server sent.
template <class T>
T expect(Response&& response) {
  if (auto* error = std::get_if<ErrorReply>(&response)) throw Error(error->code, error->message);
  if (auto* reply = std::get_if<T>(&response)) return std::move(*reply);
  throw Error(ErrorCode::kInvalidArgument, "unexpected reply kind " +
                                               std::string(message_name(response)) +
                                               " from server, expected " + std::string(T::kName));
}

}  // namespace pulley
