#!/usr/bin/env bash
# Throughput of the Ray Serve app (tailrace.ray:build) with 1 and then 2 engine replicas of one thread
# each, on the embedded model, at concurrency 32, one after the other in the same run:
#   flock /tmp/tailrace-bench.lock bench/ray_replicas.sh
# Needs .venv-ray (bin/setup ray). Writes bench/out/ray-replicas-N.json.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
port="${PORT:-8310}"
mkdir -p bench/out
for replicas in 1 2; do
    config="bench/out/ray-replicas-$replicas.yaml"
    cat > "$config" <<YAML
{"proxy_location": "HeadOnly", "http_options": {"host": "127.0.0.1", "port": $port},
 "applications": [{"name": "tailrace", "route_prefix": "/", "import_path": "tailrace.ray:build",
   "args": {"num_replicas": $replicas, "threads": 1, "served-model-name": "tiny", "disable-log-stats": true}}]}
YAML
    .venv-ray/bin/serve run "$config" > "bench/out/ray-replicas-$replicas.log" 2>&1 &
    server=$!
    until curl -sf "http://127.0.0.1:$port/health" > /dev/null; do
        kill -0 "$server" || { echo "serve run exited; see bench/out/ray-replicas-$replicas.log" >&2; exit 1; }
        sleep 1
    done
    echo "== $replicas replica(s) x 1 thread"
    .venv-ray/bin/python -m tailrace bench serve --base-url "http://127.0.0.1:$port" --model tiny \
        --concurrency 32 --num-prompts 256 --no-progress --out "bench/out/ray-replicas-$replicas.json"
    kill -TERM "$server"
    wait "$server" || true
done
