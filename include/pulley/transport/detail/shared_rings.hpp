// SPDX-License-Identifier: MIT
#pragma once

/// A TCP client's or server's connection through shared memory. Between two processes of one
/// host, on a local socket, the ends agree in the handshake (`wire::kSharedMemoryFlag` on the
/// hello and the welcome) and then hand each other a SharedRing, one per direction, over the
/// socket (send_fd); from then on every frame crosses a ring in one copy at each end, and
/// the socket carries only doorbells and the sign of a lost peer. The frames, the limits and
/// every check stay as on the socket: only the bytes' path changes.

#include <algorithm>
#include <array>
#include <asio.hpp>
#include <cerrno>
#include <chrono>
#include <cstddef>
#include <functional>
#include <memory>
#include <span>
#include <system_error>
#include <thread>
#include <utility>

#if defined(__linux__)
#include <sys/socket.h>
#endif

#include "pulley/core/spin.hpp"
#include "pulley/transport/detail/shared_ring.hpp"
#include "pulley/transport/detail/sockets.hpp"

namespace pulley::transport_detail {

/// The ring each end of a connection writes into, and the largest it maps from the other
/// end: a few strides of a large frame in flight at once (a frame larger than the ring
/// streams through it), little memory for a ps with many clients (each connection holds
/// two, had when made).
inline constexpr std::size_t kLinkRingBytes = std::size_t{1} << 20U;

/// The most bytes one copy into or out of a ring moves before the other end is told (rung,
/// when it sleeps): a large frame then streams, the reader copying out while the writer
/// copies in, instead of crossing in turns of a whole ring each.
inline constexpr std::size_t kRingStride = kLinkRingBytes / 4;

/// A connection's two rings, used in place of its socket's bytes once `start`ed: the three
/// operations the client and server use (a write of what fits now, a read of what has come,
/// a wait for room) go to the socket until then. One thread, the io_context's, uses it; at
/// most one read and one wait for room are under way at a time, as on a socket.
///
/// A read or a wait that cannot go on looks again for up to spin_before_sleep(); then it says in
/// its ring that it sleeps (the other end then rings) and parks in the one wait on the socket
/// ("the watch"), which wakes on a doorbell or on the peer's end closing (its process died or
/// closed the connection; what is left in the ring is still read before the end is
/// reported). Doorbells are taken off the socket only
/// while no watch is armed (before a first park) or by the watch's completion, which then
/// looks at both directions again: a doorbell taken by one direction's look could otherwise
/// be another's, whose armed wait would never see it (the socket no longer reads as ready
/// when epoll looks). The watch owns what is parked, so the io_context owns it, as it owns a
/// socket's handlers: nothing here keeps the connection alive. Every completion is posted,
/// each on its own, as a socket's operations complete.
class SharedRings {
 public:
  SharedRings() = default;
  SharedRings(const SharedRings&) = delete;
  SharedRings& operator=(const SharedRings&) = delete;
  ~SharedRings() { stop(); }

  /// True once started, until `stop`.
  [[nodiscard]] bool active() const noexcept { return state_ != nullptr; }

  /// From now on this end writes into `out` and reads from `in`; `socket` (which outlives the
  /// use, until `stop`) is the doorbell.
  void start(SharedRing out, SharedRing in, StreamSocket& socket) {
    auto state = std::make_shared<State>(socket);
    state->out = std::move(out);
    state->in = std::move(in);
    state_ = std::move(state);
  }

  /// Ends the use; the socket is closed or replaced next, which ends the watch, and with it
  /// what is parked, with operation_aborted, without touching any buffer. The rings are
  /// unmapped once the watch has ended.
  void stop() noexcept {
    if (!state_) return;
    state_->stopped = true;
    state_.reset();
  }

  /// As the socket's `async_read_some` (buffers: at most 16).
  template <class Buffers, class Handler>
  void async_read_some(StreamSocket& socket, const Buffers& buffers, Handler&& handler) {
    if (!state_) return socket.async_read_some(buffers, std::forward<Handler>(handler));
    ReadBuffers into;
    std::size_t total = 0;
    for (const asio::mutable_buffer& b : buffers) {
      if (into.count == into.buffers.size()) break;
      into.buffers[into.count++] = b;
      total += b.size();
    }
    if (total == 0)
      return post(*state_, ReadHandler(std::forward<Handler>(handler)), std::error_code(),
                  std::size_t{0});
    poll_read(state_, into, ReadHandler(std::forward<Handler>(handler)),
              Clock::now() + spin_before_sleep());
  }

  /// As the socket's `async_wait(wait_write)`: completes once there is room to write.
  template <class Handler>
  void async_wait_write(StreamSocket& socket, Handler&& handler) {
    if (!state_)
      return socket.async_wait(asio::socket_base::wait_write, std::forward<Handler>(handler));
    poll_write(state_, WriteHandler(std::forward<Handler>(handler)),
               Clock::now() + spin_before_sleep());
  }

  /// As `list.write_now(socket, ec)`: writes what fits now.
  bool write_now(GatherList& list, StreamSocket& socket, std::error_code& ec) {
    if (!state_) return list.write_now(socket, ec);
    Writer writer{*state_};
    return list.write_now(writer, ec);
  }

  /// True if bytes wait in the ring this end reads (once started).
  [[nodiscard]] bool has_data() const noexcept { return state_ && state_->in.has_data(); }

  /// True if the peer closed its end. For a connection at rest (nothing parked).
  [[nodiscard]] bool peer_closed() {
    if (!state_) return false;
    if (!state_->watching) drain(*state_);
    return state_->peer_gone;
  }

 private:
  using Clock = std::chrono::steady_clock;
  using ReadHandler = std::function<void(std::error_code, std::size_t)>;
  using WriteHandler = std::function<void(std::error_code)>;

  struct ReadBuffers {
    std::array<asio::mutable_buffer, 16> buffers{};
    std::size_t count = 0;
  };

  /// What waits in the watch.
  struct Parked {
    ReadHandler read;
    ReadBuffers into;
    WriteHandler write;
  };

  struct State {
    explicit State(StreamSocket& s)
        : socket(&s), doorbell(s.native_handle()), executor(s.get_executor()) {}
    SharedRing out;
    SharedRing in;
    StreamSocket* socket;  ///< valid while not `stopped`
    int doorbell;
    asio::any_io_executor executor;
    bool watching = false;         ///< the watch is armed and its completion has not run
    std::weak_ptr<Parked> parked;  ///< what it holds (it owns it)
    bool peer_gone = false;
    bool stopped = false;
  };

  /// What GatherList::write_now writes through.
  struct Writer {
    State& s;
    std::size_t write_some(std::span<const asio::const_buffer> buffers, std::error_code& ec) {
      ec.clear();
      std::size_t n = 0;
      for (const asio::const_buffer& b : buffers) {
        const std::size_t m = move_in_strides(b.size(), [&](std::size_t at, std::size_t size) {
          return s.out.write({static_cast<const std::byte*>(b.data()) + at, size}, s.doorbell);
        });
        n += m;
        if (m < b.size()) break;
      }
      if (n == 0) ec = asio::error::would_block;
      return n;
    }
  };

  /// Moves `size` bytes with `move(at, n)` (which moves what it can of n bytes from `at`
  /// and returns how many) in strides of at most kRingStride; returns how many moved.
  template <class Move>
  static std::size_t move_in_strides(std::size_t size, Move&& move) {
    std::size_t done = 0;
    while (done < size) {
      const std::size_t want = std::min(size - done, kRingStride);
      const std::size_t moved = move(done, want);
      done += moved;
      if (moved < want) break;
    }
    return done;
  }

  static std::size_t read_ring(State& s, const ReadBuffers& into) {
    std::size_t n = 0;
    for (std::size_t i = 0; i < into.count; ++i) {
      const asio::mutable_buffer& b = into.buffers[i];
      const std::size_t m = move_in_strides(b.size(), [&](std::size_t at, std::size_t size) {
        return s.in.read({static_cast<std::byte*>(b.data()) + at, size}, s.doorbell);
      });
      n += m;
      if (m < b.size()) break;
    }
    return n;
  }

  /// What parks in the watch: the one armed, else a new one.
  static Parked& park(const std::shared_ptr<State>& state) {
    State& s = *state;
    if (s.watching) {
      if (const std::shared_ptr<Parked> armed = s.parked.lock()) return *armed;
    }
    auto parked = std::make_shared<Parked>();
    s.parked = parked;
    s.watching = true;
    Parked& slot = *parked;
    s.socket->async_wait(asio::socket_base::wait_read,
                         [state, parked = std::move(parked)](std::error_code ec) {
                           State& w = *state;
                           w.watching = false;
                           ReadHandler read = std::move(parked->read);
                           WriteHandler write = std::move(parked->write);
                           if (w.stopped || ec == asio::error::operation_aborted) {
                             const std::error_code aborted = asio::error::operation_aborted;
                             if (read) post(w, std::move(read), aborted, std::size_t{0});
                             if (write) post(w, std::move(write), aborted);
                             return;
                           }
                           if (ec) {
                             w.peer_gone = true;
                           } else {
                             drain(w);
                           }
                           if (read) poll_read(state, parked->into, std::move(read), kWoken);
                           if (write) poll_write(state, std::move(write), kWoken);
                         });
    return slot;
  }

  template <class Handler, class... Args>
  static void post(State& s, Handler handler, Args... args) {
    asio::post(s.executor, [h = std::move(handler), args...] { h(args...); });
  }

  /// The `spin_end` of a look that the watch's completion makes: it has just taken the
  /// doorbells, so it neither looks again nor takes them.
  static constexpr Clock::time_point kWoken{};

  /// Looks again, `look(state, handler)`, once the io_context has run what else is ready, the
  /// core given away first. Aborted once stopped (the socket, and with it the doorbell, may
  /// be gone).
  template <class Handler, class Look>
  static void look_again(const std::shared_ptr<State>& state, Handler handler, Look look) {
    asio::post(state->executor, [state, h = std::move(handler), look]() mutable {
      if (state->stopped) return aborted(h);
      std::this_thread::yield();
      look(state, std::move(h));
    });
  }
  static void aborted(const ReadHandler& h) { h(asio::error::operation_aborted, 0); }
  static void aborted(const WriteHandler& h) { h(asio::error::operation_aborted); }

  /// Reads what has come; else looks again until `spin_end` (kWoken: from the watch's
  /// completion); else takes the doorbells, unless the watch is armed and will, and parks
  /// until the peer rings. The doorbells are taken once a spin ends, whichever look ends
  /// it: an end that closed while no wait was armed gave its one edge to nobody.
  static void poll_read(const std::shared_ptr<State>& state, const ReadBuffers& into,
                        ReadHandler handler, Clock::time_point spin_end) {
    State& s = *state;
    std::size_t n = read_ring(s, into);
    if (n == 0 && !s.peer_gone && Clock::now() < spin_end) {
      return look_again(state, std::move(handler),
                        [into, spin_end](const std::shared_ptr<State>& st, ReadHandler h) {
                          poll_read(st, into, std::move(h), spin_end);
                        });
    }
    if (n == 0 && spin_end != kWoken && !s.watching) {
      drain(s);
      n = read_ring(s, into);
    }
    std::error_code ec;
    while (n == 0 && !s.peer_gone) {
      if (s.in.reader_sleeps()) {
        Parked& parked = park(state);
        parked.read = std::move(handler);
        parked.into = into;
        return;
      }
      n = read_ring(s, into);  // bytes came meanwhile
    }
    if (n == 0) ec = asio::error::eof;
    post(s, std::move(handler), ec, n);
  }

  /// Completes once there is room; else as poll_read.
  static void poll_write(const std::shared_ptr<State>& state, WriteHandler handler,
                         Clock::time_point spin_end) {
    State& s = *state;
    if (!s.peer_gone && !s.out.has_room() && Clock::now() < spin_end) {
      return look_again(state, std::move(handler),
                        [spin_end](const std::shared_ptr<State>& st, WriteHandler h) {
                          poll_write(st, std::move(h), spin_end);
                        });
    }
    if (spin_end != kWoken && !s.watching) drain(s);
    std::error_code ec;
    if (s.peer_gone) {
      ec = asio::error::broken_pipe;
    } else if (s.out.writer_sleeps()) {
      park(state).write = std::move(handler);
      return;
    }
    post(s, std::move(handler), ec);
  }

  /// Takes every doorbell that came, and notes the peer's end closing (seen only once the
  /// bells before it are read). A peer rings once per sleep this end says it takes, so more
  /// than kMostBells waiting is a peer that does not speak the protocol: it is taken for gone.
  static void drain(State& s) {
#if defined(__linux__)
    constexpr std::size_t kMostBells = std::size_t{16} << 10U;
    std::array<char, 256> bells{};
    for (std::size_t taken = 0; taken <= kMostBells;) {
      const ssize_t n = ::recv(s.doorbell, bells.data(), bells.size(), MSG_DONTWAIT);
      if (n > 0) {
        taken += static_cast<std::size_t>(n);
        continue;
      }
      if (n < 0 && errno == EINTR) continue;
      if (n == 0 || (errno != EAGAIN && errno != EWOULDBLOCK)) s.peer_gone = true;
      return;
    }
    s.peer_gone = true;
#else
    (void)s;
#endif
  }

  std::shared_ptr<State> state_;
};

}  // namespace pulley::transport_detail
