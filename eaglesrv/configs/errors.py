class ConfigError(ValueError):
    """A configuration value is invalid; the message names the flag and the rule."""


def require(ok: bool, message: str) -> None:
    if not ok:
        raise ConfigError(message)
