"""ditbook: bring a new diffusion transformer into cache and parallel acceleration, with evidence."""

__version__ = "0.1.0"

from .card import GateError, ModelCard, gate_check, load_card  # noqa: E402,F401
