"""The served embedder, as serving imports it: the implementation lives in `xbn.evaluation.served`, below the
tracking layer, so that the MLflow pyfunc embeds with the same code as `xbn embed` and `xbn serve`."""

from xbn.evaluation.served import (
    EmbeddedRows,
    ServedModel,
    UnreadableImage,
    decode_image,
    load_served_model,
    open_image,
    served,
)

__all__ = ["EmbeddedRows", "ServedModel", "UnreadableImage", "decode_image", "load_served_model", "open_image",
           "served"]
