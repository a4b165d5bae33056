// SPDX-License-Identifier: MIT
#pragma once

#include <sys/socket.h>

#include <algorithm>
#include <asio.hpp>
#include <cerrno>
#include <chrono>
#include <cstdint>
#include <deque>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "pulley/concepts/transport.hpp"
#include "pulley/core/address.hpp"
#include "pulley/core/node.hpp"
#include "pulley/protocol/call.hpp"
#include "pulley/transport/detail/reply_targets.hpp"
#include "pulley/transport/detail/sockets.hpp"
#include "pulley/transport/tcp_options.hpp"
#include "pulley/transport/wire/codec.hpp"
#include "pulley/transport/wire/frame_reader.hpp"
#include "pulley/transport/wire/handshake.hpp"

namespace pulley {

/// The TCP `Transport`: one connection per ps task. Tensors are gather-written from the
/// caller's own buffers, and a reply's tensors are received straight into the call's
/// targets.
///
/// It has no thread of its own: its I/O runs on the caller's thread while the caller waits
/// on a PendingCall (the client waits right after sending). Requests made before a wait
/// leave together when it begins, one gather-write per ps (a push and its pull in one), to
/// every ps at once; replies are read as they arrive, several per receive when small. A
/// round trip thus costs the network's two wake-ups and no thread hand-off. The price: a
/// Tcp and its PendingCalls are used from one thread at a time, and a transfer moves only
/// while that thread waits.
///
/// Every connection opens with the handshake: the client proves its job, its task and the
/// job's secret, and the ps proves the same back, naming its task index. A ps of another
/// job, one that cannot prove the secret, or one listed at the wrong index is refused at
/// once with a message that says so (kUnauthenticated), and so is this client by a ps that
/// refuses it; neither is retried while the transport is made. A refusal for now (its task
/// is another live process's: TcpServerOptions::takeover_after) is retried as an
/// unreachable ps is, within `connect_timeout`, then fails kUnavailable.
///
/// A lost connection fails the calls waiting on it with kUnavailable (whether a request in
/// flight was handled is then unknown). The next call to that ps reconnects first (one
/// attempt, `attempt_timeout`), so a ps that restarts on the same address is reached
/// again; a restarted ps has lost its state and says so (kFailedPrecondition) until the
/// chief initializes it anew. A caller that gives up on a call in the middle of its
/// transfer (its deadline passed while a stalled peer was not reading) closes that
/// connection, the only way to stop a transfer half done.
class Tcp {
 public:
  /// Connects task `self` to every ps ("host:port", by task index), retrying with backoff
  /// while they start; throws kInvalidArgument for a malformed address (`parse_address`) or
  /// job name, kUnavailable naming the first address that stays unreachable, and
  /// kUnauthenticated when a ps and this task do not belong to the same job (or secret).
  Tcp(Node self, const std::vector<std::string>& ps_addresses, TcpOptions options = {})
      : impl_(std::make_unique<Impl>(self, parse_all(ps_addresses), std::move(options))) {}
  /// The same with parsed addresses.
  Tcp(Node self, std::vector<Address> ps_addresses, TcpOptions options = {})
      : impl_(std::make_unique<Impl>(self, std::move(ps_addresses), std::move(options))) {}

  /// Number of ps tasks.
  [[nodiscard]] std::size_t num_ps() const noexcept { return impl_->num_ps(); }

  /// Sends `request` to ps `ps`; see the Transport concept for the contract.
  PendingCall call(std::size_t ps, Request&& request, PullTargets targets = {}) {
    return impl_->call(ps, std::move(request), std::move(targets));
  }

 private:
  static std::vector<Address> parse_all(const std::vector<std::string>& addresses) {
    std::vector<Address> parsed;
    for (const std::string& a : addresses) parsed.push_back(parse_address(a));
    return parsed;
  }

  /// One call: what the caller shares with the transport, and the frame to send.
  struct Pending : CallControl {
    Pending(CallDriver* driver, std::size_t task) : CallControl(driver), ps(task) {}
    std::size_t ps;
    PullTargets targets;
    wire::Frame frame;            ///< its payload views alias the caller's tensors
    std::uint64_t frame_end = 0;  ///< where its frame ends in the link's write list
    bool writing = false;         ///< in the write list, not all written: one use
    bool sent = false;            ///< its frame is written whole: a reply may come
  };
  using PendingPtr = std::shared_ptr<Pending>;

  enum class State { kConnected, kConnecting, kHandshaking, kBroken };

  /// One connection. Every handler captures the `generation` it was started in and ignores
  /// its completion once the connection was replaced.
  struct Link {
    Link(asio::io_context& io, Address where, const wire::FrameLimits& limits)
        : address(where.to_string()),
          host(std::move(where.host)),
          port(std::to_string(where.port)),
          socket(io),
          resolver(io),
          timer(io),
          reader(limits) {}

    std::string address;  ///< "host:port", for messages
    std::string host;
    std::string port;
    asio::ip::tcp::socket socket;
    asio::ip::tcp::resolver resolver;
    asio::steady_timer timer;  ///< bounds a connection attempt
    State state = State::kBroken;
    std::uint64_t generation = 0;
    std::string broken_reason = "not connected";
    std::optional<ErrorReply> refused;   ///< the last handshake failed for good: why
    std::optional<wire::Challenge> challenge;  ///< the ps's, while handshaking
    std::string nonce;                   ///< this side's, while handshaking
    wire::Frame hello;                   ///< being written, while handshaking
    std::function<void(std::error_code)> connected;  ///< the attempt's `done`
    wire::FrameReader reader;
    transport_detail::ReceiveBuffers receive_buffers;
    std::map<std::uint64_t, PendingPtr> pending;  ///< sent or queued, awaiting a reply
    std::deque<PendingPtr> outbox;                ///< made since the caller last waited
    std::deque<PendingPtr> writing;               ///< in write_list, not all written yet
    transport_detail::GatherList write_list;      ///< their frames, as the kernel takes them
    bool write_waiting = false;                   ///< waits for the socket to take more
    bool receiving = false;                       ///< a receive is armed
    PendingPtr reading;         ///< the call whose reply is being received into its targets
    Response reading_response;  ///< that reply, decoded but for its tensors' values
    std::vector<std::size_t> sizes;  ///< scratch: tensor sizes of a reply to route
    std::chrono::steady_clock::time_point last_active;  ///< the last reply, or connection
  };

  class Impl final : public CallDriver {
   public:
    Impl(Node self, std::vector<Address> addresses, TcpOptions options)
        : self_(self), options_(std::move(options)) {
      wire::check_credentials(options_.credentials);
      for (Address& address : addresses) {
        links_.push_back(std::make_unique<Link>(io_, std::move(address), options.limits));
      }
      for (auto& link : links_) connect_with_backoff(*link);
    }

    Impl(const Impl&) = delete;
    Impl& operator=(const Impl&) = delete;

    ~Impl() {
      // Every call still waiting is answered kUnavailable, so none waits on this driver.
      for (auto& link : links_) fail(*link, "transport closed");
    }

    [[nodiscard]] std::size_t num_ps() const noexcept { return links_.size(); }

    PendingCall call(std::size_t ps, Request&& request, PullTargets targets) {
      auto pending = std::make_shared<Pending>(this, ps);
      pending->targets = std::move(targets);
      PendingCall result(pending);
      if (ps >= links_.size()) {
        pending->answer(
            ErrorReply{ErrorCode::kInvalidArgument, "no ps task " + std::to_string(ps)});
        return result;
      }
      Link& link = *links_[ps];
      if (link.state == State::kConnected && link.pending.empty() && closed_while_quiet(link)) {
        fail(link, "closed by the ps while idle");  // reconnect below, not fail this call
      }
      const std::uint64_t id = next_call_++;
      // The payload views alias the request's tensors (the caller's buffers), which stay
      // valid until the call is answered or cancelled; the rest is serialized here.
      pending->frame = wire::encode(request, id);
      link.pending.emplace(id, pending);
      link.outbox.push_back(std::move(pending));
      if (link.state == State::kBroken) connect(link, [](std::error_code) {});
      return result;
    }

    void run_until(const std::function<bool()>& done,
                   std::chrono::steady_clock::time_point deadline) override {
      for (auto& link : links_) {
        flush(*link);
        receive(*link);
      }
      while (!done()) {
        if (deadline <= std::chrono::steady_clock::now()) {
          io_.poll();  // what already arrived
          return;
        }
        io_.run_one_until(deadline);
      }
    }

    /// True if the ps closed a connection that has been quiet for a second or more (it
    /// closes idle ones: TcpServerOptions::idle_timeout), so that a call made now goes out
    /// on a new connection instead of failing on the old one. A busy link is not asked:
    /// one look costs a system call.
    static bool closed_while_quiet(Link& link) {
      const auto now = std::chrono::steady_clock::now();
      if (now - link.last_active < std::chrono::seconds(1)) return false;
      link.last_active = now;
      char byte = 0;
      const ssize_t n = ::recv(link.socket.native_handle(), &byte, 1, MSG_PEEK | MSG_DONTWAIT);
      return n == 0 || (n < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
    }

    void abort(CallControl& call) override {
      auto& pending = static_cast<Pending&>(call);
      Link& link = *links_[pending.ps];
      if (pending.writing || link.reading.get() == &pending) {
        fail(link, "a call was given up mid-transfer");
      }
    }

   private:
    void connect_with_backoff(Link& link) {
      const auto deadline = std::chrono::steady_clock::now() + options_.connect_timeout;
      auto backoff = options_.initial_backoff;
      for (;;) {
        bool done = false;
        connect(link, [&](std::error_code) { done = true; });
        while (!done) io_.run_one();
        if (link.state == State::kConnected) return;
        if (link.refused) throw Error(link.refused->code, link.refused->message);
        if (std::chrono::steady_clock::now() + backoff > deadline) break;
        std::this_thread::sleep_for(backoff);
        backoff = std::min(backoff * 2, std::chrono::milliseconds(1000));
      }
      throw Error(ErrorCode::kUnavailable, "ps at " + link.address + " unreachable for " +
                                               std::to_string(options_.connect_timeout.count()) +
                                               " ms: " + link.broken_reason);
    }

    /// One connection attempt of at most attempt_timeout, handshake included; `done(ec)`
    /// follows, with the link connected (and receiving) or broken with the reason (and
    /// `refused` set when the handshake failed for good).
    template <class Done>
    void connect(Link& link, Done done) {
      const std::uint64_t gen = ++link.generation;
      link.state = State::kConnecting;
      link.socket = asio::ip::tcp::socket(io_);
      link.refused.reset();
      link.connected = std::move(done);
      auto timed_out = std::make_shared<bool>(false);
      link.timer.expires_after(options_.attempt_timeout);
      link.timer.async_wait([this, &link, gen, timed_out](std::error_code ec) {
        if (ec || gen != link.generation ||
            (link.state != State::kConnecting && link.state != State::kHandshaking)) {
          return;
        }
        *timed_out = true;
        link.resolver.cancel();
        if (link.state == State::kHandshaking) {
          return fail(link, "no handshake within " +
                                std::to_string(options_.attempt_timeout.count()) + " ms");
        }
        std::error_code ignored;
        link.socket.close(ignored);
      });
      auto finish = [this, &link, gen, timed_out](std::error_code ec) {
        if (gen != link.generation) return;
        if (!ec) link.socket.set_option(asio::ip::tcp::no_delay(true), ec);
        if (!ec) link.socket.non_blocking(true, ec);  // requests are first written directly
        if (ec) {
          link.timer.cancel();
          link.state = State::kBroken;
          link.broken_reason = *timed_out
                                   ? "no connection within " +
                                         std::to_string(options_.attempt_timeout.count()) + " ms"
                                   : ec.message();
          fail_all(link);
          return connected(link, ec);
        }
        // Connected: the ps speaks first (its challenge), and the handshake follows.
        link.state = State::kHandshaking;
        link.reader.reset();
        link.reader.set_limits(wire::kHandshakeLimits);
        link.receive_buffers = {};  // a new socket: low watermark 1
        link.receiving = false;
        receive(link);
      };
      // A numeric address needs no resolver (whose first use starts a thread).
      std::error_code not_numeric;
      const asio::ip::address numeric = asio::ip::make_address(link.host, not_numeric);
      if (!not_numeric) {
        const asio::ip::tcp::endpoint endpoint(numeric, static_cast<std::uint16_t>(std::stoi(link.port)));
        link.socket.async_connect(endpoint, [finish](std::error_code ec) mutable { finish(ec); });
        return;
      }
      link.resolver.async_resolve(
          link.host, link.port,
          [&link, finish](std::error_code ec,
                          asio::ip::tcp::resolver::results_type endpoints) mutable {
            if (ec) return finish(ec);
            asio::async_connect(link.socket, endpoints,
                                [finish](std::error_code ec2,
                                         const asio::ip::tcp::endpoint&) mutable { finish(ec2); });
          });
    }

    /// Ends a connection attempt: calls its `done`.
    static void connected(Link& link, std::error_code ec) {
      if (auto done = std::exchange(link.connected, nullptr)) done(ec);
    }

    /// A handshake frame from the ps: its challenge (answered with this task's hello), then
    /// its welcome (checked: it must prove the secret too) or its refusal.
    void on_handshake(Link& link, const wire::FrameReader::Frame& frame) {
      wire::Handshake message = wire::decode_handshake(frame.header, frame.meta);
      if (!link.challenge) {
        auto* challenge = std::get_if<wire::Challenge>(&message);
        if (challenge == nullptr) throw wire::Malformed("the ps did not open with a challenge");
        if (challenge->job != options_.credentials.job) {
          return refuse(link, "it serves job '" + challenge->job.substr(0, wire::kMaxJobName) +
                                  "', and this task belongs to job '" + options_.credentials.job + "'");
        }
        if (challenge->ps != task_of(link)) {
          return refuse(link, "it is ps " + std::to_string(challenge->ps) + ", but is listed as ps " +
                                  std::to_string(task_of(link)) + " (are the ps addresses in task order?)");
        }
        if (challenge->nonce.size() != wire::kNonceBytes) throw wire::Malformed("a malformed challenge");
        link.challenge = std::move(*challenge);
        link.nonce = wire::make_nonce();
        link.hello = wire::encode(
            wire::Handshake{wire::Hello{options_.credentials.job, self_, link.nonce,
                                        wire::client_proof(options_.credentials.secret,
                                                           *link.challenge, self_, link.nonce),
                                        wire::incarnation()}},
            0);
        link.write_list.append(link.hello);
        return flush(link);
      }
      if (auto* refusal = std::get_if<wire::Refusal>(&message)) {
        // Its words are quoted, its code is not trusted: whoever answers on the port has
        // proved nothing yet, and must not make a worker believe training finished.
        const std::string said = refusal->reason.substr(0, 1024);
        // kUnavailable only asks for a retry (its task is held by a process still heard):
        // the worst an impostor gets from it is retries until the recovery timeout.
        if (refusal->code == ErrorCode::kUnavailable) return fail(link, "refused by the ps for now: " + said);
        link.refused = ErrorReply{ErrorCode::kUnauthenticated,
                                  "ps at " + link.address + " refused the connection: \"" + said + "\""};
        return fail(link, "refused by the ps: " + said);
      }
      auto* welcome = std::get_if<wire::Welcome>(&message);
      if (welcome == nullptr) throw wire::Malformed("the ps answered the hello with neither welcome nor refusal");
      const wire::Hello said{options_.credentials.job, self_, link.nonce, {}};
      if (!wire::proof_matches(welcome->proof, wire::server_proof(options_.credentials.secret,
                                                                  *link.challenge, said))) {
        return refuse(link, "it did not prove the job's shared secret (a ps of another job, or a "
                            "wrong PULLEY_SECRET?)");
      }
      link.challenge.reset();
      link.timer.cancel();
      link.state = State::kConnected;
      link.last_active = std::chrono::steady_clock::now();
      link.reader.set_limits(options_.limits);
      flush(link);  // the receive handler that brought the welcome arms the next receive
      connected(link, {});
    }

    /// This side refuses the ps it reached, for good.
    void refuse(Link& link, const std::string& why) {
      const std::string reason = "ps at " + link.address + " cannot be used: " + why;
      link.refused = ErrorReply{ErrorCode::kUnauthenticated, reason};
      fail(link, why);
    }

    [[nodiscard]] std::uint32_t task_of(const Link& link) const {
      for (std::size_t i = 0; i < links_.size(); ++i) {
        if (links_[i].get() == &link) return static_cast<std::uint32_t>(i);
      }
      return 0;
    }

    /// Writes the requests made since the last wait in one gather-write, straight from their
    /// buffers: what the kernel takes now, the rest as the socket drains. A call's use of
    /// its buffers ends once its own frame is written.
    void flush(Link& link) {
      if (link.state != State::kConnected && link.state != State::kHandshaking) return;
      while (link.state == State::kConnected && !link.outbox.empty()) {
        PendingPtr out = std::move(link.outbox.front());
        link.outbox.pop_front();
        if (!out->begin_use()) {  // given up before it went out: forget it
          link.pending.erase(out->frame.header.call);
          out->detach_driver();
          continue;
        }
        link.write_list.append(out->frame);
        out->frame_end = link.write_list.appended();
        out->writing = true;
        link.writing.push_back(std::move(out));
      }
      if (link.write_waiting || link.write_list.empty()) return;
      std::error_code ec;
      if (!link.write_list.write_now(link.socket, ec)) return fail(link, ec.message());
      while (!link.writing.empty() &&
             link.writing.front()->frame_end <= link.write_list.written()) {
        end_writing(*link.writing.front());
        link.writing.pop_front();
      }
      if (link.write_list.empty()) return link.write_list.clear();
      link.write_waiting = true;
      link.socket.async_wait(asio::socket_base::wait_write,
                             [this, &link, gen = link.generation](std::error_code wait) {
                               if (gen != link.generation) return;  // fail() reset the link
                               link.write_waiting = false;
                               if (wait) return fail(link, wait.message());
                               flush(link);
                             });
    }

    static void end_writing(Pending& p) {
      if (!std::exchange(p.writing, false)) return;
      p.sent = true;
      p.end_use();
    }

    /// The call a reply answers, or null if nobody waits for it any more. Throws Malformed
    /// for a reply to a request not yet sent whole: the ps answered bytes it cannot have
    /// received, so the stream is not to be trusted.
    static Pending* replied(Link& link, std::uint64_t call) {
      const auto it = link.pending.find(call);
      if (it == link.pending.end()) return nullptr;
      if (!it->second->sent) throw wire::Malformed("a reply to a request not yet sent whole");
      return it->second.get();
    }

    /// Arms a receive while calls wait for replies on the link. Between calls none is armed:
    /// re-arming right after the last reply would cost the caller a receive that finds
    /// nothing; a connection that broke meanwhile is noticed by the next call.
    void receive(Link& link) {
      if (link.receiving) return;
      if (link.state != State::kHandshaking && (link.state != State::kConnected || link.pending.empty())) {
        return;
      }
      link.receiving = true;
      link.receive_buffers.watermark(link.socket, link.reader.payload_left());
      link.socket.async_read_some(
          link.receive_buffers.of(link.reader.buffers()),
          [this, &link, gen = link.generation](std::error_code ec, std::size_t n) {
            if (gen != link.generation) return;
            link.receiving = false;
            if (ec) return fail(link, ec.message());
            try {
              link.reader.commit(n);  // may fail to grow a payload buffer
              while (auto frame =
                         link.reader.next([&](const wire::Header& h, std::span<const char> meta) {
                           return route(link, h, meta);
                         })) {
                if (link.state == State::kHandshaking) {
                  on_handshake(link, *frame);
                  if (link.state != State::kConnected && link.state != State::kHandshaking) return;
                } else {
                  on_reply(link, *frame);
                }
              }
            } catch (const std::exception& e) {  // a bad frame, or no memory: this link only
              return fail(link, e.what());
            }
            receive(link);
          });
    }

    /// Where a reply's payload goes: a reply whose tensors fit its call's targets one for
    /// one goes straight into them; anything else stays in the reader (and is decoded from
    /// there).
    static std::span<const std::span<float>> route(Link& link, const wire::Header& header,
                                                   std::span<const char> meta) {
      if (link.state != State::kConnected) return {};   // the handshake has no payload
      if (header.kind < wire::kResponseKind) return {};  // not a reply: on_reply refuses it
      if (replied(link, header.call) == nullptr) return {};
      const PendingPtr& pending = link.pending.at(header.call);
      if (pending->targets.empty()) return {};
      Response response = wire::decode_response_meta(header, meta, link.sizes);
      const auto& targets = pending->targets;
      bool fits = link.sizes.size() == targets.size();
      for (std::size_t i = 0; fits && i < targets.size(); ++i) {
        fits = link.sizes[i] == targets[i].size();
      }
      if (!fits || !pending->begin_use()) return {};  // a misfit, or a call given up
      link.reading = pending;
      link.reading_response = std::move(response);
      return targets;
    }

    static void on_reply(Link& link, const wire::FrameReader::Frame& frame) {
      replied(link, frame.header.call);  // throws for a reply before its request
      link.last_active = std::chrono::steady_clock::now();
      const auto it = link.pending.find(frame.header.call);
      if (frame.routed) {
        const PendingPtr pending = std::exchange(link.reading, nullptr);
        Response response = std::move(link.reading_response);
        detail::point_at(response, pending->targets);
        pending->answer(std::move(response));
        pending->end_use();
        link.pending.erase(it);
        return;
      }
      Response response = wire::decode_response(frame.header, frame.meta, frame.payload);
      if (it == link.pending.end()) return;  // an answer nobody waits for any more
      Pending& pending = *it->second;
      if (!std::holds_alternative<ErrorReply>(response)) {
        bool fits = true;  // (a caller that gave up gets no copy, and no answer)
        pending.unless_cancelled([&] { fits = detail::copy_into(response, pending.targets); });
        if (!fits) {
          response = ErrorReply{ErrorCode::kInvalidArgument, "reply does not fit its targets"};
        }
      }
      pending.answer(std::move(response));
      link.pending.erase(it);
    }

    static Response unavailable(const Link& link) {
      if (link.refused) return ErrorReply{*link.refused};
      return ErrorReply{ErrorCode::kUnavailable,
                        "connection to ps at " + link.address + " lost: " + link.broken_reason};
    }

    /// Every call waiting on the link, sent or queued, fails with kUnavailable.
    static void fail_all(Link& link) {
      link.outbox.clear();
      for (auto& [id, pending] : std::exchange(link.pending, {})) {
        pending->answer(unavailable(link));
        pending->detach_driver();  // answered or given up: it needs the transport no more
      }
    }

    /// The connection is gone: its handlers become stale, the uses of callers' buffers
    /// end, everything waiting on it fails, and the next call reconnects.
    void fail(Link& link, const std::string& reason) {
      if (link.state == State::kBroken) return;
      link.state = State::kBroken;
      link.broken_reason = reason;
      ++link.generation;
      std::error_code ignored;
      link.timer.cancel();
      link.resolver.cancel();
      link.socket.close(ignored);  // the operations under way end without touching buffers
      for (const PendingPtr& p : std::exchange(link.writing, {})) end_writing(*p);
      link.write_list.clear();
      link.write_waiting = false;  // its wait completes as stale
      if (link.reading) std::exchange(link.reading, nullptr)->end_use();
      link.reader.reset();
      link.challenge.reset();
      fail_all(link);
      connected(link, asio::error::connection_aborted);  // an attempt under way ends
    }

    Node self_;
    TcpOptions options_;
    asio::io_context io_{1};
    asio::executor_work_guard<asio::io_context::executor_type> work_ =
        asio::make_work_guard(io_);             ///< waits block until their deadline, never run dry
    std::vector<std::unique_ptr<Link>> links_;  ///< by ps task; destroyed before io_
    std::uint64_t next_call_ = 1;
  };

  std::unique_ptr<Impl> impl_;
};
static_assert(Transport<Tcp>);

}  // namespace pulley
