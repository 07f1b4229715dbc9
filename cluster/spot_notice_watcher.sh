#!/usr/bin/env bash
# Runs on every spot worker node (started by worker_start_ray_commands in aws-spot-gpu.yaml).
#
# EC2 announces a spot interruption two minutes ahead in the instance metadata
# (spot/instance-action). Ray does not read it; this script turns it into a Ray drain
# notice with that deadline (`ray drain-node --reason DRAIN_NODE_REASON_PREEMPTION`), which
# Ray Train and ray_checkfreq watch: ray_checkfreq checkpoints the last iteration that can
# still commit before the deadline, so the restarted job loses no iteration.
# Without it a preemption is a plain node loss: the job still resumes by itself, from the
# newest snapshot another node's agent holds or the newest commit (at most 2k iterations lost).
set -u

GCS_ADDRESS="${RCF_GCS_ADDRESS:-${RAY_HEAD_IP:-127.0.0.1}:6379}"
POLL_S="${RCF_NOTICE_POLL_S:-2}"
# The metadata service; another address only for a stand-in (a local rehearsal, tests).
IMDS="${RCF_IMDS_URL:-http://169.254.169.254}/latest"
NOTICE_FILE="$(mktemp)"
trap 'rm -f "$NOTICE_FILE"' EXIT

imds_token() {
  curl -sf --connect-timeout 1 --max-time 3 -X PUT "$IMDS/api/token" \
    -H "X-aws-ec2-metadata-token-ttl-seconds: 21600"
}

# The local raylet's node id (RCF_NODE_ID if set): a driver started on this node connects to it.
local_node_id() {
  if [[ -n "${RCF_NODE_ID:-}" ]]; then echo "$RCF_NODE_ID"; return; fi
  python3 -c "import ray; ray.init(address='$GCS_ADDRESS', logging_level='ERROR'); print(ray.get_runtime_context().get_node_id())"
}

# The HTTP status of spot/instance-action (the body in NOTICE_FILE): 200 with an
# interruption announced, 404 without one, 401 when the token expired.
notice_status() {
  curl -s --connect-timeout 1 --max-time 3 -o "$NOTICE_FILE" -w '%{http_code}' \
    -H "X-aws-ec2-metadata-token: $1" "$IMDS/meta-data/spot/instance-action" || true  # 000: no answer
}

# Seconds from now until the interruption time in NOTICE_FILE (at least 0).
seconds_left() {
  local when left
  when=$(python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['time'])" "$NOTICE_FILE") || return 1
  left=$(( $(date -d "$when" +%s) - $(date +%s) ))
  (( left < 0 )) && left=0
  echo "$left"
}

main() {
  local node_id token status left
  node_id=$(local_node_id) || { echo "cannot reach Ray at $GCS_ADDRESS" >&2; exit 1; }
  echo "watching spot notices for node $node_id"
  token=$(imds_token) || { echo "no instance metadata service at $IMDS: not an EC2 instance?" >&2; exit 1; }
  while true; do
    status=$(notice_status "$token")
    case "$status" in
      200)
        left=$(seconds_left) || { echo "an interruption notice without a time: $(cat "$NOTICE_FILE")" >&2; left=0; }
        echo "spot interruption in ${left}s: draining node $node_id"
        ray drain-node --address "$GCS_ADDRESS" --node-id "$node_id" \
          --reason DRAIN_NODE_REASON_PREEMPTION --reason-message "EC2 spot interruption" \
          --deadline-remaining-seconds "$left"
        exit 0
        ;;
      404) ;;  # no interruption announced
      401) token=$(imds_token) || echo "the metadata token expired and no new one came" >&2 ;;
      *) echo "the metadata service answered $status" >&2 ;;
    esac
    sleep "$POLL_S"
  done
}

main "$@"
