#!/usr/bin/env bash
# Two llmserve replicas behind nginx with deploy/nginx.conf's balancing (session affinity on X-Session-Id):
#   - a conversation's second turn, sent with the same X-Session-Id, reaches the replica that served the first and
#     finds its prefix there (usage.prompt_tokens_details.cached_tokens > 0), and that replica served both turns;
#   - 16 other session ids are spread over both replicas.
#
#   scripts/replicas-smoke.sh http://127.0.0.1:PORT1 http://127.0.0.1:PORT2
#
# The replicas must already serve (scripts/container-smoke.sh starts them from the image; any two `llmserve
# serve` work). nginx comes from PATH, else apt-get (as root). Debian's nginx (1.22) predates `resolve` in an
# upstream, so the compose file's `server replica:8000 resolve` line becomes one static server line per replica;
# the rest of deploy/nginx.conf is used as it is. Environment: LB_PORT (default: a free one).
set -euo pipefail
cd "$(dirname "$0")/.."
[[ $# == 2 ]] || { echo "usage: $0 REPLICA1_URL REPLICA2_URL" >&2; exit 2; }
r1="$1" r2="$2"
fail() { printf 'FAIL: %s\n' "$*" >&2; exit 1; }

if ! command -v nginx >/dev/null; then
    [[ $(id -u) == 0 ]] || fail "nginx is not installed (and installing it needs root)"
    apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nginx-light >/dev/null
fi
free_port() { python3 -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])'; }
LB_PORT="${LB_PORT:-$(free_port)}"
lb="http://127.0.0.1:$LB_PORT"
tmp="$(mktemp -d "${TMPDIR:-/tmp}/llmserve-replicas.XXXXXX")"
nginx_pid=""
cleanup() {
    if [[ -n "$nginx_pid" ]]; then kill -QUIT "$nginx_pid" 2>/dev/null || true; fi
    rm -rf "$tmp"
}
trap cleanup EXIT

# deploy/nginx.conf with this machine's replicas and port
upstreams="server ${r1#http://} max_fails=3 fail_timeout=10s; server ${r2#http://} max_fails=3 fail_timeout=10s;"
sed -e "s|^\s*server replica:8000 resolve.*|        $upstreams|" -e '/^\s*resolver /d' \
    -e "s|listen 8000;|listen 127.0.0.1:$LB_PORT;|" deploy/nginx.conf >"$tmp/nginx.conf"
grep -q 'hash $http_x_session_id consistent;' "$tmp/nginx.conf" || fail "deploy/nginx.conf has no session affinity"
nginx -t -q -c "$tmp/nginx.conf" -g "pid $tmp/nginx.pid;" || fail "nginx rejects the configuration"
nginx -c "$tmp/nginx.conf" -g "pid $tmp/nginx.pid; daemon off;" >"$tmp/nginx.log" 2>&1 &
nginx_pid=$!
for _ in $(seq 1 50); do curl -sf "$lb/nginx-health" >/dev/null && break; sleep 0.1; done
curl -sf "$lb/nginx-health" >/dev/null || { cat "$tmp/nginx.log"; fail "nginx did not start"; }
echo "nginx on $lb in front of $r1 and $r2"

served() {  # requests a replica has finished
    curl -sf "$1/metrics" | awk '/^vllm:request_success_total/ { s += $2 } END { print s + 0 }'
}
model=$(curl -sf "$lb/v1/models" | python3 -c 'import json, sys; print(json.load(sys.stdin)["data"][0]["id"])')
chat() {  # $1 = session id, $2 = messages JSON; prints the response JSON
    curl -sf --max-time 300 "$lb/v1/chat/completions" -H 'Content-Type: application/json' -H "X-Session-Id: $1" \
        -d "{\"model\": \"$model\", \"max_tokens\": 8, \"temperature\": 0, \"messages\": $2}"
}

before1=$(served "$r1") before2=$(served "$r2")
turn1='[{"role": "system", "content": "You are a terse assistant. Answer in one short sentence, no more."},
        {"role": "user", "content": "Which planet is known as the red planet, and why is it red?"}]'
reply=$(chat conversation-1 "$turn1")
answer=$(python3 -c 'import json, sys; print(json.dumps(json.load(sys.stdin)["choices"][0]["message"]["content"]))' <<<"$reply")
turn2="${turn1%]}, {\"role\": \"assistant\", \"content\": $answer}, {\"role\": \"user\", \"content\": \"And the largest?\"}]"
cached=$(chat conversation-1 "$turn2" | python3 -c 'import json, sys; print(json.load(sys.stdin)["usage"]["prompt_tokens_details"]["cached_tokens"])')
d1=$(( $(served "$r1") - before1 )) d2=$(( $(served "$r2") - before2 ))
echo "conversation-1: turn 2 found $cached cached prompt tokens; replica 1 served $d1, replica 2 served $d2"
[[ "$cached" -gt 0 ]] || fail "the second turn missed the prefix cache: it went to another replica"
[[ ( $d1 == 2 && $d2 == 0 ) || ( $d1 == 0 && $d2 == 2 ) ]] || fail "the two turns went to different replicas"

before1=$(served "$r1") before2=$(served "$r2")
for i in $(seq 1 16); do chat "session-$i" '[{"role": "user", "content": "Hi"}]' >/dev/null; done
d1=$(( $(served "$r1") - before1 )) d2=$(( $(served "$r2") - before2 ))
echo "16 sessions: replica 1 served $d1, replica 2 served $d2"
[[ $(( d1 + d2 )) == 16 && $d1 -gt 0 && $d2 -gt 0 ]] || fail "sessions were not spread over both replicas"
echo "replicas: PASS"
