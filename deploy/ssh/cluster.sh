#!/usr/bin/env bash
# A rollart-dask cluster over plain SSH, from a hosts file (see hosts.example):
#   deploy/ssh/cluster.sh start HOSTS   # prints the scheduler address for `rollart run --scheduler`
#   deploy/ssh/cluster.sh stop HOSTS
# Each host needs this package installed; ROLLART_ENV is run first on it (e.g. 'source ~/rollart/.venv/bin/activate').
# `dask ssh` starts the same worker on every host, so it cannot give each host its pool: hence this script.
# TLS by default: TLS_DIR here (made with `rollart cluster certs` when missing) is copied to every host; the
# client attaches with those files (printed at start). ROLLART_TLS=off: plain TCP, for a private network only.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
source "$HERE/../pools.sh"
ACTION=${1:?usage: $0 start|stop HOSTS}
HOSTS=${2:?usage: $0 start|stop HOSTS}
PORT=${PORT:-8786}
RUN_DIR=${RUN_DIR:-/tmp/rollart-cluster}  # on each host: logs and pids
SSH=${SSH:-ssh}                            # e.g. SSH="ssh -i key -o StrictHostKeyChecking=accept-new"
SCP=${SCP:-scp}
TLS_DIR=${TLS_DIR:-$HOME/.rollart/tls}     # here: the cluster's certificate (copied to $RUN_DIR/tls on each host)
GPU_POOLS=" train h800 h20 "               # their workers get one GPU each

entries() { grep -v '^[[:space:]]*\(#\|$\)' "$HOSTS"; }  # hosts-file lines without comments and blanks
remote() {  # host, command: run it there after ROLLART_ENV (a failing set-up stops before the command)
  $SSH "$1" "mkdir -p $RUN_DIR || exit 1; ${ROLLART_ENV:+$ROLLART_ENV || exit 1;} $2"
}
spawn() {  # host, command: start it in the background there, detached from ssh, its pid recorded for stop
  remote "$1" "nohup $2 > $RUN_DIR/$3.log 2>&1 < /dev/null & echo \$! >> $RUN_DIR/pids" < /dev/null
}

SCHED_HOST=$(entries | awk '$2 == "scheduler" {print $1; exit}')
[ -n "$SCHED_HOST" ] || { echo "$HOSTS: no 'HOST scheduler' line" >&2; exit 2; }
if tls_on; then SCHEME=tls; TLS="$(tls_args "$RUN_DIR/tls")"; else SCHEME=tcp; TLS=""; fi
SCHEDULER="$SCHEME://$SCHED_HOST:$PORT"

case "$ACTION" in
  start)
    if tls_on; then
      make_certs "$TLS_DIR"
      entries | awk '{print $1}' | sort -u | while read -r host; do
        remote "$host" "mkdir -p $RUN_DIR/tls && chmod 700 $RUN_DIR/tls" < /dev/null
        $SCP -q "$TLS_DIR/ca.pem" "$TLS_DIR/cert.pem" "$TLS_DIR/key.pem" "$host:$RUN_DIR/tls/" < /dev/null
      done
    fi
    spawn "$SCHED_HOST" "dask scheduler --protocol $SCHEME --port $PORT --preload rollart_dask.serve.dashboard.preload $TLS" scheduler
    sleep "${SCHEDULER_WAIT_S:-5}"  # workers retry anyway; this keeps their logs clean
    declare -A next_gpu=()  # host → its next free GPU index (pools on one host share its GPUs)
    while read -r host role n nthreads torch_threads; do
      [ "$role" = scheduler ] && continue
      resources=$(pool_resources "$role")  # an unknown pool stops here, naming it
      for ((i = 0; i < ${n:-1}; i++)); do
        name="$role-$host-$i"
        env="env DASK_DISTRIBUTED__WORKER__PROFILE__ENABLED=False OMP_NUM_THREADS=${torch_threads:-1}"
        if [[ "$GPU_POOLS" == *" $role "* ]]; then  # one GPU per worker: one engine (or the trainer) each
          env+=" CUDA_VISIBLE_DEVICES=${next_gpu[$host]:-0}"
          next_gpu[$host]=$(( ${next_gpu[$host]:-0} + 1 ))
        fi
        spawn "$host" "$env dask worker $SCHEDULER --name $name --resources '$resources' --nthreads ${nthreads:-2} --memory-limit 0 $TLS" "$name"
      done
    done < <(entries)
    echo "$SCHEDULER"
    attach_hint "$SCHEDULER" "$TLS_DIR"
    ;;
  stop)  # every host once: kill what start recorded there
    entries | awk '{print $1}' | sort -u | while read -r host; do
      remote "$host" "[ -f $RUN_DIR/pids ] && xargs -r kill < $RUN_DIR/pids; rm -f $RUN_DIR/pids" < /dev/null || true
    done
    ;;
  *) echo "usage: $0 start|stop HOSTS" >&2; exit 2 ;;
esac
