"""Stopping without dropping an answer: on SIGTERM (a rolling update, a scale-down), `smollm2 serve` drains.
/ready answers 503, so that load balancers stop sending it requests; a new request, the probes' aside (/health,
/ready, /metrics), gets a 503 its client can retry elsewhere; the requests in flight run to their end, and then the
process exits 0. Past a bound (--drain-timeout), those still running end with an error their clients read, and the
server exits anyway. A second SIGTERM ends the wait at once; Ctrl-C (SIGINT) stops as uvicorn does.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import time

import uvicorn

from .serving import APIError, Served, error_response

log = logging.getLogger(__name__)

PROBES = frozenset({"/health", "/ready", "/metrics"})  # answered while draining, and never waited for
GRACE_S = 5  # uvicorn's own wait for connections once the drain is over: by then none is answering a request


class Admission:
    """ASGI middleware: counts the HTTP requests being answered (served.admitted), the probes aside; once the
    server drains, answers new ones 503."""

    def __init__(self, app, served: Served):
        self.app, self.served = app, served

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or scope["path"] in PROBES:
            return await self.app(scope, receive, send)
        if self.served.draining:
            refusal = APIError(503, "the server is shutting down: send the request again, to another replica",
                               "server_error", code="shutting_down")
            return await error_response(refusal)(scope, receive, send)
        self.served.admitted += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.served.admitted -= 1


class DrainingServer(uvicorn.Server):
    """uvicorn's server, which drains on SIGTERM (see above) instead of closing its socket at once: a client
    would then be refused a connection rather than told to retry, and a keep-alive connection's next request lost."""

    def __init__(self, config: uvicorn.Config, served: Served, drain_timeout: float):
        super().__init__(config)
        self.served, self.drain_timeout = served, drain_timeout
        self.deadline: float | None = None  # set by the first SIGTERM

    def handle_exit(self, sig, frame) -> None:  # the main thread, between two of the event loop's steps
        if sig != signal.SIGTERM:
            return super().handle_exit(sig, frame)
        # Not recorded as uvicorn records the signals it stops on (to raise them again once stopped, which would
        # kill the process): a drained server has stopped as asked, and exits 0.
        if self.deadline is None:
            log.info("SIGTERM: draining, %d request(s) in flight, for up to %g s", self.served.admitted,
                     self.drain_timeout)
            self.served.draining = True
            self.deadline = time.monotonic() + self.drain_timeout
        else:
            self.deadline = time.monotonic()

    async def on_tick(self, counter: int) -> bool:  # every 0.1 s
        if self.deadline is not None and not self.should_exit:
            if self.served.admitted and time.monotonic() >= self.deadline:
                log.warning("drain timeout: ending %d request(s) still in flight", self.served.admitted)
                for engine in self.served.engines.values():  # each request ends with an error event
                    await asyncio.to_thread(engine.stop)
            self.should_exit = self.should_exit or not self.served.admitted or time.monotonic() >= self.deadline
        return await super().on_tick(counter)


def serve(app, host: str, port: int, drain_timeout: float) -> None:
    """Serve `app` (create_app's) until SIGTERM has drained it (or Ctrl-C)."""
    config = uvicorn.Config(app, host=host, port=port, timeout_graceful_shutdown=GRACE_S, log_level="info")
    DrainingServer(config, app.state.served, drain_timeout).run()
