"""The deployment entrypoints (prefect.yaml: pipelines/retrain.py:retrain). The flows live in `xbn.flows`, so an
installed xbn never adds a top-level package named `pipelines`; these files only re-export them."""
