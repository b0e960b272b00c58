"""ditbook: bring a new diffusion transformer into cache and parallel acceleration, with evidence."""

import os as _os

# cache-dit logs every hook it installs (INFO) and its routine decisions (WARNING) into every
# executed notebook; ditbook records what it decided itself, so only cache-dit's errors are shown
# (export CACHE_DIT_LOG_LEVEL=info to see them all). Read by cache-dit when it is imported.
_os.environ.setdefault("CACHE_DIT_LOG_LEVEL", "error")

__version__ = "0.1.0"

from .card import GateError, ModelCard, gate_check, load_card  # noqa: E402,F401
