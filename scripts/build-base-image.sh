#!/usr/bin/env bash
# Build a local stand-in for python:3.11-slim-bookworm where no registry can be reached: debootstrap a
# minimal Debian bookworm root filesystem with its python3.11 (+ venv/pip) and `podman import` it.
#
#   scripts/build-base-image.sh [IMAGE_NAME]        (default: localhost/llmserve-base:bookworm)
#
# Then build with: podman build --build-arg PYTHON_IMAGE=localhost/llmserve-base:bookworm ...
# Needs root, debootstrap and podman (apt-get install debootstrap podman). Idempotent: an existing image
# of that name is kept unless FORCE=1.
set -euo pipefail

IMAGE="${1:-localhost/llmserve-base:bookworm}"
MIRROR="${DEBIAN_MIRROR:-http://deb.debian.org/debian}"
SUITE=bookworm

if [[ "${FORCE:-0}" != 1 ]] && podman image exists "$IMAGE"; then
    echo "base image $IMAGE already present (FORCE=1 rebuilds it)"
    exit 0
fi
for tool in debootstrap podman; do
    command -v "$tool" >/dev/null || { echo "missing $tool: apt-get install -y $tool" >&2; exit 1; }
done

work="$(mktemp -d "${TMPDIR:-/tmp}/llmserve-base.XXXXXX")"
trap 'rm -rf "$work"' EXIT
rootfs="$work/rootfs"

# python3-venv brings ensurepip (pip inside `python3 -m venv`); ca-certificates lets pip reach HTTPS indexes.
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates \
    "$SUITE" "$rootfs" "$MIRROR" >"$work/debootstrap.log" 2>&1 \
    || { tail -n 30 "$work/debootstrap.log" >&2; exit 1; }

# Match the official python image's entry points (`python`, `pip` on PATH) and trim apt's caches.
ln -sf /usr/bin/python3 "$rootfs/usr/local/bin/python"
rm -rf "$rootfs"/var/cache/apt/archives/*.deb "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/log/*.log

tar --numeric-owner -C "$rootfs" -c . | podman import \
    --change 'ENV LANG=C.UTF-8' \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["python3"]' \
    - "$IMAGE" >/dev/null
echo "imported $IMAGE ($(podman image inspect --format '{{.Size}}' "$IMAGE") bytes)"
