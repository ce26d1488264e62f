#!/usr/bin/env python3
"""Container health probe (the image's HEALTHCHECK, compose's healthcheck): exit 0 when GET /health answers 200.

/health answers 503 while the model loads and needs no API key. The probe asks the port the server binds
(LLMSERVE_PORT), on loopback unless LLMSERVE_HOST names one specific address. Standard library only.
"""

import os
import sys
import urllib.request


def main() -> int:
    host = os.environ.get("LLMSERVE_HOST", "") or "127.0.0.1"
    if host in ("0.0.0.0", "::", "[::]"):
        host = "127.0.0.1"
    elif ":" in host and not host.startswith("["):
        host = f"[{host}]"
    port = os.environ.get("LLMSERVE_PORT", "") or "8000"
    url = f"http://{host}:{port}/health"
    opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))  # never via an HTTP(S)_PROXY
    try:
        with opener.open(url, timeout=4) as response:
            return 0 if response.status == 200 else 1
    except Exception as exc:  # any failure (refused, 503, timeout) is "unhealthy"
        print(f"{url}: {exc}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
