#!/usr/bin/env python3
"""Parses loraplex's /metrics text with prometheus_client's parser (what Prometheus-based
routers use) and checks vLLM's metric names, labels, types and values.

usage: check_metrics.py PRINT_METRICS_BINARY
Prints 'N passed, N failed'; exits 77 (skipped) when prometheus_client is not installed.
"""

import subprocess
import sys

try:
    from prometheus_client.parser import text_string_to_metric_families
except ImportError:
    print("prometheus_client is not installed (pip install prometheus-client): skipped")
    sys.exit(77)

text = subprocess.run([sys.argv[1]], capture_output=True, text=True, check=True).stdout
families = {f.name: f for f in text_string_to_metric_families(text)}
results = []


def check(name, cond, detail=""):
    results.append(bool(cond))
    print(("PASS " if cond else "FAIL ") + name + ("" if cond else ": " + str(detail)))


def value(family, sample_name, **labels):
    for s in families[family].samples:
        if s.name == sample_name and all(s.labels.get(k) == v for k, v in labels.items()):
            return s.value
    return None


base = {"model_name": "base-model", "engine": "0"}
for name, kind in [("vllm:num_requests_running", "gauge"), ("vllm:num_requests_waiting", "gauge"),
                   ("vllm:kv_cache_usage_perc", "gauge"), ("vllm:gpu_cache_usage_perc", "gauge"),
                   ("vllm:lora_requests_info", "gauge"), ("vllm:prompt_tokens", "counter"),
                   ("vllm:generation_tokens", "counter"), ("vllm:request_success", "counter"),
                   ("vllm:time_to_first_token_seconds", "histogram"),
                   ("vllm:inter_token_latency_seconds", "histogram"),
                   ("vllm:e2e_request_latency_seconds", "histogram")]:
    check(f"{name} is a {kind}", name in families and families[name].type == kind,
          families.get(name) and families[name].type)

check("running", value("vllm:num_requests_running", "vllm:num_requests_running", **base) == 2)
check("waiting", value("vllm:num_requests_waiting", "vllm:num_requests_waiting", **base) == 5)
check("kv usage", value("vllm:kv_cache_usage_perc", "vllm:kv_cache_usage_perc", **base) == 0.25)
info = families["vllm:lora_requests_info"].samples[0]
check("lora info labels", info.labels == {"max_lora": "3", "running_lora_adapters": "sql,pirate",
                                          "waiting_lora_adapters": "vocab"}, info.labels)
check("lora info value is the time", abs(info.value - 1713456789.5) < 1e-3, info.value)
check("prompt tokens", value("vllm:prompt_tokens", "vllm:prompt_tokens_total", **base) == 1000)
check("generation tokens",
      value("vllm:generation_tokens", "vllm:generation_tokens_total", **base) == 250)
check("success by reason", value("vllm:request_success", "vllm:request_success_total",
                                 finished_reason="length", **base) == 6)
ttft = families["vllm:time_to_first_token_seconds"]
buckets = [(s.labels["le"], s.value) for s in ttft.samples if s.name.endswith("_bucket")]
check("ttft buckets", buckets == [("0.01", 1), ("0.1", 4), ("1.0", 10), ("+Inf", 10)], buckets)
check("ttft count and sum",
      value("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_count", **base) == 10
      and value("vllm:time_to_first_token_seconds", "vllm:time_to_first_token_seconds_sum",
                **base) == 3.5)
print(f"{sum(results)} passed, {len(results) - sum(results)} failed")
sys.exit(0 if all(results) else 1)
