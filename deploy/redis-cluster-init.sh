#!/bin/sh
# Forms the 3-master Redis Cluster of the compose profile "redis-cluster" (run once by the
# redis-cluster-init service). redis-cli --cluster create wants addresses, so names are resolved.
set -eu
addrs=""
for node in redis-node-1 redis-node-2 redis-node-3; do
    until redis-cli -h "$node" ping >/dev/null 2>&1; do sleep 1; done
    ip="$(getent hosts "$node" | awk '{print $1}')"
    addrs="$addrs $ip:6379"
done
if redis-cli -h redis-node-1 cluster info | grep -q 'cluster_state:ok'; then
    echo "cluster already formed"
    exit 0
fi
# shellcheck disable=SC2086
redis-cli --cluster create $addrs --cluster-replicas 0 --cluster-yes
