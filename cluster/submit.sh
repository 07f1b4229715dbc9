#!/usr/bin/env bash
# Submit cluster/train_spot.py to a running Ray cluster as a Ray job.
#
#   ray up cluster/aws-spot-gpu.yaml
#   ray dashboard cluster/aws-spot-gpu.yaml &          # forwards the job API to localhost:8265
#   STORAGE_PATH=s3://my-bucket/runs cluster/submit.sh --workers 2-4 --epochs 20
#
# Extra arguments go to train_spot.py (see `python cluster/train_spot.py --help`).
# Environment: RAY_ADDRESS (job API, default http://127.0.0.1:8265), STORAGE_PATH
# (required: s3://bucket/prefix the workers can write), RUN_NAME (default checkfreq-spot;
# submitting again with the same name resumes that run), AWS_REGION (the bucket's region).
set -euo pipefail

: "${STORAGE_PATH:?set STORAGE_PATH, e.g. STORAGE_PATH=s3://my-bucket/runs}"
RAY_ADDRESS="${RAY_ADDRESS:-http://127.0.0.1:8265}"
RUN_NAME="${RUN_NAME:-checkfreq-spot}"
AWS_REGION="${AWS_REGION:-us-west-2}"
HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

# The package itself is installed on every node (setup_commands of the launcher config,
# or the image on KubeRay); the working dir only carries the entrypoint. Credentials come
# from the nodes' instance profile, never from this environment.
# RAY_TRAIN_ENABLE_PRINT_PATCH=0: Ray Train (2.60) sends a training function's print() both
# to its logger and, since a Ray worker's sys.stdout is not sys.__stdout__, to stdout too:
# every printed line would reach the job's log twice.
RUNTIME_ENV="{\"env_vars\": {\"AWS_REGION\": \"${AWS_REGION}\", \"AWS_DEFAULT_REGION\": \"${AWS_REGION}\", \"PYTHONUNBUFFERED\": \"1\", \"RAY_TRAIN_ENABLE_PRINT_PATCH\": \"0\"}}"

exec ray job submit \
  --address "$RAY_ADDRESS" \
  --submission-id "${RUN_NAME}-$(date +%Y%m%d-%H%M%S)" \
  --working-dir "$HERE" \
  --runtime-env-json "$RUNTIME_ENV" \
  -- python train_spot.py --storage-path "$STORAGE_PATH" --name "$RUN_NAME" "$@"
