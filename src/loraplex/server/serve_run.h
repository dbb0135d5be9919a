#pragma once
// `loraplex serve` as a library call: everything between the parsed command line and a
// running HTTP server on the online engine, and back to a clean exit.

#include <cstdio>

#include "loraplex/server/serve_options.h"

namespace loraplex::server {

/// Checks the chat template, the adapters' configs and the address first (each a quick
/// failure before a slow model load), then loads the model, tokenizer and EOS ids, sizes an
/// Engine from the options, loads the --lora adapters and serves until SIGINT or SIGTERM:
/// requests in flight are then aborted and it returns 0 (a signal during start-up ends the
/// process with status 0 at once). Progress and the address it listens on go to `log`
/// ("listening on http://HOST:PORT", which tests read to learn a --port 0 port).
/// Throws loraplex::Error naming the file, adapter, flag or address at fault.
///
/// Must be called before the process starts any other thread: SIGINT and SIGTERM are blocked
/// in the calling thread, so that every thread started afterwards inherits the mask and only
/// the thread that waits for them receives them.
int run_serve(const ServeOptions& options, std::FILE* log);

}  // namespace loraplex::server
