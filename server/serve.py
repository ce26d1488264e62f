"""Run the app under uvicorn with a drain on SIGTERM: stop admitting (503), let in-flight requests finish for up
to --shutdown-timeout seconds, then shut down and exit 0.

uvicorn's own handler stops at once and re-raises the signal after shutdown (exit status 143); ours flips the
app's `draining` flag, and `on_tick` (every 0.1 s) ends the main loop once nothing is in flight."""

import logging
import signal
import time
from types import FrameType

import uvicorn
from fastapi import FastAPI

logger = logging.getLogger("llmserve.server")


class DrainingServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config, app: FastAPI) -> None:
        super().__init__(config)
        self.app_state = app.state
        self.drain_deadline: float | None = None

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.drain_deadline is not None:  # a second signal: stop now, as uvicorn does on a second Ctrl+C
            self.should_exit = True
            self.force_exit = sig == signal.SIGINT
            return
        timeout = self.app_state.settings.shutdown_timeout
        logger.info("signal %d: draining %d in-flight requests (up to %.0f s)", sig, self.app_state.inflight, timeout)
        self.app_state.draining = True
        self.drain_deadline = time.monotonic() + timeout

    async def on_tick(self, counter: int) -> bool:
        if (
            self.app_state.load_error and not self.should_exit
        ):  # nothing to serve: exit (status 1) instead of 503 forever
            self.should_exit = True
        engine = self.app_state.async_engine
        # A lost tensor-parallel rank cannot be replaced in this process: exit (status 1) so that a supervisor
        # restarts the whole group, once the requests in flight have been sent their error
        tp_failed = engine is not None and engine.dead and self.app_state.settings.tensor_parallel_size > 1
        if tp_failed and self.app_state.inflight == 0 and not self.should_exit:
            logger.error("stopping: %s", engine.failure or "the tensor-parallel engine stopped")
            self.app_state.engine_failure = engine.failure or "engine stopped"
            self.should_exit = True
        if self.drain_deadline is not None and not self.should_exit:
            if self.app_state.inflight == 0:
                logger.info("drained; shutting down")
                self.should_exit = True
            elif time.monotonic() > self.drain_deadline:
                logger.warning("shutdown timeout: %d requests still in flight are cut off", self.app_state.inflight)
                self.should_exit = True
        return await super().on_tick(counter)


def make_server(app: FastAPI, host: str, port: int, log_level: str = "info") -> DrainingServer:
    config = uvicorn.Config(
        app, host=host, port=port, log_level=log_level, access_log=False, timeout_graceful_shutdown=5, log_config=None
    )
    return DrainingServer(config, app)
