// SPDX-License-Identifier: MIT
#pragma once

#include <cstdint>
#include <stdexcept>
#include <string>
#include <string_view>

namespace pulley {

/// Why a request failed. The names follow gRPC's status codes, which TensorFlow's
/// distributed runtime reports too, so a TF user reads them without a glossary.
enum class ErrorCode : std::uint8_t {
  kInvalidArgument = 1,     ///< the request itself is wrong (shape mismatch, NaN gradient)
  kNotFound = 2,            ///< an unknown variable or part
  kAlreadyExists = 3,       ///< duplicate initialization
  kFailedPrecondition = 4,  ///< e.g. a push before the variables are initialized
  kUnavailable = 5,         ///< the peer is dead or unreachable
  kDeadlineExceeded = 6,    ///< no answer in time (a dropped message ends here)
  kCancelled = 7,           ///< the caller gave the request up
  kOutOfRange = 8,          ///< training is over: the chief ended it (TF's OutOfRangeError)
  kAborted = 9,             ///< the chief aborted training
  kInternal = 10,           ///< a ps failed while handling a request (a policy threw)
  kPermissionDenied = 11,   ///< the sender's role may not make this request
  kUnauthenticated = 12,    ///< a peer of another job, or without the job's secret
  kDataLoss = 13,           ///< stored data that is corrupt or truncated (a checkpoint)
  kResourceExhausted = 14,  ///< a limit is reached (rows of a table on one ps)
};

/// Stable lower-case name of a code, for logs and error messages.
constexpr std::string_view to_string(ErrorCode code) noexcept {
  switch (code) {
    case ErrorCode::kInvalidArgument:
      return "invalid_argument";
    case ErrorCode::kNotFound:
      return "not_found";
    case ErrorCode::kAlreadyExists:
      return "already_exists";
    case ErrorCode::kFailedPrecondition:
      return "failed_precondition";
    case ErrorCode::kUnavailable:
      return "unavailable";
    case ErrorCode::kDeadlineExceeded:
      return "deadline_exceeded";
    case ErrorCode::kCancelled:
      return "cancelled";
    case ErrorCode::kOutOfRange:
      return "out_of_range";
    case ErrorCode::kAborted:
      return "aborted";
    case ErrorCode::kInternal:
      return "internal";
    case ErrorCode::kPermissionDenied:
      return "permission_denied";
    case ErrorCode::kUnauthenticated:
      return "unauthenticated";
    case ErrorCode::kResourceExhausted:
      return "resource_exhausted";
    case ErrorCode::kDataLoss:
      return "data_loss";
  }
  return "unknown";
}

/// The exception every pulley call throws for a failed request; `code()` says which kind.
class Error : public std::runtime_error {
 public:
  Error(ErrorCode code, const std::string& message)
      : std::runtime_error(std::string(to_string(code)) + ": " + message), code_(code) {}

  /// Which kind of failure.
  [[nodiscard]] ErrorCode code() const noexcept { return code_; }
  /// The message without the code's name in front.
  [[nodiscard]] const char* message() const noexcept {
    return what() + to_string(code_).size() + 2;
  }

 private:
  ErrorCode code_;
};

}  // namespace pulley
