#!/usr/bin/env bash
# Submit offline batch generation as a Ray job (resumable: rerun it after an
# interruption and finished prompts are skipped).
#
#   deploy/jobs/generate-job.sh [INPUT.jsonl] [OUTPUT.jsonl]
#
# RAY_API_SERVER_ADDRESS: the cluster's job server (dashboard), default
# http://127.0.0.1:8265 (`ray start --head` locally; `ray dashboard
# deploy/cluster/aws-gpu.yaml` or `kubectl port-forward svc/saguaro-head-svc
# 8265:8265` for remote clusters). Ray 2.60 clusters started with `ray start`
# use token authentication: export RAY_AUTH_MODE=token (the token is read from
# ~/.ray/auth_token or RAY_AUTH_TOKEN).
#
# INPUT/OUTPUT are opened by the job's driver on the head node: use absolute
# paths there (or a shared filesystem). The default models are the built-in
# tiny family on CPU; pass other engine flags through EXTRA, e.g.
#   EXTRA="--target hf:Qwen/Qwen3-32B --draft hf:Qwen/Qwen3-0.6B --device cuda --worker-cpus 2" deploy/jobs/generate-job.sh ...
set -euo pipefail
cd "$(dirname "$0")/../.."

INPUT=$(realpath "${1:-deploy/jobs/prompts.example.jsonl}")
OUTPUT=$(realpath -m "${2:-results.jsonl}")
ADDRESS=${RAY_API_SERVER_ADDRESS:-http://127.0.0.1:8265}
EXTRA=${EXTRA:---target zoo:tiny/target --draft zoo:tiny/draft --worker-cpus 0.25}

# shellcheck disable=SC2086
exec ray job submit --address "$ADDRESS" --working-dir . -- \
    python -m saguaro_ray.jobs.generate \
        --input "$INPUT" --output "$OUTPUT" \
        --mode ssd --k 4 --budget 8 \
        --temperature 0 --max-tokens 64 --n 1 --seed 0 \
        $EXTRA
