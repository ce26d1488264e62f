"""`llmserve serve [flags]` starts the HTTP server; `llmserve inspect [MODEL]` prints the model's module tree.
Every flag is a Settings field (config/settings.py) and an LLMSERVE_* environment variable."""

import logging
import sys

from config.settings import load_settings


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    access = logging.getLogger("llmserve.access")
    handler = logging.StreamHandler(sys.stdout)  # one bare JSON object per line, ready for a log shipper
    handler.setFormatter(logging.Formatter("%(message)s"))
    access.addHandler(handler)
    access.propagate = False


def main(argv: list[str] | None = None) -> int:
    command, settings = load_settings(argv)
    _configure_logging(settings.log_level)
    if command == "inspect":
        from model.engine.inspect import describe_model

        print(describe_model(settings))
        return 0
    from server.app import create_app
    from server.serve import make_server

    if not settings.model:
        from config.default_model import ensure_default_model

        ensure_default_model(settings.models_dir)
    server = make_server(create_app(settings), settings.host, settings.port, settings.log_level)
    server.run()
    return 1 if server.app_state.load_error else 0


if __name__ == "__main__":
    sys.exit(main())
