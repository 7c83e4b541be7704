"""The one exception the loader raises for anything the user can fix."""


class ModelLoadError(RuntimeError):
    """A model could not be resolved or loaded; the message is one line saying why and what to do."""
