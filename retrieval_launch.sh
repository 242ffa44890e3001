#!/usr/bin/env bash
# Start the Search-R1 retrieval server on this node: `bash retrieval_launch.sh`.
# Training reaches it at retriever.url="http://127.0.0.1:8000/retrieve" (retriever.topk=3).
#
# Defaults: dense MiniLM encoder, flat inner-product index, the shipped corpus, port 8000, loopback.
# Override with environment variables or extra flags (flags given here win):
#   CORPUS_PATH=/data/wiki-18.jsonl RETRIEVER_NAME=bm25 TOPK=3 PORT=8000 bash retrieval_launch.sh
#   bash retrieval_launch.sh --retriever_name e5 --retriever_model /models/e5-base-v2 --faiss_gpu
# The index is built once (first start) and reloaded afterwards; INDEX_PATH chooses where it lives.
set -euo pipefail

here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
if [[ -n "${ALIGNRL_PYTHON:-}" ]]; then
    py="$ALIGNRL_PYTHON"
elif [[ -x "$here/.venv/bin/python" ]]; then
    py="$here/.venv/bin/python"
else
    py="python3"
fi

args=(--retriever_name "${RETRIEVER_NAME:-minilm}" --topk "${TOPK:-3}" --port "${PORT:-8000}"
      --host "${HOST:-127.0.0.1}")
[[ -n "${CORPUS_PATH:-}" ]] && args+=(--corpus_path "$CORPUS_PATH")
[[ -n "${INDEX_PATH:-}" ]] && args+=(--index_path "$INDEX_PATH")

exec "$py" -m alignrl serve retrieve "${args[@]}" "$@"
