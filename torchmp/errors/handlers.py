"""The factory :func:`~torchmp.errors.record` asks for its default error handler.

A function rather than a constant so that the handler is created when a function is
decorated (after any environment set-up), and so that a platform can patch this one
place to install its own :class:`ErrorHandler` subclass everywhere.
"""

from __future__ import annotations

from .error_handler import ErrorHandler

__all__ = ["get_error_handler"]


def get_error_handler() -> ErrorHandler:
    """Return a new default :class:`ErrorHandler`."""
    return ErrorHandler()
