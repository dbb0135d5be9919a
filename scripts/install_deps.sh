#!/usr/bin/env bash
# Installs what loraplex needs to build and test on a fresh Debian/Ubuntu machine. Packages
# already present are not touched, so this is quick on a prepared machine.
set -euo pipefail
# libcpp-httplib-dev and libcli11-dev: the HTTP server and the `serve` command line;
# python3-dev: the Python package's extension module (Debian's python3; others ship headers).
packages=(cmake ninja-build g++ pkg-config libgtest-dev nlohmann-json3-dev libonig-dev
          clang clang-format libclang-rt-14-dev git libicu-dev libcpp-httplib-dev libcli11-dev
          python3-dev)
# scripts/fetch_flashinfer.sh downloads a wheel with pip.
python3 -m pip --version >/dev/null 2>&1 || packages+=(python3-pip)
sudo=""
[ "$(id -u)" -eq 0 ] || sudo="sudo"
missing=()
for p in "${packages[@]}"; do
  dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing+=("$p")
done
if ((${#missing[@]})); then
  echo "installing: ${missing[*]}"
  $sudo apt-get update -qq
  DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends "${missing[@]}"
fi
# FlashInfer's C++ headers (PyPI wheel) for the CUDA backend's paged attention.
bash "$(dirname "$0")/fetch_flashinfer.sh"
# xgrammar's C++ core (PyPI sdist) for structured output.
bash "$(dirname "$0")/fetch_xgrammar.sh"
# Python modules the tests compare against: jinja2 (chat templates rendered as transformers
# renders them) and prometheus_client (its parser reads /metrics). pip for the python3 on PATH
# (what CMake finds); Debian's packages where pip may not install into the system Python.
if ! python3 -c "import jinja2, prometheus_client" 2>/dev/null; then
  echo "installing Python modules: jinja2 prometheus-client"
  python3 -m pip install --quiet jinja2 prometheus-client 2>/dev/null ||
    python3 -m pip install --quiet --break-system-packages jinja2 prometheus-client 2>/dev/null ||
    {
      $sudo apt-get update -qq
      DEBIAN_FRONTEND=noninteractive $sudo apt-get install -y -qq --no-install-recommends \
        python3-jinja2 python3-prometheus-client
    }
fi
# The Python package (python/, built with -DLORAPLEX_PYTHON=ON) and its tests: nanobind
# (the bindings), pytest and numpy; torch (PyPI's wheel, about 3 minutes and 4 GB on a fresh
# machine) for the ops on torch tensors. pip only.
if ! python3 -c "import nanobind, pytest, numpy, torch" 2>/dev/null; then
  echo "installing Python modules: nanobind pytest numpy torch"
  python3 -m pip install --quiet nanobind pytest numpy torch 2>/dev/null ||
    python3 -m pip install --quiet --break-system-packages nanobind pytest numpy torch
fi
# The official OpenAI Python client drives `loraplex serve` in its end-to-end test (Debian does
# not package it: pip only).
if ! python3 -c "import openai" 2>/dev/null; then
  echo "installing Python modules: openai"
  python3 -m pip install --quiet openai 2>/dev/null ||
    python3 -m pip install --quiet --break-system-packages openai
fi
