#!/usr/bin/env bash
# Part of `make test`: the browser tests (tests/browser) drive Debian's Chromium. Run as root with apt-get, install it
# when it is missing; otherwise say that the browser tests will skip. It never fails the build: the tests say why
# they skip.
set -u

if command -v chromium >/dev/null 2>&1 || command -v chromium-browser >/dev/null 2>&1 || [ -x /usr/lib/chromium/chromium ]; then
    exit 0
fi
if [ "$(id -u)" != 0 ] || ! command -v apt-get >/dev/null 2>&1; then
    echo "ensure-chromium: no Chromium, and not root with apt-get to install it: the browser tests will skip" >&2
    exit 0
fi
echo "ensure-chromium: installing Debian's chromium for the browser tests" >&2
log=$(mktemp)
if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq chromium; } >"$log" 2>&1 </dev/null; then
    tail -n 20 "$log" >&2
    echo "ensure-chromium: installing chromium failed: the browser tests will skip" >&2
fi
rm -f "$log"
exit 0
