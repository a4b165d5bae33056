// SPDX-License-Identifier: MIT
#pragma once

/// The handshake that opens every TCP connection, before any request:
///
///   ps     → client   Challenge {job, ps task, server nonce}
///   client → ps       Hello     {job, client task, client nonce, proof}
///   ps     → client   Welcome   {proof}           or   Refusal {code, reason}, then close
///
/// On a local socket the hello's header may carry kSharedMemoryFlag, and the welcome's then
/// says whether the ps takes it: if it does, the client's next byte on the socket brings its
/// ring's memory file (or says it has none) and the ps's next byte its own, and where both
/// ends sent one the frames that follow cross those rings instead of the socket
/// (transport/detail/shared_rings.hpp).
///
/// Each proof is an HMAC-SHA-256, keyed by the job's shared secret, over everything both
/// sides said (both nonces, the job, both tasks) and which side proves: the client shows it
/// knows the secret without sending it, for this connection only (the server's nonce is
/// fresh), and the ps shows the same back, so a client never trains against a ps of another
/// job or an impostor. A ps refuses a peer of another job, without the secret or naming a
/// task it cannot be, with one logged line; such a peer never reaches the service.
///
/// What it does not do: encrypt or sign the frames that follow. Someone on the path between
/// two tasks can read parameters and inject frames into an open connection; run a job's
/// traffic over a private network or an encrypted one (WireGuard, IPsec, an SSH or stunnel
/// tunnel) where that matters (README, "Security").

#include <array>
#include <cstddef>
#include <cstdint>
#include <span>
#include <string>
#include <string_view>
#include <variant>

#include "pulley/core/detail/random.hpp"
#include "pulley/core/error.hpp"
#include "pulley/core/node.hpp"
#include "pulley/transport/detail/hmac.hpp"
#include "pulley/transport/wire/frame.hpp"

namespace pulley {

/// What a task proves when it connects: the job it belongs to and the job's shared secret.
/// Every task of a job holds the same; see `runner/credentials.hpp` for where the runner
/// takes them from (environment, a file, generated).
struct Credentials {
  /// The job's name: a ps refuses tasks of any other job (two jobs that share a port by
  /// mistake fail at once instead of training each other's model). At most 256 bytes.
  std::string job = "pulley";
  /// The shared secret. Empty: the handshake still names the job and the task, but proves
  /// nothing, and a ps says so in its log when it starts.
  std::string secret;
};

namespace wire {

/// Bytes of a handshake nonce.
inline constexpr std::size_t kNonceBytes = 32;
/// Longest job name a handshake carries.
inline constexpr std::size_t kMaxJobName = 256;
/// What a handshake frame may claim: a few hundred bytes of metadata and no payload.
inline constexpr FrameLimits kHandshakeLimits{4096, 0};

/// ps → client, first thing on a connection.
struct Challenge {
  static constexpr std::string_view kName = "Challenge";
  std::string job;         ///< the job the ps belongs to
  std::uint32_t ps = 0;    ///< its task index
  std::string nonce;       ///< kNonceBytes fresh random bytes

  template <class Archive>
  void serialize(Archive& archive) {
    archive(job, ps, nonce);
  }
};

/// client → ps, its first frame.
struct Hello {
  static constexpr std::string_view kName = "Hello";
  std::string job;    ///< the job the client belongs to
  Node peer;          ///< the client's task
  std::string nonce;  ///< kNonceBytes fresh random bytes
  std::string proof;  ///< client_proof(...)
  /// The client's process (`incarnation()`), the same on every connection it opens: a ps
  /// lets one process at a time be a task (TcpServerOptions::takeover_after). 0: unsaid.
  std::uint64_t incarnation = 0;
  /// The shard the client wants on this connection: the ps's own (`kOwnShard`), or the
  /// shard whose copy the ps holds when the job keeps copies (ps/shard_copies.hpp).
  std::uint32_t shard = kOwnShard;

  /// The ps's own shard, whatever its index.
  static constexpr std::uint32_t kOwnShard = 0xFFFFFFFFU;
  /// No shard: the connection links one worker to the next in a ring (TcpRing), and the
  /// listener is that worker (Challenge::ps then names its rank). A ps refuses it as a shard
  /// it does not hold, and the proof binds it, so neither kind of hello passes for the other.
  static constexpr std::uint32_t kRingLink = 0xFFFFFFFEU;
  /// No shard: a worker of a ring checks in with another to form the next ring
  /// (TcpRingRendezvous: after a loss, or to join). Refused by a ps, and by a ring link.
  static constexpr std::uint32_t kRingRendezvous = 0xFFFFFFFDU;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(job, peer, nonce, proof, incarnation, shard);
  }
};

/// This process's incarnation: drawn at random the first time it is asked, never 0.
inline std::uint64_t incarnation() {
  static const std::uint64_t drawn = [] {
    std::uint64_t value = 0;
    while (value == 0) pulley::detail::random_bytes(&value, sizeof value);
    return value;
  }();
  return drawn;
}

/// ps → client: the client is in.
struct Welcome {
  static constexpr std::string_view kName = "Welcome";
  std::string proof;  ///< server_proof(...)
  /// The serving process, drawn at random when it starts serving (never 0): a client that
  /// reconnects and meets another one knows the ps was started again, holding nothing.
  std::uint64_t server = 0;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(proof, server);
  }
};

/// ps → client: the client is not let in, and why; the ps closes the connection.
struct Refusal {
  static constexpr std::string_view kName = "Refusal";
  ErrorCode code = ErrorCode::kUnauthenticated;
  std::string reason;

  template <class Archive>
  void serialize(Archive& archive) {
    archive(code, reason);
  }
};

/// The handshake's messages; their frame kinds start at kHandshakeKind.
using Handshake = std::variant<Challenge, Hello, Welcome, Refusal>;
static_assert(std::variant_size_v<Handshake> == kHandshakeKinds);

/// `kNonceBytes` bytes from the operating system's random source.
inline std::string make_nonce() {
  std::string nonce(kNonceBytes, '\0');
  pulley::detail::random_bytes(nonce.data(), nonce.size());
  return nonce;
}

namespace detail {

/// The HMAC over what both sides said, each field length-prefixed so that no two
/// transcripts share bytes; `side` says who proves.
inline std::string proof(std::string_view side, const std::string& secret, const Challenge& c,
                         const Node& peer, const std::string& client_nonce, std::uint32_t shard) {
  auto field = [](std::string_view text) {
    std::string out = std::to_string(text.size()) + ":";
    out += text;
    return out;
  };
  const transport_detail::Digest digest = transport_detail::hmac_sha256(
      secret, {field("pulley handshake v1"), field(side), field(c.job),
               field(std::to_string(c.ps)), field(c.nonce), field(peer.name()),
               field(client_nonce), field(std::to_string(shard))});
  return {reinterpret_cast<const char*>(digest.data()), digest.size()};
}

}  // namespace detail

/// The client's proof that it holds `secret`, for this challenge.
inline std::string client_proof(const std::string& secret, const Challenge& c, const Node& peer,
                                const std::string& client_nonce, std::uint32_t shard = Hello::kOwnShard) {
  return detail::proof("client", secret, c, peer, client_nonce, shard);
}

/// The ps's proof that it holds `secret` too, for this challenge and hello.
inline std::string server_proof(const std::string& secret, const Challenge& c, const Hello& h) {
  return detail::proof("server", secret, c, h.peer, h.nonce, h.shard);
}

/// True if `proof` is `expected` (compared in constant time).
inline bool proof_matches(std::string_view proof, std::string_view expected) {
  return transport_detail::same_digest(
      std::span(reinterpret_cast<const std::uint8_t*>(proof.data()), proof.size()),
      std::span(reinterpret_cast<const std::uint8_t*>(expected.data()), expected.size()));
}

/// The hello a client `self` answers `challenge` with: a fresh nonce, the proof that it
/// holds `credentials.secret`, this process's incarnation, and `shard` (a ps shard, or a
/// ring's kind: Hello::kRingLink, kRingRendezvous).
inline Hello hello_for(const Credentials& credentials, const Challenge& challenge, const Node& self,
                       std::uint32_t shard = Hello::kOwnShard) {
  std::string nonce = make_nonce();
  std::string proof = client_proof(credentials.secret, challenge, self, nonce, shard);
  return Hello{credentials.job, self, std::move(nonce), std::move(proof), incarnation(), shard};
}

/// True if `welcome` proves that the server holds the secret too, for `challenge` and the
/// hello `sent` (the client's side of the handshake's last check).
inline bool welcome_proves(const Credentials& credentials, const Challenge& challenge, const Hello& sent,
                           const Welcome& welcome) {
  return proof_matches(welcome.proof, server_proof(credentials.secret, challenge, sent));
}

/// Why the ps would refuse `hello` after `challenge`, or "" when it lets it in: another job,
/// a malformed hello, a ps task as a client (unless `ps_clients`: the chief's JoinDesk
/// takes new ps tasks), or a proof that does not match the secret.
inline std::string refusal_reason(const Credentials& credentials, const Challenge& challenge,
                                  const Hello& hello, bool ps_clients = false) {
  if (hello.job != challenge.job) {
    return "a task of job '" + hello.job.substr(0, kMaxJobName) + "' connected to a ps of job '" +
           challenge.job + "'";
  }
  if (hello.nonce.size() != kNonceBytes) return "a malformed hello (nonce)";
  if (static_cast<unsigned>(hello.peer.role) > static_cast<unsigned>(Node::Role::kEvaluator)) {
    return "a hello naming an unknown job type";
  }
  if (hello.peer.role == Node::Role::kPs && !ps_clients) return "a ps task cannot connect as a client";
  if (!proof_matches(hello.proof, client_proof(credentials.secret, challenge, hello.peer, hello.nonce, hello.shard))) {
    return hello.peer.name() + " did not prove the job's shared secret (a wrong PULLEY_SECRET?)";
  }
  return {};
}

/// Throws kInvalidArgument unless `credentials` can go into a handshake.
inline void check_credentials(const Credentials& credentials) {
  if (credentials.job.empty() || credentials.job.size() > kMaxJobName) {
    throw Error(ErrorCode::kInvalidArgument,
                "a job name must have 1 to " + std::to_string(kMaxJobName) + " bytes");
  }
}

}  // namespace wire
}  // namespace pulley
