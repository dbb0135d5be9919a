"""Shared fixtures of the loraplex Python tests. Run against a build with
`PYTHONPATH=<build>/python pytest python/tests` (scripts/test.sh does), or against an
installed package. LORAPLEX_CLI names the `loraplex` binary whose `generate` output the
offline API is compared with (default: <repo>/build/tools/loraplex)."""

import json
import os

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TESTDATA = os.path.join(REPO, "testdata")
FIXTURES = ["tiny-llama", "tiny-qwen2", "tiny-mixtral"]


def fixture_dir(name):
    return os.path.join(TESTDATA, name)


def adapters_of(name):
    root = os.path.join(fixture_dir(name), "adapters")
    return {a: os.path.join(root, a) for a in sorted(os.listdir(root))}


def read_jsonl(path):
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


@pytest.fixture(scope="session")
def cli():
    path = os.environ.get("LORAPLEX_CLI", os.path.join(REPO, "build", "tools", "loraplex"))
    if not os.access(path, os.X_OK):
        pytest.skip(f"no loraplex binary at {path} (set LORAPLEX_CLI)")
    return path


@pytest.fixture(scope="session")
def tiny_llama():
    """One engine on the tiny Llama with room for its four adapters (tests that load or
    remove adapters use names and ids of their own)."""
    import loraplex

    llm = loraplex.LLM(
        os.path.join(fixture_dir("tiny-llama"), "model"), enable_lora=True, max_loras=4,
        max_lora_rank=64, max_num_seqs=32,
    )
    yield llm
    llm.shutdown()
