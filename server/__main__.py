"""`llmserve serve [flags]` starts the HTTP server; `llmserve inspect [MODEL]` prints the model's module tree.
Every flag is a Settings field (config/settings.py) and an LLMSERVE_* environment variable."""

import logging
import os
import sys

from config.settings import Settings, load_settings


def _configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    access = logging.getLogger("llmserve.access")
    handler = logging.StreamHandler(sys.stdout)  # one bare JSON object per line, ready for a log shipper
    handler.setFormatter(logging.Formatter("%(message)s"))
    access.addHandler(handler)
    access.propagate = False


def _leave_triton_unloaded_on_cpu(settings: Settings) -> None:
    """torch._dynamo imports Triton wherever it is installed (our tests install it for its CPU interpreter), and
    Triton has no CPU kernels to give a CPU server: its library alone kept 70 MiB resident here. Marked missing, it
    is what torch's CPU wheel sees: inductor compiles C++ and the attention takes torch's path."""
    if "triton" in sys.modules or os.environ.get("TRITON_INTERPRET") == "1":
        return
    from model.device import resolve_device

    if resolve_device(settings.device).type == "cpu":
        sys.modules["triton"] = None  # type: ignore[assignment]  # `import triton` raises ImportError


def _reserve_weight_memory(settings: Settings) -> None:
    """Fault in the weights' huge pages (as many as the last start with these settings took) on a thread of their
    own while this one imports the server: off the path to the first answer (model/arena.py)."""
    from model import arena
    from model.device import resolve_device

    if settings.tensor_parallel_size == 1 and resolve_device(settings.device).type == "cpu":
        arena.reserve(arena.record_path(settings))


def main(argv: list[str] | None = None) -> int:
    command, settings = load_settings(argv)
    _configure_logging(settings.log_level)
    if command == "serve":
        _leave_triton_unloaded_on_cpu(settings)
        _reserve_weight_memory(settings)
    if command == "serve" and settings.tensor_parallel_size > 1 and int(os.environ.get("RANK", "0")) > 0:
        # torchrun started every rank with the same command: the ranks other than 0 follow rank 0's steps
        from model.engine.workers import run_worker

        if not settings.model:
            from config.default_model import ensure_default_model

            ensure_default_model(settings.models_dir)
        return run_worker(settings)
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
    return 1 if server.app_state.load_error or server.app_state.engine_failure else 0


if __name__ == "__main__":
    sys.exit(main())
