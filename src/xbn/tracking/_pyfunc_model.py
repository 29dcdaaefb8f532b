"""The pyfunc's "model from code" entry point: MLflow copies this file into the logged model and runs it at
load time, so the model is rebuilt from installed code instead of unpickled (no CloudPickle payload)."""

from mlflow.models import set_model

from xbn.tracking.pyfunc import EmbedderModel

set_model(EmbedderModel())
