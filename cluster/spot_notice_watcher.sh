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
IMDS=http://169.254.169.254/latest

imds_token() {
  curl -sf -X PUT "$IMDS/api/token" -H "X-aws-ec2-metadata-token-ttl-seconds: 21600"
}

# The local raylet's node id: a driver started on this node connects to it.
local_node_id() {
  python3 -c "import ray; ray.init(address='$GCS_ADDRESS', logging_level='ERROR'); print(ray.get_runtime_context().get_node_id())"
}

# Seconds until the interruption time EC2 announced, or nothing while there is no notice.
seconds_left() {
  local token="$1" notice when
  notice=$(curl -sf -H "X-aws-ec2-metadata-token: $token" "$IMDS/meta-data/spot/instance-action") || return 1
  when=$(printf '%s' "$notice" | python3 -c "import json, sys; print(json.load(sys.stdin)['time'])") || return 1
  echo $(( $(date -d "$when" +%s) - $(date +%s) ))
}

main() {
  local node_id token left
  node_id=$(local_node_id) || { echo "cannot reach Ray at $GCS_ADDRESS" >&2; exit 1; }
  echo "watching spot notices for node $node_id"
  token=$(imds_token) || { echo "no instance metadata service: not an EC2 instance?" >&2; exit 1; }
  while true; do
    if left=$(seconds_left "$token"); then
      (( left < 0 )) && left=0
      echo "spot interruption in ${left}s: draining node $node_id"
      ray drain-node --address "$GCS_ADDRESS" --node-id "$node_id" \
        --reason DRAIN_NODE_REASON_PREEMPTION --reason-message "EC2 spot interruption" \
        --deadline-remaining-seconds "$left"
      exit 0
    fi
    sleep "$POLL_S"
    token=$(imds_token) || true   # refresh: a token expires after 6 hours
  done
}

main "$@"
