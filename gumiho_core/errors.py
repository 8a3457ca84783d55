"""The one exception type users see. Its message is a single clear line, no traceback."""


class GumihoError(Exception):
    """A problem the user can fix: a bad path, mismatched heads, an over-long prompt..."""


class ContextTooLong(GumihoError):
    """The prompt plus the requested new tokens do not fit in the target's context."""
