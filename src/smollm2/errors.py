"""The one exception type the project raises for bad input.

The CLI and the server catch it and show its message as one line; anything else is a bug.
"""


class SmolError(ValueError):
    """Bad input: the message names what is wrong (file, tensor, parameter, line)."""
