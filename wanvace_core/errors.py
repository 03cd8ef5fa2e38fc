"""Errors raised by the core. Each message names the input, the value and the fix."""


class WanVACEError(Exception):
    """Base class for every error this package raises on purpose."""


class WanVACEInputError(WanVACEError, ValueError):
    """A user-supplied value is invalid; raised before any heavy work starts."""


class WanVACEModelFolderError(WanVACEError, ValueError):
    """A model folder or weight file is missing, malformed or not a VACE pipeline."""
