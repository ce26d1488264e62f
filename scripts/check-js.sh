#!/usr/bin/env bash
# Part of `make lint`: a syntax check of the chat page's own ES modules (server/static/js/; never the vendored
# files in server/static/vendor/) with `node --check`, each parsed as a module, so a typo fails the build instead of
# a blank page. Without node, run as root with apt-get, it installs Debian's nodejs (as ensure-chromium.sh does
# Chromium); otherwise it says that the check was skipped.
set -u
cd "$(dirname "$0")/.."

if ! command -v node >/dev/null 2>&1 && [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "check-js: installing Debian's nodejs for the JavaScript syntax check" >&2
    log=$(mktemp)
    if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq nodejs; } >"$log" 2>&1 </dev/null; then
        tail -n 20 "$log" >&2
    fi
    rm -f "$log"
fi
if ! command -v node >/dev/null 2>&1; then
    echo "check-js: no node, and not root with apt-get to install it: JavaScript syntax check skipped" >&2
    exit 0
fi

status=0
count=0
while IFS= read -r -d '' file; do
    count=$((count + 1))
    # stdin with --input-type=module: parsed as an ES module (strict, import/export) whatever the extension
    if ! out=$(node --input-type=module --check <"$file" 2>&1); then
        # node names the input [stdin]; the stack trace of node's own checker says nothing about the file
        printf '%s\n' "${out//\[stdin\]/$file}" | grep -v -e '^    at ' -e '^Node\.js ' -e '^$' >&2
        status=1
    fi
done < <(find server/static/js -type f \( -name '*.js' -o -name '*.mjs' \) -print0 | sort -z)
if [ "$count" = 0 ]; then
    echo "check-js: no modules found under server/static/js" >&2
    exit 1
fi
[ "$status" = 0 ] && echo "check-js: $count modules parse"
exit "$status"
