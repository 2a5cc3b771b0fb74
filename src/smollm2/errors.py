"""The one exception type the project raises for bad input.

The CLI and the server catch it and show its message as one line; anything else is a bug.
"""


class SmolError(ValueError):
    """Bad input: the message names what is wrong (file, tensor, parameter, line)."""


class FieldError(SmolError):
    """Bad input in one field of a request, which `field` names as the server's errors do (tools.0.function.name)."""

    def __init__(self, field: str, problem: str):
        super().__init__(f"{field}: {problem}")
        self.field = field
