#!/usr/bin/env bash
# Build the code sandbox image from local files only (no registry is reachable or used).
#
#   [DOCKER_HOST=unix://...] deploy/docker/build-sandbox-image.sh [IMAGE]   # default rollart-code-sandbox:latest
#
# 1. A root filesystem with this machine's python3 (PYTHON, default /usr/bin/python3): the binary,
#    the shared libraries it and its extension modules link, and its standard library (without
#    tests, idle, tkinter); /etc/passwd with nobody; an empty /scratch mount point.
# 2. `docker import` of that tarball as rollart-code-sandbox-base:local.
# 3. `docker build` of Dockerfile.sandbox FROM it (user nobody, workdir /scratch).
set -euo pipefail

image=${1:-rollart-code-sandbox:latest}
base=rollart-code-sandbox-base:local
here=$(cd "$(dirname "$0")" && pwd)
py=$(readlink -f "${PYTHON:-/usr/bin/python3}")
[ -x "$py" ] || { echo "no python3 at ${PYTHON:-/usr/bin/python3}; set PYTHON" >&2; exit 2; }
command -v docker >/dev/null || { echo "the docker CLI is missing (apt-get install -y docker.io)" >&2; exit 2; }

work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
root=$work/rootfs
mkdir -p "$root"/{bin,etc,tmp,scratch,proc,sys,dev,usr/bin}

stdlib=$("$py" -I -S -c 'import sysconfig; print(sysconfig.get_path("stdlib"))')
dynload=$("$py" -I -S -c 'import _ctypes, os; print(os.path.dirname(_ctypes.__file__))' 2>/dev/null || echo "$stdlib/lib-dynload")

# The interpreter, reachable as /usr/bin/python3 whatever its own path.
mkdir -p "$root$(dirname "$py")"
cp -L "$py" "$root$py"
[ "$py" = /usr/bin/python3 ] || ln -sf "$py" "$root/usr/bin/python3"

# The standard library (and, when it lives elsewhere, the extension modules).
tar -C / --exclude='*/test' --exclude='*/tests' --exclude='*/idlelib' --exclude='*/tkinter' \
    --exclude='*/turtledemo' --exclude='*/ensurepip' --exclude='*/site-packages' --exclude='*/dist-packages' \
    -cf - "${stdlib#/}" | tar -C "$root" -xf -
case $dynload in "$stdlib"/*) ;; *) tar -C / -cf - "${dynload#/}" | tar -C "$root" -xf - ;; esac

# Shared libraries of the interpreter and of every extension module, with the loader.
{ ldd "$py"; find "$dynload" -name '*.so' -exec ldd {} \; 2>/dev/null; } \
    | grep -oE '/[^ ]+\.so[^ ]*' | sort -u | while read -r lib; do
        [ -e "$lib" ] || continue
        mkdir -p "$root$(dirname "$lib")"
        cp -L "$lib" "$root$lib"
    done

printf 'root:x:0:0:root:/root:/bin/false\nnobody:x:65534:65534:nobody:/scratch:/bin/false\n' >"$root/etc/passwd"
printf 'root:x:0:\nnogroup:x:65534:\n' >"$root/etc/group"
chmod 1777 "$root/tmp"

tar -C "$root" -cf "$work/rootfs.tar" .
docker import "$work/rootfs.tar" "$base" >/dev/null
# The legacy builder: it needs no buildx plugin, and FROM a local image pulls nothing.
mkdir -p "$work/context"
DOCKER_BUILDKIT=0 docker build -q -t "$image" --build-arg BASE="$base" -f "$here/Dockerfile.sandbox" "$work/context" >/dev/null
docker run --rm --network none "$image" >/dev/null
echo "$image"
