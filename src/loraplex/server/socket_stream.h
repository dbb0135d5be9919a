#pragma once
// A server connection as cpp-httplib's Stream, with the deadlines its own stream lacks:
// httplib times each read separately, so a client that sends a byte every few seconds keeps a
// request (and its thread) forever. Here reads fail once the current deadline has passed (the
// server sets one for a request's head, then for its body); waiting for the next request on a
// kept-alive connection blocks in poll() instead of httplib's 10 ms polling loop, and ends at
// once when the server shuts the socket down. Reads are buffered (httplib reads headers a byte
// at a time). Writes wait at most `write_timeout` for room in the socket's buffer.

#include <httplib.h>

#include <chrono>
#include <string>
#include <vector>

namespace loraplex::server {

class SocketStream : public httplib::Stream {
 public:
  using Clock = std::chrono::steady_clock;

  SocketStream(int fd, std::chrono::milliseconds write_timeout);

  /// Reads after `deadline` fail (return -1).
  void set_read_deadline(Clock::time_point deadline) { deadline_ = deadline; }
  /// No read deadline (reads then wait up to a minute each).
  void clear_read_deadline() { deadline_ = Clock::time_point::max(); }
  /// Waits up to `timeout` for the first byte of the next request; false when none came, or
  /// the client closed the connection, or the server shut it down.
  bool wait_for_request(std::chrono::milliseconds timeout);

  bool is_readable() const override;
  bool is_writable() const override;
  ssize_t read(char* ptr, size_t size) override;
  ssize_t write(const char* ptr, size_t size) override;
  void get_remote_ip_and_port(std::string& ip, int& port) const override;
  void get_local_ip_and_port(std::string& ip, int& port) const override;
  socket_t socket() const override { return fd_; }

 private:
  // poll() for `events` until the read deadline (or `timeout` when sooner); > 0 when ready.
  int wait(short events, std::chrono::milliseconds timeout) const;
  bool peer_open() const;

  int fd_;
  std::chrono::milliseconds write_timeout_;
  Clock::time_point deadline_ = Clock::time_point::max();
  std::vector<char> buffer_;
  size_t buffer_begin_ = 0;
  size_t buffer_end_ = 0;
};

}  // namespace loraplex::server
