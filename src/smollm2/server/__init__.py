"""An HTTP server with continuous batching that speaks OpenAI's and Anthropic's APIs: `smollm2 serve`, or
create_app() for your own (load_app() from sources, as the command loads them)."""

from .app import create_app, load_app
from .scheduler import EngineThread

__all__ = ["EngineThread", "create_app", "load_app"]
