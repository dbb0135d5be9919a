#include "serve_http_client.h"

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <memory>
#include <regex>
#include <thread>

#include <nlohmann/json.hpp>

#include "loraplex/core/error.h"

namespace loraplex::cli {
namespace {

using Clock = std::chrono::steady_clock;
using nlohmann::json;

double seconds(Clock::duration d) { return std::chrono::duration<double>(d).count(); }

// "http://HOST:PORT[/][v1[/]]" -> "http://HOST:PORT"; paths other than /v1 are refused so that
// a typo does not send every request to a 404.
std::string scheme_host_port(const std::string& url) {
  static const std::regex re(R"(^(https?://(\[[0-9A-Fa-f:.]+\]|[^/:\[\]]+)(:[0-9]+)?)(/v1)?/?$)");
  std::smatch m;
  LORAPLEX_CHECK(std::regex_match(url, m, re), "--server ", url,
                 ": expected http://HOST:PORT (optionally ending in /v1)");
  return m[1].str();
}

std::unique_ptr<httplib::Client> make_client(const HttpTarget& t) {
  auto c = std::make_unique<httplib::Client>(scheme_host_port(t.url));
  const auto timeout = std::chrono::duration<double>(t.timeout_s);
  c->set_read_timeout(std::chrono::duration_cast<std::chrono::microseconds>(timeout));
  c->set_write_timeout(std::chrono::duration_cast<std::chrono::microseconds>(timeout));
  c->set_connection_timeout(std::chrono::duration_cast<std::chrono::microseconds>(timeout));
  if (!t.api_key.empty()) c->set_bearer_token_auth(t.api_key);
  return c;
}

// The message of an OpenAI error body, else the body itself (shortened).
std::string error_message(const std::string& body) {
  const json j = json::parse(body, nullptr, false);
  if (j.is_object() && j.contains("error") && j["error"].is_object() &&
      j["error"].contains("message") && j["error"]["message"].is_string()) {
    return j["error"]["message"].get<std::string>();
  }
  return body.size() > 300 ? body.substr(0, 300) + "..." : body;
}

// One streamed completion; fills `r` (sent_s is set by the caller).
void stream_completion(const HttpTarget& target, const std::string& model, const TraceRequest& t,
                       Clock::time_point t0, HttpRequestResult& r) {
  json body;
  body["model"] = model;
  body["prompt"] = t.prompt;
  body["max_tokens"] = t.output_len;
  body["temperature"] = 0;
  body["ignore_eos"] = true;
  body["stream"] = true;
  body["stream_options"] = {{"include_usage", true}};
  // vLLM's extension: each chunk's token ids, so that a chunk whose text is held back (an
  // incomplete UTF-8 sequence) still counts as carrying a token.
  body["return_token_ids"] = true;

  std::unique_ptr<httplib::Client> client;
  try {
    client = make_client(target);
  } catch (const std::exception& e) {
    r.error = e.what();
    return;
  }
  int status = 0;
  bool done = false;
  bool has_usage = false;
  int64_t tokens_seen = 0;
  std::string pending;  // bytes of an event not yet complete
  std::string raw;      // the body of a non-200 answer
  std::string error;    // an error event inside the stream
  Clock::time_point last;
  const Clock::time_point start = Clock::now();

  const auto on_event = [&](const std::string& data, Clock::time_point now) {
    if (data == "[DONE]") {
      done = true;
      return;
    }
    const json j = json::parse(data, nullptr, false);
    if (!j.is_object()) {
      error = "malformed event: " + data.substr(0, 200);
      return;
    }
    if (j.contains("error")) {
      error = error_message(data);
      return;
    }
    if (j.contains("usage") && j["usage"].is_object()) {
      r.completion_tokens = j["usage"].value("completion_tokens", int64_t{0});
      has_usage = true;
    }
    if (!j.contains("choices") || !j["choices"].is_array() || j["choices"].empty()) return;
    const json& c = j["choices"][0];
    int64_t n = 0;
    if (c.contains("token_ids") && c["token_ids"].is_array()) {
      n = static_cast<int64_t>(c["token_ids"].size());
    } else if (c.contains("text") && c["text"].is_string() &&
               !c["text"].get<std::string>().empty()) {
      n = 1;  // a server without token ids: a chunk with text carries at least one token
    }
    if (n == 0) return;
    tokens_seen += n;
    if (r.first_token_s < 0) {
      r.first_token_s = seconds(now - t0);
      r.ttft_s = seconds(now - start);
    } else {
      r.itl_s.push_back(seconds(now - last));
    }
    last = now;
  };

  httplib::Request req;
  req.method = "POST";
  req.path = "/v1/completions";
  req.headers = {{"Content-Type", "application/json"}, {"Accept", "text/event-stream"}};
  req.body = body.dump();
  req.response_handler = [&](const httplib::Response& res) {
    status = res.status;
    return true;
  };
  req.content_receiver = [&](const char* data, size_t size, uint64_t, uint64_t) {
    const Clock::time_point now = Clock::now();
    if (status != 200) {
      raw.append(data, size);
      return true;
    }
    pending.append(data, size);
    size_t end;
    while ((end = pending.find("\n\n")) != std::string::npos) {
      const std::string event = pending.substr(0, end);
      pending.erase(0, end + 2);
      size_t pos = 0;
      while (pos < event.size()) {
        size_t eol = event.find('\n', pos);
        if (eol == std::string::npos) eol = event.size();
        std::string line = event.substr(pos, eol - pos);
        if (!line.empty() && line.back() == '\r') line.pop_back();
        if (line.rfind("data:", 0) == 0) {
          line.erase(0, 5);
          if (!line.empty() && line.front() == ' ') line.erase(0, 1);
          on_event(line, now);
        }
        pos = eol + 1;
      }
    }
    return true;
  };
  httplib::Response res;
  httplib::Error err = httplib::Error::Success;
  const bool sent = client->send(req, res, err);
  r.e2e_s = seconds(Clock::now() - start);
  if (!has_usage) r.completion_tokens = tokens_seen;
  if (!sent && status == 0) {
    r.error = "request failed: " + httplib::to_string(err);
  } else if (status != 200) {
    r.error = "HTTP " + std::to_string(status) + ": " + error_message(raw);
  } else if (!error.empty()) {
    r.error = error;
  } else if (!done) {
    r.error = "the stream ended without data: [DONE]" +
              (sent ? std::string() : " (" + httplib::to_string(err) + ")");
  } else {
    r.ok = true;
  }
}

}  // namespace

ServerModels list_server_models(const HttpTarget& target) {
  const std::unique_ptr<httplib::Client> client = make_client(target);
  const httplib::Result res = client->Get("/v1/models");
  LORAPLEX_CHECK(res, "--server ", target.url, ": GET /v1/models failed: ",
                 res.error() == httplib::Error::Connection
                     ? std::string("cannot connect (is the server running there?)")
                     : httplib::to_string(res.error()));
  LORAPLEX_CHECK(res->status == 200, "--server ", target.url, ": GET /v1/models answered HTTP ",
                 res->status, ": ", error_message(res->body),
                 res->status == 401 ? " (check --api-key)" : "");
  const json j = json::parse(res->body, nullptr, false);
  LORAPLEX_CHECK(j.is_object() && j.contains("data") && j["data"].is_array(), "--server ",
                 target.url, ": GET /v1/models: not an OpenAI model list");
  ServerModels m;
  for (const json& e : j["data"]) {
    if (!e.is_object() || !e.contains("id") || !e["id"].is_string()) continue;
    const bool adapter = e.contains("parent") && !e["parent"].is_null();
    if (adapter) {
      m.adapters.push_back(e["id"].get<std::string>());
    } else if (m.base.empty()) {
      m.base = e["id"].get<std::string>();
    }
  }
  return m;
}

HttpTraceResult play_trace_http(const HttpTarget& target, const std::vector<TraceRequest>& trace,
                                const std::vector<std::string>& models,
                                const std::function<void(size_t, size_t, double)>& progress) {
  LORAPLEX_CHECK(models.size() == trace.size(), "play_trace_http: ", models.size(),
                 " model names for ", trace.size(), " requests");
  scheme_host_port(target.url);  // a bad URL stops here, not in every thread
  HttpTraceResult out;
  out.requests.resize(trace.size());
  // A thread per request: finished ones are joined as the run goes so that a long trace does
  // not keep every thread's stack.
  std::vector<std::thread> threads(trace.size());
  std::unique_ptr<std::atomic<bool>[]> finished(new std::atomic<bool>[trace.size()]);
  for (size_t i = 0; i < trace.size(); ++i) finished[i] = false;
  std::atomic<size_t> done{0};
  size_t next = 0;
  size_t joined = 0;
  const Clock::time_point t0 = Clock::now();
  Clock::time_point last_progress = t0;
  while (joined < trace.size()) {
    Clock::time_point now = Clock::now();
    while (next < trace.size() && seconds(now - t0) >= trace[next].arrival_s) {
      const size_t i = next++;
      out.requests[i].sent_s = seconds(Clock::now() - t0);
      threads[i] = std::thread([&, i] {
        stream_completion(target, models[i], trace[i], t0, out.requests[i]);
        finished[i] = true;
        ++done;
      });
    }
    for (size_t i = joined; i < next && finished[i]; ++i, ++joined) threads[i].join();
    if (progress && seconds(now - last_progress) >= 0.5) {
      last_progress = now;
      progress(done, next, seconds(now - t0));
    }
    wait_for_arrival(t0, trace, next, std::chrono::milliseconds(1));
  }
  out.duration_s = seconds(Clock::now() - t0);
  return out;
}

}  // namespace loraplex::cli
