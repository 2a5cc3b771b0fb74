"""An OpenAI-compatible HTTP server with continuous batching: `smollm2 serve`, or create_app() for your own."""

from .app import create_app
from .scheduler import Scheduler

__all__ = ["Scheduler", "create_app"]
