"""The benchmarks' way to serve an app: uvicorn on a free local port, in a thread of this process.

    with Serving(create_app(model, tokenizer)) as url:   # http://127.0.0.1:PORT
        ...
"""

from __future__ import annotations

import socket
import threading
import time


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Serving:
    def __init__(self, app):
        import uvicorn
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=free_port(), log_level="warning"))

    def __enter__(self) -> str:
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)
        return f"http://127.0.0.1:{self.server.config.port}"

    def __exit__(self, *exc):
        self.server.should_exit = True
        self.thread.join(timeout=60)
