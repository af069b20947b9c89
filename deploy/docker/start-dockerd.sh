#!/usr/bin/env bash
# Start, stop or check a private Docker engine on this host, for the code sandbox's docker backend.
#
#   deploy/docker/start-dockerd.sh start [DIR]   # prints the DOCKER_HOST to use (unix://DIR/docker.sock)
#   deploy/docker/start-dockerd.sh stop [DIR]
#   deploy/docker/start-dockerd.sh status [DIR]
#
# DIR (default $ROLLART_DOCKERD_DIR or /tmp/rollart-dockerd) holds its data root, exec root, socket,
# pid file and log, so it never touches a system engine. No iptables and no bridge: the sandbox
# only runs containers with --network none. Needs root and `dockerd` (Debian: apt-get install -y docker.io).
set -euo pipefail

cmd=${1:-start}
dir=${2:-${ROLLART_DOCKERD_DIR:-/tmp/rollart-dockerd}}
sock=$dir/docker.sock
pidfile=$dir/dockerd.pid
host=unix://$sock

running() { [ -f "$pidfile" ] && kill -0 "$(cat "$pidfile")" 2>/dev/null; }
answers() { DOCKER_HOST=$host docker version --format '{{.Server.Version}}' >/dev/null 2>&1; }

case $cmd in
start)
    command -v dockerd >/dev/null || { echo "dockerd not found; install it: apt-get install -y docker.io" >&2; exit 2; }
    [ "$(id -u)" = 0 ] || { echo "dockerd needs root" >&2; exit 2; }
    if running && answers; then echo "$host"; exit 0; fi
    mkdir -p "$dir/data" "$dir/exec"
    # setsid: the engine outlives the shell that started it, and a Ctrl-C there does not reach it.
    setsid dockerd --host "$host" --data-root "$dir/data" --exec-root "$dir/exec" --pidfile "$pidfile" \
        --iptables=false --ip6tables=false --ip-forward=false --ip-masq=false --bridge=none \
        --userland-proxy=false ${ROLLART_DOCKERD_ARGS:-} >"$dir/dockerd.log" 2>&1 </dev/null &
    for _ in $(seq 1 120); do
        if answers; then echo "$host"; exit 0; fi
        sleep 0.25
    done
    echo "dockerd did not answer on $sock within 30 s; log: $dir/dockerd.log" >&2
    tail -n 20 "$dir/dockerd.log" >&2 || true
    exit 1
    ;;
stop)
    if running; then
        pid=$(cat "$pidfile")
        kill "$pid"
        for _ in $(seq 1 80); do kill -0 "$pid" 2>/dev/null || break; sleep 0.25; done
        kill -0 "$pid" 2>/dev/null && kill -9 "$pid"
    fi
    exit 0
    ;;
status)
    if running && answers; then echo "$host"; exit 0; fi
    echo "not running ($dir)" >&2
    exit 1
    ;;
*)
    echo "usage: $0 start|stop|status [DIR]" >&2
    exit 2
    ;;
esac
