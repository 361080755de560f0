"""What the llama-swap reader reports: the `ConfigError` that refuses a file, and the warning
texts for the sections and keys gpuproxy reads but does not honour.

Its own module so that every step (loading, macros, the sections) raises the same error and
the "not supported" wording has one owner (docs/configuration.md lists the same differences).
"""

from __future__ import annotations


class ConfigError(ValueError):
    """A config the importer must refuse. `path` is the YAML key path, e.g. `models.x.cmd`."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}" if path else message)
        self.path = path
        self.message = message


TOP_UNSUPPORTED = {
    "logLevel": "not supported by gpuproxy; ignored (set GPUPROXY_LOG_LEVEL instead)",
    "logTimeFormat": "not supported by gpuproxy; ignored (gpuproxy's log lines have their own "
                     "format)",
    "logToStdout": "not supported by gpuproxy; ignored (gpuproxy logs to stdout; model output "
                   "is under /logs)",
    "logRequests": "not supported by gpuproxy; ignored (llama-swap does not use it either)",
    "metricsMaxInMemory": "not supported by gpuproxy; ignored (the activity log is kept in "
                          "the database)",
    "store": "not supported by gpuproxy; ignored (activity is stored in gpuproxy's database)",
    "ui": "not supported by gpuproxy; ignored (gpuproxy has its own admin pages)",
}

MODEL_UNSUPPORTED = {
    "timeouts": "not supported by gpuproxy; ignored (gpuproxy's upstream client uses its own "
                "timeouts)",
    "compat": "not supported by gpuproxy; ignored (websocket upgrades get no special "
              "treatment)",
    "healthCheckTimeout": "not supported per model (llama-swap ignores it too); the global "
                          "healthCheckTimeout applies",
}
