"""The one error the codec raises: a peer sent something that breaks the protocol."""


class ProtocolError(Exception):
    """Bad input from a peer. `code` is the machine-readable error code sent back in an error message."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
