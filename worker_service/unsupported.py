"""The one error for a checkpoint the worker cannot run as it is (see models/config_checks.py)."""


class UnsupportedModel(ValueError):
    """A checkpoint this worker cannot run as it is; the message says what and why. The worker
    reports it in one line as its reason for not starting."""
