#pragma once
// `loraplex bench serve --server URL`: the trace of serve_workload.h played against a running
// OpenAI-compatible server (ours or vLLM) as streamed POST /v1/completions, measured on the
// client side. Built only where cpp-httplib is found (LORAPLEX_WITH_HTTP_CLIENT).

#include <cstdint>
#include <functional>
#include <string>
#include <vector>

#include "serve_workload.h"

namespace loraplex::cli {

/// Where the server is: "http://HOST:PORT" (a trailing "/" or "/v1" is accepted) and the key
/// sent as "Authorization: Bearer KEY" when not empty.
struct HttpTarget {
  std::string url;
  std::string api_key;
  double timeout_s = 600.0;  // per read: a request queued longer than this fails
};

/// The models a server lists at GET /v1/models.
struct ServerModels {
  std::string base;                   // the entry without a `parent`
  std::vector<std::string> adapters;  // the entries with one
};

/// GET /v1/models. Throws loraplex::Error naming the URL and the cause (bad URL, no connection,
/// HTTP status and the server's message) so that a wrong address or key stops the benchmark
/// before any request is sent.
ServerModels list_server_models(const HttpTarget& target);

/// What one streamed request measured. Times are seconds; `sent_s` and `first_token_s` count
/// from the start of the run.
struct HttpRequestResult {
  bool ok = false;
  std::string error;  // why not ok
  double sent_s = 0.0;
  double first_token_s = -1.0;  // -1: no token came
  double ttft_s = 0.0;
  double e2e_s = 0.0;
  std::vector<double> itl_s;  // one gap per chunk that carried tokens, after the first
  int64_t completion_tokens = 0;
};

struct HttpTraceResult {
  double duration_s = 0.0;
  std::vector<HttpRequestResult> requests;  // in trace order
};

/// Plays `trace`: request i is sent at its arrival time, on its own thread and connection, as
/// POST /v1/completions with model `models[i]`, its prompt as token ids, max_tokens its output
/// length, temperature 0, ignore_eos, stream with include_usage and return_token_ids. Never
/// throws for a failed request: it is counted in its result. `progress(done, sent, elapsed_s)`
/// is called about twice a second when given.
HttpTraceResult play_trace_http(
    const HttpTarget& target, const std::vector<TraceRequest>& trace,
    const std::vector<std::string>& models,
    const std::function<void(size_t, size_t, double)>& progress = nullptr);

}  // namespace loraplex::cli
