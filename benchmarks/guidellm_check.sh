#!/usr/bin/env bash
# guidellm's default benchmark (streamed /v1/chat/completions, each prompt sent as a list of
# text parts) against `raymoe serve` on a tiny random-weight checkpoint over loopback: a short
# synchronous run. Exits non-zero unless every request succeeded.
#
# guidellm depends on torch (from PyPI, a CUDA build of several GB), so it is never a test
# dependency: it gets a virtualenv of its own, made with --system-site-packages so that the
# torch already installed here (raymoe's, CPU or GPU) is reused rather than downloaded.
#
#   bash benchmarks/guidellm_check.sh            # REQUESTS=20 GUIDELLM_VERSION=0.8.0 by default
set -euo pipefail

REPO=$(cd "$(dirname "$0")/.." && pwd)
PYTHON=${PYTHON:-python}
VENV=${GUIDELLM_VENV:-$HOME/.cache/raymoe/guidellm-venv}
VERSION=${GUIDELLM_VERSION:-0.8.0}
REQUESTS=${REQUESTS:-20}
PROMPT_TOKENS=${PROMPT_TOKENS:-64}
OUTPUT_TOKENS=${OUTPUT_TOKENS:-16}
WORK=$(mktemp -d)
SERVER=""

stop_server() {
    if [ -n "$SERVER" ] && kill -0 "$SERVER" 2>/dev/null; then
        kill -INT "$SERVER"  # as Ctrl-C: raymoe serve shuts its Ray down
        for _ in $(seq 60); do kill -0 "$SERVER" 2>/dev/null || break; sleep 1; done
        kill -KILL "$SERVER" 2>/dev/null || true
    fi
}
trap stop_server EXIT

# 1. guidellm in its own virtualenv.
if ! "$VENV/bin/guidellm" --version 2>/dev/null | grep -q "$VERSION"; then
    "$PYTHON" -m venv --system-site-packages "$VENV"
    "$VENV/bin/pip" install -q "guidellm==$VERSION"
fi

# 2. A tiny checkpoint (the test suite's builder) and a free loopback port.
"$PYTHON" - "$WORK/model" <<'EOF'
import sys
sys.path.insert(0, "tests")
from tiny_models import build_reference_model, write_checkpoint
write_checkpoint(build_reference_model("qwen3_moe", max_position_embeddings=1024), sys.argv[1])
EOF
PORT=$("$PYTHON" -c "import socket; s = socket.socket(); s.bind(('127.0.0.1', 0)); print(s.getsockname()[1])")
cat > "$WORK/cluster.yaml" <<EOF
model: $WORK/model
device: cpu
dtype: float32
routers: 1
expert_workers: 1
serve:
  served_model_name: tiny
EOF

# 3. The server, ready when /health answers and it says so.
(cd "$REPO" && exec "$PYTHON" -m raymoe.cluster.cli serve "$WORK/cluster.yaml" --port "$PORT") > "$WORK/serve.log" 2>&1 &
SERVER=$!
for _ in $(seq 300); do
    if grep -q "raymoe serve: ready at" "$WORK/serve.log" && curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; then
        break
    fi
    kill -0 "$SERVER" 2>/dev/null || { tail -50 "$WORK/serve.log"; exit 1; }
    sleep 1
done

# 4. guidellm's defaults: openai_http, /v1/chat/completions, streamed; synchronous profile.
"$VENV/bin/guidellm" run \
    --backend "kind=openai_http,target=http://127.0.0.1:$PORT,model=tiny" \
    --profile kind=synchronous \
    --constraint "kind=max_requests,count=$REQUESTS" \
    --data "kind=synthetic_text,prompt_tokens=$PROMPT_TOKENS,output_tokens=$OUTPUT_TOKENS" \
    --tokenizer "kind=huggingface_auto,model=$WORK/model" \
    --output "kind=json,path=$WORK/report.json" \
    --disable-console-interactive

# 5. Every request must have succeeded.
"$VENV/bin/python" - "$WORK/report.json" "$REQUESTS" <<'EOF'
import json, sys

report = json.load(open(sys.argv[1]))
totals = report["benchmarks"][0]["metrics"]["request_totals"]
print(f"guidellm requests: {totals}")
if totals.get("errored") or totals.get("incomplete") or totals.get("successful") != int(sys.argv[2]):
    sys.exit("guidellm saw failed or missing requests")
EOF
echo "guidellm_check: $REQUESTS/$REQUESTS requests succeeded (logs and report in $WORK)"
