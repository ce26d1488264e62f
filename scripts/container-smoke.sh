#!/usr/bin/env bash
# Build the CPU image with podman and prove it serves: run the server from the built image's filesystem as the
# image would run it (its user, env, workdir, entrypoint; read-only root), then ask /health, the image's own
# HEALTHCHECK command, one streamed chat completion (expects `data: [DONE]`), and stop it with SIGTERM in the
# middle of a second stream: that stream must still end with [DONE] (drain) and the server must exit 0. Then two
# replicas from the same image behind nginx with deploy/nginx.conf's session affinity (scripts/replicas-smoke.sh):
# a conversation's second turn returns to the replica holding its prefix cache, other sessions spread over both.
#
#   sudo scripts/container-smoke.sh          (not part of `make test`: it builds a 1.3 GB image)
#
# Runs where Docker cannot: no engine and no registry. Root, podman (installed with apt-get if missing),
# `podman build --isolation=chroot --network=host`, the base image debootstrapped by scripts/build-base-image.sh,
# and the server started with unshare + chroot on `podman image mount` (plain `podman run` is refused by some
# sandboxes' rlimits). Environment knobs:
#   IMAGE         tag to build                      (default localhost/llmserve:smoke)
#   PYTHON_IMAGE  base image; unset = build/reuse localhost/llmserve-base:bookworm with build-base-image.sh
#   TORCH_WHEELS  folder with the torch +cpu wheel  (default: pip's find-links, if it holds one)
#   PORT          loopback port for the server      (default: a free one)
#   NO_BUILD=1    reuse an already built IMAGE
set -euo pipefail
cd "$(dirname "$0")/.."

IMAGE="${IMAGE:-localhost/llmserve:smoke}"
step() { printf '\n== %s\n' "$*"; }
fail() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }

[[ $(id -u) == 0 ]] || fail "run as root (podman build --isolation=chroot, image mount, chroot)"
if ! command -v podman >/dev/null || ! command -v debootstrap >/dev/null; then
    step "installing podman and debootstrap"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq podman debootstrap >/dev/null
fi
command -v curl >/dev/null || fail "curl is needed"

tmp="$(mktemp -d "${TMPDIR:-/tmp}/llmserve-smoke.XXXXXX")"
server_pid="" rootfs="" replica_pids=()
cleanup() {
    if [[ -n "$server_pid" ]]; then kill -KILL "$server_pid" 2>/dev/null || true; fi
    for pid in "${replica_pids[@]}"; do kill -KILL "$pid" 2>/dev/null || true; done
    if [[ -n "$rootfs" ]]; then podman image unmount "$IMAGE" >/dev/null 2>&1 || true; fi
    rm -rf "$tmp"
}
trap cleanup EXIT

# ---- build ----
if [[ "${NO_BUILD:-0}" != 1 ]]; then
    if [[ -z "${PYTHON_IMAGE:-}" ]]; then
        PYTHON_IMAGE=localhost/llmserve-base:bookworm
        step "base image $PYTHON_IMAGE (debootstrapped Debian bookworm, python3.11)"
        start=$(date +%s)
        scripts/build-base-image.sh "$PYTHON_IMAGE"
        echo "base image ready in $(( $(date +%s) - start ))s"
    fi
    build_args=(--isolation=chroot --network=host --format docker --layers --target cpu
                --build-arg "PYTHON_IMAGE=$PYTHON_IMAGE" -t "$IMAGE")
    wheels="${TORCH_WHEELS:-$(pip config get global.find-links 2>/dev/null || true)}"
    if [[ -n "$wheels" ]] && compgen -G "$wheels/torch-*+cpu-*.whl" >/dev/null; then
        build_args+=(--build-context "torch-wheels=$wheels")
        echo "torch from $wheels"
    fi
    # A TLS-intercepting proxy's CA (this machine trusts one through PIP_CERT / SSL_CERT_FILE): hand it to pip in
    # the build's RUN steps through mounts, leaving the Dockerfile as a user on the open internet runs it.
    ca="${PIP_CERT:-${SSL_CERT_FILE:-}}"
    if [[ -n "$ca" && -f "$ca" ]]; then
        printf '[global]\ncert = /etc/ssl/certs/ca-certificates.crt\n' >"$tmp/pip.conf"
        build_args+=(-v "$ca:/etc/ssl/certs/ca-certificates.crt:ro" -v "$tmp/pip.conf:/etc/pip.conf:ro")
    fi
    step "podman build ${build_args[*]} ."
    start=$(date +%s)
    podman build "${build_args[@]}" . >"$tmp/build.log" 2>&1 || { tail -n 40 "$tmp/build.log"; fail "build failed"; }
    build_s=$(( $(date +%s) - start ))
    echo "built in ${build_s}s"
fi

# ---- the image's own config ----
step "image config"
inspect() { podman image inspect --format "$1" "$IMAGE" | sed '/^$/d'; }
size=$(inspect '{{.Size}}')
user=$(inspect '{{.Config.User}}')
workdir=$(inspect '{{.Config.WorkingDir}}')
healthcheck=$(inspect '{{json .Config.Healthcheck}}')
mapfile -t entry < <(inspect '{{range .Config.Entrypoint}}{{println .}}{{end}}{{range .Config.Cmd}}{{println .}}{{end}}')
mapfile -t health_cmd < <(inspect '{{range .Config.Healthcheck.Test}}{{println .}}{{end}}')
mapfile -t image_env < <(inspect '{{range .Config.Env}}{{println .}}{{end}}')
printf 'size %s bytes (%s MiB), user %s, workdir %s, entrypoint+cmd: %s\nhealthcheck %s\n' \
    "$size" "$((size / 1048576))" "$user" "$workdir" "${entry[*]}" "$healthcheck"
[[ -n "$user" && "${user%%:*}" != 0 && "${user%%:*}" != root ]] || fail "image runs as root"
[[ "${health_cmd[0]:-}" == CMD ]] || fail "no exec-form HEALTHCHECK (build with --format docker)"
inspect '{{json .Config.ExposedPorts}}' | grep -q '"8000/tcp"' || fail "8000 not exposed"
[[ " ${image_env[*]} " == *" LLMSERVE_MODELS_DIR="* ]] || fail "no LLMSERVE_MODELS_DIR in the image env"

# ---- run it from the image's filesystem ----
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
PORT="${PORT:-$(free_port)}"
base="http://127.0.0.1:$PORT"
rootfs="$(podman image mount "$IMAGE")"
uid="${user%%:*}" gid="${user#*:}"
[[ "$gid" == "$user" ]] && gid="$uid"
# The image's env, then what `docker run -e` would override: loopback only, a free port.
run_env=("${image_env[@]}" "HOME=$workdir" LLMSERVE_HOST=127.0.0.1 "LLMSERVE_PORT=$PORT")
serve() {  # $1 = port, $2 = log file; the server's pid in $served_pid
    # A private mount namespace (nothing leaks to the host): /proc and /dev from the host, tmpfs /tmp; the image's
    # root stays read-only, as with `docker run --read-only`. exec all the way down, so $! is the server itself.
    unshare --mount --propagation private -- /bin/sh -c '
        root="$1" userspec="$2"; shift 2
        mount --rbind /proc "$root/proc" && mount --rbind /dev "$root/dev" && mount -t tmpfs -o mode=1777 tmpfs "$root/tmp" \
        && exec chroot --userspec="$userspec" "$root" "$@"' sh "$rootfs" "$uid:$gid" \
        /usr/bin/env -i -C "$workdir" "${run_env[@]}" "LLMSERVE_PORT=$1" "${entry[@]}" >"$2" 2>&1 &
    served_pid=$!
}
wait_healthy() {  # $1 = pid, $2 = base URL, $3 = log file
    local status="" start
    start=$(date +%s)
    for _ in $(seq 1 300); do
        kill -0 "$1" 2>/dev/null || { tail -n 40 "$3"; fail "server exited before it was healthy"; }
        status=$(curl -s -o /dev/null -w '%{http_code}' "$2/health" || true)
        [[ "$status" == 200 ]] && break
        sleep 1
    done
    [[ "$status" == 200 ]] || { tail -n 40 "$3"; fail "/health never answered 200 (last: $status)"; }
    echo "$2/health 200, $(( $(date +%s) - start ))s after start"
}
step "serving from $rootfs as $uid:$gid on $base"
serve "$PORT" "$tmp/server.log"
server_pid=$served_pid
wait_healthy "$server_pid" "$base" "$tmp/server.log"

# The image's HEALTHCHECK command, run as `docker exec` would: in the server's mount namespace, root and cwd.
nsenter --target "$server_pid" --mount --root --wd -S "$uid" -G "$gid" \
    /usr/bin/env -i "${run_env[@]}" "${health_cmd[@]:1}" || fail "the image's HEALTHCHECK command failed"
echo "HEALTHCHECK command: healthy"

model=$(curl -sf "$base/v1/models" | python3 -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
chat() {  # $1 = max_tokens
    curl -sN --max-time 300 "$base/v1/chat/completions" -H 'Content-Type: application/json' -d "{
        \"model\": \"$model\", \"stream\": true, \"max_tokens\": $1, \"temperature\": 0,
        \"messages\": [{\"role\": \"user\", \"content\": \"Write a short poem about the sea.\"}]}"
}
step "streamed chat completion ($model)"
chat 16 >"$tmp/stream1.txt"
grep -q '"delta"' "$tmp/stream1.txt" || { cat "$tmp/stream1.txt"; fail "no delta chunk in the stream"; }
tail -n 3 "$tmp/stream1.txt" | grep -qx 'data: \[DONE\]' || { cat "$tmp/stream1.txt"; fail "stream did not end with data: [DONE]"; }
echo "$(grep -c '^data: ' "$tmp/stream1.txt") SSE events, ends with data: [DONE]"

step "SIGTERM during a stream: drain, then exit 0"
chat 48 >"$tmp/stream2.txt" &
client_pid=$!
for _ in $(seq 1 200); do grep -q '"delta"' "$tmp/stream2.txt" 2>/dev/null && break; sleep 0.05; done
grep -q '"delta"' "$tmp/stream2.txt" || fail "second stream never started"
kill -TERM "$server_pid"
start=$(date +%s)
rc=0
wait "$server_pid" || rc=$?
server_pid=""
wait "$client_pid" || true
echo "server exited with status $rc, $(( $(date +%s) - start ))s after SIGTERM"
tail -n 3 "$tmp/stream2.txt" | grep -qx 'data: \[DONE\]' || { tail -n 5 "$tmp/stream2.txt"; fail "the in-flight stream was cut off"; }
echo "in-flight stream finished: data: [DONE]"
[[ "$rc" == 0 ]] || { tail -n 20 "$tmp/server.log"; fail "exit status $rc after SIGTERM"; }

step "two replicas behind nginx: session affinity"
replica_urls=()
for i in 1 2; do
    port=$(free_port)
    serve "$port" "$tmp/replica$i.log"
    replica_pids+=("$served_pid")
    replica_urls+=("http://127.0.0.1:$port")
done
for i in 0 1; do wait_healthy "${replica_pids[$i]}" "${replica_urls[$i]}" "$tmp/replica$((i + 1)).log"; done
scripts/replicas-smoke.sh "${replica_urls[@]}"

step "PASS"
[[ -n "${build_s:-}" ]] && echo "build: ${build_s}s"
echo "image: $IMAGE, $((size / 1048576)) MiB uncompressed"
