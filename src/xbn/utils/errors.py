"""The exit codes of every `xbn` command, and the exceptions the CLI maps to them without importing the heavy
modules that raise them."""

EXIT_FAILURE = 1  # an error of the run itself (a non-finite loss, a rollback with nothing to restore)
EXIT_CONFIG = 2  # params.yaml or a --set is wrong: the message names the key
EXIT_DATA = 3  # the data (or a file a stage needs) is missing or fails validation
EXIT_SERVICE = 4  # a service the run needs (the MLflow tracking store) cannot be reached


class EnvironmentSettingError(ValueError):
    """An environment variable xbn reads (e.g. XBN_CPU_BF16) holds a value it does not accept; exit 2, as a bad
    param."""


class ServiceUnavailableError(ConnectionError):
    """A service the run needs (the MLflow tracking store) cannot be reached; the message names it."""


class NonFiniteLossError(RuntimeError):
    """The loss, a gain or a memory statistic became NaN/inf: training stops (the message names the iteration),
    the last good checkpoint is kept."""


class TrainingStalledError(RuntimeError):
    """Training learns nothing (a zero loss or no mined pair for a whole window, or val R@1 below the
    warm-up's for `train.stall.patience` epochs) and `train.stall.action` is stop; the message names the cause."""


class RegistryError(ValueError):
    """A registry action that cannot be done as asked (a rollback with nothing to restore, an unknown version);
    the message says why and what to do instead. A ValueError: it is a wrong request, not a broken store."""


class IntegrityError(RuntimeError):
    """A model file whose sha256 differs from the one recorded for it; the message names the file and both."""
