"""Serving a trained embedder: the catalogue's faiss index (`index`), search over it (`search`), the batch
embedding job (`embed_job`), ONNX export (`onnx_export`) and the HTTP endpoint (`http`).

Import the submodules themselves: this package imports nothing, so `xbn.serving.index` does not pull in
FastAPI and `xbn.serving.http` does not pull in onnx.
"""
