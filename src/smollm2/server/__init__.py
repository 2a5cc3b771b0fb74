"""An HTTP server with continuous batching that speaks OpenAI's and Anthropic's APIs: `smollm2 serve`, or
create_app() for your own (load_app() from sources, as the command loads them)."""

__all__ = ["EngineThread", "create_app", "load_app"]


def __getattr__(name):
    # The server pulls in FastAPI, the engine and the grammar engine: imported only when asked for, so that the
    # command line reads the server's defaults (defaults.py) before its flags without them.
    if name in ("create_app", "load_app"):
        from . import app

        return getattr(app, name)
    if name == "EngineThread":
        from .scheduler import EngineThread

        return EngineThread
    raise AttributeError(name)
