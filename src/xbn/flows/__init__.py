"""Prefect flows over xbn's stages (the same functions `dvc repro` runs through the CLI): `retrain` (the weekly
schedule), `catalogue` (the catalogue on Dask) and `tune` (an Optuna study). prefect.yaml's entrypoints are the
thin files in the project's pipelines/ folder, which import them from here."""
