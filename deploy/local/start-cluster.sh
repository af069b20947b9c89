#!/usr/bin/env bash
# A scheduler and one Dask worker per pool on this host (the embedded cluster's shape), on loopback only, to attach to:
#   deploy/local/start-cluster.sh start   # then: rollart run flows/quickstart.yaml --scheduler tcp://127.0.0.1:8786
#   deploy/local/start-cluster.sh stop
set -euo pipefail
PORT=${PORT:-8786}
RUN_DIR=${RUN_DIR:-/tmp/rollart-cluster}
BIG=1000000   # pools are tags: concurrency is decided by the services, not by resource counts
mkdir -p "$RUN_DIR"
export DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED=False

worker() {  # name, resources, nthreads, torch threads
  OMP_NUM_THREADS=$4 nohup dask worker "tcp://127.0.0.1:$PORT" --name "$1" --resources "$2" --nthreads "$3" \
    --memory-limit 0 --host 127.0.0.1 --dashboard-address 127.0.0.1:0 > "$RUN_DIR/$1.log" 2>&1 &
  echo $! >> "$RUN_DIR/pids"
}

case "${1:-start}" in
  start)
    : > "$RUN_DIR/pids"
    nohup dask scheduler --host 127.0.0.1 --port "$PORT" --dashboard-address 127.0.0.1:8787 --preload rollart_dask.serve.dashboard.preload > "$RUN_DIR/scheduler.log" 2>&1 &
    echo $! >> "$RUN_DIR/pids"
    sleep 3
    worker train-0 "H800=$BIG TRAIN=$BIG" 2 1
    worker h800-0 "H800=$BIG" 2 1
    worker h20-0 "H20=$BIG" 2 1
    worker cpu-0 "CPU=$BIG" 2 1
    worker reward-0 "SERVERLESS=$BIG REWARD=$BIG" 2 1
    echo "scheduler tcp://127.0.0.1:$PORT (logs in $RUN_DIR)"
    ;;
  stop)
    [ -f "$RUN_DIR/pids" ] && xargs -r kill < "$RUN_DIR/pids" || true
    rm -f "$RUN_DIR/pids"
    ;;
  *) echo "usage: $0 start|stop" >&2; exit 2 ;;
esac
