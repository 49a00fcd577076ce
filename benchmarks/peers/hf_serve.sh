#!/usr/bin/env bash
# transformers serve (HF's OpenAI-compatible server with continuous batching), in its own virtual environment, for
# benchmarks/serve_peers.py's `hf` peer. Benchmark-only: never a dependency of the project, its tests or CI.
#
#   bash benchmarks/peers/hf_serve.sh install   # once: $PEERS_DIR/hf-venv (default ~/.cache/ray_specdec_peers)
#   bash benchmarks/peers/hf_serve.sh check     # prints the versions it runs
#
# Why its own environment: transformers 5.24 (what the project's `transformers>=5.0` installs today) answers every
# GPTNeoX completion under --continuous-batching with "PagedAttentionCache.update() missing 1 required positional
# argument: 'kwargs'". 5.23 serves it. The environment sees this Python's packages (torch, the local CPU wheel, and
# the rest) and pins only transformers over them, plus accelerate and openai, which `transformers serve` needs.
set -euo pipefail
PEERS_DIR=${PEERS_DIR:-$HOME/.cache/ray_specdec_peers}
VENV=$PEERS_DIR/hf-venv
HF_VERSION=5.23.0
PYTHON=${PYTHON:-python3}

case "${1:-}" in
  install)
    mkdir -p "$PEERS_DIR"
    [ -x "$VENV/bin/python" ] || "$PYTHON" -m venv --system-site-packages "$VENV"
    "$VENV/bin/pip" install -q "transformers==$HF_VERSION" accelerate openai
    "$0" check
    ;;
  check)
    "$VENV/bin/python" -c 'import transformers, torch, accelerate; print("transformers", transformers.__version__, "torch", torch.__version__)'
    echo "run: python -m benchmarks.serve_peers --servers hf  (finds $VENV/bin/transformers)"
    ;;
  *)
    echo "usage: $0 install|check" >&2
    exit 2
    ;;
esac
